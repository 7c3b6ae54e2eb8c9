"""Validate, evaluate, gate, package and register a checkpoint (roll-out: serving.py).

Each step takes and returns plain values (paths, numbers, JSON-able dicts) so that a KFP
component can pass them between pods, and a failure raises with a message that says which
file or threshold failed: KFP shows it as the step's error and runs nothing after it.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import os
import shutil
import time
from pathlib import Path

from cubeserve import deploy
from cubeserve.checkpoint import CheckpointError, load_models, sha256_file, version_style
from cubeserve.config import QUANTIZATIONS, to_yaml_dict
from cubeserve.deploy import STREAM_MODEL

# The only files a checkpoint may hold: tensors as safetensors, configs and tokenizer files as
# text. Anything else (a pickle above all) is refused by name before anything is read.
ALLOWED_SUFFIXES = {".safetensors", ".yaml", ".yml", ".json", ".txt", ".model", ".md"}


class GateFailed(ValueError):
    """An evaluation metric is outside its threshold; nothing was packaged or registered."""


# -- 1. validate -------------------------------------------------------------------------------

def fetch_checkpoint(checkpoint: str) -> str:
    """A local directory holding the checkpoint. An object-store URI (s3://, file://; see
    cubeserve.storage) is downloaded once into this pod's temporary directory; a local path is
    returned as it is."""
    if "://" not in checkpoint:
        return checkpoint
    import tempfile

    from cubeserve import storage

    cache = Path(tempfile.gettempdir()) / f"cubeserve-checkpoint-{hashlib.sha256(checkpoint.encode()).hexdigest()[:16]}"
    if not cache.is_dir():
        partial = cache.with_name(cache.name + f".partial-{os.getpid()}")
        shutil.rmtree(partial, ignore_errors=True)
        try:
            storage.download_dir(checkpoint, partial)
        except storage.StorageError as exc:
            raise CheckpointError(str(exc)) from None
        partial.rename(cache)
    return str(cache)


def checkpoint_files(checkpoint: str | Path) -> list[Path]:
    root = Path(checkpoint)
    return sorted(p for p in root.rglob("*") if p.is_file())


def checkpoint_digest(file_sha256: dict[str, str]) -> str:
    """One digest for the whole checkpoint: sha256 over the sorted `path sha256` lines, so the
    same files give the same digest wherever the directory lives."""
    lines = "".join(f"{name} {digest}\n" for name, digest in sorted(file_sha256.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


# The Secret that gives every step its object-store credentials, as environment variables
# (kfp_pipelines.checkpoint_rollout mounts it, optional, so a pod never waits for it); the
# predictor's storage initializer reads the same one.
S3_SECRET = deploy.STORAGE_SECRET
S3_SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION")


def preflight(checkpoint: str, model_store: str) -> None:
    """What a run needs from its namespace, checked by its first step before anything else: the
    credentials of the Secret S3_SECRET when a URI is s3://, and a model store they can list.
    Fails at once, naming the Secret and what it lacks (a pod that waited for a missing Secret
    would hold the run until its deadline, and again for every retry)."""
    import os

    from cubeserve import storage

    if any(uri.startswith("s3://") for uri in (checkpoint, model_store)):
        missing = [k for k in storage.CREDENTIAL_VARIABLES if not os.environ.get(k)]
        if missing:
            raise storage.StorageError(
                f"no S3 credentials: {', '.join(missing)} not set; create the Secret {S3_SECRET} in the run's "
                f"namespace with the keys {', '.join(S3_SECRET_KEYS)} (docs/pipeline.md, 'Running the pipeline from the "
                f"Kubeflow UI')")
    storage.list_dirs(model_store)  # the endpoint answers, the credentials are good, the bucket exists


def validate_checkpoint(checkpoint: str, quantization: str = "none") -> dict:
    """Files, headers, version and a strict load (`cubeserve.checkpoint.load_models`); returns
    what the registry records.

    `quantization` (none | int8 | int4 | fp8) is part of what is served, so of the identity: `sha256`
    is the checkpoint's digest for "none", and a digest of it and the quantization otherwise
    (`served_digest`): the same checkpoint quantized is another version, registered, packaged
    and rolled out on its own; `checkpoint_sha256` is the files' digest either way.

    Raises CheckpointError naming the file for a pickle (by suffix or content), a truncated
    file, unexpected files, or weights that do not match the config (e.g. v0.5 with v0.1)."""
    from cubeserve.engine.fast_paths import recipe

    if quantization not in QUANTIZATIONS:  # before anything is downloaded
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    root = Path(fetch_checkpoint(checkpoint))
    if not root.is_dir():
        raise CheckpointError(f"{checkpoint}: not a directory")
    # The CLIP folder is checked here and loaded by the evaluation.
    cfg, _, _ = load_models(root, device="cpu", allowed_suffixes=ALLOWED_SUFFIXES)
    file_sha256 = {p.relative_to(root).as_posix(): sha256_file(p) for p in checkpoint_files(root)}
    return {
        "config_name": cfg.name,
        "config": to_yaml_dict(cfg),
        "version": version_style(cfg.gpt.use_bbox),  # the weights' own: load_models checked they agree
        "num_tokens": cfg.num_tokens,
        "files_sha256": file_sha256,
        "checkpoint_sha256": checkpoint_digest(file_sha256),
        "quantization": quantization,
        "quantization_recipe": recipe(quantization),
        "sha256": served_digest(checkpoint_digest(file_sha256), quantization),
    }


def served_digest(checkpoint_sha256: str, quantization: str) -> str:
    """The identity of what is served: the checkpoint's digest, or with a quantization a digest
    of it, the quantization and its recipe (`fast_paths.recipe`: the same files quantized another
    way are another model; an unquantized checkpoint keeps the digest it was always registered
    under)."""
    from cubeserve.engine.fast_paths import recipe

    if quantization == "none":
        return checkpoint_sha256
    return hashlib.sha256(f"{checkpoint_sha256} quantization={quantization} recipe={recipe(quantization)}\n"
                          .encode()).hexdigest()


# -- 2. evaluate -------------------------------------------------------------------------------

DEVICES = ("cpu", "cuda")


def fetch_champion(registry) -> str:
    """The champion's weights, downloaded from its packaged version into this pod's temporary
    directory ("" when there is no champion yet)."""
    import tempfile

    from cubeserve import storage
    from cubeserve.registry import CHAMPION

    champion = registry.by_alias(CHAMPION)
    if champion is None:
        return ""
    uri = storage.join(champion.source.rstrip("/"), STREAM_MODEL, str(champion.triton_version), "weights") + "/"
    local = Path(tempfile.mkdtemp(prefix=f"champion-{champion.version}-"))
    storage.download_dir(uri, local)
    return str(local)


def _token_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions where two sets of token sequences agree (0 when the lengths differ)."""
    same = total = 0
    for x, y in zip(a, b):
        total += max(len(x), len(y))
        same += sum(i == j for i, j in zip(x, y)) if len(x) == len(y) else 0
    return same / total if total else 0.0


def evaluate_checkpoint(checkpoint: str, prompts: list[str], resolution: int = 5, device: str = "cpu",
                        champion_weights: str = "", heldout_shapes: int = 0, quantization: str = "none") -> dict:
    """Meshes for fixed prompts (greedy, seed 0): validity, timings, agreement with the champion;
    with `heldout_shapes` > 0, also the demo benchmark (`cubeserve.demo.evaluate`): mean IoU of
    generated and of tokenizer-reconstructed meshes against held-out procedural shapes (-1
    when not run). Only models trained on those shapes score well on it.

    With a `quantization`, the checkpoint is evaluated as it will be served (quantized), and the
    numerics harness (`cubeserve.numerics`) compares it with its unquantized parent in float32
    on the prompts: numerics_agreement (teacher-forced top-1), numerics_kl, numerics_iou (-1
    without a quantization).

    Returns {"metrics": {...}, "html": report}. Metrics are per run, not per prompt, so that
    the gate and the registry compare like with like."""
    import torch
    import trimesh

    from cubeserve.engine import Engine, GenerationRequest
    from cubeserve.preview import render_preview

    torch.manual_seed(0)
    weights = fetch_checkpoint(checkpoint)
    engine = Engine.from_dir(weights, device=device, quantization=quantization)
    requests = [GenerationRequest(prompt=p, seed=0, resolution=resolution) for p in prompts]
    t0 = time.perf_counter()
    results = engine.generate(requests)
    elapsed = time.perf_counter() - t0
    tokens = [r.tokens for r in results]
    rows, valid, watertight = [], 0, 0
    for r in results:
        mesh = trimesh.Trimesh(vertices=r.mesh.vertices, faces=r.mesh.faces, process=False)
        ok = not r.mesh.empty
        tight = ok and bool(mesh.is_watertight)
        valid, watertight = valid + ok, watertight + tight
        png = render_preview(r.mesh.vertices, r.mesh.faces, size=256, message=r.mesh.message)
        rows.append((r.request.prompt, len(r.mesh.vertices), len(r.mesh.faces), tight, png))
    n = len(results)
    metrics = {
        "prompts": n,
        "valid_share": valid / n,
        "watertight_share": watertight / n,
        # One decode step produces one token for every object of the batch.
        "time_per_output_token_s": results[0].timings["time_per_token_s"],
        "time_per_object_s": elapsed / n,
        "token_agreement": -1.0,  # no champion to compare with
        "shape_iou": -1.0,
        "shape_reconstruction_iou": -1.0,
        "numerics_agreement": -1.0,  # no quantization: nothing to compare
        "numerics_kl": -1.0,
        "numerics_iou": -1.0,
    }
    if quantization != "none":
        from cubeserve import numerics

        parent = Engine.from_dir(weights, device=device, dtype="float32")
        oracle = numerics.Oracle.of(numerics.EngineDecoder(parent), numerics.requests_for(prompts), resolution)
        del parent
        report = numerics.compare(oracle, numerics.EngineDecoder(engine), quantization)
        metrics.update(numerics_agreement=report.agreement, numerics_kl=report.kl, numerics_iou=report.iou)
    if heldout_shapes > 0:
        from cubeserve.demo.evaluate import evaluate_engine

        summary = evaluate_engine(engine, n=heldout_shapes, resolution=resolution).summary
        metrics["shape_iou"] = summary["generation_iou"]
        metrics["shape_reconstruction_iou"] = summary["reconstruction_iou"]
    if champion_weights:
        champion = Engine.from_dir(champion_weights, device=device)
        theirs = champion.generate_tokens([GenerationRequest(prompt=p, seed=0) for p in prompts]).tolist()
        metrics["token_agreement"] = _token_agreement(tokens, theirs)
        del champion
    return {"metrics": metrics, "html": _report(checkpoint, metrics, rows, resolution, device)}


def _report(checkpoint: str, metrics: dict, rows: list, resolution: int, device: str) -> str:
    """A self-contained HTML page (KFP's HTML viewer shows it): metrics and previews inline."""
    metric_rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{v:.4g}</td></tr>" for k, v in metrics.items())
    meshes = "".join(
        f"<figure><img src='data:image/png;base64,{base64.b64encode(png).decode()}' width=256>"
        f"<figcaption>{html.escape(prompt)}: {nv} vertices, {nf} faces"
        f"{', watertight' if tight else ''}</figcaption></figure>"
        for prompt, nv, nf, tight, png in rows)
    return (f"<html><body style='font-family:sans-serif'><h2>cube3d evaluation</h2>"
            f"<p>{html.escape(checkpoint)} on {html.escape(device)}, resolution {resolution}, greedy, seed 0"
            f"</p><table border=1 cellpadding=4>{metric_rows}</table>"
            f"<div style='display:flex;flex-wrap:wrap'>{meshes}</div></body></html>")


# -- 3. gate -----------------------------------------------------------------------------------

def gate(metrics: dict, min_valid_share: float, min_watertight_share: float,
         min_token_agreement: float, max_time_per_output_token_s: float, min_shape_iou: float = 0.0,
         min_numerics_agreement: float = 0.0) -> str:
    """Raise GateFailed listing every threshold missed; a passing summary otherwise.
    Token agreement is only checked against an existing champion (it is -1 without one);
    a shape-IoU threshold requires the held-out shape benchmark to have run; the numerics
    agreement is checked for a quantized checkpoint (-1 otherwise)."""
    failures = []
    measured = metrics.get("numerics_agreement", -1.0)
    if 0 <= measured < min_numerics_agreement:
        failures.append(f"numerics_agreement {measured:.3f} < {min_numerics_agreement} (the quantized weights' "
                        f"teacher-forced agreement with the unquantized checkpoint)")
    if min_shape_iou > 0 and metrics.get("shape_iou", -1.0) < min_shape_iou:
        measured = metrics.get("shape_iou", -1.0)
        failures.append(f"shape_iou {measured:.3f} < {min_shape_iou}" if measured >= 0 else
                        f"shape_iou not measured (heldout_shapes = 0) but min_shape_iou = {min_shape_iou}")
    if metrics["valid_share"] < min_valid_share:
        failures.append(f"valid_share {metrics['valid_share']:.3f} < {min_valid_share}")
    if metrics["watertight_share"] < min_watertight_share:
        failures.append(f"watertight_share {metrics['watertight_share']:.3f} < {min_watertight_share}")
    if metrics["token_agreement"] >= 0 and metrics["token_agreement"] < min_token_agreement:
        failures.append(f"token_agreement {metrics['token_agreement']:.3f} < {min_token_agreement}")
    if metrics["time_per_output_token_s"] > max_time_per_output_token_s:
        failures.append(f"time_per_output_token_s {metrics['time_per_output_token_s']:.4g} > "
                        f"{max_time_per_output_token_s}")
    if failures:
        raise GateFailed("gate failed: " + "; ".join(failures))
    return "gate passed: " + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items())


# -- 4. package --------------------------------------------------------------------------------

def version_uri(model_store: str, version: int) -> str:
    """Where version N lives: `<model_store>/<N>/`, a complete Triton model repository, the
    InferenceService's storageUri. The trailing slash matters: KServe's storage initializer lists
    objects by prefix, so `<model_store>/1` would also fetch `<model_store>/10/...`."""
    from cubeserve import storage

    return storage.join(model_store, str(version)) + "/"


def manifest_uri(model_store: str, version: int) -> str:
    """`<model_store>/<N>.json`, written after every file of version N: a version without it is
    incomplete (a failed upload) and is never registered or listed. It sits beside the version's
    folder, not in it, so that KServe never downloads it into the model repository."""
    from cubeserve import storage

    return storage.join(model_store, f"{version}.json")


def store_versions(model_store: str) -> dict[int, dict]:
    """Complete versions in the model store: N -> its manifest."""
    from cubeserve import storage

    found = {}
    for name in storage.list_dirs(model_store):
        if name.isdigit():
            text = storage.read_text(manifest_uri(model_store, int(name)))
            if text is not None:
                found[int(name)] = json.loads(text)
    return dict(sorted(found.items()))


def package(checkpoint: str, model_store: str, validation: dict, instance_kind: str = "gpu",
            min_version: int = 1) -> int:
    """Upload the checkpoint as version N of the model store, in the layout KServe and the
    ServingRuntime read (`<model_store>/<N>/{cube3d,cube3d_stream}/...`, Triton model version N).

    N is the next number past every version in the store and `min_version - 1` that no other
    run has claimed (leases.claim_version: a conditional create, so two runs started together get
    two numbers on a store that honours conditional writes). A checkpoint
    that is in the store already (same digest and instance kind: a retried step or a resumed
    run) returns its version instead of uploading it again. The weights are checked against the
    validated digests before anything is uploaded."""
    import tempfile

    from cubeserve import storage
    from cubeserve.engine.fast_paths import check_recipe
    from cubeserve.pipeline.leases import claim_version
    from cubeserve.serving.repository import INSTANCE_KINDS, build_version_repository

    if instance_kind not in INSTANCE_KINDS:  # before anything is downloaded
        raise ValueError(f"instance_kind must be one of {', '.join(INSTANCE_KINDS)}, got {instance_kind!r}")
    validation = _integral(validation)
    quantization = validation.get("quantization", "none")  # part of validation["sha256"]
    # The validation may come from another image (a cached step): its digest named its recipe.
    check_recipe(quantization, validation.get("quantization_recipe"))
    existing = store_versions(model_store)
    for version, manifest in existing.items():
        if manifest.get("sha256") == validation["sha256"] and manifest.get("instance_kind") == instance_kind:
            return version
    numbered = [int(n) for n in storage.list_dirs(model_store) if n.isdigit()]  # incomplete ones too
    version = claim_version(model_store, max([min_version - 1, *numbered]) + 1,
                            {"sha256": validation["sha256"], "instance_kind": instance_kind})
    with tempfile.TemporaryDirectory() as tmp:
        repo = build_version_repository(fetch_checkpoint(checkpoint), version, Path(tmp) / "repo", instance_kind,
                                        quantization)
        weights = repo / STREAM_MODEL / str(version) / "weights"
        for rel, digest in validation["files_sha256"].items():
            if sha256_file(weights / rel) != digest:
                raise CheckpointError(f"{rel}: changed after it was validated")
        storage.upload_dir(repo, version_uri(model_store, version))
    storage.write_text(manifest_uri(model_store, version), json.dumps({
        "version": version, "sha256": validation["sha256"], "instance_kind": instance_kind,
        "config_name": validation["config_name"], "files_sha256": validation["files_sha256"],
        "quantization": quantization, "quantization_recipe": validation.get("quantization_recipe", ""),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=2, sort_keys=True))
    return version


# -- 5. register -------------------------------------------------------------------------------

def _integral(obj):
    """KFP passes dicts as protobuf Structs: every number comes back a float."""
    if isinstance(obj, float) and obj.is_integer():
        return int(obj)
    if isinstance(obj, dict):
        return {k: _integral(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_integral(v) for v in obj]
    return obj


def register(registry_uri: str, model_name: str, model_store: str, triton_version: int, validation: dict,
             metrics: dict, source_uri: str, pipeline_run_id: str, mlflow_run_id: str) -> str:
    """A registry version for packaged version N, created in the pipeline run's MLflow run with the
    object-store URI of version N as its source, tagged. A checkpoint registered already (same
    sha256) returns its version instead (a retried step). The alias `challenger` is set by the
    roll-out, under its lease (cubeserve.pipeline.leases), not here: runs register at any time.
    """
    from cubeserve.registry import open_registry

    registry = open_registry(registry_uri, model_name)
    validation = _integral(validation)
    existing = registry.find_by_sha256(validation["sha256"])
    if existing is not None:
        return existing.version
    version = registry.create(
        source=version_uri(model_store, triton_version),
        run_id=mlflow_run_id,
        description=f"{source_uri} ({validation['version']}, config {validation['config_name']})",
        tags={
            "sha256": validation["sha256"],
            "files_sha256": json.dumps(validation["files_sha256"], sort_keys=True),
            "config": json.dumps(validation["config"], sort_keys=True),
            "config_name": validation["config_name"],
            "checkpoint_version": validation["version"],
            "quantization": validation.get("quantization", "none"),
            **({"quantization_recipe": validation["quantization_recipe"]}
               if validation.get("quantization_recipe") else {}),
            "metrics": json.dumps(metrics, sort_keys=True),
            **{f"metric.{k}": f"{v:.6g}" for k, v in metrics.items()},
            "source_uri": source_uri,
            "pipeline_run_id": pipeline_run_id,
            "model_store": model_store,
            "triton_version": str(triton_version),
        })
    return version.version


# -- what a run does with a checkpoint -----------------------------------------------------------

NEW, RESUME, DONE = "new", "resume", "done"
# Roll-out decisions that end a version's roll-out; anything else (none yet, "failed") is resumed.
FINAL_DECISIONS = ("promoted", "rolled_back", "unchanged")


# The run tag a run's last step sets when it has done its work: `validate` for a checkpoint whose
# roll-out was decided before (DONE), the roll-out once its decision is recorded. The exit
# handler judges the run by it, not by the state the KFP backend hands it, which is RUNNING for
# runs that succeeded on backends before 2.17 (kfp_pipelines/pod_runner.py says why).
FINISHED_TAG = "cubeserve.finished"


def mark_finished(registry, pipeline_run_id: str, step: str, outcome: str) -> None:
    """Record on the pipeline run's MLflow run that its last step, `step`, did its work."""
    registry.tag_run(registry.start_run(pipeline_run_id), {FINISHED_TAG: f"{step}: {outcome}"[:1000]})


def finished(registry, run_id: str) -> str:
    """What the run's last step recorded (mark_finished), "" when nothing did."""
    return registry.get_run(run_id).tags.get(FINISHED_TAG, "")


def plan_run(registry, sha256: str) -> tuple[str, str, str]:
    """(action, registry version, why): NEW for a checkpoint never registered; RESUME for one
    registered by an earlier run whose roll-out did not finish (it failed, or the run stopped);
    DONE for one whose roll-out was decided."""
    existing = registry.find_by_sha256(sha256)
    if existing is None:
        return NEW, "", "not registered yet"
    decision = existing.tags.get("rollout.decision", "")
    if decision in FINAL_DECISIONS:
        return DONE, existing.version, f"already version {existing.version}, roll-out {decision}"
    return RESUME, existing.version, (f"version {existing.version} was registered but its roll-out "
                                      f"{'failed' if decision else 'never finished'}: resuming it")
