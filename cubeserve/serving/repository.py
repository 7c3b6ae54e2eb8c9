"""A Triton model repository holding ONE checkpoint version: what `<base>/<V>/` in object storage
holds, so that KServe's storage initializer downloads it into /mnt/models and the ServingRuntime's
`tritonserver --model-store=/mnt/models` (cubeserve.deploy.tritonserver_args) serves it as is:

    cube3d/config.pbtxt
    cube3d/<V>/model.py
    cube3d_stream/config.pbtxt
    cube3d_stream/<V>/model.py
    cube3d_stream/<V>/weights/<the checkpoint's files>

The Triton model version is the checkpoint version V, so the `version` label of the metrics and
the MODEL_VERSION output of every response say which checkpoint served it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from cubeserve.config import QUANTIZATIONS
from cubeserve.deploy import IMAGE_MODEL_REPOSITORY, PREDICT_MODEL, STREAM_MODEL

# The models' code and configs in this checkout (an editable install): triton_models/.
MODEL_REPOSITORY = Path(__file__).resolve().parents[2] / "triton_models"

INSTANCE_KINDS = ("cpu", "gpu")
# The engine's model on one GPU: triton_engine.py runs a KIND_GPU instance on its own device
# (cuda:<model_instance_device_id>); in a pod that sees one GPU, that is device 0.
_GPU_GROUP = "instance_group [ { count: 1 kind: KIND_GPU gpus: [ 0 ] } ]"
_CPU_GROUP = "instance_group [ { count: 1 kind: KIND_CPU } ]"
_INSTANCE_GROUP = re.compile(r"^instance_group \[.*\]$", re.MULTILINE)


def template_repository() -> Path:
    """Where the models' code and configs come from: triton_models/ of this checkout (an
    editable install), or of the runtime image (k8s/Dockerfile copies it there)."""
    return MODEL_REPOSITORY if MODEL_REPOSITORY.is_dir() else Path(IMAGE_MODEL_REPOSITORY)


def _config_with_instance_group(config: Path, group: str) -> str:
    text = config.read_text()
    text, count = _INSTANCE_GROUP.subn(group, text)
    if count != 1:
        raise ValueError(f"{config}: expected one single-line `instance_group [ ... ]`, found {count}")
    return text


# A packaged version's own engine settings, in its version directory (`cube3d_stream/<V>/`): a
# model's config.pbtxt parameters hold for all its versions, and a version set (several
# versions in one repository, rollout/version_sets.py) keeps one config, so what differs by
# version (its quantization) cannot live there.
VERSION_SETTINGS = "version.json"


def version_settings(version_dir: str | Path) -> dict:
    """The settings packaged with a version ({} for a version packaged without them)."""
    path = Path(version_dir) / VERSION_SETTINGS
    return json.loads(path.read_text()) if path.is_file() else {}


def stored_version(model_store: str, version: int) -> tuple[str, dict]:
    """Version N of a model store as the pipeline packaged it (`<model_store>/<N>/`, a model
    repository): the URI of its weights and its settings, read where they are."""
    from cubeserve import storage

    folder = storage.join(model_store, str(version), STREAM_MODEL, str(version))
    text = storage.read_text(storage.join(folder, VERSION_SETTINGS))
    return storage.join(folder, "weights") + "/", json.loads(text) if text else {}


def with_string_parameters(text: str, parameters: dict, where: Path) -> str:
    """A model config's text with these of its string parameters set (each must be there once)."""
    for key, value in parameters.items():
        text, count = re.subn(rf'(key: "{key}" value: {{ string_value: )"[^"]*"', rf'\g<1>"{value}"', text)
        if count != 1:
            raise ValueError(f"{where} has no string parameter {key!r}")
    return text


def build_version_repository(weights_dir: str | Path, version: int, target_dir: str | Path,
                             instance_kind: str, quantization: str = "none") -> Path:
    """Write the model repository of checkpoint `version` (an int >= 1) with the checkpoint
    `weights_dir` into `target_dir`, which must not exist yet; returns it.

    `instance_kind` "gpu": `cube3d_stream` (the engine) runs one KIND_GPU instance on GPU 0;
    the predict model `cube3d` stays KIND_CPU (it only forwards requests to the engine over BLS
    and imports no torch, so it needs no GPU). "cpu": both KIND_CPU (the engine on the config's
    `device`, cpu). `quantization` (none | int8 | int4 | fp8): the engine quantizes the GPT's weights
    at load (the weights stay the checkpoint's safetensors), so a quantized version is one more
    checkpoint version; it and its recipe are the version's own (`VERSION_SETTINGS`). The model code and configs come from template_repository().

    Assembled in a hidden staging directory beside `target_dir` and renamed into place, so no
    reader sees half a repository. Zero-byte files are refused by name: KServe's storage
    initializer skips zero-byte objects, so the served copy would silently lack them."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(f"version: must be an integer >= 1 (a Triton model version), got {version!r}")
    if instance_kind not in INSTANCE_KINDS:
        raise ValueError(f"instance_kind: must be one of {list(INSTANCE_KINDS)}, got {instance_kind!r}")
    from cubeserve.engine.fast_paths import recipe  # torch: only where a version is packaged

    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization: must be one of {list(QUANTIZATIONS)}, got {quantization!r}")
    weights, target = Path(weights_dir), Path(target_dir)
    if not weights.is_dir():
        raise ValueError(f"weights_dir: {weights} is not a directory")
    if target.exists():
        raise FileExistsError(f"{target} exists; a version repository is written once, into a new directory")
    empty = sorted(p.relative_to(weights).as_posix() for p in weights.rglob("*") if p.is_file() and p.stat().st_size == 0)
    if empty:
        raise ValueError(f"{weights}: zero-byte files {empty}: KServe's storage initializer skips empty objects, "
                         f"so the served repository would lack them; remove them or give them content")
    template = template_repository()
    groups = {STREAM_MODEL: _GPU_GROUP if instance_kind == "gpu" else _CPU_GROUP, PREDICT_MODEL: _CPU_GROUP}
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        for model in (PREDICT_MODEL, STREAM_MODEL):
            version_dir = staging / model / str(version)
            version_dir.mkdir(parents=True)
            (staging / model / "config.pbtxt").write_text(
                _config_with_instance_group(template / model / "config.pbtxt", groups[model]))
            shutil.copy2(template / model / "1" / "model.py", version_dir / "model.py")
        shutil.copytree(weights, staging / STREAM_MODEL / str(version) / "weights")
        (staging / STREAM_MODEL / str(version) / VERSION_SETTINGS).write_text(json.dumps(
            {"quantization": quantization, "quantization_recipe": recipe(quantization)}, indent=1) + "\n")
        os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target
