"""Autoscaling on concurrency (docs/deploy/autoscaling.md): the manifests held to cubeserve.deploy,
what KServe makes of them per release (tests/kserve_standin.py, checked against the real v0.20.0
manager in tests/test_cluster.py) validated against KEDA v2.20.2's CRD, and, with real servers and
a real Prometheus (marker `scale`, `make scale-test`), the exact query KEDA is given following a
stepped load up and back down, and a replica drained away under load losing nothing.
"""

from __future__ import annotations

import gzip
import json
import math
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import kserve_standin
from cubeserve import deploy
from k8s_validation import (EXCLUDED_KSERVE, MIN_KSERVE, REPO, crd_errors, find, load_crd_schemas, render,
                            supported_releases)

KEDA_OVERLAYS = {"raw": ("cube3d",), "cpu": ("cube3d",), "experiment": ("cube3d",), "ab": ("cube3d-a", "cube3d-b")}
KNATIVE = "autoscaling.knative.dev/"


def keda_schemas() -> dict:
    crds = json.loads(gzip.decompress((REPO / "tests" / "data" / "cluster" / "keda-v2.20.2.json.gz").read_bytes()))["crds"]
    return load_crd_schemas(crds)


def _string_parameter(config: str, key: str) -> str:
    return re.search(rf'key: "{key}" value: {{ string_value: "([^"]*)" }}', config).group(1)


def test_the_engine_limits_are_the_shipped_configs():
    """containerConcurrency is what a replica holds before its engine refuses: the config's
    max_objects, and max_queue (empty: 8 x max_objects, the scheduler's default)."""
    from cubeserve.engine.scheduler import Scheduler

    config = (REPO / "triton_models" / deploy.STREAM_MODEL / "config.pbtxt").read_text()
    assert int(_string_parameter(config, "max_objects")) == deploy.MAX_OBJECTS
    assert _string_parameter(config, "max_queue") == ""
    import inspect

    assert "max_queue = 8 * max_objects" in inspect.getsource(Scheduler.__init__), \
        "the scheduler's default max_queue is no longer 8 x max_objects: update deploy.MAX_QUEUE"
    assert deploy.CONTAINER_CONCURRENCY == deploy.MAX_OBJECTS + deploy.MAX_QUEUE
    assert deploy.SCALE_TARGET <= deploy.CONTAINER_CONCURRENCY and deploy.SCALE_TARGET_CPU <= deploy.SCALE_TARGET


@pytest.mark.parametrize("release", supported_releases(MIN_KSERVE["canary"]))
def test_the_serverless_overlay_scales_on_concurrency(release):
    """The revision KServe writes scales on concurrency at scaleTarget per pod (utilization 100%:
    Knative's effective target is the target itself), 1 to MAX_REPLICAS pods, a replica kept
    through 15 minutes of quiet, and the engine's capacity as the hard limit."""
    isvc = find(render("canary"), "InferenceService")
    predictor = isvc["spec"]["predictor"]
    assert predictor["minReplicas"] >= 1  # the served version never goes to zero
    annotations, container_concurrency = kserve_standin.knative_autoscaling(release, isvc)
    assert annotations == {
        f"{KNATIVE}class": "kpa.autoscaling.knative.dev", f"{KNATIVE}metric": "concurrency",
        f"{KNATIVE}target": str(deploy.SCALE_TARGET), f"{KNATIVE}min-scale": "1",
        f"{KNATIVE}max-scale": str(deploy.MAX_REPLICAS),
        f"{KNATIVE}target-utilization-percentage": str(deploy.TARGET_UTILIZATION_PERCENT),
        f"{KNATIVE}scale-down-delay": f"{deploy.SCALE_DOWN_DELAY_S // 60}m"}
    assert container_concurrency == deploy.CONTAINER_CONCURRENCY
    assert kserve_standin.knative_target(annotations, container_concurrency) == deploy.SCALE_TARGET
    # Knative's webhook: scale-down-delay at most 1 h, utilization 1-100.
    assert deploy.SCALE_DOWN_DELAY_S <= 3600 and 1 <= deploy.TARGET_UTILIZATION_PERCENT <= 100


@pytest.mark.parametrize("overlay", sorted(KEDA_OVERLAYS))
def test_the_raw_overlays_scale_on_their_own_pods_through_keda(overlay):
    objects = render(overlay)
    for name in KEDA_OVERLAYS[overlay]:
        isvc = find(objects, "InferenceService", name)
        predictor, annotations = isvc["spec"]["predictor"], isvc["metadata"]["annotations"]
        assert annotations[kserve_standin.AUTOSCALER_CLASS] == "keda"
        assert not [k for k in annotations if k.startswith(KNATIVE)]
        assert not {"scaleMetric", "scaleTarget", "containerConcurrency"} & set(predictor)
        assert predictor["minReplicas"] >= 1 and predictor["maxReplicas"] == deploy.MAX_REPLICAS
        (metric,) = predictor["autoScaling"]["metrics"]
        target = deploy.SCALE_TARGET_CPU if overlay == "cpu" else deploy.SCALE_TARGET
        assert metric == {"type": "External", "external": {
            "metric": {"backend": "prometheus", "serverAddress": deploy.PROMETHEUS_URL,
                       "query": deploy.concurrency_query(name)},
            "target": {"type": "Value", "value": str(target)}}}
        assert predictor["autoScaling"]["behavior"] == {"scaleDown": {"stabilizationWindowSeconds": deploy.SCALE_DOWN_DELAY_S}}


def test_the_query_reads_the_gauge_the_servers_export():
    """The gauge the drain waits on (serving/triton_common.py's Drain), set by each model instance
    with the `model` label the query filters on; tests/test_autoscaling.py's `scale` test reads it
    from real servers."""
    from cubeserve.serving.drain import IN_PROGRESS_METRIC

    assert deploy.CONCURRENCY_METRIC == IN_PROGRESS_METRIC
    common = (REPO / "cubeserve" / "serving" / "triton_common.py").read_text()
    assert 'labels={"model": args["model_name"]' in common
    assert f'{IN_PROGRESS_METRIC}{{model="{deploy.STREAM_MODEL}",' in deploy.concurrency_query()


def test_the_query_selects_the_stable_predictors_pods_only():
    """Prometheus anchors =~: the stable Deployment's pods match, a canary's, another
    InferenceService's (an A/B arm) and the Deployment name alone do not."""
    selector = re.search(r'pod=~"([^"]+)"', deploy.concurrency_query("cube3d")).group(1)
    for pod, counted in (("cube3d-predictor-7c9d8b6f5-x2k7q", True), ("cube3d-predictor-5b4d-abcde", True),
                         ("cube3d-v2-predictor-7c9d8b6f5-x2k7q", False), ("cube3d-a-predictor-7c9d8b6f5-x2k7q", False),
                         ("cube3d-predictor", False), ("my-cube3d-predictor-7c9d8b6f5-x2k7q", False)):
        assert bool(re.fullmatch(selector, pod)) == counted, pod


@pytest.mark.parametrize("release", [r for r in supported_releases(MIN_KSERVE["raw"])])
def test_the_scaled_objects_kserve_writes_are_valid_for_keda(release):
    """Every raw overlay's ScaledObject, as KServe `release` writes it, passes KEDA v2.20.2's CRD,
    with the threshold the target and the manifests' scale-down window."""
    schemas = keda_schemas()
    for overlay, names in KEDA_OVERLAYS.items():
        objects = render(overlay)
        for name in names:
            (scaled,) = kserve_standin.scaled_objects(release, find(objects, "InferenceService", name)).values()
            assert crd_errors(scaled, schemas) == [], (overlay, release)
            (trigger,) = scaled["spec"]["triggers"]
            assert trigger["type"] == "prometheus" and trigger["metadata"]["query"] == deploy.concurrency_query(name)
            assert float(trigger["metadata"]["threshold"]) == (deploy.SCALE_TARGET_CPU if overlay == "cpu" else deploy.SCALE_TARGET)
            assert "metricType" not in trigger  # AverageValue: ceil(value / threshold) replicas
            window = scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
            assert window["stabilizationWindowSeconds"] == deploy.SCALE_DOWN_DELAY_S
            assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (1, deploy.MAX_REPLICAS)


def test_kserve_0_15_writes_no_window_and_0_14_has_no_keda():
    """Why the raw overlays need v0.16.0: v0.15 keeps no behavior (its CRD has none: the API server
    refuses the overlay), v0.14 has no keda class."""
    isvc = find(render("raw"), "InferenceService")
    (scaled,) = kserve_standin.scaled_objects("v0.15.2", isvc).values()
    assert "advanced" not in scaled["spec"] and scaled["spec"]["triggers"][0]["metadata"]["threshold"] == "8.000000"
    with pytest.raises(ValueError, match="no autoscaler class keda"):
        kserve_standin.scaled_objects("v0.14.0", isvc)
    assert "v0.16.0" in EXCLUDED_KSERVE  # so v0.17.0 is the first release the raw overlays are checked on


def test_a_raw_canary_of_a_keda_service_would_get_a_scaled_object_keda_refuses():
    """The reason `cubeserve rollout canary` refuses a RawDeployment canary of a KEDA service."""
    from cubeserve.rollout import RolloutError, VersionRegistry, plan_canary

    isvc = find(render("raw"), "InferenceService")
    isvc["spec"]["canary"] = [{"predictor": {"name": "v2", "model": {"storageUri": "s3://b/cube3d/2/"}},
                               "trafficPercent": 10}]
    canary = kserve_standin.scaled_objects("v0.20.0", isvc)["cube3d-v2-predictor"]
    assert canary["spec"]["triggers"] == []
    assert any("triggers" in e for e in crd_errors(canary, keda_schemas()))
    del isvc["spec"]["canary"]
    registry = VersionRegistry.from_configmap(find(render("raw"), "ConfigMap"))
    with pytest.raises(RolloutError, match="ScaledObject without triggers"):
        plan_canary(isvc, registry, "2", 0)


@pytest.mark.parametrize("value, current, wanted", [
    (0, 1, 1), (8, 1, 1), (8.7, 1, 1),  # within the 10% tolerance: unchanged
    (9, 1, 2), (24, 1, 3), (24, 3, 3), (26, 3, 3), (27, 3, 4), (100, 2, 4),  # capped at maxReplicas
    (2, 3, 1), (15, 3, 2)])
def test_the_replica_count_is_the_hpas(value, current, wanted):
    assert kserve_standin.hpa_replicas(value, deploy.SCALE_TARGET, current, 1, deploy.MAX_REPLICAS) == wanted


# -- real servers and a real Prometheus ----------------------------------------------------------

STABLE_PODS = ("cube3d-predictor-7c9d8b6f5-x2k7q", "cube3d-predictor-7c9d8b6f5-h8m4p")
CANARY_POD = "cube3d-v2-predictor-6b5c4d8f9-q7w2z"  # scraped too: the query must leave it out
STEPS = (2, 24, 2)
RESOLUTION = 4


def start_servers(tmp_path: Path, servers: list, n: int = 2) -> None:
    """n real servers of the demo model, appended to `servers` as made (the caller stops them)."""
    from cubeserve.server.local_triton import LocalTriton, copy_model_repository, ensure_demo_weights, free_port

    for i in range(n):
        repo = copy_model_repository(tmp_path / f"models-{i}", {"dtype": "float32"})
        ensure_demo_weights(repo)
        servers.append(LocalTriton(repo, free_port(), free_port(), free_port(), log_path=tmp_path / f"server-{i}.log"))
    for s in servers:
        s.start()


class Load:
    """Closed-loop clients over the servers (a client sticks to one, as a connection to a Service
    does), `clients` of them until changed; a refused request (busy, draining) is sent again to
    another server, as the Service would once the endpoint is gone. Every outcome counted."""

    def __init__(self, servers: list):
        self.servers, self.clients, self.lock = servers, 0, threading.Lock()
        self.ok, self.refused, self.lost, self.threads, self.stopped = 0, 0, [], [], threading.Event()
        self.in_flight = 0  # requests sent and not answered yet
        self.excluded: set[int] = set()  # servers being drained: no new client picks them

    def set_clients(self, n: int) -> None:
        self.clients = n
        while len(self.threads) < n:
            t = threading.Thread(target=self._client, args=(len(self.threads),), daemon=True)
            self.threads.append(t)
            t.start()

    def _client(self, index: int) -> None:
        from cube3d_client import Cube3DClient

        rng = random.Random(index)
        clients = {}
        try:
            while not self.stopped.is_set():
                if index >= self.clients:
                    time.sleep(0.05)
                    continue
                choices = [i for i in range(len(self.servers)) if i not in self.excluded] or [0]
                server = choices[index % len(choices)]
                client = clients.get(server) or clients.setdefault(
                    server, Cube3DClient(self.servers[server].http_url, "http", retries=0, timeout=120))
                with self.lock:
                    self.in_flight += 1
                try:
                    client.generate("a small ball", seed=rng.randrange(1 << 30), resolution=RESOLUTION)
                    with self.lock:
                        self.ok += 1
                except Exception as exc:  # noqa: BLE001 - counted
                    with self.lock:
                        if getattr(exc, "retryable", False):
                            self.refused += 1
                        else:
                            self.lost.append(f"{type(exc).__name__}: {exc}")
                    time.sleep(0.05)
                finally:
                    with self.lock:
                        self.in_flight -= 1
        finally:
            for c in clients.values():
                c.close()

    def settle(self, timeout: float = 180.0) -> None:
        """Until exactly `clients` requests are out: the clients of a step down have had their last
        answers (however slow the machine), those of a step up have sent their first."""
        deadline = time.monotonic() + timeout
        while self.in_flight != self.clients:
            assert time.monotonic() < deadline, f"{self.in_flight} requests out, {self.clients} clients"
            time.sleep(0.1)

    def stop(self) -> None:
        self.stopped.set()
        for t in self.threads:
            t.join(timeout=150)


@pytest.mark.scale
def test_the_keda_query_follows_a_stepped_load_and_a_drained_replica_loses_nothing(tmp_path):
    """Two real servers scraped by a real Prometheus (with the pod labels a PodMonitor gives them,
    and one of them scraped a second time as a canary's pod) under 2 -> 24 -> 2 clients: at each
    step the manifests' exact query, evaluated by that Prometheus, is the clients' concurrency,
    and the replica count KEDA's HPA computes from it (target SCALE_TARGET, 10% tolerance) goes
    1 -> 3 -> 1, as does Knative's on the same concurrency. Then one replica is removed as a scale-down removes a pod (the preStop drain the
    manifests run, then SIGTERM) while the clients keep sending: no request is lost."""
    from prometheus_server import PrometheusServer

    servers = []
    try:
        start_servers(tmp_path, servers)
        targets = [f"127.0.0.1:{s.metrics_port}" for s in servers]
        prometheus = PrometheusServer(tmp_path / "prometheus", targets)
        static = [{"targets": [t], "labels": {"namespace": "models", "pod": pod}} for t, pod in zip(targets, STABLE_PODS)]
        static.append({"targets": [targets[1]], "labels": {"namespace": "models", "pod": CANARY_POD}})
        config = json.loads(prometheus.config.read_text())
        config["scrape_configs"] = [{"job_name": "cube3d", "honor_labels": True, "static_configs": static}]
        prometheus.config.write_text(json.dumps(config))
        query = deploy.concurrency_query("cube3d")
        knative_target = kserve_standin.knative_target(*kserve_standin.knative_autoscaling(
            "v0.20.0", find(render("canary"), "InferenceService")))
        with prometheus:  # starts it (and stops it by its PID)
            assert prometheus.wait_for(f"count({query.removeprefix('sum(').removesuffix(')')})", 60), "no series scraped"
            load = Load(servers)
            replicas, seen = 1, []
            try:
                for clients in STEPS:
                    load.set_clients(clients)
                    load.settle()
                    time.sleep(3)  # two scrapes of the servers' gauges since
                    values = []
                    for _ in range(8):
                        (sample,) = prometheus.query(query)
                        values.append(float(sample["value"][1]))
                        time.sleep(1)
                    value = statistics.median(values)
                    replicas = kserve_standin.hpa_replicas(value, deploy.SCALE_TARGET, replicas, 1, deploy.MAX_REPLICAS)
                    # Knative (Serverless) on the same concurrency: ceil(observed / its effective target)
                    pods = math.ceil(value / knative_target)
                    seen.append((clients, value, replicas, min(max(pods, 1), deploy.MAX_REPLICAS)))
                # One replica removed under load, as a scale-down removes a pod: the drain first.
                load.set_clients(8)
                time.sleep(3)
                load.excluded.add(1)  # the endpoint goes away: new requests go to the other pod
                hook = subprocess.run([sys.executable, *deploy.drain_command(servers[1].triton_http_port,
                                                                             servers[1].metrics_port,
                                                                             timeout=120, settle=2)[1:]],
                                      capture_output=True, text=True, timeout=180)
                assert hook.returncode == 0, hook.stdout + hook.stderr
                servers[1].stop()
                time.sleep(3)
            finally:
                load.stop()
        assert [(c, r) for c, _, r, _ in seen] == [(2, 1), (24, 3), (2, 1)], seen
        assert [k for *_, k in seen] == [1, 3, 1], seen  # Knative's count on the same signal
        low, high, back = (v for _, v, _, _ in seen)
        # The clients' concurrency (a client between two requests is not counted), the canary
        # pod's second series of the same server left out (it would add about 12).
        assert low <= 2 and 16 < high <= 24 and back <= 2, seen
        assert load.lost == [] and load.ok > 0, load.lost[:3]
        print(f"(clients, query value, KEDA's replicas, Knative's pods): {seen}; {load.ok} answered, "
              f"{load.refused} refused and sent again")
    finally:
        for s in servers:
            s.stop()
