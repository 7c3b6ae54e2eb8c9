"""The roll-out step: canary, soak, then promote or roll back, recorded on the registry version.

Two targets behind one function (`roll_out`):

* "local": a tritonserver started with `--model-control-mode=explicit` on the model store.
  Triton has no traffic split, so the stages map to the set of versions served:
  canary = champion and challenger both loaded (clients choose a version; the soak sends its
  requests to the challenger), promote = only the challenger, rollback = only the champion.
  The set is written into the store's config.pbtxt too (`version_policy: specific`), so a
  restarted server serves the same versions, then both models are reloaded through the
  model-control API (cube3d_stream first: cube3d forwards to it).
* "kserve": `cubeserve rollout`'s pure plans (cubeserve/rollout.py) applied by its client: a
  canary at `percent`, a soak, then promote if the new revision became ready, else roll back.
  The version must be listed in the ConfigMap cube3d-versions, its files at `<baseUri>/<N>`.

Either way the champion alias moves only on promotion, and the decision and its reason are
tags on the version (`rollout.decision`, `rollout.reason`, ...).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from cubeserve.deploy import PREDICT_MODEL, STREAM_MODEL

# `version_policy: { latest { num_versions: 1 } }`, `{ all {} }` or `{ specific { ... } }`.
_POLICY_RE = re.compile(r"version_policy\s*:\s*\{.*?\}\s*\}", re.S)


def write_served_versions(store: str | Path, versions: list[int]) -> None:
    """Persist which versions are served: `version_policy: specific` in both config.pbtxt."""
    policy = "version_policy: { specific { versions: [" + ", ".join(map(str, sorted(versions))) + "] } }"
    for model in (STREAM_MODEL, PREDICT_MODEL):
        path = Path(store) / model / "config.pbtxt"
        text = path.read_text()
        new, n = _POLICY_RE.subn(policy, text, count=1)
        path.write_text(new if n else text + "\n" + policy + "\n")


def serve_versions(triton_url: str, store: str | Path, versions: list[int]) -> None:
    """Make the local server serve exactly `versions` (none: unload both models)."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(triton_url, network_timeout=600.0)
    try:
        if not versions:
            for model in (PREDICT_MODEL, STREAM_MODEL):
                client.unload_model(model)
            return
        write_served_versions(store, versions)
        for model in (STREAM_MODEL, PREDICT_MODEL):
            client.load_model(model)  # explicit mode: a loaded model is reloaded from its files
        for model in (STREAM_MODEL, PREDICT_MODEL):
            for v in versions:
                if not client.is_model_ready(model, str(v)):
                    raise RuntimeError(f"{model} version {v} did not become ready on {triton_url}")
    finally:
        client.close()


def served_versions(triton_url: str) -> list[int]:
    """Versions of cube3d that the server reports READY."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(triton_url)
    try:
        index = client.get_model_repository_index()
    finally:
        client.close()
    return sorted(int(m["version"]) for m in index
                  if m.get("name") == PREDICT_MODEL and m.get("state") == "READY" and m.get("version"))


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


def roll_out(target: str, registry_uri: str, model_name: str, version: str, canary_percent: int,
             soak_requests: int, soak_seconds: float, prompts: list[str], triton_url: str = "",
             store: str = "", namespace: str = "", isvc: str = "cube3d", force_rollback: bool = False) -> dict:
    """Canary, soak, promote or roll back the registry `version`; returns the decision."""
    from cubeserve.registry import CHALLENGER, CHAMPION, ModelRegistry

    registry = ModelRegistry(registry_uri, model_name)
    new = registry.get(version)
    champion = registry.by_alias(CHAMPION)
    if champion is not None and champion.version == new.version:
        return {"decision": "unchanged", "reason": f"version {version} is already the champion"}
    registry.set_tags(version, {"rollout.target": target, "rollout.canary_percent": str(canary_percent),
                                "rollout.started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    if target == "local":
        decision, reason = _local(registry, new, champion, triton_url, store, prompts, soak_requests,
                                  soak_seconds, force_rollback)
    elif target == "kserve":
        decision, reason = _kserve(new, canary_percent, soak_seconds, namespace, isvc, force_rollback)
    else:
        raise ValueError(f"target must be 'local' or 'kserve', got {target!r}")
    if decision == "promoted":
        registry.set_alias(CHAMPION, version)
    registry.delete_alias(CHALLENGER)  # decided either way
    registry.set_tags(version, {"rollout.decision": decision, "rollout.reason": reason,
                                "rollout.finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    return {"decision": decision, "reason": reason}


def _local(registry, new, champion, triton_url, store, prompts, soak_requests, soak_seconds, force_rollback):
    n = new.triton_version
    old = [champion.triton_version] if champion is not None else []
    if not triton_url:
        raise ValueError("target 'local' needs triton_url (a tritonserver with --model-control-mode=explicit)")
    store = store or new.tags.get("model_store", "")
    try:
        serve_versions(triton_url, store, old + [n])  # canary: both versions served
        problem = soak_local(triton_url, n, prompts, soak_requests, soak_seconds)
    except Exception as exc:  # a version that does not load is a failed canary
        problem = f"canary of version {n} failed to load: {exc}"
    if force_rollback and not problem:
        problem = "rollback requested (force_rollback)"
    if problem:
        serve_versions(triton_url, store, old)
        return "rolled_back", problem + (f"; serving version {old[0]} again" if old else "; nothing served")
    serve_versions(triton_url, store, [n])
    return "promoted", (f"{soak_requests} soak requests to version {n} succeeded; "
                        f"{'replaced version ' + str(old[0]) if old else 'first version served'}")


def _kserve(new, percent, soak_seconds, namespace, isvc, force_rollback):
    """The same stages through `cubeserve rollout`'s plans on a cluster (needs a kubeconfig or
    a service account allowed to patch the InferenceService)."""
    from cubeserve import rollout

    cluster = rollout.Cluster(namespace or None)
    registry = cluster.registry(rollout.VERSIONS_CONFIGMAP)
    version = str(new.triton_version)
    plan = rollout.plan_canary(cluster.get(rollout.ISVC_API, isvc), registry, version, percent)
    if plan.patch:
        cluster.patch(rollout.ISVC_API, isvc, plan.patch)
    time.sleep(soak_seconds)
    state = rollout.rollout_state(cluster.get(rollout.ISVC_API, isvc), registry)
    if state.ready and not force_rollback:
        plan = rollout.plan_promote(cluster.get(rollout.ISVC_API, isvc), registry)
        if plan.patch:
            cluster.patch(rollout.ISVC_API, isvc, plan.patch)
        return "promoted", f"canary of version {version} at {percent}% was ready after {soak_seconds:.0f} s"
    # Serverless rollbacks take two calls (pin traffic, then clear it once the old revision is
    # ready); the first is made here, `cubeserve rollout rollback --wait` finishes it.
    plan = rollout.plan_rollback(cluster.get(rollout.ISVC_API, isvc), registry, force=True)
    if plan.patch:
        cluster.patch(rollout.ISVC_API, isvc, plan.patch)
    why = "rollback requested" if force_rollback else f"not ready after {soak_seconds:.0f} s ({state.summary()})"
    return "rolled_back", f"canary of version {version} at {percent}%: {why}"


def describe(result: dict) -> str:
    return json.dumps(result, sort_keys=True)
