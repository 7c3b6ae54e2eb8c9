"""Kubeflow pipeline: validate, evaluate, gate, package, register and roll out a checkpoint.

    python -m kfp_pipelines.compile --image REGISTRY/cube-serve:TAG   # the YAML for the Kubeflow UI
    make pipeline CHECKPOINT=DIR                                      # one run on this machine

The image is a compile-time parameter (`build(image)`): every step runs the cube-serve runtime
image (k8s/Dockerfile), which carries cubeserve, kfp and everything a step imports, so no step
installs anything at start. Each component is a thin wrapper over cubeserve.pipeline (tested
there); its imports live inside the function because KFP ships only the function's source.

What a run does with a checkpoint (`validate` decides, `steps.plan_run`):
* new: evaluate (on a GPU when device is "cuda"), gate, package into the model store, register
  (alias challenger), roll out;
* resume: registered by an earlier run whose roll-out failed or never finished: roll it out;
* done: registered and its roll-out decided before: nothing more.
The exit handler (`finish`) runs whatever happened: it closes the run's MLflow run and, when a
run fails after registration, takes the challenger out of serving and clears its alias.

Credentials come from Secrets as environment variables (kfp-kubernetes): `cube-serve-s3` (the
object store; also KServe's storage initializer's, k8s/pipeline/) and, optionally,
`cube-serve-mlflow` (an MLflow server behind authentication).
"""

from typing import NamedTuple

from kfp import dsl, kubernetes
from kfp.dsl import HTML, Metrics, Output, PipelineTaskFinalStatus

from cubeserve import deploy
from cubeserve.pipeline.serving import FINISH_DEADLINE_S, ROLLOUT_DEADLINE_S
from cubeserve.pipeline.steps import S3_SECRET, S3_SECRET_KEYS

PIPELINE_NAME = "cube3d-checkpoint-rollout"
MLFLOW_SECRET = "cube-serve-mlflow"
MLFLOW_SECRET_KEYS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
# Target local loads versions through tritonserver's model-repository API, an admin API (docs/security.md):
# these steps get the admin key from the Secret deploy.ADMIN_SECRET where it exists.
ADMIN_STEPS = ("roll_out", "finish")
GPU_RESOURCE = "nvidia.com/gpu"


# -- the steps (plain functions; `build` makes them components of an image) ----------------------

def validate(checkpoint: str, model_store: str, registry_uri: str, model_name: str, device: str,
             pipeline_run_id: str, quantization: str = "none") -> NamedTuple("ValidateOutputs", [("validation", dict), ("action", str),
                                                                     ("version", str), ("mlflow_run_id", str)]):
    """The run's Secrets, object store and registry answer (first, so a missing one fails the
    run at once); only safetensors + configs, strict load, version detected, sha256 of every
    file; opens this pipeline run's MLflow run; decides what the run does (new, resume or done),
    for the checkpoint as served (`quantization` is part of its identity)."""
    from collections import namedtuple

    from cubeserve.pipeline.steps import DEVICES, DONE, mark_finished, plan_run, preflight, validate_checkpoint
    from cubeserve.registry import open_registry

    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    preflight(checkpoint, model_store)
    registry = open_registry(registry_uri, model_name)
    result = validate_checkpoint(checkpoint, quantization)
    action, version, why = plan_run(registry, result["sha256"])
    run_id = registry.start_run(pipeline_run_id, {
        "checkpoint": checkpoint, "sha256": result["sha256"], "config_name": result["config_name"],
        "checkpoint_version": result["version"], "action": action})
    print(f"checkpoint {result['sha256'][:12]}: {action} ({why})")
    if action == DONE:  # nothing follows: this run's work is done
        mark_finished(registry, pipeline_run_id, "validate", why)
    out = namedtuple("ValidateOutputs", ["validation", "action", "version", "mlflow_run_id"])
    return out(result, action, version, run_id)


def evaluate(checkpoint: str, prompts: list, resolution: int, device: str, heldout_shapes: int, registry_uri: str,
             model_name: str, mlflow_run_id: str, metrics: Output[Metrics], report: Output[HTML],
             quantization: str = "none") -> dict:
    """Meshes for the fixed prompts, compared with the champion's tokens when there is one (and,
    quantized, with the unquantized checkpoint by the numerics harness); the metrics and the
    HTML report also go to the run's MLflow run."""
    from cubeserve.pipeline.steps import evaluate_checkpoint, fetch_champion
    from cubeserve.registry import open_registry

    registry = open_registry(registry_uri, model_name)
    champion_weights = fetch_champion(registry)
    result = evaluate_checkpoint(checkpoint, list(prompts), resolution, device, champion_weights, heldout_shapes,
                                 quantization)
    for key, value in result["metrics"].items():
        metrics.log_metric(key, float(value))
    with open(report.path, "w") as f:
        f.write(result["html"])
    registry.log_metrics(mlflow_run_id, result["metrics"])
    registry.log_artifact_text(mlflow_run_id, "evaluation.html", result["html"])
    return result["metrics"]


def gate(metrics: dict, min_valid_share: float, min_watertight_share: float, min_token_agreement: float,
         max_time_per_output_token_s: float, min_shape_iou: float, min_numerics_agreement: float = 0.0) -> str:
    """Fails the run (before anything is packaged) when a metric misses its threshold."""
    from cubeserve.pipeline.steps import gate as check

    summary = check(metrics, min_valid_share, min_watertight_share, min_token_agreement,
                    max_time_per_output_token_s, min_shape_iou, min_numerics_agreement)
    print(summary)
    return summary


def package(checkpoint: str, model_store: str, instance_kind: str, validation: dict, registry_uri: str,
            model_name: str, target: str, namespace: str) -> int:
    """Version N in the model store (`<model_store>/<N>/`, what KServe's storageUri names). N is
    past every registered version too, so a rolled-back version's number is never reused for
    other weights. For the kserve target, N is listed in the ConfigMap cube3d-versions."""
    from cubeserve.pipeline.leases import unprotected_warning
    from cubeserve.pipeline.serving import record_version
    from cubeserve.pipeline.steps import package as upload_version
    from cubeserve.registry import open_registry

    print(unprotected_warning(model_store) or "the model store honours conditional writes: version N is this run's alone")

    known = [v.triton_version for v in open_registry(registry_uri, model_name).versions()]
    version = upload_version(checkpoint, model_store, validation, instance_kind, min_version=max(known, default=0) + 1)
    print(f"version {version}: {model_store.rstrip('/')}/{version}/")
    if target == "kserve":
        print(record_version(namespace, version, model_store))
    return version


def register(registry_uri: str, model_name: str, model_store: str, triton_version: int, validation: dict,
             metrics: dict, checkpoint: str, pipeline_run_id: str, mlflow_run_id: str) -> str:
    """A registry version in the run's MLflow run, with its tags and the alias challenger."""
    from cubeserve.pipeline.steps import register as create_version

    version = create_version(registry_uri, model_name, model_store, triton_version, validation, metrics,
                             checkpoint, pipeline_run_id, mlflow_run_id)
    print(f"registered {model_name} version {version} (model store version {triton_version})")
    return version


def roll_out(target: str, registry_uri: str, model_name: str, version: str, canary_percent: int,
             soak_requests: int, soak_seconds: float, prompts: list, triton_url: str, model_store: str,
             namespace: str, isvc: str, pipeline_run_id: str, prometheus_url: str, analysis_windows: int,
             analysis_window_seconds: float, analysis_thresholds: dict, metrics_selector: str, shadow_share: float,
             shadow_seconds: float) -> dict:
    """Canary (after a shadow on the local target), soak, analysis windows from Prometheus, then
    promote (alias champion moves) or roll back; the decision and the figures are tagged."""
    from cubeserve.pipeline.serving import Gate
    from cubeserve.pipeline.serving import roll_out as run

    gate = Gate(prometheus_url=prometheus_url, windows=analysis_windows, window_seconds=analysis_window_seconds,
                shadow_share=shadow_share, shadow_seconds=shadow_seconds, thresholds=dict(analysis_thresholds),
                selector=metrics_selector)
    result = run(target, registry_uri, model_name, version, canary_percent, soak_requests, soak_seconds,
                 list(prompts), triton_url=triton_url, model_store=model_store, namespace=namespace, isvc=isvc,
                 pipeline_run_id=pipeline_run_id, gate=gate)
    print(f"{model_name} version {version}: {result['decision']} ({result['reason']})")
    return result


def finish(status: PipelineTaskFinalStatus, registry_uri: str, model_name: str, pipeline_run_id: str, target: str,
           triton_url: str, model_store: str, namespace: str, isvc: str) -> str:
    """Exit handler: closes the MLflow run; after a failure, the champion keeps serving and the
    challenger alias is cleared (the same checkpoint run again resumes its roll-out)."""
    from cubeserve.pipeline.serving import finish_run

    outcome = finish_run(status.state, status.error_message or "", registry_uri, model_name, pipeline_run_id,
                         target, triton_url, model_store, namespace, isvc)
    print(outcome)
    return outcome


STEPS = (validate, evaluate, gate, package, register, roll_out, finish)


def _with_secrets(task: dsl.PipelineTask) -> dsl.PipelineTask:
    # Optional: a pod whose Secret is missing would wait (CreateContainerConfigError) until its
    # deadline and then be retried; the first step checks the credentials instead (steps.preflight).
    kubernetes.use_secret_as_env(task, S3_SECRET, {k: k for k in S3_SECRET_KEYS}, optional=True)
    kubernetes.use_secret_as_env(task, MLFLOW_SECRET, {k: k for k in MLFLOW_SECRET_KEYS}, optional=True)
    return task


# Each step's pod: CPU and memory requests (memory is also the limit); retries only where
# repeating is safe (not the gate, whose answer would not change, nor the roll-out, whose failed
# soak is a decision); and a deadline in seconds (the pod's activeDeadlineSeconds), so that a
# step that hangs, or a pod that cannot start (a missing Secret), fails the run instead of
# holding it forever. The roll-out's deadline bounds its soak, shadow and analysis windows
# (cubeserve.pipeline.serving.Gate.validate).
POD = {
    "validate": ("1", "8Gi", 2, 3600),
    "evaluate": ("4", "16Gi", 2, 3600),
    "evaluate-gpu": ("4", "32Gi", 2, 3600),
    "gate": ("100m", "256Mi", 0, 300),
    "package": ("2", "16Gi", 2, 3600),
    "register": ("250m", "1Gi", 2, 600),
    "roll_out": ("1", "2Gi", 0, ROLLOUT_DEADLINE_S),
    "finish": ("250m", "1Gi", 2, FINISH_DEADLINE_S),
}


def _pod(task: dsl.PipelineTask, step: str) -> dsl.PipelineTask:
    cpu, memory, retries, deadline = POD[step]
    # Every step reads or changes state outside its inputs (the object store, the registry,
    # the cluster), so none may be answered from KFP's cache.
    task.set_caching_options(False)
    task.set_cpu_request(cpu).set_memory_request(memory).set_memory_limit(memory)
    if retries:
        task.set_retry(num_retries=retries, backoff_duration="30s")
    kubernetes.set_timeout(task, deadline)
    if step in ADMIN_STEPS:  # only the steps that load versions into a local tritonserver hold the key
        kubernetes.use_secret_as_env(task, deploy.ADMIN_SECRET, {deploy.ADMIN_KEY_ENV: deploy.ADMIN_KEY_ENV},
                                     optional=True)
    return _with_secrets(task)


def build(image: str):
    """The pipeline with every step in `image` (the cube-serve runtime image)."""
    if not image or image.startswith("registry.example.com/"):
        raise ValueError(f"image must name the cube-serve runtime image you pushed, got {image!r}")
    c = {f.__name__: dsl.component(f, base_image=image, install_kfp_package=False) for f in STEPS}

    @dsl.pipeline(name=PIPELINE_NAME, description="Validate, evaluate, gate, package, register and roll out "
                                                   "a Cube 3D checkpoint")
    def checkpoint_rollout(
        checkpoint: str,
        model_store: str,
        registry_uri: str,
        model_name: str = "cube3d",
        instance_kind: str = "gpu",
        prompts: list = ["a red chair", "a wooden table", "a small boat"],
        resolution: int = 5,
        device: str = "cpu",
        gpu_tolerations: list = [],
        gpu_node_selector: dict = {},
        min_valid_share: float = 1.0,
        min_watertight_share: float = 0.0,
        min_token_agreement: float = 0.0,
        max_time_per_output_token_s: float = 1.0,
        heldout_shapes: int = 0,
        min_shape_iou: float = 0.0,
        quantization: str = "none",
        min_numerics_agreement: float = 0.95,
        target: str = "kserve",
        triton_url: str = "",
        canary_percent: int = 10,
        soak_requests: int = 2,
        soak_seconds: float = 300.0,
        namespace: str = "",
        isvc: str = "cube3d",
        prometheus_url: str = "",
        analysis_windows: int = 3,
        analysis_window_seconds: float = 300.0,
        analysis_thresholds: dict = {},
        metrics_selector: str = "",
        shadow_share: float = 0.1,
        shadow_seconds: float = 300.0,
    ):
        """Validate, evaluate, gate, package, register and roll out a Cube 3D checkpoint.

        Args:
            checkpoint: The checkpoint folder (safetensors + config.yaml + clip/), e.g. s3://bucket/checkpoints/run-42/.
            model_store: Where versions are packaged: version N goes to <model_store>/<N>/ (an s3:// URI; the baseUri of the ConfigMap cube3d-versions).
            registry_uri: The MLflow tracking server, e.g. http://mlflow.mlflow.svc.cluster.local:5000.
            model_name: The registered model's name in MLflow.
            instance_kind: gpu or cpu: where the packaged version runs its Triton instances.
            prompts: Prompts of the evaluation and of the canary's soak requests.
            resolution: Marching-cubes resolution (log2 of the grid size) of the evaluation meshes.
            device: cpu or cuda: where the evaluation runs (cuda requests one GPU for that step).
            gpu_tolerations: Tolerations of the GPU evaluation's pod (device cuda), Kubernetes' fields, e.g. [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}].
            gpu_node_selector: Node labels the GPU evaluation's pod needs (device cuda), e.g. {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}.
            min_valid_share: Gate: the least share of prompts that must give a non-empty mesh.
            min_watertight_share: Gate: the least share of watertight meshes.
            min_token_agreement: Gate: the least share of shape tokens equal to the champion's (greedy); not checked without a champion.
            max_time_per_output_token_s: Gate: the most seconds per generated token.
            heldout_shapes: Score generations against this many held-out procedural shapes (the demo benchmark; 0 = off).
            min_shape_iou: Gate: the least mean IoU on those shapes (needs heldout_shapes > 0).
            quantization: none, int8, int4 or fp8: serve the GPT's weights quantized (at load); the checkpoint quantized is a version of its own.
            min_numerics_agreement: Gate (quantization only): the least teacher-forced top-1 agreement of the quantized weights with the unquantized checkpoint on the prompts.
            target: kserve (the InferenceService isvc in namespace) or local (a tritonserver at triton_url).
            triton_url: host:port of the tritonserver's REST port (target local only).
            canary_percent: Share of the traffic for the canary (target kserve).
            soak_requests: Requests sent to the canary before it may be promoted (target local).
            soak_seconds: How long the canary runs before the analysis windows (or, without them, the decision).
            namespace: The InferenceService's namespace (target kserve; empty = the run's namespace).
            isvc: The InferenceService's name (target kserve).
            prometheus_url: Prometheus scraping the servers' metrics port, e.g. http://prometheus.monitoring.svc:9090; required while analysis_windows > 0 (set analysis_windows 0 to let the soak alone decide).
            analysis_windows: Analysis windows after the canary starts: any failed window rolls back; the last one must pass (not enough data rolls back).
            analysis_window_seconds: Length of each analysis window (traffic sent by the step on target local; the users' traffic on kserve).
            analysis_thresholds: Gate limits of cubeserve rollout analyze, e.g. {"max_error_rate": 0.05, "max_p95_ratio": 1.5, "min_requests": 20}; the others keep their defaults.
            metrics_selector: More Prometheus label matchers for the version's series, e.g. namespace="models".
            shadow_share: Target local: share of requests copied to the new version before the canary (0 = no shadow stage).
            shadow_seconds: Target local: how long the shadow stage runs before its analysis.
        """
        run_id = dsl.PIPELINE_JOB_ID_PLACEHOLDER
        done = c["finish"](registry_uri=registry_uri, model_name=model_name, pipeline_run_id=run_id, target=target,
                           triton_url=triton_url, model_store=model_store, namespace=namespace, isvc=isvc)
        _pod(done, "finish")
        with dsl.ExitHandler(done, name="checkpoint"):
            checked = _pod(c["validate"](checkpoint=checkpoint, model_store=model_store, registry_uri=registry_uri,
                                         model_name=model_name, device=device, pipeline_run_id=run_id,
                                         quantization=quantization), "validate")
            action, mlflow_run = checked.outputs["action"], checked.outputs["mlflow_run_id"]
            rollout_args = dict(target=target, registry_uri=registry_uri, model_name=model_name,
                                canary_percent=canary_percent, soak_requests=soak_requests,
                                soak_seconds=soak_seconds, prompts=prompts, triton_url=triton_url,
                                model_store=model_store, namespace=namespace, isvc=isvc, pipeline_run_id=run_id,
                                prometheus_url=prometheus_url, analysis_windows=analysis_windows,
                                analysis_window_seconds=analysis_window_seconds,
                                analysis_thresholds=analysis_thresholds, metrics_selector=metrics_selector,
                                shadow_share=shadow_share, shadow_seconds=shadow_seconds)
            with dsl.If(action == "new", name="new-checkpoint"):
                evaluate_args = dict(checkpoint=checkpoint, prompts=prompts, resolution=resolution, device=device,
                                     heldout_shapes=heldout_shapes, registry_uri=registry_uri,
                                     model_name=model_name, mlflow_run_id=mlflow_run, quantization=quantization)
                with dsl.If(device == "cuda", name="on-gpu"):
                    on_gpu = _pod(c["evaluate"](**evaluate_args), "evaluate-gpu")
                    on_gpu.set_accelerator_type(GPU_RESOURCE).set_accelerator_limit(1)
                    # GPU nodes are often tainted: without a toleration the pod stays Pending, and
                    # its deadline never starts (it counts from the pod's start on a node).
                    kubernetes.add_toleration_json(on_gpu, gpu_tolerations)
                    kubernetes.add_node_selector_json(on_gpu, gpu_node_selector)
                with dsl.Else(name="on-cpu"):
                    on_cpu = _pod(c["evaluate"](**evaluate_args), "evaluate")
                metrics = dsl.OneOf(on_gpu.outputs["Output"], on_cpu.outputs["Output"])
                passed = _pod(c["gate"](metrics=metrics, min_valid_share=min_valid_share,
                                        min_watertight_share=min_watertight_share,
                                        min_token_agreement=min_token_agreement,
                                        max_time_per_output_token_s=max_time_per_output_token_s,
                                        min_shape_iou=min_shape_iou,
                                        min_numerics_agreement=min_numerics_agreement), "gate")
                packaged = _pod(c["package"](checkpoint=checkpoint, model_store=model_store,
                                             instance_kind=instance_kind, validation=checked.outputs["validation"],
                                             registry_uri=registry_uri, model_name=model_name, target=target,
                                             namespace=namespace), "package").after(passed)
                registered = _pod(c["register"](registry_uri=registry_uri, model_name=model_name,
                                                model_store=model_store, triton_version=packaged.output,
                                                validation=checked.outputs["validation"], metrics=metrics,
                                                checkpoint=checkpoint, pipeline_run_id=run_id,
                                                mlflow_run_id=mlflow_run), "register")
                _pod(c["roll_out"](version=registered.output, **rollout_args), "roll_out")
            with dsl.Elif(action == "resume", name="resume-rollout"):
                _pod(c["roll_out"](version=checked.outputs["version"], **rollout_args), "roll_out")

    return checkpoint_rollout
