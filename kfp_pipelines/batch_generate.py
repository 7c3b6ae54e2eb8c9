"""Kubeflow pipeline `batch_generate`: a prompts file to meshes and a results table, as a KubeRay
RayJob (k8s/batch/) that the step creates and waits for; the run fails when the job fails.

    python -m kfp_pipelines.compile --image REGISTRY/cube-serve:TAG   # both pipelines' YAML

The step runs the cube-serve runtime image, as every step of checkpoint_rollout.py does, and so
does the RayJob's Ray cluster (the same image: it has Ray and cubeserve). The step's pod only
waits; the batch runs on the Ray cluster's pods, which get the object store's credentials from
the Secret cube-serve-s3. The step's service account needs create and get on rayjobs (the Role
cube-serve-batch, k8s/pipeline/rbac.yaml).
"""

from kfp import dsl, kubernetes

PIPELINE_NAME = "cube3d-batch-generate"
# The step waits for the whole batch: its pod's deadline is the RayJob's, plus time to start.
STEP_DEADLINE_S = 24 * 3600 + 1800


def batch_generate(prompts: str, out: str, weights: str, version: int, model_store: str, image: str,
                   workers: int, worker_cpu: str, worker_memory: str, gpus_per_worker: int, resolution: int,
                   preview: bool, namespace: str, pipeline_run_id: str) -> dict:
    """Creates the RayJob of the batch (its name from the pipeline run, so a retried step waits
    for the job its first attempt made) and waits for KubeRay's verdict; fails unless it succeeded."""
    from cubeserve.batch.kuberay import rayjob
    from cubeserve.pipeline.batch import job_name, run_rayjob

    manifest = rayjob(job_name(pipeline_run_id), image, prompts, out, weights=weights,
                      version=version if version > 0 else None, model_store=model_store, workers=workers,
                      worker_cpu=worker_cpu, worker_memory=worker_memory, gpus_per_worker=gpus_per_worker,
                      resolution=resolution, preview=preview)
    status = run_rayjob(manifest, namespace)
    print(f"batch done: meshes and {out.rstrip('/')}/results/ written")
    return {k: status.get(k, "") for k in ("jobId", "jobStatus", "jobDeploymentStatus", "rayClusterName")}


def build(image: str):
    """The pipeline with its step, and the RayJob's Ray cluster, in `image`."""
    if not image or image.startswith("registry.example.com/"):
        raise ValueError(f"image must name the cube-serve runtime image you pushed, got {image!r}")
    step = dsl.component(batch_generate, base_image=image, install_kfp_package=False)

    @dsl.pipeline(name=PIPELINE_NAME, description="Prompts to meshes and a results table on a KubeRay RayJob")
    def batch_pipeline(
        prompts: str,
        out: str,
        weights: str = "",
        version: int = 0,
        model_store: str = "",
        workers: int = 1,
        worker_cpu: str = "4",
        worker_memory: str = "16Gi",
        gpus_per_worker: int = 0,
        resolution: int = 8,
        preview: bool = False,
        namespace: str = "",
    ):
        """Prompts to meshes and a results table on a KubeRay RayJob.

        Args:
            prompts: The prompts file, JSONL or Parquet, e.g. s3://bucket/batches/catalogue.jsonl (one row per object: prompt and optional id, seed, guidance, top_p, temperature, resolution, bbox, format).
            out: Where <id>.<format> and results/ go, e.g. s3://bucket/batches/catalogue/ (a rerun into it skips the rows on record).
            weights: The checkpoint folder, e.g. s3://bucket/checkpoints/run-42/ (or set version).
            version: Model store version N instead of weights (0 = use weights).
            model_store: The model store of version (the checkpoint pipeline's model_store).
            workers: Ray worker pods.
            worker_cpu: CPU of each worker pod.
            worker_memory: Memory of each worker pod.
            gpus_per_worker: GPUs per worker pod, one decode actor each (0 = decode on the CPU).
            resolution: Marching-cubes resolution (log2 of the grid size) for rows without one.
            preview: Also write <id>.png previews.
            namespace: Where the RayJob is created (empty = the run's namespace).
        """
        task = step(prompts=prompts, out=out, weights=weights, version=version, model_store=model_store,
                    image=image, workers=workers, worker_cpu=worker_cpu, worker_memory=worker_memory,
                    gpus_per_worker=gpus_per_worker, resolution=resolution, preview=preview, namespace=namespace,
                    pipeline_run_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER)
        # It creates a job in the cluster: never answered from KFP's cache. A retried pod (say,
        # evicted) waits for the job the first attempt created, so retrying is safe.
        task.set_caching_options(False)
        task.set_retry(num_retries=2, backoff_duration="30s")
        task.set_cpu_request("100m").set_memory_request("256Mi").set_memory_limit("256Mi")
        kubernetes.set_timeout(task, STEP_DEADLINE_S)

    return batch_pipeline
