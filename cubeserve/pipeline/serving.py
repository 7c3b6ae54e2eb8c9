"""The roll-out step: canary, analysis, then promote or roll back, recorded on the registry
version; and what the pipeline's exit handler does when a run fails after registration.

Two targets behind one function (`roll_out`):

* "local": a tritonserver started with `--model-control-mode=explicit` (`make pipeline` starts
  one). The step shares no disk with it: it downloads the versions from the model store and
  loads them through Triton's model-control API with the files in the request (the API's file
  override), so the server serves exactly those versions. The traffic split is the predict
  model's in-server experiment (serving/experiment.py), set through the same API as its config
  parameter `experiment`. Stages: both versions loaded and a soak of requests pinned to the new
  one (it must load and answer); with a Prometheus (`prometheus_url`) and `analysis_windows`:
  shadow (the champion answers every request, a share is copied to the new version and
  compared), canary (arms champion / new at `canary_percent`), then analysis windows, each
  `analysis_window_seconds` of traffic sent by the step and judged by `cubeserve rollout
  analyze` (cubeserve/rollout/analyze.py) against the champion; promote = only the new version
  loaded, rollback = only the champion. (Every file travels base64-encoded in one HTTP request:
  right for the demo and test checkpoints, not for multi-GB weights; use KServe there.)
* "kserve": `cubeserve rollout`'s pure plans (cubeserve/rollout/) applied by its client: a
  canary at `percent`, a soak until its revision is ready, then the analysis windows over the
  users' traffic (figures by the `version` label), then promote, else roll back. Version N is
  `<model_store>/<N>/`; `record_version` (the package step) lists it in the ConfigMap
  cube3d-versions, whose baseUri must be the pipeline's model store.

With `analysis_windows` 0 the soak alone decides; windows without a Prometheus are refused (a
forgotten URL must not promote ungated). Either way the
champion alias moves only on promotion, and the decision, its reason and every analysis window's
figures are tags on the version (`rollout.decision`, `rollout.reason`, `rollout.analysis`, ...).
"""

from __future__ import annotations

import json
import math
import os
import socket
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from cubeserve.deploy import PREDICT_MODEL, STREAM_MODEL
from cubeserve.pipeline import leases


def _model_config_json(config_pbtxt: str, versions: list[int], experiment: str = "") -> str:
    """A config.pbtxt as the JSON that the model-control API takes, serving `versions`, with
    the parameter `experiment` when one is given."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    from cubeserve.serving.experiment import EXPERIMENT_PARAMETER

    config = text_format.Parse(config_pbtxt, model_config_pb2.ModelConfig())
    config.version_policy.specific.versions[:] = sorted(versions)
    if experiment:
        config.parameters[EXPERIMENT_PARAMETER].string_value = experiment
    return json_format.MessageToJson(config, preserving_proto_field_name=True)


def admin_headers(key: str | None = None) -> dict[str, str]:
    """The admin header for tritonserver's model-repository API (docs/security.md): `key`, else
    the one the step got from the Secret (cubeserve.deploy.ADMIN_SECRET) in its environment."""
    from cubeserve import deploy

    key = key or os.environ.get(deploy.ADMIN_KEY_ENV)
    if not key:
        raise RuntimeError(f"target 'local' loads versions through tritonserver's model-repository API, an admin "
                           f"API: give the server's admin key as ${deploy.ADMIN_KEY_ENV} (the Secret "
                           f"{deploy.ADMIN_SECRET})")
    return {deploy.ADMIN_HEADER: key}


def serve_versions(triton_url: str, model_store: str, versions: list[int], experiment: str = "",
                   models: tuple[str, ...] = (STREAM_MODEL, PREDICT_MODEL), admin_key: str | None = None) -> None:
    """Make the local server serve exactly `versions` of the model store (none: unload both),
    the predict model with `experiment` (its JSON, serving/experiment.py; "" none). `models`:
    only these are (re)loaded, e.g. the predict model alone to change the experiment while the
    engines keep running. `admin_key`: the server's (admin_headers)."""
    import tritonclient.http as httpclient

    headers = admin_headers(admin_key)
    client = httpclient.InferenceServerClient(triton_url, network_timeout=600.0)
    try:
        _serve_versions(client, triton_url, model_store, versions, experiment, models, headers)
    except (ConnectionError, socket.timeout, socket.gaierror) as exc:  # say where, not only what
        raise RuntimeError(f"tritonserver at {triton_url} cannot be reached ({type(exc).__name__}: {exc}): is "
                           "triton_url right and the server running?") from exc
    finally:
        client.close()


def _serve_versions(client, triton_url, model_store, versions, experiment, models, headers) -> None:
    from cubeserve import storage
    from cubeserve.pipeline.steps import version_uri

    client.is_server_live()  # reachable, before any download
    if not versions:
        for model in (PREDICT_MODEL, STREAM_MODEL):
            client.unload_model(model, headers=headers)
        return
    with tempfile.TemporaryDirectory() as tmp:
        for v in versions:
            storage.download_dir(version_uri(model_store, v), Path(tmp) / str(v))
        newest = Path(tmp) / str(max(versions))
        for model in models:  # cube3d forwards to cube3d_stream: the engines first
            files = {}
            for v in versions:
                root = Path(tmp) / str(v) / model / str(v)
                for f in sorted(p for p in root.rglob("*") if p.is_file()):
                    files[f"file:{v}/{f.relative_to(root).as_posix()}"] = f.read_bytes()
            config = _model_config_json((newest / model / "config.pbtxt").read_text(), versions,
                                        experiment if model == PREDICT_MODEL else "")
            client.load_model(model, headers=headers, config=config, files=files)
    for model in models:
        for v in versions:
            if not client.is_model_ready(model, str(v)):
                raise RuntimeError(f"{model} version {v} did not become ready on {triton_url}")


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
# How long a rollback waits for the reverted revision (inside the half hour the soak leaves).
ROLLBACK_WAIT_S = 900.0
# The exit handler's deadline: the roll-out lease outlives both steps, so it expires (and another
# run may take over) only when neither this run's roll-out nor its exit handler can still act.
FINISH_DEADLINE_S = 1800


def send_traffic(triton_url: str, prompts: list[str], seconds: float, clients: int = 2, requests: int = 0,
                 max_seconds: float = 0.0) -> dict:
    """Unpinned requests to the predict model from `clients` threads for `seconds`, and on until
    `requests` were sent (at most `max_seconds` in all, when given): the load that the analysis
    windows judge; the experiment in force picks each one's version. Failures are counted, not
    raised: Prometheus measures them per version."""
    from cube3d_client import Cube3DClient

    counts = {"sent": 0, "failed": 0}
    lock = threading.Lock()
    start = time.monotonic()

    def more() -> bool:
        elapsed = time.monotonic() - start
        if max_seconds and elapsed >= max_seconds:
            return False
        with lock:
            return elapsed < seconds or counts["sent"] < requests

    def client_loop(worker: int) -> None:
        with Cube3DClient(triton_url, "http", retries=0) as client:
            i = 0
            while more():
                try:
                    client.generate(prompts[(worker + i) % len(prompts)], seed=worker * 100_000 + i, resolution=4)
                    failed = 0
                except Exception:  # noqa: BLE001 - measured by the server's metrics
                    failed = 1
                with lock:
                    counts["sent"] += 1
                    counts["failed"] += failed
                i += 1

    threads = [threading.Thread(target=client_loop, args=(w,), daemon=True) for w in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return counts


@dataclass(frozen=True)
class Gate:
    """The promotion gate of a roll-out: windows of Prometheus data judged by
    cubeserve/rollout/analyze.py. Off with 0 windows; windows need a Prometheus."""
    prometheus_url: str = ""
    windows: int = 0
    window_seconds: float = 60.0
    shadow_share: float = 0.0  # local target: a shadow stage first when > 0
    shadow_seconds: float = 0.0
    thresholds: dict = field(default_factory=dict)  # analyze.Thresholds' fields; the rest keep their defaults
    selector: str = ""  # more label matchers, e.g. namespace="models"
    traffic_clients: int = 2  # local target: concurrent clients of the step's traffic

    @property
    def enabled(self) -> bool:
        return self.windows > 0

    def limits(self):
        from cubeserve.rollout.analyze import Thresholds

        unknown = set(self.thresholds) - set(Thresholds.names())
        if unknown:
            raise ValueError(f"analysis_thresholds: unknown {sorted(unknown)}; allowed: {', '.join(Thresholds.names())}")
        return Thresholds(**self.thresholds)

    def validate(self, soak_seconds: float) -> None:
        if not 0 <= self.windows <= 100:
            raise ValueError(f"analysis_windows must be from 0 to 100, got {self.windows}")
        if self.windows and not self.prometheus_url:
            raise ValueError(f"prometheus_url is required with analysis_windows {self.windows} (a Prometheus "
                             f"scraping the servers); set analysis_windows to 0 to let the soak alone decide")
        if not 1 <= self.window_seconds <= MAX_SOAK_S:
            raise ValueError(f"analysis_window_seconds must be from 1 to {MAX_SOAK_S}, got {self.window_seconds}")
        if not 0 <= self.shadow_share <= 1:
            raise ValueError(f"shadow_share must be from 0 to 1, got {self.shadow_share}")
        if not 1 <= self.traffic_clients <= 64:
            raise ValueError(f"traffic_clients must be from 1 to 64, got {self.traffic_clients}")
        if not 0 <= self.shadow_seconds <= MAX_SOAK_S:
            raise ValueError(f"shadow_seconds must be from 0 to {MAX_SOAK_S}, got {self.shadow_seconds}")
        self.limits()
        total = soak_seconds + (self.shadow_seconds + self.windows * self.window_seconds if self.enabled else 0)
        if total > MAX_SOAK_S:
            raise ValueError(f"soak_seconds + shadow_seconds + analysis_windows x analysis_window_seconds must be "
                             f"at most {MAX_SOAK_S} (the roll-out step's deadline is {ROLLOUT_DEADLINE_S} s), "
                             f"got {total:g}")


SCRAPE_WAIT_S = 300.0  # how long a window waits for Prometheus to scrape past its end


def judge(gate: Gate, stage: str, candidate: int, baseline: int | None, started: float):
    """The analysis of the window from `started` (Unix time) to Prometheus' first scrape after
    now, so that the window holds exactly this stage's traffic. Prometheus not answering is a
    failed window (never a promotion)."""
    from cubeserve.rollout import analyze as a

    client = a.PrometheusClient(gate.prometheus_url)
    ended = time.time()
    try:
        while (at := client.latest_scrape(gate.selector) or 0.0) < ended:
            if time.time() > ended + SCRAPE_WAIT_S:
                raise a.PrometheusError(f"{gate.prometheus_url}: no scrape in the {SCRAPE_WAIT_S:.0f} s after the "
                                        f"{stage} window")
            time.sleep(0.5)
        result = a.analyze(client, candidate, baseline, max(1.0, at - started), gate.limits(), at=at,
                           selector=gate.selector)
    except a.PrometheusError as exc:
        result = a.Analysis(a.FAIL, a.Figures(str(candidate)), None, [], [f"analysis failed: {exc}"],
                            max(1.0, ended - started), ended)
    print(f"{stage}: {result.report()}", flush=True)
    return result


def _brief(stage: str, result) -> dict:
    """One window for the registry tag: verdict, reasons and the figures that decide."""
    keys = ("requests", "error_rate", "p50_seconds", "p95_seconds", "time_per_token_p95", "queue_p95_seconds",
            "empty_mesh_rate", "not_watertight_rate", "shadow_agreement_mean", "shadow_identical_share")

    def figures(f):
        if f is None:
            return None
        return {"version": f.version, **{k: round(getattr(f, k), 5) for k in keys if getattr(f, k) is not None}}

    return {"stage": stage, "result": result.result, "window_s": round(result.window_seconds, 1),
            "reasons": result.reasons, "candidate": figures(result.candidate), "baseline": figures(result.baseline)}


def _experiment(n: int, champion: int, canary_percent: int = 0, shadow_share: float = 0.0) -> str:
    """The predict model's experiment for a stage: champion and candidate arms (canary), or the
    champion alone with the candidate as its shadow."""
    from cubeserve.serving.experiment import Arm, Experiment, Shadow

    name = f"rollout-v{n}"
    if shadow_share:
        return Experiment(name, (Arm("champion", champion, 1),), Shadow(n, shadow_share)).to_json()
    return Experiment(name, (Arm("champion", champion, 100 - canary_percent),
                             Arm("candidate", n, canary_percent))).to_json()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def roll_out(target: str, registry_uri: str, model_name: str, version: str, canary_percent: int,
             soak_requests: int, soak_seconds: float, prompts: list[str], triton_url: str = "",
             model_store: str = "", namespace: str = "", isvc: str = "cube3d", pipeline_run_id: str = "",
             force_rollback: bool = False, gate: Gate = Gate()) -> dict:
    """Canary, soak, analysis windows (`gate`), promote or roll back the registry `version`;
    returns the decision and the analysis of every window.

    The version is `challenger` while its roll-out runs (the pipeline's exit handler takes it out
    again if the run fails meanwhile, see `finish_run`)."""
    from cubeserve.registry import CHALLENGER, CHAMPION, open_registry

    if target not in TARGETS:
        raise ValueError(f"target must be one of {', '.join(TARGETS)}, got {target!r}")
    if not 0 <= soak_seconds <= MAX_SOAK_S:
        raise ValueError(f"soak_seconds must be from 0 to {MAX_SOAK_S} (the roll-out step's deadline is "
                         f"{ROLLOUT_DEADLINE_S} s), got {soak_seconds}")
    gate.validate(soak_seconds)
    if gate.enabled and not 1 <= canary_percent <= 99:  # an arm without traffic has no figures
        raise ValueError(f"canary_percent must be from 1 to 99 with analysis windows, got {canary_percent}")
    registry = open_registry(registry_uri, model_name)
    new = registry.get(version)
    model_store = model_store or new.tags.get("model_store", "")
    champion = registry.by_alias(CHAMPION)
    if champion is not None and champion.version == new.version:
        return _decided(registry, pipeline_run_id, {"decision": "unchanged",
                                                    "reason": f"version {version} is already the champion"})
    # One roll-out at a time per model store: LeaseHeld (the step fails, naming the holder) while
    # another run's is under way. Held until the decision is recorded, or, when this step fails,
    # until the exit handler has put the champion back.
    owner = pipeline_run_id or f"cubeserve-{uuid.uuid4().hex[:12]}"
    leases.acquire(model_store, owner, version, ROLLOUT_DEADLINE_S + FINISH_DEADLINE_S)
    # Tagged first: the exit handler recognises its run's challenger by the tag.
    registry.set_tags(version, {"rollout.target": target, "rollout.canary_percent": str(canary_percent),
                                "rollout.pipeline_run_id": pipeline_run_id, "rollout.started": _now()})
    registry.set_alias(CHALLENGER, version)
    analyses: list[dict] = []  # every analysis window, as it is judged
    if target == "local":
        decision, reason = _local(new, champion, triton_url, model_store, prompts, soak_requests,
                                  soak_seconds, force_rollback, canary_percent, gate, analyses)
    else:
        decision, reason = _kserve(new, champion, canary_percent, soak_seconds, namespace, isvc, force_rollback,
                                   gate, analyses)
    if decision == "promoted":
        registry.set_alias(CHAMPION, version)
    registry.delete_alias(CHALLENGER)  # decided either way
    tags = {"rollout.decision": decision, "rollout.reason": reason, "rollout.finished": _now()}
    if analyses:
        tags["rollout.analysis"] = _analysis_tag(analyses)
    registry.set_tags(version, tags)
    result = _decided(registry, pipeline_run_id, {"decision": decision, "reason": reason, "analysis": analyses})
    leases.release(model_store, owner)
    return result


def _decided(registry, pipeline_run_id: str, result: dict) -> dict:
    """The roll-out is the last step of a run that took a checkpoint to a decision."""
    from cubeserve.pipeline.steps import mark_finished

    if pipeline_run_id:
        mark_finished(registry, pipeline_run_id, "roll_out", f"{result['decision']}: {result['reason']}")
    return result


def _analysis_tag(analyses: list[dict]) -> str:
    """The windows as JSON for the tag `rollout.analysis`, the latest ones that fit in a tag
    (the registry cuts longer values, which would no longer be JSON)."""
    from cubeserve.registry import MAX_TAG_CHARS

    for first in range(len(analyses)):
        text = json.dumps(analyses[first:], separators=(",", ":"))
        if len(text) <= MAX_TAG_CHARS:
            return text
    return json.dumps([{k: v for k, v in analyses[-1].items() if k in ("stage", "result")}])


def _analysis_windows(gate: Gate, n: int, baseline: int | None, analyses: list, traffic=None) -> str:
    """Run the gate's windows (each with `traffic(seconds)` when given, else the users'
    traffic); "" when the last passed and none failed, else why not."""
    from cubeserve.rollout.analyze import FAIL, PASS

    result = None
    for i in range(1, gate.windows + 1):
        started = time.time()
        if traffic:
            traffic(gate.window_seconds)
        else:
            time.sleep(gate.window_seconds)
        result = judge(gate, f"analysis {i}/{gate.windows}", n, baseline, started)
        analyses.append(_brief(f"analysis {i}", result))
        if result.result == FAIL:
            return f"analysis window {i} of {gate.windows} failed: {result.summary()}"
    if result is not None and result.result != PASS:
        return f"{result.result} after the last analysis window: {result.summary()}"
    return ""


def _local(new, champion, triton_url, model_store, prompts, soak_requests, soak_seconds, force_rollback,
           canary_percent, gate, analyses):
    n = new.triton_version
    old = [champion.triton_version] if champion is not None else []
    if not triton_url:
        raise ValueError("target 'local' needs triton_url (a tritonserver with --model-control-mode=explicit)")
    try:
        serve_versions(triton_url, model_store, old + [n])  # both versions served, no split yet
        problem = soak_local(triton_url, n, prompts, soak_requests, soak_seconds)
    except Exception as exc:  # a version that does not load is a failed canary
        problem = f"canary of version {n} failed to load: {exc}"
    if not problem and gate.enabled:
        problem = _local_stages(new, old, triton_url, model_store, prompts, canary_percent, gate, analyses)
    if force_rollback and not problem:
        problem = "rollback requested (force_rollback)"
    if problem:
        try:
            serve_versions(triton_url, model_store, old)
        except Exception as exc:  # the cause first: the rollback's own failure would hide it
            raise RuntimeError(f"rolling back on {triton_url} after: {problem}; the rollback failed too: {exc}") from exc
        return "rolled_back", problem + (f"; serving version {old[0]} again" if old else "; nothing served")
    serve_versions(triton_url, model_store, [n])
    passed = (f"{gate.windows} analysis windows of {gate.window_seconds:g} s passed" if gate.enabled
              else f"{soak_requests} soak requests to version {n} succeeded (no analysis)")
    return "promoted", f"{passed}; {'replaced version ' + str(old[0]) if old else 'first version served'}"


def _local_stages(new, old, triton_url, model_store, prompts, canary_percent, gate, analyses) -> str:
    """Shadow, canary and the analysis windows on the local server; "" or the reason to roll back."""
    from cubeserve.rollout.analyze import FAIL

    n = new.triton_version

    min_requests = gate.limits().min_requests

    def traffic(seconds: float, share: float = min(canary_percent, 100 - canary_percent) / 100) -> None:
        # Enough requests for the version with the smaller share to reach min_requests, however
        # slow this machine is (at most ten windows long). Twice the mean: requests without a
        # user key are split at random, and at 20 requests and a half share the odds of fewer
        # than 5 are 0.6 %.
        needed = math.ceil(min_requests / max(share, 0.01) * 2) if old else min_requests
        send_traffic(triton_url, prompts, seconds, gate.traffic_clients, needed, 10 * seconds)

    if not old:  # nothing to compare with: the new version alone, judged on absolute limits
        return _analysis_windows(gate, n, None, analyses, traffic)
    if gate.shadow_share > 0 and gate.shadow_seconds > 0:
        # The engines stay loaded; only the predict model takes the new experiment.
        serve_versions(triton_url, model_store, old + [n], _experiment(n, old[0], shadow_share=gate.shadow_share),
                       models=(PREDICT_MODEL,))
        started = time.time()
        traffic(gate.shadow_seconds, gate.shadow_share)
        result = judge(gate, "shadow", n, old[0], started)
        analyses.append(_brief("shadow", result))
        if result.result == FAIL:  # not enough data is no verdict: the canary goes on
            return f"shadow of version {n} failed: {result.summary()}"
    serve_versions(triton_url, model_store, old + [n], _experiment(n, old[0], canary_percent=canary_percent),
                   models=(PREDICT_MODEL,))
    return _analysis_windows(gate, n, old[0], analyses, traffic)


def record_version(namespace: str, version: int, model_store: str) -> str:
    """List version N in the ConfigMap cube3d-versions (where `cubeserve rollout` reads the
    versions it may deploy), after checking that its baseUri is this model store. Returns what
    was done. It writes only the key the pipeline owns (`packaged`: rollout.versions), under its
    own field manager, so re-applying the manifests neither conflicts with it nor resets it. A
    concurrent edit makes the patch fail (resourceVersion precondition); it is retried on fresh
    data."""
    from cubeserve import rollout
    from cubeserve.rollout.versions import PACKAGED_KEY

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
        packaged = " ".join([*((configmap.get("data") or {}).get(PACKAGED_KEY) or "").split(), str(version)])
        patch = {"metadata": {"resourceVersion": configmap["metadata"]["resource_version"]},
                 "data": {PACKAGED_KEY: packaged}}
        try:
            cluster.core.patch_namespaced_config_map(rollout.VERSIONS_CONFIGMAP, cluster.namespace, patch,
                                                     field_manager=rollout.FIELD_MANAGER)
            return f"versions: {' '.join([*registry.versions, str(version)])}"
        except Exception as exc:  # noqa: BLE001 - 409 Conflict: someone else edited it; read again
            if getattr(exc, "status", None) != 409 or attempt == 4:
                raise
    raise AssertionError("unreachable")


def _kserve(new, champion, percent, soak_seconds, namespace, isvc, force_rollback, gate, analyses):
    """The same stages through `cubeserve rollout` (its plans, preflight and client) on a cluster
    (needs a kubeconfig or a service account allowed to patch the InferenceService:
    k8s/pipeline/rbac.yaml). The analysis windows judge the users' traffic by version label."""
    from cubeserve import rollout

    target = rollout.Rollout(rollout.Cluster(namespace or None), isvc)
    version = str(new.triton_version)
    target.run("canary", version=version, percent=percent)
    time.sleep(soak_seconds)
    state = target.state()
    if not state.ready or force_rollback:
        _kserve_rollback(target, version)
        why = "rollback requested" if force_rollback else f"not ready after {soak_seconds:.0f} s ({state.summary()})"
        return "rolled_back", f"canary of version {version} at {percent}%: {why}"
    if gate.enabled:
        baseline = champion.triton_version if champion is not None else None
        problem = _analysis_windows(gate, new.triton_version, baseline, analyses)
        if problem:
            _kserve_rollback(target, version)
            return "rolled_back", f"canary of version {version} at {percent}%: {problem}"
    target.run("promote", version=version)  # this run's canary, or nothing
    passed = f"; {gate.windows} analysis windows passed" if gate.enabled else ""
    return "promoted", f"canary of version {version} at {percent}% was ready after {soak_seconds:.0f} s{passed}"


def _kserve_rollback(target, version: str) -> None:
    # What `cubeserve rollout rollback --wait` does: a Serverless rollback pins the traffic to
    # the previous revision, then drops the split once the reverted revision is ready (both
    # patches, or NotReady after ROLLBACK_WAIT_S: the step fails and the CLI can finish it).
    # Only this run's canary (`version`) is rolled back.
    target.run_until_done("rollback", wait=ROLLBACK_WAIT_S, version=version)


def finish_run(state: str, error: str, registry_uri: str, model_name: str, pipeline_run_id: str, target: str,
               triton_url: str = "", model_store: str = "", namespace: str = "", isvc: str = "cube3d") -> str:
    """The exit handler: close the run's MLflow run; if the run failed after a version became
    `challenger` in it, take that version out of serving (the champion keeps serving), clear the
    alias and tag the version `rollout.decision=failed`, so that running the same checkpoint
    again resumes its roll-out. Returns what it did.

    Whether the run succeeded is what its last step recorded (steps.mark_finished), not `state`:
    the KFP backend hands the exit task the MLMD state of the DAG it watches, which is RUNNING
    for a run that succeeded (and for many that failed) on backends before 2.17.0, and RUNNING
    on 2.17 too for a run that took no If branch; FAILED can follow a retried step that then
    succeeded (kfp_pipelines/pod_runner.py, from the backend's source). `error` is always empty
    (the backend does not fill it in)."""
    from cubeserve.pipeline.steps import finished
    from cubeserve.registry import CHALLENGER, CHAMPION, open_registry

    registry = open_registry(registry_uri, model_name)
    run_id = registry.start_run(pipeline_run_id, {})
    last = finished(registry, run_id)
    if last:
        registry.end_run(run_id, "FINISHED")
        return f"succeeded ({last}; the backend reported {state})"
    done = (f"pipeline run {pipeline_run_id} ended before its last step finished (the backend reported {state})"
            + (f": {error}" if error else ""))
    challenger = registry.by_alias(CHALLENGER)
    store = model_store or (challenger.tags.get("model_store", "") if challenger is not None else "")
    if challenger is not None and challenger.tags.get("rollout.pipeline_run_id") == pipeline_run_id:
        lease = leases.read_lease(store) if store else None
        if lease is not None and lease.owner != pipeline_run_id:
            # Another run took the roll-out over (this run's lease expired): what is served is
            # that run's to change now.
            done += (f"; version {challenger.version} was this run's challenger, but the roll-out is no "
                     f"longer this run's ({lease.describe() if lease.owner else 'released'}): serving left as it is")
        else:
            champion = registry.by_alias(CHAMPION)
            try:
                if target == "local" and triton_url:
                    serve_versions(triton_url, store, [champion.triton_version] if champion else [])
                elif target == "kserve":
                    from cubeserve import rollout

                    target = rollout.Rollout(rollout.Cluster(namespace or None), isvc)
                    state_now = target.state()
                    if state_now.phase == rollout.CANARY and state_now.canary == str(challenger.triton_version):
                        _kserve_rollback(target, state_now.canary)
                reverted = "champion serving"
            except Exception as exc:  # noqa: BLE001 - reported, the alias is still cleared
                reverted = f"could not restore the champion's serving: {exc}"
            registry.delete_alias(CHALLENGER)
            registry.set_tags(challenger.version, {"rollout.decision": "failed", "rollout.reason": done[:1000],
                                                   "rollout.finished": _now()})
            done += f"; version {challenger.version} is no longer challenger ({reverted})"
    if store and leases.release(store, pipeline_run_id):
        done += "; roll-out lease released"
    registry.end_run(run_id, "FAILED")
    return done
