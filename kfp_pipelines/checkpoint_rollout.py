"""Kubeflow pipeline: validate, evaluate, gate, package, register and roll out a checkpoint.

    python -m kfp_pipelines.compile          # writes kfp_pipelines/checkpoint_rollout.yaml
    python -m kfp_pipelines.run_local --checkpoint DIR --store DIR   # kfp.local, no cluster

Each component is a thin wrapper over cubeserve.pipeline (tested directly there); its imports
live inside the function because KFP ships only the function's source to the step's pod,
which runs the cube-serve image (cubeserve installed). A failing step stops the run: nothing
after a failed validation or gate is packaged, registered or served.
"""

from typing import NamedTuple

from kfp import dsl
from kfp.dsl import HTML, Metrics, Output

# The runtime image (k8s/Dockerfile) with cubeserve and the pipeline extra installed. kfp.local
# with SubprocessRunner(use_venv=False) ignores it and runs the steps in this environment.
IMAGE = "registry.example.com/cube-serve:0.1.0"
PIPELINE_NAME = "cube3d-checkpoint-rollout"


@dsl.component(base_image=IMAGE)
def validate(checkpoint: str, registry_uri: str, model_name: str
             ) -> NamedTuple("ValidateOutputs", [("validation", dict), ("sha256", str), ("existing_version", str)]):
    """Only safetensors + configs, strict load, version detected, sha256 of every file; and
    whether this very checkpoint (same digest) is registered already."""
    from collections import namedtuple

    from cubeserve.pipeline.steps import validate_checkpoint
    from cubeserve.registry import ModelRegistry

    result = validate_checkpoint(checkpoint)
    existing = ModelRegistry(registry_uri, model_name).find_by_sha256(result["sha256"])
    if existing is not None:
        print(f"checkpoint {result['sha256']} is already version {existing.version}: nothing to do")
    out = namedtuple("ValidateOutputs", ["validation", "sha256", "existing_version"])
    return out(result, result["sha256"], existing.version if existing else "")


@dsl.component(base_image=IMAGE)
def evaluate(existing_version: str, checkpoint: str, prompts: list, resolution: int, device: str,
             heldout_shapes: int, registry_uri: str, model_name: str, metrics: Output[Metrics],
             report: Output[HTML]) -> dict:
    """Meshes for the fixed prompts, compared with the champion's tokens when there is one."""
    from pathlib import Path

    if existing_version:  # registered already: every later step is a no-op
        with open(report.path, "w") as f:
            f.write(f"<p>already registered as version {existing_version}; not evaluated again</p>")
        return {}

    from cubeserve.pipeline.steps import evaluate_checkpoint
    from cubeserve.registry import CHAMPION, ModelRegistry

    champion = ModelRegistry(registry_uri, model_name).by_alias(CHAMPION)
    champion_weights = str(Path(champion.source) / "weights") if champion else ""
    result = evaluate_checkpoint(checkpoint, list(prompts), resolution, device, champion_weights, heldout_shapes)
    for key, value in result["metrics"].items():
        metrics.log_metric(key, float(value))
    with open(report.path, "w") as f:
        f.write(result["html"])
    return result["metrics"]


@dsl.component(base_image=IMAGE)
def gate(existing_version: str, metrics: dict, min_valid_share: float, min_watertight_share: float,
         min_token_agreement: float, max_time_per_output_token_s: float, min_shape_iou: float) -> str:
    """Fails the run (before anything is packaged) when a metric misses its threshold."""
    if existing_version:
        return f"skipped: already version {existing_version}"
    from cubeserve.pipeline.steps import gate as check

    summary = check(metrics, min_valid_share, min_watertight_share, min_token_agreement,
                    max_time_per_output_token_s, min_shape_iou)
    print(summary)
    return summary


@dsl.component(base_image=IMAGE)
def package(existing_version: str, checkpoint: str, store: str, validation: dict, registry_uri: str,
            model_name: str) -> int:
    """The next Triton version N in the model store. N is past every registered version too,
    so a rolled-back version's number is never reused for different weights."""
    if existing_version:
        return 0
    from cubeserve.pipeline.steps import package as write_version
    from cubeserve.registry import ModelRegistry

    registry = ModelRegistry(registry_uri, model_name)
    try:
        known = [v.triton_version for v in registry.versions()]
    except Exception:  # no registered model yet
        known = []
    return write_version(checkpoint, store, validation["files_sha256"], min_version=max(known, default=0) + 1)


@dsl.component(base_image=IMAGE)
def register(existing_version: str, registry_uri: str, model_name: str, store: str, triton_version: int,
             validation: dict, metrics: dict, source_uri: str, run_id: str) -> str:
    """A registry version with its tags and the alias `challenger`; returns its number."""
    if existing_version:
        return existing_version
    from cubeserve.pipeline.steps import register as create_version

    version = create_version(registry_uri, model_name, store, triton_version, validation, metrics,
                             source_uri, run_id)
    print(f"registered {model_name} version {version} (Triton version {triton_version})")
    return version


@dsl.component(base_image=IMAGE)
def roll_out(existing_version: str, target: str, registry_uri: str, model_name: str, version: str,
             canary_percent: int, soak_requests: int, soak_seconds: float, prompts: list, triton_url: str,
             store: str, namespace: str, isvc: str) -> dict:
    """Canary, soak, promote (alias champion moves) or roll back; the decision is tagged."""
    if existing_version:
        return {"decision": "duplicate", "reason": f"checkpoint already registered as version {existing_version}"}
    from cubeserve.pipeline.serving import roll_out as run

    result = run(target, registry_uri, model_name, version, canary_percent, soak_requests, soak_seconds,
                 list(prompts), triton_url=triton_url, store=store, namespace=namespace, isvc=isvc)
    print(f"{model_name} version {version}: {result['decision']} ({result['reason']})")
    return result


@dsl.pipeline(name=PIPELINE_NAME, description="Validate, evaluate, gate, package, register and roll "
                                               "out a Cube 3D checkpoint")
def checkpoint_rollout(
    checkpoint: str,
    store: str,
    registry_uri: str,
    model_name: str = "cube3d",
    prompts: list = ["a red chair", "a wooden table", "a small boat"],
    resolution: int = 5,
    device: str = "cpu",
    min_valid_share: float = 1.0,
    min_watertight_share: float = 0.0,
    min_token_agreement: float = 0.0,
    max_time_per_output_token_s: float = 1.0,
    heldout_shapes: int = 0,
    min_shape_iou: float = 0.0,
    target: str = "local",
    triton_url: str = "",
    canary_percent: int = 10,
    soak_requests: int = 2,
    soak_seconds: float = 0.0,
    namespace: str = "",
    isvc: str = "cube3d",
):
    checked = validate(checkpoint=checkpoint, registry_uri=registry_uri, model_name=model_name)
    # A checkpoint registered before (same sha256) makes every later step a no-op. (Not a
    # dsl.If: kfp.local 2.17 cannot resolve a task output inside a condition.)
    existing = checked.outputs["existing_version"]
    evaluated = evaluate(existing_version=existing, checkpoint=checkpoint, prompts=prompts,
                         resolution=resolution, device=device, heldout_shapes=heldout_shapes,
                         registry_uri=registry_uri, model_name=model_name)
    passed = gate(existing_version=existing, metrics=evaluated.outputs["Output"],
                  min_valid_share=min_valid_share, min_watertight_share=min_watertight_share,
                  min_token_agreement=min_token_agreement,
                  max_time_per_output_token_s=max_time_per_output_token_s, min_shape_iou=min_shape_iou)
    packaged = package(existing_version=existing, checkpoint=checkpoint, store=store,
                       validation=checked.outputs["validation"], registry_uri=registry_uri,
                       model_name=model_name).after(passed)
    registered = register(existing_version=existing, registry_uri=registry_uri, model_name=model_name,
                          store=store, triton_version=packaged.output, validation=checked.outputs["validation"],
                          metrics=evaluated.outputs["Output"], source_uri=checkpoint,
                          run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER)
    roll_out(existing_version=existing, target=target, registry_uri=registry_uri, model_name=model_name,
             version=registered.output, canary_percent=canary_percent, soak_requests=soak_requests,
             soak_seconds=soak_seconds, prompts=prompts, triton_url=triton_url, store=store,
             namespace=namespace, isvc=isvc)
