"""The batch on Kubernetes: a KubeRay RayJob (ray.io/v1, KubeRay v1.7.0) whose Ray cluster runs the
cube-serve runtime image (k8s/Dockerfile, which has Ray and cubeserve) and whose entrypoint is
`cubeserve batch ... --address auto`; KubeRay creates the cluster, submits the entrypoint, and
deletes the cluster when the job ends. `rayjob()` is the one description of it: k8s/batch/rayjob.yaml
is its output for the example arguments there (tests/test_batch.py keeps them equal), and the
Kubeflow pipeline's step creates it with the run's arguments (cubeserve.pipeline.batch).

What KubeRay reports (ray-operator/apis/ray/v1/rayjob_types.go and
controllers/ray/rayjob_controller.go at v1.7.0), read by `outcome`:
* status.jobDeploymentStatus, KubeRay's side: "" -> Initializing -> Running (or Waiting, in
  InteractiveMode) -> Complete or Failed, the only two terminal values (IsJobDeploymentTerminal).
  With spec.backoffLimit, a Failed job that may retry is written as Retrying instead and starts
  again from "" (checkBackoffLimitAndUpdateStatusIfNeeded). ValidationFailed: the spec was refused
  before anything started, and stays so.
* status.jobStatus, Ray's own: PENDING, RUNNING, then STOPPED, SUCCEEDED or FAILED (IsJobTerminal).
  Complete means the Ray job reached a terminal jobStatus: SUCCEEDED or STOPPED (FAILED gives
  Failed with reason AppFailed). Failed can also come with no terminal jobStatus: reason
  DeadlineExceeded (activeDeadlineSeconds), SubmissionFailed, ...
So the batch succeeded exactly when jobDeploymentStatus is Complete and jobStatus SUCCEEDED.
"""

from __future__ import annotations

import shlex

from cubeserve import deploy

GROUP, VERSION, KIND, PLURAL = "ray.io", "v1", "RayJob", "rayjobs"
RAY_VERSION = "2.60.0"  # the ray[data] the image installs (pyproject.toml's batch extra)
GPU_RESOURCE = "nvidia.com/gpu"
TERMINAL = ("Complete", "Failed")
NEVER_STARTS = ("ValidationFailed",)


def entrypoint(prompts: str, out: str, weights: str = "", version: int | None = None, model_store: str = "",
               decode_actors: int = 1, decode_cpus: int = 1, geometry_actors: int = 1, device: str = "auto",
               resolution: int = 8, preview: bool = False) -> str:
    """The `cubeserve batch` command the RayJob submits (to the cluster it runs in)."""
    args = ["cubeserve", "batch", prompts, "--out", out, "--address", "auto", "--no-progress",
            "--device", device, "--decode-actors", str(decode_actors), "--decode-cpus", str(decode_cpus),
            "--geometry-actors", str(geometry_actors),
            "--resolution", str(resolution)]
    if version is not None:
        args += ["--version", str(version), "--model-store", model_store]
    else:
        args += ["--weights", weights]
    if preview:
        args.append("--preview")
    return shlex.join(args)


def _container(name: str, image: str, cpu: str, memory: str, gpus: int = 0) -> dict:
    limits = {"cpu": cpu, "memory": memory, **({GPU_RESOURCE: str(gpus)} if gpus else {})}
    return {
        "name": name, "image": image,
        "resources": {"requests": {"cpu": cpu, "memory": memory}, "limits": limits},
        # The object store's credentials, as the pipeline's steps get them (optional: a local
        # or mounted output needs none).
        "envFrom": [{"secretRef": {"name": deploy.STORAGE_SECRET, "optional": True}}],
    }


def rayjob(name: str, image: str, prompts: str, out: str, weights: str = "", version: int | None = None,
           model_store: str = "", workers: int = 1, worker_cpu: str = "4", worker_memory: str = "16Gi",
           gpus_per_worker: int = 0, resolution: int = 8, preview: bool = False,
           deadline_s: int = 24 * 3600) -> dict:
    """The RayJob of one batch: a head (the driver: reads the prompts, writes the results table;
    no actors) and `workers` worker pods (decode actors, one per GPU where they have GPUs, and
    geometry actors)."""
    if (version is None) == (not weights):
        raise ValueError("give either weights or version (with model_store)")
    decode_actors = workers * gpus_per_worker if gpus_per_worker else workers
    # Decoding on the CPU: all of a worker's cores but one, which its geometry actor takes.
    decode_cpus = 1 if gpus_per_worker else max(1, _cores(worker_cpu) - 1)
    worker = _container("ray-worker", image, worker_cpu, worker_memory, gpus_per_worker)
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": KIND,
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "cube-serve-batch"}},
        "spec": {
            "entrypoint": entrypoint(prompts, out, weights, version, model_store, decode_actors=decode_actors,
                                     decode_cpus=decode_cpus, geometry_actors=workers, device="cuda" if gpus_per_worker else "cpu",
                                     resolution=resolution, preview=preview),
            # The cluster lives as long as its job; a failed job is not retried by KubeRay (the
            # pipeline's step, or a rerun, resumes it: rows on record are skipped).
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": 600,
            "activeDeadlineSeconds": deadline_s,
            "backoffLimit": 0,
            "rayClusterSpec": {
                "rayVersion": RAY_VERSION,
                "headGroupSpec": {
                    # No actor on the head: it runs the driver and Ray's services.
                    "rayStartParams": {"num-cpus": "0"},
                    "template": {"spec": {"containers": [_container("ray-head", image, "2", "8Gi")]}},
                },
                "workerGroupSpecs": [{
                    "groupName": "batch", "replicas": workers, "minReplicas": workers, "maxReplicas": workers,
                    "rayStartParams": {},
                    "template": {"spec": {"containers": [worker]}},
                }],
            },
        },
    }


def _cores(quantity: str) -> int:
    """Whole cores of a Kubernetes CPU quantity ("4", "2.5", "3500m")."""
    text = str(quantity)
    return int(float(text[:-1]) / 1000) if text.endswith("m") else int(float(text))


def outcome(obj: dict) -> str | None:
    """None while the RayJob may still change; "succeeded"; or why it failed (module docstring)."""
    status = obj.get("status") or {}
    deployment, job = status.get("jobDeploymentStatus", ""), status.get("jobStatus", "")
    if deployment in NEVER_STARTS:
        return f"{deployment}: {status.get('message', '')}"
    if deployment not in TERMINAL:
        return None
    if deployment == "Complete" and job == "SUCCEEDED":
        return "succeeded"
    why = status.get("reason") or f"job {job or 'never ran'}"
    return f"{deployment} ({why}): {status.get('message', '')}".rstrip(": ")
