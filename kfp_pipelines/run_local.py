"""Run the checkpoint pipeline on this machine the way a Kubeflow cluster runs it (`make pipeline`).

    python -m kfp_pipelines.run_local --checkpoint DIR_OR_URI [--state outputs/pipeline]

It starts what a cluster would provide, each as its own process on 127.0.0.1, and stops them at
the end: an S3 object store (`rclone serve s3`), the MLflow tracking server with the flags of
k8s/mlflow/mlflow.yaml, a tritonserver with explicit model control (the roll-out's "local"
target) and a Prometheus scraping its metrics port (the roll-out's analysis windows). Their data stays in STATE (s3/, mlflow/), so the next run finds this run's champion.
A checkpoint folder is first uploaded to the object store (s3://cube-serve/checkpoints/...), as
a user would upload it; then the compiled pipeline (the same YAML the Kubeflow UI runs, with the
image `cube-serve:local`, which here is this Python environment) runs with every step in its own
empty folder (kfp_pipelines/pod_runner.py), credentials in the environment variables of the
Secrets the pipeline names.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
from contextlib import ExitStack
from pathlib import Path

from cubeserve import deploy

LOCAL_IMAGE = "cube-serve:local"
BUCKET = "cube-serve"
MODEL_STORE = f"s3://{BUCKET}/models/cube3d"
PIPELINE_ROOT = f"s3://{BUCKET}/pipeline-root"
DEFAULT_STATE = Path("outputs") / "pipeline"
SCRAPE_INTERVAL_S = 2.0
# The roll-out's promotion gate on this machine: short stages with the step's own traffic (two
# clients), and a minimum of requests that the demo model reaches on 2 CPU cores in a window.
LOCAL_GATE = {"analysis_windows": 2, "analysis_window_seconds": 20.0, "shadow_share": 0.5, "shadow_seconds": 15.0,
              "canary_percent": 50, "analysis_thresholds": {"min_requests": 5}}


def upload_checkpoint(checkpoint: str) -> str:
    """A local checkpoint folder uploaded to the object store (named after its content, so the
    same folder is uploaded once); a URI is returned as it is."""
    from cubeserve import storage

    if "://" in checkpoint:
        return checkpoint
    root = Path(checkpoint).resolve()
    if not root.is_dir():
        raise SystemExit(f"--checkpoint {checkpoint}: no such directory")
    digest = hashlib.sha256()
    for p in sorted(q for q in root.rglob("*") if q.is_file()):
        digest.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes())
    uri = f"s3://{BUCKET}/checkpoints/{root.name}-{digest.hexdigest()[:12]}/"
    if not storage.exists(uri):
        storage.upload_dir(root, uri)
    return uri


class LocalCluster:
    """The object store, the MLflow server and a tritonserver, started for one or more runs."""

    def __init__(self, state: str | Path, triton_url: str = "", prometheus_url: str = "",
                 defaults: dict | None = None, backend: str = ""):
        """`triton_url` / `prometheus_url`: use these instead of starting them (a server given
        without a Prometheus: no analysis windows). `defaults`: pipeline parameters of every run
        (over LOCAL_GATE). `backend`: the KFP backend release whose DAG states the runs get
        (pod_runner.BACKENDS; default the oldest, the minimum docs/pipeline.md names)."""
        from kfp_pipelines.pod_runner import BACKENDS

        self.backend = backend or BACKENDS[0]
        self.state = Path(state).resolve()
        self.triton_url = triton_url
        self.prometheus_url = prometheus_url
        self.defaults = {**LOCAL_GATE, **(defaults or {})}
        self.server = None  # the tritonserver started here (none with triton_url)
        self._stack = ExitStack()

    def __enter__(self) -> "LocalCluster":
        from cubeserve.server.local_triton import LocalTriton, free_port
        from kfp_pipelines.local_services import MlflowServer, ObjectStore, Prometheus

        self.state.mkdir(parents=True, exist_ok=True)
        try:
            self.store = self._stack.enter_context(ObjectStore.persistent(self.state / "s3"))
            # This process uploads checkpoints and artifacts as the KFP launcher does: with the
            # store's credentials in its environment until the cluster stops.
            saved = {k: os.environ.get(k) for k in self.store.env()}
            self._stack.callback(lambda: [os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
                                          for k, v in saved.items()])
            os.environ.update(self.store.env())
            if not self.store.client().list_buckets().get("Buckets"):
                self.store.create_bucket(BUCKET)
            self.mlflow = self._stack.enter_context(MlflowServer(self.state / "mlflow"))
            if not self.triton_url:
                serving = self.state / "serving"  # the serving node's own disk: empty, models come by API
                serving.mkdir(exist_ok=True)
                server = LocalTriton(serving, free_port(), free_port(), free_port(),
                                     log_path=self.state / "tritonserver.log",
                                     extra_args=("--model-control-mode=explicit",))
                self.server = self._stack.enter_context(server)
                self.triton_url = self.server.http_url
                if not self.prometheus_url:
                    prometheus = Prometheus(self.state / "prometheus", [f"127.0.0.1:{server.metrics_port}"],
                                            SCRAPE_INTERVAL_S)
                    self.prometheus_url = self._stack.enter_context(prometheus).url
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def runner(self, compiled: Path, secrets: dict | None = None):
        """A PodRunner for this cluster. `secrets` replaces Secrets of the namespace by name
        (None: the Secret does not exist)."""
        from cubeserve import storage
        from kfp_pipelines.pod_runner import PodRunner

        namespace = {"cube-serve-s3": self.store.env(), **(secrets or {})}
        # The admin key of the server started here, or of the one given (from this environment).
        key = self.server.admin_key if self.server else os.environ.get(deploy.ADMIN_KEY_ENV)
        if key and deploy.ADMIN_SECRET not in namespace:
            namespace[deploy.ADMIN_SECRET] = {deploy.ADMIN_KEY_ENV: key}
        return PodRunner(compiled, images={LOCAL_IMAGE: Path(sys.executable).parent},
                         secrets={k: v for k, v in namespace.items() if v is not None},
                         pipeline_root=PIPELINE_ROOT, workdir=self.state / "pods", upload=storage.upload_path,
                         backend=self.backend)

    def run(self, checkpoint: str, secrets: dict | None = None, **params):
        """One pipeline run; returns the pod runner's RunResult."""
        from kfp_pipelines.compile import compile_to

        compiled = compile_to(LOCAL_IMAGE, self.state / "pipeline.yaml")
        arguments = {"checkpoint": upload_checkpoint(checkpoint), "model_store": MODEL_STORE,
                     "registry_uri": self.mlflow.uri, "target": "local", "triton_url": self.triton_url,
                     "instance_kind": "cpu", "soak_seconds": 0.0, "prometheus_url": self.prometheus_url,
                     **self.defaults, **params}
        return self.runner(compiled, secrets).run(arguments)


def summary(registry_uri: str, model_name: str = "cube3d") -> dict:
    """The registry after a run: every version with its aliases and roll-out decision."""
    from cubeserve.registry import open_registry

    versions = open_registry(registry_uri, model_name).versions()
    return {"registry_uri": registry_uri, "versions": [
        {"version": v.version, "aliases": list(v.aliases), "source": v.source,
         "triton_version": v.tags.get("triton_version"), "sha256": v.tags.get("sha256"),
         "decision": v.tags.get("rollout.decision"), "reason": v.tags.get("rollout.reason"),
         "analysis": whole_requests(json.loads(v.tags.get("rollout.analysis") or "null"))} for v in versions]}


def steps(tasks: dict) -> dict:
    """The steps that ran, by the names the pipeline gives them (validate, evaluate, ..., finish),
    with their states: not the KFP paths (exit-handler-1/condition-branches-2/...) nor its
    numbered copies of a step in another branch (evaluate-2, roll-out-2)."""
    return {_step(path): t.state for path, t in tasks.items() if t.attempts}


def _step(path: str) -> str:
    return re.sub(r"-\d+$", "", path.rsplit("/", 1)[-1])


def step_error(error: str) -> str:
    """The run's error with the failed step named as in `steps` ("gate: ..."), not by its KFP path."""
    found = re.match(r"([\w-]+(?:/[\w-]+)*): ", error)
    return f"{_step(found[1])}: {error[found.end():]}" if found else error


def whole_requests(analysis):
    """The roll-out's analysis windows as printed: request counts whole (Prometheus' increase()
    extrapolates over the window, so the registry's figures have fractions)."""
    for window in analysis or []:
        for side in ("candidate", "baseline"):
            if isinstance(window.get(side), dict) and "requests" in window[side]:
                window[side]["requests"] = round(window[side]["requests"])
    return analysis


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="checkpoint folder or s3:// URI")
    parser.add_argument("--state", default=str(DEFAULT_STATE),
                        help="the object store's and the registry's data (default: %(default)s)")
    parser.add_argument("--triton-url", default="", help="REST host:port of a server with explicit model "
                                                         "control (default: start one); its admin key in "
                                                         "$CUBE3D_ADMIN_KEY")
    parser.add_argument("--prometheus-url", default="", help="Prometheus scraping that server (default: start one "
                                                             "with the server; none with --triton-url)")
    parser.add_argument("--backend", default="", help="the KFP backend release to behave as (default: the oldest "
                                                       "supported)")
    parser.add_argument("--param", action="append", default=[], metavar="NAME=JSON",
                        help="a pipeline parameter, e.g. --param min_token_agreement=0.9 (repeatable)")
    args = parser.parse_args(argv)
    params = {}
    for item in args.param:
        name, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--param takes NAME=VALUE, got {item!r}")
        try:
            params[name] = json.loads(value)
        except json.JSONDecodeError:
            params[name] = value
    with LocalCluster(args.state, args.triton_url, args.prometheus_url, backend=args.backend) as cluster:
        result = cluster.run(args.checkpoint, **params)
        report = {"run_id": result.run_id, "state": result.state, "error": step_error(result.error),
                  "steps": steps(result.tasks),
                  **summary(cluster.mlflow.uri)}
    print(json.dumps(report, indent=2))
    return 0 if result.state == "SUCCEEDED" else 1


if __name__ == "__main__":
    sys.exit(main())
