"""The checkpoint pipeline as a Kubeflow cluster runs it (kfp_pipelines/run_local.py's LocalCluster):
the compiled YAML, every step a pod with its own empty folder (kfp_pipelines/pod_runner.py), an S3
server (rclone) holding checkpoints, versions and artifacts, the MLflow server of k8s/mlflow over
HTTP, and a tritonserver with explicit model control as the roll-out's local target.

The runs of one module share that cluster, in order: the first checkpoint becomes version 1 and
champion; the same checkpoint again does nothing; another stops at the gate against the champion;
bad input of every kind fails with a message naming it, with the champion serving throughout; a
run that fails after registering takes its challenger out, and running it again resumes the
roll-out. Then the KServe target against the cluster stand-in of the rollout tests, and the
compiled pipeline's settings (image, caching, retries, resources, GPU, secrets, descriptions).
"""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cubeserve import storage
from cubeserve.checkpoint import GPT_FILE, write_random_weights
from cubeserve.pipeline import serving, steps
from cubeserve.registry import CHALLENGER, CHAMPION, open_registry
from cubeserve.serving.stubs import python_stubs
from prometheus_server import require_prometheus
from serving_helpers import wait_until
from kfp_pipelines import checkpoint_rollout as pipeline_module
from kfp_pipelines.compile import compile_to
from kfp_pipelines.pod_runner import FAILED, SUCCEEDED, load_pipeline
from kfp_pipelines.run_local import MODEL_STORE, LocalCluster

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # The soak alone decides by default here (no analysis windows: each costs a minute of
    # traffic); the runs that test the promotion gate pass GATE.
    require_prometheus()  # the cluster's Prometheus: installed, or skipped (failed under CI)
    with LocalCluster(tmp_path_factory.mktemp("cluster"), defaults={"analysis_windows": 0}) as c:
        yield c


# The promotion gate for the tests: short stages, and ratio limits for a shared 2-core machine
# (p95s of a few dozen requests of two equal models differ by up to 2.5x there).
GATE = {"analysis_windows": 2, "analysis_window_seconds": 10.0, "shadow_share": 0.5, "shadow_seconds": 10.0,
        "canary_percent": 50, "analysis_thresholds": {"min_requests": 5, "max_p95_ratio": 3.0,
                                                      "max_time_per_token_ratio": 3.0}}


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return write_random_weights("tiny", tmp_path_factory.mktemp("good"), seed=0)


@pytest.fixture(scope="module")
def first_run(cluster, good):
    """The module's first run (version 1, champion), with what it left (`after`): the tests after
    it in the file, in any order (tests/conftest.py, CUBESERVE_TEST_ORDER), add versions."""
    result = cluster.run(str(good))
    result.after = state(cluster)
    result.after["stubs"] = set(python_stubs(cluster.server.tritonserver_pid()).values())
    return result


def registry(cluster):
    return open_registry(cluster.mlflow.uri, "cube3d")


def state(cluster) -> dict:
    """What a run may change: the registry's versions (with their aliases), the object store's
    versions, and what the server serves."""
    return {"versions": [(v.version, v.aliases) for v in registry(cluster).versions()],
            "store": set(steps.store_versions(MODEL_STORE)), "served": serving.served_versions(cluster.triton_url)}


def steps_in(result, state: str) -> set[str]:
    return {path.rsplit("/", 1)[-1] for path, t in result.tasks.items() if t.state == state}


def assert_champion_serving(cluster, version: str):
    reg = registry(cluster)
    champion = reg.by_alias(CHAMPION)
    assert champion is not None and champion.version == version
    assert reg.by_alias(CHALLENGER) is None
    assert serving.served_versions(cluster.triton_url) == [champion.triton_version]


def test_first_checkpoint_is_packaged_registered_served_and_champion(cluster, first_run, good):
    assert first_run.state == SUCCEEDED, first_run.error
    # The oldest supported backend hands the exit handler RUNNING for this successful run; the
    # handler goes by what the run recorded.
    assert first_run.task("exit-handler-1").mlmd_state == "RUNNING"
    assert first_run.task("finish").outputs["Output"].startswith("succeeded (roll_out: promoted")
    assert {"validate", "evaluate-2", "gate", "package", "register", "roll-out", "finish"} <= steps_in(first_run, SUCCEEDED)
    assert not first_run.ran("evaluate")  # the GPU branch: device is cpu
    checked = first_run.task("validate").outputs
    assert checked["action"] == "new"
    assert first_run.after["versions"] == [("1", (CHAMPION,))]
    v = registry(cluster).get("1")
    # Lineage: the object-store URI of version 1 as the source, in the pipeline run's MLflow run.
    assert v.source == f"{MODEL_STORE}/1/" and v.run_id == checked["mlflow_run_id"]
    assert v.tags["sha256"] == checked["validation"]["sha256"] and v.tags["triton_version"] == "1"
    assert v.tags["pipeline_run_id"] == first_run.run_id and v.tags["rollout.decision"] == "promoted"
    assert v.tags["source_uri"].startswith("s3://cube-serve/checkpoints/")
    run = registry(cluster).get_run(v.run_id)
    assert run.pipeline_run_id == first_run.run_id and run.status == "FINISHED"
    assert run.metrics["valid_share"] == 1.0 and run.params["action"] == "new"
    assert "data:image/png;base64," in registry(cluster).read_artifact_text(v.run_id, "evaluation.html")
    # Version 1 in the layout KServe reads, with its manifest beside it; the HTML report in the
    # pipeline root, as the launcher uploads it.
    assert first_run.after["store"] == {1}
    assert storage.exists(f"{MODEL_STORE}/1/cube3d_stream/1/weights/{GPT_FILE}")
    assert storage.exists(f"{MODEL_STORE}/1/cube3d/1/model.py")
    report = first_run.task("evaluate-2").artifacts["report"]
    assert report.startswith("s3://cube-serve/pipeline-root/") and "data:image/png" in storage.read_text(report)
    assert first_run.after["served"] == [1]
    # Its engine process is known as cube3d_stream version 1 although Triton runs it from the
    # temporary folder of the load request (the predict model's watchdog relies on this).
    assert ("cube3d_stream", "1") in first_run.after["stubs"]


def test_same_checkpoint_again_does_nothing(cluster, first_run, good):
    before = state(cluster)
    again = cluster.run(str(good))
    assert again.state == SUCCEEDED, again.error
    assert again.task("validate").outputs["action"] == "done"
    assert again.task("finish").outputs["Output"].startswith("succeeded (validate: already version 1")
    assert not again.ran("package") and not again.ran("roll-out") and again.ran("finish")
    assert state(cluster) == before
    assert_champion_serving(cluster, registry(cluster).by_alias(CHAMPION).version)


def test_another_checkpoint_is_compared_with_the_champion_and_stopped_at_the_gate(cluster, first_run, tmp_path):
    other = write_random_weights("tiny", tmp_path / "other", seed=1)
    before = state(cluster)
    result = cluster.run(str(other), min_token_agreement=0.99)
    assert result.state == FAILED and "token_agreement" in result.task("gate").error
    metrics = result.task("evaluate-2").outputs["Output"]
    assert 0.0 <= metrics["token_agreement"] < 0.99  # measured against the champion's weights
    assert not result.ran("package") and result.task("finish").state == SUCCEEDED
    assert state(cluster) == before


def test_the_same_checkpoint_quantized_is_a_version_of_its_own_held_to_its_parent(cluster, first_run, good):
    """Version 1's files with quantization int8 are not "done": they are another served version,
    evaluated quantized against the unquantized checkpoint, here stopped by the numerics gate."""
    before = state(cluster)
    result = cluster.run(str(good), quantization="int8", min_numerics_agreement=1.01)
    assert result.task("validate").outputs["action"] == "new"
    assert result.task("validate").outputs["validation"]["quantization"] == "int8"
    assert result.state == FAILED and "numerics_agreement" in result.task("gate").error
    metrics = result.task("evaluate-2").outputs["Output"]
    assert 0.0 <= metrics["numerics_agreement"] <= 1.0 and metrics["numerics_kl"] >= 0.0
    assert not result.ran("package") and result.task("finish").state == SUCCEEDED
    assert state(cluster) == before


@pytest.mark.parametrize("case", ["bad uri", "no secret", "wrong key", "registry unreachable", "bad device"])
def test_bad_input_fails_naming_it_and_the_champion_keeps_serving(cluster, first_run, good, case):
    params, secrets, expect = {}, None, ""
    if case == "bad uri":
        params["checkpoint"] = "s3://cube-serve/checkpoints/no-such-run/"
        expect = "s3://cube-serve/checkpoints/no-such-run/"
    elif case == "no secret":
        # The pod starts (the Secret is optional) and the first step names what is missing, at
        # once: a pod waiting for the Secret would hold the run for its deadline, per retry.
        secrets, expect = {"cube-serve-s3": None}, "create the Secret cube-serve-s3 in the run's namespace"
    elif case == "wrong key":
        secrets = {"cube-serve-s3": {**cluster.store.env(), "AWS_SECRET_ACCESS_KEY": "not-the-key"}}
        expect = "AWS_SECRET_ACCESS_KEY"
    elif case == "registry unreachable":
        params["registry_uri"], expect = "http://127.0.0.1:9", "http://127.0.0.1:9"
    else:
        params["device"], expect = "gpu", "device must be one of cpu, cuda, got 'gpu'"
    before = state(cluster)
    result = cluster.run(params.pop("checkpoint", str(good)), secrets=secrets, **params)
    assert result.state == FAILED and result.task("validate").state == FAILED
    assert expect in result.task("validate").error, result.task("validate").error
    assert result.task("validate").launched  # failed by its own check, not held by the kubelet
    assert not result.ran("evaluate-2") and not result.ran("package")
    assert state(cluster) == before
    assert_champion_serving(cluster, registry(cluster).by_alias(CHAMPION).version)


def test_a_run_failing_after_register_clears_its_challenger_and_a_rerun_resumes(cluster, first_run, tmp_path):
    other = write_random_weights("tiny", tmp_path / "resumed", seed=4)
    champion, before = registry(cluster).by_alias(CHAMPION), state(cluster)
    # The roll-out cannot reach its server: the step fails after a new version was registered.
    broken = cluster.run(str(other), triton_url="127.0.0.1:9")
    assert broken.state == FAILED and broken.task("register").state == SUCCEEDED
    assert broken.task("roll-out").state == FAILED and broken.task("finish").state == SUCCEEDED
    v2 = registry(cluster).versions()[-1]
    assert v2.version not in [v for v, _ in before["versions"]]
    assert v2.tags["rollout.decision"] == "failed"
    # Judged by what the run recorded (no last step finished), whatever state the backend passed.
    assert v2.tags["rollout.reason"].startswith(f"pipeline run {broken.run_id} ended before its last step finished")
    assert registry(cluster).get_run(v2.run_id).status == "FAILED"
    assert_champion_serving(cluster, champion.version)  # the exit handler cleared the challenger
    # The same checkpoint again resumes the roll-out of that version (no second package or
    # version), through the promotion gate this time: shadow, canary, two analysis windows
    # against the champion.
    resumed = cluster.run(str(other), **GATE)
    assert resumed.state == SUCCEEDED, resumed.error
    assert resumed.task("validate").outputs["action"] == "resume" and resumed.task("validate").outputs["version"] == v2.version
    assert not resumed.ran("package") and resumed.ran("roll-out-2")
    decision = resumed.task("roll-out-2").outputs["Output"]
    assert decision["decision"] == "promoted", decision
    assert decision["reason"] == f"2 analysis windows of 10 s passed; replaced version {champion.triton_version}"
    analysis = json.loads(registry(cluster).get(v2.version).tags["rollout.analysis"])
    assert [w["stage"] for w in analysis] == ["shadow", "analysis 1", "analysis 2"]
    assert [w["result"] for w in analysis][1:] == ["pass", "pass"]
    for window in analysis[1:]:  # the figures of both arms, from the server's metrics via Prometheus
        assert window["candidate"]["version"] == v2.tags["triton_version"]
        assert window["baseline"]["version"] == str(champion.triton_version)
        assert window["candidate"]["requests"] >= 5 and window["candidate"]["error_rate"] == 0
        assert window["candidate"]["empty_mesh_rate"] == 0 and window["baseline"]["p95_seconds"] > 0
    assert [v for v, _ in state(cluster)["versions"]] == [v for v, _ in before["versions"]] + [v2.version]
    assert state(cluster)["store"] == before["store"] | {int(v2.tags["triton_version"])}
    assert_champion_serving(cluster, v2.version)


def test_a_canary_that_fails_its_soak_on_its_own_is_rolled_back(cluster, first_run, tmp_path):
    """Version 3 packaged for GPU instances cannot load on the CPU-only local server: the canary
    fails by itself (nothing forced), is unloaded, and the champion keeps serving."""
    champion = registry(cluster).by_alias(CHAMPION).version
    weights = write_random_weights("tiny", tmp_path / "gpu-only", seed=3)
    result = cluster.run(str(weights), instance_kind="gpu")
    assert result.state == SUCCEEDED, result.error  # a rollback is a decision, not a failure
    decision = result.task("roll-out").outputs["Output"]
    assert decision["decision"] == "rolled_back" and "failed to load" in decision["reason"]
    new = registry(cluster).versions()[-1]
    assert new.tags["rollout.decision"] == "rolled_back" and CHAMPION not in new.aliases
    assert_champion_serving(cluster, champion)


def test_a_candidate_that_fails_the_analysis_is_rolled_back_automatically(cluster, first_run, tmp_path):
    """A checkpoint whose every mesh is empty, let through the evaluation gate and the soak
    (min_valid_share 0, no soak requests): its shadow's figures in Prometheus fail the gate, and
    the roll-out rolls it back by itself with the figures on the version."""
    from test_analyze import empty_mesh_checkpoint

    champion = registry(cluster).by_alias(CHAMPION)
    hollow = empty_mesh_checkpoint(write_random_weights("tiny", tmp_path / "source", seed=6), tmp_path / "hollow")
    result = cluster.run(str(hollow), min_valid_share=0.0, soak_requests=0, **GATE)
    assert result.state == SUCCEEDED, result.error  # a rollback is a decision, not a failure
    decision = result.task("roll-out").outputs["Output"]
    new = registry(cluster).versions()[-1]
    assert decision["decision"] == "rolled_back", decision
    # The shadow stage finds it (when its random share of copies reached min_requests, else the
    # first canary window does); no window passes it.
    assert re.match(rf"(shadow of version {new.tags['triton_version']}|analysis window 1 of 2) failed: fail: ",
                    decision["reason"]), decision["reason"]
    assert "empty-mesh rate 1 > 0.05" in decision["reason"]
    assert decision["reason"].endswith(f"serving version {champion.triton_version} again")
    windows = json.loads(new.tags["rollout.analysis"])
    assert windows[-1]["stage"] in ("shadow", "analysis 1") and windows[-1]["result"] == "fail"
    assert "pass" not in [w["result"] for w in windows]
    assert windows[-1]["candidate"]["empty_mesh_rate"] == 1.0 and windows[-1]["baseline"]["empty_mesh_rate"] == 0.0
    assert new.tags["rollout.decision"] == "rolled_back" and CHAMPION not in new.aliases
    assert_champion_serving(cluster, champion.version)


# -- the KServe target, against the cluster stand-in of tests/test_rollout.py -------------------------
# Serverless (the canary overlay), where KServe splits traffic between revisions: a raw canary
# gets no traffic from KServe v0.20 (docs/deploy/rollouts.md), so no analysis window would see it. The stand-in
# API server refuses (403) what the pipeline's Role (k8s/pipeline) does not allow, as RBAC does.

def pipeline_role_rules() -> list[dict]:
    from test_rollout import rollout_role_rules

    return rollout_role_rules()


def candidate_version(cluster):
    """A registered version other than the champion: the newest of the module's earlier runs, or,
    when this test runs alone, one registered here as `register` would (the stand-in cluster
    never reads the store)."""
    reg = registry(cluster)
    champion = reg.by_alias(CHAMPION)
    found = next((v for v in reversed(reg.versions()) if v.version != champion.version), None)
    if found is None:
        n = max(v.triton_version for v in reg.versions()) + 1
        found = reg.create(f"{MODEL_STORE}/{n}/", {"sha256": f"{n:064d}", "triton_version": str(n),
                                                   "model_store": MODEL_STORE})
    return found


# What only the other deployment mode reads (a Serverless run lists no ReplicaSets).
RAW_ONLY_RESOURCES = {"replicasets"}


def assert_only_what_the_role_allows(stub, every_rule: bool = False):
    """Every request the steps made was allowed by the Role, but the preflight's optional reads;
    with every_rule, each rule of the Role but the RawDeployment-only ones (these Serverless runs
    do not need them; tests/test_rollout.py runs a raw roll-out under the same Role) was needed by
    some request."""
    from k8s_validation import rbac_allows
    from test_rollout import OPTIONAL_PREFLIGHT_READS

    refused = {attrs[:4] for attrs, allowed in stub.authorized if not allowed}
    assert refused <= OPTIONAL_PREFLIGHT_READS, refused
    if every_rule:
        used = [attrs for attrs, allowed in stub.authorized if allowed]
        for rule in stub.rules:
            if set(rule["resources"]) <= RAW_ONLY_RESOURCES:
                continue
            assert any(rbac_allows([rule], *attrs[:4]) for attrs in used), f"an unused permission: {rule}"


def test_kserve_target_records_the_version_and_rolls_back_a_canary_that_never_becomes_ready(
        cluster, first_run, tmp_path, monkeypatch):
    from test_rollout import ISVC_PATH, VERSIONS_PATH, StubApiServer, World, overlay_isvc

    isvc_path, cm_path = ISVC_PATH, VERSIONS_PATH
    isvc = overlay_isvc("canary")
    isvc["spec"]["predictor"]["model"]["storageUri"] = f"{MODEL_STORE}/1/"
    # The API server and KServe's controller as tests/kserve_standin.py models them (v0.20.0);
    # the canary's revision never becomes ready here.
    stub = StubApiServer(World(isvc=isvc), rules=pipeline_role_rules())
    stub.objects[cm_path]["data"] = {"baseUri": MODEL_STORE, "versions": "1"}
    try:
        monkeypatch.setenv("KUBECONFIG", str(stub.kubeconfig(tmp_path / "kubeconfig")))
        reg = registry(cluster)
        candidate = candidate_version(cluster)
        # The package step lists the version where `cubeserve rollout` reads versions.
        assert serving.record_version("models", candidate.triton_version, MODEL_STORE).startswith("versions: 1 ")
        # Its own key (the manifests own `versions`), under its own field manager.
        data = stub.objects[cm_path]["data"]
        assert data["versions"] == "1" and data["packaged"] == str(candidate.triton_version)
        (patch,) = [q for m, p, _, _, q in stub.requests if m == "PATCH" and p == cm_path]
        assert patch["fieldManager"] == ["cubeserve-rollout"]
        assert "listed already" in serving.record_version("models", candidate.triton_version, MODEL_STORE)
        with pytest.raises(ValueError, match="baseUri is s3://cube-serve/models/cube3d, but the pipeline's "
                                             "model_store is s3://elsewhere/models"):
            serving.record_version("models", candidate.triton_version, "s3://elsewhere/models")
        champion = reg.by_alias(CHAMPION).version
        import threading

        outcome = {}
        step = threading.Thread(target=lambda: outcome.update(serving.roll_out(
            "kserve", cluster.mlflow.uri, "cube3d", candidate.version, 10, 0, 0.0, ["a cup"], namespace="models",
            isvc="cube3d")))
        step.start()
        # The rollback's first patch pins the traffic to version 1's revision and reverts the
        # spec; KServe makes a new revision of version 1, whose pods start (the canary's never do).
        wait_until(lambda: len(stub.patches(isvc_path)) >= 2, 300, "the rollback's first patch")
        stub.world.kserve.start_pods(stub.world.isvc["status"]["components"]["predictor"]["latestCreatedRevision"])
        step.join(300)
        assert not step.is_alive(), "the roll-out step did not finish its rollback"
        result = outcome
        assert result["decision"] == "rolled_back" and "not ready" in result["reason"]
        patches = stub.patches(isvc_path)
        assert patches[0]["spec"]["predictor"]["model"]["storageUri"] == f"{MODEL_STORE}/{candidate.triton_version}/"
        assert patches[0]["spec"]["predictor"]["canaryTrafficPercent"] == 10
        # Rolled back to the end, as `cubeserve rollout rollback --wait` does (not left at 0 %
        # with two revisions routed): pin, then drop the split once version 1's revision is ready.
        assert [p["spec"]["predictor"]["canaryTrafficPercent"] for p in patches[1:]] == [0, None]
        predictor = stub.world.isvc["spec"]["predictor"]
        assert "canaryTrafficPercent" not in predictor and predictor["model"]["storageUri"] == f"{MODEL_STORE}/1/"
        assert reg.by_alias(CHAMPION).version == champion and reg.by_alias(CHALLENGER) is None
        assert_only_what_the_role_allows(stub, every_rule=True)
    finally:
        stub.close()


def test_kserve_target_rolls_back_a_ready_canary_that_fails_the_analysis(cluster, first_run, tmp_path, monkeypatch):
    """The canary becomes ready, then its analysis window, queried by version label from a real
    Prometheus (scraping a synthetic exporter of the servers' series, tests/test_analyze.py),
    finds a third of its requests failing: the step rolls it back through the Rollout object."""
    import threading
    import time

    from prometheus_server import PrometheusServer
    from test_analyze import SyntheticServer
    from test_rollout import ISVC_PATH, VERSIONS_PATH, StubApiServer, World, overlay_isvc

    from cubeserve.serving import metrics as m

    reg = registry(cluster)
    champion = reg.by_alias(CHAMPION)
    candidate = candidate_version(cluster)
    isvc = overlay_isvc("canary")
    isvc["spec"]["predictor"]["model"]["storageUri"] = f"{MODEL_STORE}/{champion.triton_version}/"
    stub = StubApiServer(World(isvc=isvc), rules=pipeline_role_rules())
    stub.objects[VERSIONS_PATH]["data"] = {"baseUri": MODEL_STORE,
                                           "versions": f"{champion.triton_version} {candidate.triton_version}"}
    exporter = SyntheticServer()
    prometheus = PrometheusServer(tmp_path / "prometheus", [exporter.target]).start()
    try:
        monkeypatch.setenv("KUBECONFIG", str(stub.kubeconfig(tmp_path / "kubeconfig")))
        gate = serving.Gate(prometheus.url, windows=1, window_seconds=4.0, thresholds={"min_requests": 5})
        outcome = {}
        step = threading.Thread(target=lambda: outcome.update(serving.roll_out(
            "kserve", cluster.mlflow.uri, "cube3d", candidate.version, 10, 0, 2.0, ["a cup"], namespace="models",
            isvc="cube3d", gate=gate)))
        step.start()
        wait_until(lambda: stub.patches(ISVC_PATH), 300, "the canary patch")  # patched in: its pods start
        stub.world.kserve.start_pods()
        i, deadline = 0, time.monotonic() + 900
        while step.is_alive():  # the users' traffic: the canary fails one request in three
            assert time.monotonic() < deadline, "the roll-out step did not end within 900 s"
            stub.world.kserve.start_pods()  # the rollback's reverted revision too
            exporter.request(str(champion.triton_version), m.OK, 0.8, 0.01)
            exporter.request(str(candidate.triton_version), m.FAILED if i % 3 == 0 else m.OK, 0.8, 0.01)
            i += 1
            time.sleep(0.05)
        step.join()
        assert outcome["decision"] == "rolled_back", outcome
        assert outcome["reason"].startswith(f"canary of version {candidate.triton_version} at 10%: analysis window "
                                            f"1 of 1 failed: fail: ") and "error rate 0.3" in outcome["reason"]
        (window,) = outcome["analysis"]
        assert window["baseline"]["version"] == str(champion.triton_version) and window["baseline"]["error_rate"] == 0
        # Rolled back to the end: the split dropped once the champion's new revision was ready.
        predictor = stub.world.isvc["spec"]["predictor"]
        assert "canaryTrafficPercent" not in predictor
        assert predictor["model"]["storageUri"] == f"{MODEL_STORE}/{champion.triton_version}/"
        assert_only_what_the_role_allows(stub)
        assert json.loads(reg.get(candidate.version).tags["rollout.analysis"])[0]["result"] == "fail"
        assert reg.by_alias(CHAMPION).version == champion.version and reg.by_alias(CHALLENGER) is None
    finally:
        prometheus.stop()
        exporter.stop()
        stub.close()


@pytest.mark.parametrize("settings, message", [
    (dict(windows=101), "analysis_windows must be from 0 to 100, got 101"),
    (dict(window_seconds=0.5), "analysis_window_seconds must be from 1 to 5400, got 0.5"),
    (dict(shadow_share=1.5), "shadow_share must be from 0 to 1, got 1.5"),
    (dict(thresholds={"max_error_rate": 2}), "max_error_rate: must be a number in [0, 1], got 2"),
    (dict(thresholds={"max_errors": 0.1}), "analysis_thresholds: unknown ['max_errors']"),
    (dict(windows=20, window_seconds=300), "must be at most 5400 (the roll-out step's deadline is 7200 s), got 6000"),
    (dict(canary_percent=0), "canary_percent must be from 1 to 99 with analysis windows, got 0"),
    (dict(prometheus_url=""), "prometheus_url is required with analysis_windows 1"),
])
def test_bad_gate_settings_are_refused_before_anything_changes(settings, message):
    percent = settings.pop("canary_percent", 10)
    gate = serving.Gate(**{"prometheus_url": "http://127.0.0.1:9", "windows": 1, **settings})
    with pytest.raises(ValueError) as refused:  # before the registry (unreachable here) is opened
        serving.roll_out("local", "http://127.0.0.1:9", "cube3d", "2", percent, 0, 0.0, ["a cup"], gate=gate)
    assert message in str(refused.value)


def test_an_unreachable_local_server_fails_the_roll_out_naming_the_url_and_the_cause(monkeypatch):
    """target=local with a wrong triton_url: the rollback (which ran first into the same refused
    connection) raised a bare ConnectionRefusedError, and the cause was lost."""
    from types import SimpleNamespace

    from cubeserve import deploy
    from cubeserve.server.local_triton import free_port

    monkeypatch.setenv(deploy.ADMIN_KEY_ENV, deploy.new_admin_key())
    url = f"127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(RuntimeError) as failed:
        serving.serve_versions(url, "s3://models", [])
    assert f"tritonserver at {url} cannot be reached (ConnectionRefusedError" in str(failed.value)
    with pytest.raises(RuntimeError) as failed:
        serving._local(SimpleNamespace(triton_version=2), SimpleNamespace(triton_version=1), url, "s3://models",
                       ["a cup"], 1, 0.0, False, 10, serving.Gate(), [])
    message = str(failed.value)
    assert message.startswith(f"rolling back on {url} after: canary of version 2 failed to load: tritonserver at "
                              f"{url} cannot be reached"), message
    assert "the rollback failed too: tritonserver at" in message


# -- the compiled pipeline ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    path = compile_to("ghcr.io/example/cube-serve:1.2.3", tmp_path_factory.mktemp("compiled") / "p.yaml")
    return load_pipeline(path)


def all_tasks(spec):
    for comp in [spec["root"], *spec["components"].values()]:
        for name, task in ((comp.get("dag") or {}).get("tasks") or {}).items():
            yield name, task, spec["components"][task["componentRef"]["name"]]


def test_the_image_is_required_and_never_a_placeholder():
    for bad in ("", "registry.example.com/cube-serve:0.1.0"):
        with pytest.raises(ValueError, match="image must name the cube-serve runtime image"):
            pipeline_module.build(bad)
    out = subprocess.run([sys.executable, "-m", "kfp_pipelines.compile"], capture_output=True, text=True)
    assert out.returncode == 2 and "--image" in out.stderr


def test_every_step_runs_the_image_with_nothing_to_install(compiled):
    spec, _ = compiled
    for name, executor in spec["deploymentSpec"]["executors"].items():
        container = executor["container"]
        assert container["image"] == "ghcr.io/example/cube-serve:1.2.3", name
        command = " ".join(container["command"])
        assert "pip install" not in command and "kfp.dsl.executor_main" in command, name


def test_caching_retries_resources_gpu_and_secrets(compiled):
    spec, platform = compiled
    retried = {"validate": 2, "evaluate": 2, "gate": 0, "package": 2, "register": 2, "roll-out": 0, "finish": 2}
    executors = spec["deploymentSpec"]["executors"]
    secret_uses = platform["deploymentSpec"]["executors"]
    seen = set()
    for name, task, comp in all_tasks(spec):
        if "executorLabel" not in comp:
            continue
        step = comp["executorLabel"].removeprefix("exec-").rstrip("-0123456789") or name
        seen.add(step)
        assert task["cachingOptions"].get("enableCache") is not True, name  # caching off everywhere
        assert int((task.get("retryPolicy") or {}).get("maxRetryCount", 0)) == retried[step], name
        resources = executors[comp["executorLabel"]]["container"]["resources"]
        assert resources["resourceCpuRequest"] and resources["resourceMemoryRequest"], name
        platform_executor = secret_uses[comp["executorLabel"]]
        assert int(platform_executor["activeDeadlineSeconds"]) > 0, name  # a stuck pod fails the run
        uses = {u["secretName"]: u for u in platform_executor["secretAsEnv"]}
        # No pod can be held by a missing Secret (validate checks the credentials instead).
        assert all(u.get("optional") for u in uses.values()), name
        assert {k["envVar"] for k in uses["cube-serve-s3"]["keyToEnv"]} == set(pipeline_module.S3_SECRET_KEYS)
    assert seen == set(retried)
    # The evaluation on the "cuda" branch asks for one GPU; the CPU branch asks for none.
    gpu = [executors[c["executorLabel"]]["container"]["resources"].get("accelerator")
           for _, _, c in all_tasks(spec) if c.get("executorLabel", "").startswith("exec-evaluate")]
    assert sorted(map(str, gpu)) == sorted(["None", str({"count": "1", "resourceCount": "1",
                                                         "resourceType": "nvidia.com/gpu", "type": "nvidia.com/gpu"})])
    # ... and only it can be given tolerations and a node selector (GPU nodes are often tainted;
    # an unschedulable pod never reaches its deadline), from the run's parameters.
    scheduled = {label: (e.get("tolerations"), e.get("nodeSelector")) for label, e in secret_uses.items()
                 if e.get("tolerations") or e.get("nodeSelector")}
    (gpu_label,) = [c["executorLabel"] for _, _, c in all_tasks(spec) if c.get("executorLabel", "").startswith(
        "exec-evaluate") and executors[c["executorLabel"]]["container"]["resources"].get("accelerator")]
    assert scheduled == {gpu_label: (
        [{"tolerationJson": {"componentInputParameter": "pipelinechannel--gpu_tolerations"}}],
        {"nodeSelectorJson": {"componentInputParameter": "pipelinechannel--gpu_node_selector"}})}
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert params["gpu_tolerations"]["defaultValue"] == [] and params["gpu_node_selector"]["defaultValue"] == {}


def test_every_pipeline_parameter_is_described(compiled):
    spec, _ = compiled
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert {"checkpoint", "model_store", "registry_uri", "instance_kind", "device", "target"} <= set(params)
    for name, definition in params.items():
        assert len(definition.get("description", "")) > 10, name


def test_every_step_has_typed_inputs_and_outputs():
    import typing

    for func in pipeline_module.STEPS:
        hints = typing.get_type_hints(func)
        for name in inspect.signature(func).parameters:
            assert name in hints, f"{func.__name__}: input {name} has no type"
        assert "return" in hints and hints["return"] is not None, f"{func.__name__}: untyped output"


def test_nothing_is_packaged_registered_or_rolled_out_before_the_gate_passes(compiled):
    # A cluster runs a component's tasks side by side unless a task names another in
    # dependentTasks (the local pod runner happens to run them in order): package must wait for
    # the gate (`.after(passed)`, it takes none of the gate's outputs), and what follows package
    # waits through it.
    spec, _ = compiled
    (dag,) = [c["dag"]["tasks"] for c in [spec["root"], *spec["components"].values()]
              if "gate" in ((c.get("dag") or {}).get("tasks") or {})]

    def upstream(name: str) -> set[str]:
        seen, todo = set(), list(dag[name].get("dependentTasks", []))
        while todo:
            task = todo.pop()
            if task not in seen:
                seen.add(task)
                todo.extend(dag[task].get("dependentTasks", []))
        return seen

    assert "gate" in dag["package"].get("dependentTasks", []), dag["package"].get("dependentTasks")
    for step in ("package", "register", "roll-out"):
        assert "gate" in upstream(step), (step, upstream(step))


def test_the_local_report_names_the_steps_and_counts_whole_requests():
    """`make pipeline`'s final report (run_local.main): the steps that ran by the pipeline's names,
    not the KFP paths (exit-handler-1/condition-branches-2/...) nor the numbered copies of a step
    in another branch; the failed step named so in the error; request counts whole."""
    from kfp_pipelines.pod_runner import TaskResult
    from kfp_pipelines.run_local import step_error, steps, whole_requests

    tasks = {path: TaskResult(path, state, attempts=attempts) for path, state, attempts in [
        ("exit-handler-1", "SUCCEEDED", 0),
        ("exit-handler-1/validate", "SUCCEEDED", 1),
        ("exit-handler-1/condition-branches-2/condition-6/condition-branches-3/condition-5/evaluate-2", "SUCCEEDED", 2),
        ("exit-handler-1/condition-branches-2/condition-6/condition-branches-3/condition-4/evaluate", "SKIPPED", 0),
        ("exit-handler-1/condition-branches-2/condition-6/gate", "FAILED", 1),
        ("exit-handler-1/condition-branches-2/condition-7/roll-out-2", "SKIPPED", 0),
        ("finish", "SUCCEEDED", 1)]}
    assert steps(tasks) == {"validate": "SUCCEEDED", "evaluate": "SUCCEEDED", "gate": "FAILED", "finish": "SUCCEEDED"}
    assert step_error("exit-handler-1/condition-branches-2/condition-6/gate: exit code 1: GateFailed: x < 0.9") \
        == "gate: exit code 1: GateFailed: x < 0.9"
    assert step_error("") == ""
    windows = [{"stage": "analysis 1", "candidate": {"version": "2", "requests": 20.57143},
                "baseline": {"version": "1", "requests": 19.4}}, {"stage": "shadow", "candidate": None}]
    assert [w["candidate"] and w["candidate"]["requests"] for w in whole_requests(windows)] == [21, None]
    assert windows[0]["baseline"]["requests"] == 19 and whole_requests(None) is None
