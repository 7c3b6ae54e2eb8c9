"""The roll-out step: canary, soak, then promote or roll back, recorded on the registry version;
and what the pipeline's exit handler does when a run fails after registration.

Two targets behind one function (`roll_out`):

* "local": a tritonserver started with `--model-control-mode=explicit` (`make pipeline` starts
  one). The step shares no disk with it: it downloads the versions from the model store and
  loads them through Triton's model-control API with the files in the request (the API's file
  override), so the server serves exactly those versions. Triton has no traffic split, so the
  stages map to the set of versions served: canary = champion and challenger both loaded
  (clients choose a version; the soak sends its requests to the challenger), promote = only
  the challenger, rollback = only the champion. (Every file travels base64-encoded in one HTTP
  request: right for the demo and test checkpoints, not for multi-GB weights; use KServe there.)
* "kserve": `cubeserve rollout`'s pure plans (cubeserve/rollout/) applied by its client: a
  canary at `percent`, a soak, then promote if the new revision became ready, else roll back.
  Version N is `<model_store>/<N>/`; `record_version` (the package step) lists it in the
  ConfigMap cube3d-versions, whose baseUri must be the pipeline's model store.

Either way the champion alias moves only on promotion, and the decision and its reason are
tags on the version (`rollout.decision`, `rollout.reason`, ...).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from cubeserve.deploy import PREDICT_MODEL, STREAM_MODEL


def _model_config_json(config_pbtxt: str, versions: list[int]) -> str:
    """A config.pbtxt as the JSON that the model-control API takes, serving `versions`."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    config = text_format.Parse(config_pbtxt, model_config_pb2.ModelConfig())
    config.version_policy.specific.versions[:] = sorted(versions)
    return json_format.MessageToJson(config, preserving_proto_field_name=True)


def serve_versions(triton_url: str, model_store: str, versions: list[int]) -> None:
    """Make the local server serve exactly `versions` of the model store (none: unload both)."""
    import tritonclient.http as httpclient

    from cubeserve import storage
    from cubeserve.pipeline.steps import version_uri

    client = httpclient.InferenceServerClient(triton_url, network_timeout=600.0)
    try:
        if not versions:
            for model in (PREDICT_MODEL, STREAM_MODEL):
                client.unload_model(model)
            return
        with tempfile.TemporaryDirectory() as tmp:
            for v in versions:
                storage.download_dir(version_uri(model_store, v), Path(tmp) / str(v))
            newest = Path(tmp) / str(max(versions))
            for model in (STREAM_MODEL, PREDICT_MODEL):  # cube3d forwards to cube3d_stream
                files = {}
                for v in versions:
                    root = Path(tmp) / str(v) / model / str(v)
                    for f in sorted(p for p in root.rglob("*") if p.is_file()):
                        files[f"file:{v}/{f.relative_to(root).as_posix()}"] = f.read_bytes()
                config = _model_config_json((newest / model / "config.pbtxt").read_text(), versions)
                client.load_model(model, config=config, files=files)
        for model in (STREAM_MODEL, PREDICT_MODEL):
            for v in versions:
                if not client.is_model_ready(model, str(v)):
                    raise RuntimeError(f"{model} version {v} did not become ready on {triton_url}")
    finally:
        client.close()


def served_versions(triton_url: str) -> list[int]:
    """Versions of cube3d that the server reports ready. (Not the repository index: models
    loaded with their files in the request are not in the repository.)"""
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    client = httpclient.InferenceServerClient(triton_url)
    try:
        try:
            versions = client.get_model_metadata(PREDICT_MODEL).get("versions", [])
        except InferenceServerException:  # not loaded
            return []
        return sorted(int(v) for v in versions if client.is_model_ready(PREDICT_MODEL, v))
    finally:
        client.close()


def soak_local(triton_url: str, version: int, prompts: list[str], requests: int, seconds: float) -> str:
    """Requests to the canary version for at least `seconds` and `requests` requests; returns
    "" when every one gave a non-empty mesh, else the first problem."""
    from cube3d_client import Cube3DClient

    deadline = time.monotonic() + seconds
    sent = 0
    with Cube3DClient(triton_url, "http", model_version=str(version), retries=1) as client:
        while sent < requests or time.monotonic() < deadline:
            prompt = prompts[sent % len(prompts)]
            try:
                result = client.generate(prompt, seed=sent, resolution=4)
            except Exception as exc:  # any failure of the canary decides: roll back
                return f"request {sent + 1} ({prompt!r}) to version {version} failed: {exc}"
            if result.num_faces == 0:
                return f"request {sent + 1} ({prompt!r}) to version {version} gave an empty mesh"
            sent += 1
    return ""


TARGETS = ("local", "kserve")
# The roll-out step's deadline (its pod's activeDeadlineSeconds in the pipeline); the soak must
# end well before it, so that the decision is made and recorded.
ROLLOUT_DEADLINE_S = 7200
MAX_SOAK_S = ROLLOUT_DEADLINE_S - 1800


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def roll_out(target: str, registry_uri: str, model_name: str, version: str, canary_percent: int,
             soak_requests: int, soak_seconds: float, prompts: list[str], triton_url: str = "",
             model_store: str = "", namespace: str = "", isvc: str = "cube3d", pipeline_run_id: str = "",
             force_rollback: bool = False) -> dict:
    """Canary, soak, promote or roll back the registry `version`; returns the decision.

    The version is `challenger` while its roll-out runs (the pipeline's exit handler takes it out
    again if the run fails meanwhile, see `finish_run`)."""
    from cubeserve.registry import CHALLENGER, CHAMPION, open_registry

    if target not in TARGETS:
        raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
    if not 0 <= soak_seconds <= MAX_SOAK_S:
        raise ValueError(f"soak_seconds must be from 0 to {MAX_SOAK_S} (the roll-out step's deadline is "
                         f"{ROLLOUT_DEADLINE_S} s), got {soak_seconds}")
    registry = open_registry(registry_uri, model_name)
    new = registry.get(version)
    champion = registry.by_alias(CHAMPION)
    if champion is not None and champion.version == new.version:
        return {"decision": "unchanged", "reason": f"version {version} is already the champion"}
    registry.set_alias(CHALLENGER, version)
    registry.set_tags(version, {"rollout.target": target, "rollout.canary_percent": str(canary_percent),
                                "rollout.pipeline_run_id": pipeline_run_id, "rollout.started": _now()})
    model_store = model_store or new.tags.get("model_store", "")
    if target == "local":
        decision, reason = _local(new, champion, triton_url, model_store, prompts, soak_requests,
                                  soak_seconds, force_rollback)
    else:
        decision, reason = _kserve(new, canary_percent, soak_seconds, namespace, isvc, force_rollback)
    if decision == "promoted":
        registry.set_alias(CHAMPION, version)
    registry.delete_alias(CHALLENGER)  # decided either way
    registry.set_tags(version, {"rollout.decision": decision, "rollout.reason": reason, "rollout.finished": _now()})
    return {"decision": decision, "reason": reason}


def _local(new, champion, triton_url, model_store, prompts, soak_requests, soak_seconds, force_rollback):
    n = new.triton_version
    old = [champion.triton_version] if champion is not None else []
    if not triton_url:
        raise ValueError("target 'local' needs triton_url (a tritonserver with --model-control-mode=explicit)")
    try:
        serve_versions(triton_url, model_store, old + [n])  # canary: both versions served
        problem = soak_local(triton_url, n, prompts, soak_requests, soak_seconds)
    except Exception as exc:  # a version that does not load is a failed canary
        problem = f"canary of version {n} failed to load: {exc}"
    if force_rollback and not problem:
        problem = "rollback requested (force_rollback)"
    if problem:
        serve_versions(triton_url, model_store, old)
        return "rolled_back", problem + (f"; serving version {old[0]} again" if old else "; nothing served")
    serve_versions(triton_url, model_store, [n])
    return "promoted", (f"{soak_requests} soak requests to version {n} succeeded; "
                        f"{'replaced version ' + str(old[0]) if old else 'first version served'}")


def record_version(namespace: str, version: int, model_store: str) -> str:
    """List version N in the ConfigMap cube3d-versions (where `cubeserve rollout` reads the
    versions it may deploy), after checking that its baseUri is this model store. Returns what
    was done. A concurrent edit makes the patch fail (resourceVersion precondition); it is
    retried on fresh data."""
    from cubeserve import rollout

    cluster = rollout.Cluster(namespace or None)
    for attempt in range(5):
        configmap = cluster.core.read_namespaced_config_map(rollout.VERSIONS_CONFIGMAP, cluster.namespace).to_dict()
        registry = rollout.VersionRegistry.from_configmap(configmap)
        if registry.base_uri.rstrip("/") != model_store.rstrip("/"):
            raise rollout.RolloutError(
                f"ConfigMap {cluster.namespace}/{rollout.VERSIONS_CONFIGMAP}: baseUri is {registry.base_uri}, "
                f"but the pipeline's model_store is {model_store}: set one to the other")
        if str(version) in registry.versions:
            return f"version {version} is listed already"
        versions = " ".join([*registry.versions, str(version)])
        patch = {"metadata": {"resourceVersion": configmap["metadata"]["resource_version"]},
                 "data": {"versions": versions}}
        try:
            cluster.core.patch_namespaced_config_map(rollout.VERSIONS_CONFIGMAP, cluster.namespace, patch)
            return f"versions: {versions}"
        except Exception as exc:  # noqa: BLE001 - 409 Conflict: someone else edited it; read again
            if getattr(exc, "status", None) != 409 or attempt == 4:
                raise
    raise AssertionError("unreachable")


def _kserve(new, percent, soak_seconds, namespace, isvc, force_rollback):
    """The same stages through `cubeserve rollout` (its plans, preflight and client) on a cluster
    (needs a kubeconfig or a service account allowed to patch the InferenceService:
    k8s/pipeline/rbac.yaml)."""
    from cubeserve import rollout

    target = rollout.Rollout(rollout.Cluster(namespace or None), isvc)
    version = str(new.triton_version)
    target.run("canary", version=version, percent=percent)
    time.sleep(soak_seconds)
    state = target.state()
    if state.ready and not force_rollback:
        target.run("promote")
        return "promoted", f"canary of version {version} at {percent}% was ready after {soak_seconds:.0f} s"
    _kserve_rollback(target)
    why = "rollback requested" if force_rollback else f"not ready after {soak_seconds:.0f} s ({state.summary()})"
    return "rolled_back", f"canary of version {version} at {percent}%: {why}"


def _kserve_rollback(target) -> None:
    # Serverless rollbacks take two calls (pin traffic, then clear it once the old revision is
    # ready); the first is made here, `cubeserve rollout rollback --wait` finishes it.
    target.run("rollback", force=True)


# The exit task's `status.state` for a run that succeeded: the KFP v2 backend passes the DAG's MLMD
# execution state (COMPLETE; backend/src/v2/driver/resolve.go), the SDK's documentation says
# SUCCEEDED. Anything else (FAILED, CANCELED, ...) is a failure.
SUCCEEDED_STATES = ("COMPLETE", "SUCCEEDED")


def finish_run(state: str, error: str, registry_uri: str, model_name: str, pipeline_run_id: str, target: str,
               triton_url: str = "", model_store: str = "", namespace: str = "", isvc: str = "cube3d") -> str:
    """The exit handler: close the run's MLflow run; if the run failed after a version became
    `challenger` in it, take that version out of serving (the champion keeps serving), clear the
    alias and tag the version `rollout.decision=failed`, so that running the same checkpoint
    again resumes its roll-out. Returns what it did. (`error` is often empty: the KFP backend
    does not report the failed step's message to the exit task.)"""
    from cubeserve.registry import CHALLENGER, CHAMPION, open_registry

    registry = open_registry(registry_uri, model_name)
    run_id = registry.start_run(pipeline_run_id, {})
    if state in SUCCEEDED_STATES:
        registry.end_run(run_id, "FINISHED")
        return "succeeded"
    done = f"pipeline run {pipeline_run_id} ended {state}" + (f": {error}" if error else "")
    challenger = registry.by_alias(CHALLENGER)
    if challenger is not None and pipeline_run_id in (challenger.tags.get("pipeline_run_id"),
                                                      challenger.tags.get("rollout.pipeline_run_id")):
        champion = registry.by_alias(CHAMPION)
        try:
            if target == "local" and triton_url:
                serve_versions(triton_url, model_store or challenger.tags.get("model_store", ""),
                               [champion.triton_version] if champion else [])
            elif target == "kserve":
                from cubeserve import rollout

                target = rollout.Rollout(rollout.Cluster(namespace or None), isvc)
                state_now = target.state()
                if state_now.phase == rollout.CANARY and state_now.canary == str(challenger.triton_version):
                    _kserve_rollback(target)
            reverted = "champion serving"
        except Exception as exc:  # noqa: BLE001 - reported, the alias is still cleared
            reverted = f"could not restore the champion's serving: {exc}"
        registry.delete_alias(CHALLENGER)
        registry.set_tags(challenger.version, {"rollout.decision": "failed", "rollout.reason": done[:1000],
                                               "rollout.finished": _now()})
        done += f"; version {challenger.version} is no longer challenger ({reverted})"
    registry.end_run(run_id, "FAILED")
    return done
