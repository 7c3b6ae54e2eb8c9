"""A stand-in for the Kubernetes API server with KubeRay's RayJob controller (v1.7.0) behind it,
for the calls the batch pipeline's step makes (cubeserve.pipeline.batch): create and get of
ray.io/v1 rayjobs in the namespace "models".

The API server: a created RayJob is checked against the RayJob CRD's schema of KubeRay v1.7.0
(tests/data/kuberay/, made strict: an unknown field is an error here, where the API server would
prune it silently) and refused 422 Invalid when it does not conform, 409 AlreadyExists when the
name is taken; `rules` (a Role's rules) refuse with 403 what RBAC would (k8s_validation.rbac_allows,
request_attributes), and `authorized` records every request's attributes and the answer.

The controller moves a RayJob's status one reconcile after each read (so the first read sees it
as created, with no status), as rayjob_controller.go at v1.7.0
writes it (line numbers of `git show v1.7.0:ray-operator/controllers/ray/rayjob_controller.go`):
* validateRayJob first (L144-161): a name over 47 characters or not a DNS-1035 label
  (utils/validation.go L533-540, utils/constant.go L381), a negative ttlSecondsAfterFinished,
  activeDeadlineSeconds <= 0, backoffLimit < 0, neither rayClusterSpec nor clusterSelector
  (ValidateRayJobSpec, L543-630) -> jobDeploymentStatus ValidationFailed, reason ValidationFailed;
* "" (New) -> Initializing (L166-179, initRayJobStatusIfNeed: jobId, rayClusterName, startTime);
* Initializing -> Running once the cluster is ready and the submitter is created (L179-236),
  jobStatus PENDING then RUNNING as the dashboard reports it (L249-365);
* the Ray job's end (L331-357): jobStatus SUCCEEDED or STOPPED -> Complete; FAILED -> Failed with
  reason AppFailed and the job's message;
* a Failed job with spec.backoffLimit and attempts left is written as Retrying instead
  (checkBackoffLimitAndUpdateStatusIfNeeded, L518-556; status.failed counts attempts), and
  Retrying goes back to "" for a new cluster (L366-409).
What each attempt's Ray job ends with is the test's to say (`job_results`): nothing runs Ray here.
"""

from __future__ import annotations

import copy
import gzip
import http.server
import json
import re
import threading
from pathlib import Path
from urllib.parse import urlparse

import jsonschema

from k8s_validation import ApiHandler, _close

DATA = Path(__file__).resolve().parent / "data" / "kuberay"
KUBERAY_RELEASE = "v1.7.0"
NAMESPACE = "models"
COLLECTION = f"/apis/ray.io/v1/namespaces/{NAMESPACE}/rayjobs"
DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
MAX_RAYJOB_NAME = 47  # utils/constant.go L381: MaxRayClusterNameLength (53) - 6


def rayjob_schema(release: str = KUBERAY_RELEASE) -> dict:
    """The RayJob v1 CRD schema of a KubeRay release, strict (no unknown fields)."""
    body = json.loads(gzip.decompress((DATA / f"rayjob-{release}.json.gz").read_bytes()))
    schema = body["openAPIV3Schema"]
    _close(schema)
    return schema


def schema_errors(obj: dict, schema: dict | None = None) -> list[str]:
    body = {k: v for k, v in obj.items() if k != "status"}
    validator = jsonschema.Draft4Validator(schema or rayjob_schema())
    return [f"RayJob {'.'.join(str(p) for p in e.absolute_path)}: {e.message}" for e in validator.iter_errors(body)]


def validation_error(obj: dict) -> str | None:
    """validateRayJob's answer (the rules of ValidateRayJobMetadata and ValidateRayJobSpec that a
    manifest can break), None when it passes."""
    name, spec = obj["metadata"]["name"], obj.get("spec", {})
    if len(name) > MAX_RAYJOB_NAME:
        return f"The RayJob metadata is invalid: RayJob name should be no more than {MAX_RAYJOB_NAME} characters"
    if not DNS1035.match(name):
        return "The RayJob metadata is invalid: RayJob name should be a valid DNS1035 label"
    if spec.get("ttlSecondsAfterFinished", 0) < 0:
        return "The RayJob spec is invalid: TTLSecondsAfterFinished must be a non-negative integer"
    if not spec.get("rayClusterSpec") and not spec.get("clusterSelector"):
        return "The RayJob spec is invalid: one of RayClusterSpec or ClusterSelector must be set"
    if spec.get("activeDeadlineSeconds") is not None and spec["activeDeadlineSeconds"] <= 0:
        return "The RayJob spec is invalid: activeDeadlineSeconds must be a positive integer"
    if spec.get("backoffLimit") is not None and spec["backoffLimit"] < 0:
        return "The RayJob spec is invalid: backoffLimit must be a positive integer"
    return None


class RayJobController:
    """One RayJob's status as KubeRay writes it, one reconcile per call of `reconcile`."""

    def __init__(self, obj: dict, job_results: list[str], message: str = ""):
        self.obj, self.results, self.message = obj, list(job_results), message
        self.attempt = 0
        self.ticks = 0  # reconciles in the current phase

    def reconcile(self) -> None:
        status = self.obj.setdefault("status", {})
        phase = status.get("jobDeploymentStatus", "")
        if phase in ("Complete", "Failed", "ValidationFailed"):
            return
        if phase == "" and self.attempt == 0 and (problem := validation_error(self.obj)):
            status.update(jobDeploymentStatus="ValidationFailed", reason="ValidationFailed", message=problem)
            return
        name = self.obj["metadata"]["name"]
        if phase == "":
            status.update(jobDeploymentStatus="Initializing", jobId=f"{name}-{self.attempt}",
                          rayClusterName=f"{name}-abc{self.attempt}", startTime="2026-01-01T00:00:00Z",
                          succeeded=status.get("succeeded", 0), failed=status.get("failed", 0))
        elif phase == "Initializing":
            status.update(jobDeploymentStatus="Running", jobStatus="PENDING")
        elif phase == "Running" and status.get("jobStatus") == "PENDING":
            status["jobStatus"] = "RUNNING"
        elif phase == "Running":
            result = self.results[min(self.attempt, len(self.results) - 1)]
            status["jobStatus"] = result
            if result == "FAILED":
                status.update(jobDeploymentStatus="Failed", reason="AppFailed",
                              message=self.message or "Job entrypoint command failed with exit code 3")
                status["failed"] = status.get("failed", 0) + 1
                limit = self.obj["spec"].get("backoffLimit")
                if limit is not None and status["failed"] < limit + 1:
                    status["jobDeploymentStatus"] = "Retrying"
            else:
                status.update(jobDeploymentStatus="Complete", message=f"Job finished with status {result}")
                if result == "SUCCEEDED":
                    status["succeeded"] = status.get("succeeded", 0) + 1
            status["endTime"] = "2026-01-01T01:00:00Z"
        elif phase == "Retrying":  # the cluster is deleted, then everything starts again
            self.attempt += 1
            for key in ("jobStatus", "reason", "message", "endTime"):
                status.pop(key, None)
            status["jobDeploymentStatus"] = ""


class KubeRayStandIn:
    def __init__(self, rules: list[dict] | None = None, job_results: tuple[str, ...] = ("SUCCEEDED",),
                 message: str = ""):
        self.rules, self.authorized, self.requests = rules, [], []
        self.jobs: dict[str, RayJobController] = {}
        self.created: list[dict] = []  # the bodies of every accepted create
        schema = rayjob_schema()
        stub = self

        class Handler(ApiHandler):
            api, namespace = stub, NAMESPACE

            def do_POST(self):
                path = urlparse(self.path).path
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.requests.append(("POST", path, body))
                if self._forbidden("POST", path):
                    return
                if path != COLLECTION:
                    return self._error(404, "NotFound")
                errors = schema_errors(body, schema)
                if errors:
                    return self._error(422, "Invalid", "; ".join(errors))
                name = body["metadata"]["name"]
                if name in stub.jobs:
                    return self._error(409, "AlreadyExists", f'rayjobs.ray.io "{name}" already exists')
                obj = copy.deepcopy(body)
                obj["metadata"].update(namespace=NAMESPACE, uid=f"uid-{name}", resourceVersion="1",
                                       creationTimestamp="2026-01-01T00:00:00Z")
                stub.jobs[name] = RayJobController(obj, list(job_results), message)
                stub.created.append(body)
                self._send(201, obj)

            def do_GET(self):
                path = urlparse(self.path).path
                stub.requests.append(("GET", path, None))
                if self._forbidden("GET", path):
                    return
                name = path.rsplit("/", 1)[-1]
                job = stub.jobs.get(name) if path.startswith(COLLECTION + "/") else None
                if job is None:
                    return self._error(404, "NotFound", f'rayjobs.ray.io "{name}" not found')
                self._send(200, job.obj)
                job.reconcile()  # the controller acts between two reads

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def kubeconfig(self, path: Path) -> Path:
        import yaml

        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "stub",
            "clusters": [{"name": "stub", "cluster": {"server": self.url}}],
            "users": [{"name": "stub", "user": {"token": "not-a-secret"}}],
            "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "stub", "namespace": NAMESPACE}}]}))
        return path

    def statuses(self, name: str) -> dict:
        return self.jobs[name].obj.get("status", {})

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
