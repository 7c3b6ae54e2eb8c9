"""The batch pipeline's step (kfp_pipelines/batch_generate.py): create the RayJob of a batch
(cubeserve.batch.kuberay.rayjob) with the `kubernetes` client, as kfp has no resource op, and
wait for its end. The step fails when the job does, so the pipeline run fails with it.

A retried step finds the RayJob its first attempt created (same name: the pipeline run's) and
waits for that one instead of starting a second batch into the same output. What the step needs
of the API (k8s/pipeline/rbac.yaml, Role cube-serve-batch): create and get on rayjobs.
"""

from __future__ import annotations

import re
import time

from cubeserve.batch import kuberay

MAX_NAME = 47  # KubeRay v1.7.0: MaxRayJobNameLength (utils/constant.go), checked by ValidateRayJobMetadata
POLL_S = 10.0  # how often the step reads the RayJob


class BatchJobFailed(RuntimeError):
    """The RayJob ended without success, or did not end in time."""


def job_name(pipeline_run_id: str, prefix: str = "cube3d-batch") -> str:
    """A RayJob name of this pipeline run: a DNS-1035 label of at most MAX_NAME characters."""
    tail = re.sub(r"[^a-z0-9-]", "", pipeline_run_id.lower())
    return f"{prefix}-{tail}"[:MAX_NAME].rstrip("-")


def run_rayjob(manifest: dict, namespace: str = "", poll_s: float | None = None, timeout_s: float = 25 * 3600,
               say=print) -> dict:
    """Create the RayJob `manifest` (or find it, created by an earlier attempt) and wait until
    KubeRay reports it terminal; returns its status on success, raises BatchJobFailed otherwise."""
    from kubernetes.client.exceptions import ApiException

    from cubeserve.rollout import Cluster

    poll_s = POLL_S if poll_s is None else poll_s
    cluster = Cluster(namespace or None)
    ns, name = cluster.namespace, manifest["metadata"]["name"]
    api = (kuberay.GROUP, kuberay.VERSION, ns, kuberay.PLURAL)
    try:
        cluster.custom.create_namespaced_custom_object(*api, manifest)
        say(f"created RayJob {ns}/{name}")
    except ApiException as exc:
        if exc.status != 409:
            raise
        say(f"RayJob {ns}/{name} exists (an earlier attempt of this step created it): waiting for it")
    deadline, last = time.monotonic() + timeout_s, None
    while True:
        try:
            obj = cluster.custom.get_namespaced_custom_object(*api[:3], kuberay.PLURAL, name)
        except ApiException as exc:
            if exc.status == 404:
                raise BatchJobFailed(f"RayJob {ns}/{name} was deleted before it finished") from None
            raise
        status = obj.get("status") or {}
        state = (status.get("jobDeploymentStatus", ""), status.get("jobStatus", ""))
        if state != last:
            say(f"RayJob {ns}/{name}: jobDeploymentStatus {state[0] or '(new)'}, jobStatus {state[1] or '(none)'}")
            last = state
        result = kuberay.outcome(obj)
        if result == "succeeded":
            return status
        if result is not None:
            raise BatchJobFailed(f"RayJob {ns}/{name} failed: {result}")
        if time.monotonic() > deadline:
            raise BatchJobFailed(f"RayJob {ns}/{name} did not finish in {timeout_s:.0f} s (last: {state})")
        time.sleep(poll_s)
