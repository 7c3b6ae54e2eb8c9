"""`cubeserve rollout`: the state transitions as pure functions of the objects that k8s/ renders,
the patches they make (valid objects, exactly the fields KServe documents), refusals that change
nothing, idempotency, and the command line against objects held in memory."""

from __future__ import annotations

import argparse
import copy
import io

import pytest
import yaml

from cubeserve import rollout as r
from k8s_validation import KSERVE_CRDS, crd_errors, find, load_crd_schemas, render, validate

BASE = "s3://replace-me-model-bucket/cube3d"
REGISTRY = r.Registry(BASE, ("1", "2", "3"))


def serverless() -> dict:
    isvc = find(render("canary"), "InferenceService")
    isvc["metadata"].update(namespace="models", resourceVersion="100", generation=1)
    return isvc


def raw(with_canary: bool = True) -> dict:
    isvc = find(render("raw-canary"), "InferenceService")
    isvc["metadata"].update(namespace="models", resourceVersion="200", generation=1)
    if not with_canary:
        del isvc["spec"]["canary"]
    return isvc


def graph() -> dict:
    ab = find(render("ab"), "InferenceGraph")
    ab["metadata"].update(namespace="models", resourceVersion="300")
    return ab


def apply(obj: dict, plan: r.Plan) -> dict:
    """What the API server stores after the patch, with the generation KServe's controller
    has not observed yet."""
    assert plan.changed
    assert plan.patch["metadata"]["resourceVersion"] == obj["metadata"]["resourceVersion"]
    after = r.merge_patch(obj, plan.patch)
    after["metadata"]["resourceVersion"] = str(int(obj["metadata"]["resourceVersion"]) + 1)
    after["metadata"]["generation"] = obj["metadata"].get("generation", 1) + 1
    return after


def reconciled(isvc: dict, ready: bool = True) -> dict:
    """The status KServe writes once it caught up with the spec: a new revision (Serverless) or
    the canary deployment (RawDeployment), ready or not."""
    isvc = copy.deepcopy(isvc)
    generation = isvc["metadata"]["generation"]
    status = {"observedGeneration": generation}
    if r.deployment_mode(isvc) == r.SERVERLESS:
        created = f"cube3d-predictor-{generation:05d}"
        status["components"] = {"predictor": {
            "latestCreatedRevision": created,
            "latestReadyRevision": created if ready else f"cube3d-predictor-{generation - 1:05d}"}}
    else:
        status["canaryStatuses"] = [{"name": c["predictor"]["name"], "ready": ready, "trafficPercent": c["trafficPercent"]}
                                    for c in isvc["spec"].get("canary", [])]
    isvc["status"] = status
    return isvc


def leaves(patch: dict, prefix: str = "") -> set[str]:
    """The paths a merge patch sets or removes."""
    paths = set()
    for key, value in patch.items():
        path = f"{prefix}.{key}" if prefix else key
        paths |= leaves(value, path) if isinstance(value, dict) and value else {path}
    return paths


@pytest.fixture(scope="module")
def crd_schemas():
    return load_crd_schemas(KSERVE_CRDS) if KSERVE_CRDS.is_dir() else None


def assert_valid(obj: dict, crd_schemas) -> None:
    assert validate(obj) == []
    if crd_schemas is not None:
        assert crd_errors(obj, crd_schemas) == []


# -- Serverless: canaryTrafficPercent ----------------------------------------------------------------

def test_serverless_canary_promote(crd_schemas):
    isvc = serverless()
    plan = r.plan_canary(isvc, REGISTRY, "2", 10)
    # KServe's documented canary: a new storageUri and canaryTrafficPercent; the stable version
    # goes into the annotation in the same patch (one new revision either way).
    assert leaves(plan.patch) == {"metadata.resourceVersion", f"metadata.annotations.{r.STABLE_ANNOTATION}",
                                  "spec.predictor.canaryTrafficPercent", "spec.predictor.model.storageUri"}
    assert plan.patch["spec"]["predictor"] == {"canaryTrafficPercent": 10, "model": {"storageUri": f"{BASE}/2/"}}
    assert plan.changes == (f"spec.predictor.model.storageUri: {BASE}/1/ -> {BASE}/2/",)  # 10% and "1" were there
    canary = apply(isvc, plan)
    assert_valid(canary, crd_schemas)
    state = r.rollout_state(canary, REGISTRY)
    assert (state.phase, state.stable, state.canary, state.percent) == ("canary", "1", "2", 10)

    # More traffic to the same canary: only the percentage (no new revision).
    plan = r.plan_canary(reconciled(canary), REGISTRY, "2", 50)
    assert leaves(plan.patch) == {"metadata.resourceVersion", "spec.predictor.canaryTrafficPercent"}
    assert plan.changes == ("spec.predictor.canaryTrafficPercent: 10 -> 50",)
    canary = apply(reconciled(canary), plan)
    assert not r.plan_canary(canary, REGISTRY, "2", 50).changed  # idempotent

    # Promote: remove canaryTrafficPercent, once the canary's revision is ready.
    with pytest.raises(r.NotReady):
        r.plan_promote(canary, REGISTRY)  # KServe has not caught up with the last patch
    with pytest.raises(r.NotReady):
        r.plan_promote(reconciled(canary, ready=False), REGISTRY)
    plan = r.plan_promote(reconciled(canary), REGISTRY)
    assert plan.patch["spec"] == {"predictor": {"canaryTrafficPercent": None}}
    assert leaves(plan.patch) == {"metadata.resourceVersion", "spec.predictor.canaryTrafficPercent"}
    promoted = apply(reconciled(canary), plan)
    assert_valid(promoted, crd_schemas)
    state = r.rollout_state(promoted, REGISTRY)
    assert (state.phase, state.stable) == ("stable", "2")
    assert not r.plan_promote(promoted, REGISTRY).changed
    assert not r.plan_rollback(promoted, REGISTRY).changed

    # The next canary starts from version 2 and would roll back to it.
    plan = r.plan_canary(promoted, REGISTRY, "3", 5)
    assert plan.patch["metadata"]["annotations"][r.STABLE_ANNOTATION] == "2"
    assert r.rollout_state(apply(promoted, plan), REGISTRY).stable_uri == f"{BASE}/2/"


def test_serverless_rollback_pins_the_old_revision_then_finishes(crd_schemas):
    canary = reconciled(apply(serverless(), r.plan_canary(serverless(), REGISTRY, "2", 25)))
    plan = r.plan_rollback(canary, REGISTRY)
    # All traffic to the last rolled-out revision at once (canaryTrafficPercent 0) while the spec
    # goes back to version 1.
    assert plan.patch["spec"] == {"predictor": {"canaryTrafficPercent": 0, "model": {"storageUri": f"{BASE}/1/"}}}
    pinned = apply(canary, plan)
    assert_valid(pinned, crd_schemas)
    assert r.rollout_state(pinned, REGISTRY).phase == "rolling-back"
    with pytest.raises(r.RolloutError, match="rollback"):
        r.plan_canary(pinned, REGISTRY, "3", 10)  # unfinished
    with pytest.raises(r.RolloutError, match="rollback"):
        r.plan_promote(reconciled(pinned), REGISTRY)
    with pytest.raises(r.NotReady):
        r.plan_rollback(reconciled(pinned, ready=False), REGISTRY)
    plan = r.plan_rollback(reconciled(pinned), REGISTRY)
    assert plan.patch["spec"] == {"predictor": {"canaryTrafficPercent": None}}
    done = apply(reconciled(pinned), plan)
    assert_valid(done, crd_schemas)
    state = r.rollout_state(done, REGISTRY)
    assert (state.phase, state.stable) == ("stable", "1")
    assert not r.plan_rollback(done, REGISTRY).changed
    # --force skips the readiness check.
    assert r.plan_rollback(reconciled(pinned, ready=False), REGISTRY, force=True).changed


def test_serverless_rollback_of_a_canary_at_100_percent_rolls_forward_to_stable():
    canary = apply(serverless(), r.plan_canary(serverless(), REGISTRY, "2", 100))
    plan = r.plan_rollback(canary, REGISTRY)
    assert plan.patch["spec"] == {"predictor": {"canaryTrafficPercent": None, "model": {"storageUri": f"{BASE}/1/"}}}
    assert r.rollout_state(apply(canary, plan), REGISTRY).stable == "1"


def test_serverless_canary_turns_on_tag_routing():
    isvc = serverless()
    del isvc["metadata"]["annotations"][r.TAG_ROUTING_ANNOTATION]
    del isvc["spec"]["predictor"]["canaryTrafficPercent"]
    plan = r.plan_canary(isvc, REGISTRY, "2", 10)
    assert plan.patch["metadata"]["annotations"][r.TAG_ROUTING_ANNOTATION] == "true"
    assert "spec.predictor.canaryTrafficPercent: (unset) -> 10" in plan.changes


# -- RawDeployment: spec.canary[] --------------------------------------------------------------------

def test_raw_canary_start_share_promote(crd_schemas):
    stable = raw(with_canary=False)
    plan = r.plan_canary(stable, REGISTRY, "2", 10)
    # One spec.canary entry, merged over the stable predictor by KServe: only the version differs.
    assert leaves(plan.patch) == {"metadata.resourceVersion", "spec.canary"}
    assert plan.patch["spec"]["canary"] == [{
        "predictor": {"name": "v2", "model": {"name": "kserve-container", "modelFormat": {"name": "triton"},
                                              "storageUri": f"{BASE}/2/"}},
        "trafficPercent": 10}]
    canary = apply(stable, plan)
    assert_valid(canary, crd_schemas)
    # The overlay k8s/overlays/raw-canary is exactly this state.
    assert canary["spec"] == raw()["spec"]

    plan = r.plan_canary(canary, REGISTRY, "2", 40)
    assert plan.changes == ("spec.canary[0].trafficPercent: 10 -> 40",)
    canary = apply(canary, plan)
    assert not r.plan_canary(canary, REGISTRY, "2", 40).changed

    with pytest.raises(r.NotReady):
        r.plan_promote(reconciled(canary, ready=False), REGISTRY)
    plan = r.plan_promote(reconciled(canary), REGISTRY)
    # The stable predictor takes the canary's version; the canary goes.
    assert plan.patch["spec"] == {"predictor": {"model": {"storageUri": f"{BASE}/2/"}}, "canary": None}
    promoted = apply(reconciled(canary), plan)
    assert_valid(promoted, crd_schemas)
    assert "canary" not in promoted["spec"]
    assert r.rollout_state(promoted, REGISTRY).stable == "2"
    assert not r.plan_promote(promoted, REGISTRY).changed


def test_raw_rollback_drops_the_canary(crd_schemas):
    plan = r.plan_rollback(raw(), REGISTRY)  # no readiness needed to go back
    assert plan.patch["spec"] == {"canary": None}
    back = apply(raw(), plan)
    assert_valid(back, crd_schemas)
    assert back["spec"]["predictor"] == raw()["spec"]["predictor"]
    assert not r.plan_rollback(back, REGISTRY).changed


def test_the_modes_come_from_status_then_annotation():
    isvc = raw()
    assert r.deployment_mode(isvc) == r.RAW
    isvc["metadata"]["annotations"][r.MODE_ANNOTATION] = "Standard"  # KServe's newer name
    assert r.deployment_mode(isvc) == r.RAW
    isvc["status"] = {"deploymentMode": "Knative"}  # what KServe resolved wins
    assert r.deployment_mode(isvc) == r.SERVERLESS
    assert r.deployment_mode(isvc, "raw") == r.RAW  # --mode
    del isvc["status"], isvc["metadata"]["annotations"][r.MODE_ANNOTATION], isvc["spec"]["canary"]
    with pytest.raises(r.RolloutError, match="deployment mode"):
        r.rollout_state(isvc, REGISTRY)
    isvc["metadata"]["annotations"][r.MODE_ANNOTATION] = "ModelMesh"
    with pytest.raises(r.RolloutError, match="not supported"):
        r.rollout_state(isvc, REGISTRY)


# -- refusals: clear errors, nothing changed ----------------------------------------------------------

@pytest.mark.parametrize("make", [serverless, raw])
@pytest.mark.parametrize("version, percent, message", [
    ("2", -1, "0 to 100"), ("2", 101, "0 to 100"), ("2", 12.5, "0 to 100"), ("2", True, "0 to 100"),
    ("2", "10", "0 to 100"), ("9", 10, "unknown version '9'"), ("V2!", 10, "invalid version"),
])
def test_bad_canary_arguments_are_refused(make, version, percent, message):
    isvc = make()
    before = copy.deepcopy(isvc)
    with pytest.raises(r.RolloutError, match=message):
        r.plan_canary(isvc, REGISTRY, version, percent)
    assert isvc == before


def test_a_rollout_while_another_is_unfinished_is_refused():
    for isvc in (raw(), apply(serverless(), r.plan_canary(serverless(), REGISTRY, "2", 10))):
        before = copy.deepcopy(isvc)
        with pytest.raises(r.RolloutError, match="canary of version 2 .* in progress"):
            r.plan_canary(isvc, REGISTRY, "3", 10)
        assert isvc == before
    with pytest.raises(r.RolloutError, match="already the stable version"):
        r.plan_canary(serverless(), REGISTRY, "1", 10)
    two = raw()
    two["spec"]["canary"].append(copy.deepcopy(two["spec"]["canary"][0]))
    with pytest.raises(r.RolloutError, match="2 canaries"):
        r.plan_promote(two, REGISTRY)


def test_services_outside_the_registry_are_refused():
    cpu = find(render("cpu"), "InferenceService")
    with pytest.raises(r.RolloutError, match="no storageUri"):
        r.plan_canary(cpu, REGISTRY, "2", 10)
    other = raw(with_canary=False)
    other["spec"]["predictor"]["model"]["storageUri"] = "gs://elsewhere/model"
    with pytest.raises(r.RolloutError, match="not a version of the registry"):
        r.plan_canary(other, REGISTRY, "2", 10)


def test_the_registry_comes_from_its_configmap():
    configmap = find(render("canary"), "ConfigMap", r.VERSIONS_CONFIGMAP)
    assert r.Registry.from_configmap(configmap) == r.Registry(BASE, ("1", "2"))
    configmap["data"]["versions"] = "1, 2,3 3\n4"
    assert r.Registry.from_configmap(configmap).versions == ("1", "2", "3", "4")
    assert REGISTRY.version_of(f"{BASE}/2/") == "2" and REGISTRY.version_of(f"{BASE}/2") == "2" and REGISTRY.version_of(f"{BASE}/9/") is None
    assert REGISTRY.version_of(f"{BASE}x/2") is None
    with pytest.raises(r.RolloutError, match="baseUri"):
        r.Registry.from_configmap({"data": {"baseUri": "bucket/cube3d", "versions": "1"}})
    with pytest.raises(r.RolloutError, match="not a valid version"):
        r.Registry.from_configmap({"data": {"baseUri": BASE, "versions": "1 v_2"}})


# -- A/B on the InferenceGraph --------------------------------------------------------------------------

def test_ab_weights(crd_schemas):
    ab = graph()
    plan = r.plan_ab(ab, r.parse_weights("A=50,B=50"))
    assert leaves(plan.patch) == {"metadata.resourceVersion", "spec.nodes.root.steps"}
    assert plan.changes == ("spec.nodes.root.steps[0].weight: 80 -> 50", "spec.nodes.root.steps[1].weight: 20 -> 50")
    after = apply(ab, plan)
    assert_valid(after, crd_schemas)
    steps = after["spec"]["nodes"]["root"]["steps"]
    assert [(s["name"], s["weight"]) for s in steps] == [("a", 50), ("b", 50)]
    assert [s["serviceUrl"] for s in steps] == [s["serviceUrl"] for s in ab["spec"]["nodes"]["root"]["steps"]]
    assert after["spec"]["nodes"]["root"]["routerType"] == "Splitter"
    assert not r.plan_ab(after, {"a": 50, "b": 50}).changed
    assert r.plan_ab(after, r.parse_weights("b=100,a=0")).changed


@pytest.mark.parametrize("weights, message", [
    ("a=80,b=30", "add up to 100"), ("a=100", "missing: b"), ("a=80,c=20", "no step named c"),
    ("a=80,b=-20", "from 0 to 100"), ("a=x,b=20", "must be an integer"), ("a=50,a=50", "twice"),
    ("a:80", "NAME=WEIGHT"),
])
def test_bad_ab_weights_are_refused(weights, message):
    ab = graph()
    before = copy.deepcopy(ab)
    with pytest.raises(r.RolloutError, match=message):
        r.plan_ab(ab, r.parse_weights(weights))
    assert ab == before


# -- merge patches --------------------------------------------------------------------------------------

def test_merge_patch_is_rfc_7386():
    assert r.merge_patch({"a": "b", "c": {"d": "e", "f": "g"}}, {"a": "z", "c": {"f": None}}) == {"a": "z", "c": {"d": "e"}}
    assert r.merge_patch({"a": [1, 2]}, {"a": [3]}) == {"a": [3]}
    assert r.merge_patch({"a": {"b": "c"}}, {"a": {"b": "d", "c": None}}) == {"a": {"b": "d"}}
    target = {"x": {"y": 1}}
    r.merge_patch(target, {"x": {"y": 2}})
    assert target == {"x": {"y": 1}}  # a copy


# -- the command line, against objects in memory ---------------------------------------------------------

class ApiException(Exception):
    """Stands for kubernetes.client.exceptions.ApiException (matched by name)."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


class FakeCluster:
    """Objects in memory; patches applied as the API server does, resourceVersion checked."""

    def __init__(self, objects: dict, ready: bool = True, ready_after_gets: int | None = None):
        self.objects, self.patches, self.namespace = objects, [], "models"
        self.ready, self.ready_after_gets, self.gets = ready, ready_after_gets, 0

    def __call__(self, namespace=None, context=None):
        return self

    def get(self, api, name):
        self.gets += 1
        obj = self.objects[(api[1], name)]
        if obj["kind"] == "InferenceService":
            ready = self.ready or (self.ready_after_gets is not None and self.gets > self.ready_after_gets)
            return reconciled(obj, ready)
        return copy.deepcopy(obj)

    def patch(self, api, name, patch):
        current = self.objects[(api[1], name)]
        if patch["metadata"]["resourceVersion"] != current["metadata"]["resourceVersion"]:
            raise ApiException(409, "Conflict")
        self.patches.append(patch)
        self.objects[(api[1], name)] = apply(current, r.Plan("", patch))
        return self.objects[(api[1], name)]

    def registry(self, name):
        return REGISTRY


def run(cluster, monkeypatch, *argv):
    monkeypatch.setattr(r, "cluster_factory", cluster)
    monkeypatch.setattr(r.time, "sleep", lambda seconds: None)
    parser = argparse.ArgumentParser(prog="cubeserve")  # as cubeserve/cli.py builds it
    r.add_rollout_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["rollout", *argv])
    out = io.StringIO()
    return args.func(args, out=out), out.getvalue()


def test_cli_canary_promote_and_status(monkeypatch, capsys):
    cluster = FakeCluster({("inferenceservices", "cube3d"): serverless()})
    code, out = run(cluster, monkeypatch, "canary", "--version", "2", "--percent", "20", "-n", "models")
    assert code == 0 and len(cluster.patches) == 1
    assert out.splitlines() == [
        "canary of version 2 at 20% (stable: version 1)",
        "  spec.predictor.canaryTrafficPercent: 10 -> 20",
        f"  spec.predictor.model.storageUri: {BASE}/1/ -> {BASE}/2/",
        "patched",
    ]
    code, out = run(cluster, monkeypatch, "canary", "--version", "2", "--percent", "20")
    assert code == 0 and len(cluster.patches) == 1 and "nothing to change" in out
    code, out = run(cluster, monkeypatch, "status")
    assert code == 0 and "canary of version 2 at 20% (stable: version 1)" in out and "versions 1 2 3" in out
    code, out = run(cluster, monkeypatch, "promote", "--dry-run")
    assert code == 0 and len(cluster.patches) == 1 and "dry run" in out
    code, out = run(cluster, monkeypatch, "promote")
    assert code == 0 and len(cluster.patches) == 2
    assert "spec.predictor.canaryTrafficPercent: 20 -> (removed)" in out
    code, out = run(cluster, monkeypatch, "promote")
    assert code == 0 and len(cluster.patches) == 2 and "nothing to promote" in out


def test_cli_refusals_change_nothing(monkeypatch, capsys):
    cluster = FakeCluster({("inferenceservices", "cube3d"): raw()})
    for argv, words in ((["canary", "--version", "3", "--percent", "10"], "in progress"),
                        (["canary", "--version", "2", "--percent", "150"], "0 to 100"),
                        (["canary", "--version", "7", "--percent", "10"], "unknown version")):
        code, out = run(cluster, monkeypatch, *argv)
        assert code == 2 and out == "" and words in capsys.readouterr().err
    assert cluster.patches == []
    with pytest.raises(SystemExit):  # argparse: not an integer
        run(cluster, monkeypatch, "canary", "--version", "2", "--percent", "ten")


def test_cli_waits_for_readiness_and_reports_conflicts(monkeypatch, capsys):
    cluster = FakeCluster({("inferenceservices", "cube3d"): raw()}, ready=False)
    code, _ = run(cluster, monkeypatch, "promote")
    assert code == 3 and "not ready" in capsys.readouterr().err and cluster.patches == []
    cluster = FakeCluster({("inferenceservices", "cube3d"): raw()}, ready=False, ready_after_gets=2)
    code, out = run(cluster, monkeypatch, "promote", "--wait", "60")
    assert code == 0 and out.startswith("waiting:") and len(cluster.patches) == 1

    cluster = FakeCluster({("inferenceservices", "cube3d"): raw()})
    stale = cluster.patch
    cluster.patch = lambda api, name, patch: stale(api, name, {**patch, "metadata": {"resourceVersion": "1"}})
    code, _ = run(cluster, monkeypatch, "rollback")
    assert code == 1 and "run it again" in capsys.readouterr().err


def test_cli_ab(monkeypatch, capsys):
    cluster = FakeCluster({("inferencegraphs", "cube3d-ab"): graph()})
    code, out = run(cluster, monkeypatch, "ab", "--weights", "A=60,B=40")
    assert code == 0 and "weights a=80,b=20 -> a=60,b=40" in out
    assert [s["weight"] for s in cluster.objects[("inferencegraphs", "cube3d-ab")]["spec"]["nodes"]["root"]["steps"]] == [60, 40]
    code, _ = run(cluster, monkeypatch, "ab", "--weights", "A=60,B=60")
    assert code == 2 and "add up to 100" in capsys.readouterr().err and len(cluster.patches) == 1


# -- the thin client over HTTP, against a stub API server on 127.0.0.1 ---------------------------------

class StubApiServer:
    """Answers the calls `Cluster` makes (GET and PATCH of a namespaced custom object or of a
    ConfigMap) from objects in memory, as the API server does for a merge patch. `on_patch(path,
    stored)` returns the object as the controller leaves it afterwards (e.g. `reconciled`)."""

    def __init__(self, objects: dict, on_patch=None):
        import http.server
        import json
        import threading

        self.objects, self.requests = objects, []
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                stub.requests.append(("GET", self.path, None, None))
                obj = stub.objects.get(self.path)
                self._send(200, obj) if obj else self._send(404, {"kind": "Status", "code": 404, "reason": "NotFound"})

            def do_PATCH(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.requests.append(("PATCH", self.path, self.headers["Content-Type"], body))
                current = stub.objects[self.path]
                if body.get("metadata", {}).get("resourceVersion") not in (None, current["metadata"]["resourceVersion"]):
                    return self._send(409, {"kind": "Status", "code": 409, "reason": "Conflict"})
                stored = apply(current, r.Plan("", body))
                stub.objects[self.path] = on_patch(self.path, stored) if on_patch else stored
                self._send(200, stub.objects[self.path])

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def kubeconfig(self, path, namespace: str = "models"):
        """A kubeconfig whose current context is this server (for KUBECONFIG)."""
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "stub",
            "clusters": [{"name": "stub", "cluster": {"server": self.url}}],
            "users": [{"name": "stub", "user": {"token": "not-a-secret"}}],
            "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "stub", "namespace": namespace}}]}))
        return path

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_cluster_client_sends_merge_patches_over_http(tmp_path, monkeypatch):
    pytest.importorskip("kubernetes")
    isvc_path = "/apis/serving.kserve.io/v1beta1/namespaces/models/inferenceservices/cube3d"
    configmap = find(render("raw-canary"), "ConfigMap")
    stub = StubApiServer({isvc_path: reconciled(raw()),
                          "/api/v1/namespaces/models/configmaps/cube3d-versions": configmap})
    try:
        monkeypatch.setenv("KUBECONFIG", str(stub.kubeconfig(tmp_path / "kubeconfig")))
        parser = argparse.ArgumentParser(prog="cubeserve")
        r.add_rollout_parser(parser.add_subparsers(dest="command", required=True))
        args = parser.parse_args(["rollout", "promote"])
        out = io.StringIO()
        assert args.func(args, out=out) == 0, out.getvalue()
        method, path, content_type, body = stub.requests[-1]
        assert (method, path, content_type) == ("PATCH", isvc_path, "application/merge-patch+json")
        assert body == {"metadata": {"resourceVersion": "200"},
                        "spec": {"predictor": {"model": {"storageUri": f"{BASE}/2/"}}, "canary": None}}
        assert "canary" not in stub.objects[isvc_path]["spec"]
    finally:
        stub.close()


def test_cubeserve_cli_has_rollout(monkeypatch):
    from cubeserve import cli

    parser = cli.build_parser()
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    if "rollout" not in subcommands:
        pytest.skip("cubeserve/cli.py does not wire `rollout` yet (add_rollout_parser)")
    cluster = FakeCluster({("inferenceservices", "cube3d"): raw()})
    monkeypatch.setattr(r, "cluster_factory", cluster)
    assert cli.main(["rollout", "rollback"]) == 0 and len(cluster.patches) == 1


def test_cli_serverless_rollback_with_wait_does_both_steps(monkeypatch):
    canary = apply(serverless(), r.plan_canary(serverless(), REGISTRY, "2", 10))
    cluster = FakeCluster({("inferenceservices", "cube3d"): canary}, ready=False, ready_after_gets=3)
    code, out = run(cluster, monkeypatch, "rollback", "--wait", "600")
    assert code == 0 and len(cluster.patches) == 2, out
    assert "waiting:" in out and "finish the rollback" in out
    final = cluster.objects[("inferenceservices", "cube3d")]
    assert "canaryTrafficPercent" not in final["spec"]["predictor"]
    assert r.rollout_state(final, REGISTRY).stable == "1"
    # Without --wait, the first call pins and the second (once ready) finishes.
    cluster = FakeCluster({("inferenceservices", "cube3d"): canary})
    assert run(cluster, monkeypatch, "rollback")[0] == 0 and len(cluster.patches) == 1
    assert run(cluster, monkeypatch, "rollback")[0] == 0 and len(cluster.patches) == 2
    code, out = run(cluster, monkeypatch, "rollback")
    assert code == 0 and len(cluster.patches) == 2 and "nothing to roll back" in out
