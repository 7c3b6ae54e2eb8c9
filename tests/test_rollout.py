"""`cubeserve rollout` against stand-ins for the API server and KServe's controller
(tests/kserve_standin.py, which cites the KServe, Knative and Kubernetes source it follows):
readiness and traffic read from the status KServe writes, promote without a restart, rollbacks
that never send all the traffic to the version being rolled back, drift reported as drift, one
writer per field, the preflight against each KServe release's CRDs, and the command line, in
memory and over HTTP with the real `kubernetes` client."""

from __future__ import annotations

import argparse
import copy
import io
import json
import re
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
import yaml

from cubeserve import rollout as r
from cubeserve.rollout import cli, plans
from cubeserve.rollout.preflight import ClusterFacts, check
from k8s_validation import (EXCLUDED_KSERVE, GATEWAY_API_RELEASES, KSERVE_RELEASES, ApiHandler, crd_errors, find,
                            gateway_api_errors, kserve_crd, kserve_version, render, require_crds, require_releases,
                            supported_releases, validate)
from kserve_standin import ApiError, KServeController, ObjectStore

BASE = "s3://replace-me-model-bucket/cube3d"
REGISTRY = r.VersionRegistry(BASE, ("1", "2", "3"))



# The KServe releases tests/kserve_standin.py models (each step of its per-release behaviour), and
# those the manifests support (k8s_validation.EXCLUDED_KSERVE, docs/deploy/compatibility.md): the rollout tests run on each.
MODELLED_KSERVE = ("v0.14.0", "v0.15.0", "v0.15.1", "v0.16.0", "v0.17.0", "v0.19.0", "v0.20.0")
SUPPORTED_MODELLED = tuple(release for release in MODELLED_KSERVE if release not in EXCLUDED_KSERVE)
per_release = pytest.mark.parametrize("release", SUPPORTED_MODELLED)


def crd_release(release: str) -> str:
    """The newest release at or before `release` whose CRDs are in tests/data/kserve: the fields
    the tool writes (spec.canary, spec.predictor.name, both from v0.20.0) are the same in between."""
    return max((r for r in KSERVE_RELEASES if kserve_version(r) <= kserve_version(release)), key=kserve_version)
# Serverless canaries on every release; RawDeployment canaries (spec.canary) from v0.20.0.
SERVERLESS_AND_RAW_CANARIES = [("canary", release) for release in SUPPORTED_MODELLED] + [("raw-canary", "v0.20.0")]


def overlay_isvc(overlay: str) -> dict:
    isvc = find(render(overlay), "InferenceService")
    isvc["metadata"]["namespace"] = "models"
    return isvc


class World:
    """One InferenceService: the API server's copy (created by `kubectl apply --server-side` of
    an overlay) and KServe's controller, with the first revision or Deployment ready."""

    def __init__(self, overlay: str = "canary", isvc: dict | None = None, release: str = "v0.20.0"):
        self.overlay = overlay_isvc(overlay) if isvc is None else isvc
        self.store = ObjectStore(self.overlay, manager="kubectl", operation="Apply")
        self.kserve = KServeController(self.store, release)
        self.kserve.reconcile()
        self.kserve.start_pods()

    @property
    def isvc(self) -> dict:
        return self.store.get()

    def revisions(self):
        """What the pods serve, as `Cluster.revisions` / `Cluster.replica_sets` read it."""
        if self.kserve.raw():
            return r.replica_sets_of(self.kserve.replica_set_objects())
        return self.kserve.revision_uris()

    def state(self) -> r.RolloutState:
        return r.rollout_state(self.isvc, REGISTRY, self.revisions())

    def plan(self, action: str, *args, **kwargs) -> r.Plan:
        planner = {"canary": r.plan_canary, "promote": r.plan_promote, "rollback": r.plan_rollback}[action]
        return planner(self.isvc, REGISTRY, *args, revisions=self.revisions(), **kwargs)

    def send(self, plan: r.Plan, reconcile: bool = True) -> dict:
        """The patch as `Cluster.patch` sends it; KServe reconciles (unless it lags)."""
        assert plan.changed
        self.store.update(plan.patch, r.FIELD_MANAGER)
        if reconcile:
            self.kserve.reconcile()
        return self.isvc

    def do(self, action: str, *args, **kwargs) -> r.Plan:
        plan = self.plan(action, *args, **kwargs)
        self.send(plan)
        return plan


def leaves(patch: dict, prefix: str = "") -> set[str]:
    """The paths a merge patch sets or removes."""
    paths = set()
    for key, value in patch.items():
        path = f"{prefix}.{key}" if prefix else key
        paths |= leaves(value, path) if isinstance(value, dict) and value else {path}
    return paths


def assert_valid(isvc: dict, releases: tuple[str, ...] | None = None) -> None:
    """Valid for the `kserve` package's API and for the CRDs of every supported release (default)."""
    assert validate(isvc) == []
    require_releases()  # every supported release is in tests/data/kserve
    for release in releases or supported_releases():
        assert crd_errors(isvc, require_crds(release)) == [], release


# -- Serverless: canaryTrafficPercent --------------------------------------------------------------

@per_release
def test_serverless_canary_share_and_promote_without_a_restart(release):
    world = World("canary", release=release)
    assert world.state().phase == "stable" and world.state().stable == "1"
    assert world.kserve.serving() == [(f"{BASE}/1/", 100)]

    plan = world.plan("canary", "2", 10)
    assert leaves(plan.patch) == {"metadata.resourceVersion", "spec.predictor.canaryTrafficPercent",
                                  "spec.predictor.model.storageUri"}
    assert plan.changes == ("spec.predictor.canaryTrafficPercent: (unset) -> 10",
                            f"spec.predictor.model.storageUri: {BASE}/1/ -> {BASE}/2/")
    world.send(plan)
    assert_valid(world.isvc)
    state = world.state()
    assert (state.phase, state.stable, state.canary, state.percent, state.ready) == ("canary", "1", "2", 10, False)
    # Knative routes the canary's share to the latest *ready* revision: still version 1.
    assert world.kserve.serving() == [(f"{BASE}/1/", 10), (f"{BASE}/1/", 90)]
    with pytest.raises(r.NotReady):
        world.plan("promote")

    world.kserve.start_pods()
    state = world.state()
    assert state.ready and [(t.version, t.percent, t.tag) for t in state.traffic] == [("2", 10, "latest"), ("1", 90, "prev")]
    starts = len(world.kserve.model_starts)

    plan = world.do("canary", "2", 50)  # more traffic: the percentage only, no new revision
    assert plan.changes == ("spec.predictor.canaryTrafficPercent: 10 -> 50",)
    assert not world.plan("canary", "2", 50).changed  # idempotent

    plan = world.do("promote")
    assert plan.patch["spec"] == {"predictor": {"canaryTrafficPercent": None}}
    assert world.kserve.serving() == [(f"{BASE}/2/", 100)]
    assert len(world.kserve.model_starts) == starts  # a route change: nothing restarted
    state = world.state()
    assert (state.phase, state.stable, state.drift) == ("stable", "2", ())
    assert not world.plan("promote").changed and not world.plan("rollback").changed

    # The next canary rolls back to version 2, the revision KServe rolled out last.
    world.do("canary", "3", 5)
    assert world.state().stable_uri == f"{BASE}/2/"


@per_release
def test_a_status_that_lags_the_spec_is_not_taken_for_the_new_revision(release):
    world = World("canary", release=release)
    world.kserve.start_pods()
    world.send(world.plan("canary", "2", 10), reconcile=False)  # KServe has not seen the patch yet
    state = world.state()
    assert (state.phase, state.canary, state.ready) == ("canary", "2", None)
    with pytest.raises(r.NotReady, match="not been made by KServe yet"):
        world.plan("promote")
    assert world.plan("promote", force=True).changed  # --force skips the check


@per_release
def test_serverless_rollback_with_wait_never_gives_the_canary_all_the_traffic(release, monkeypatch):
    world = World("canary", release=release)
    world.do("canary", "2", 25)
    world.kserve.start_pods()
    # The Knative Service's generation (which KServe reports as status.observedGeneration) runs
    # ahead of the InferenceService's whenever KServe re-renders it: make the two equal right
    # after the rollback's first patch, so a check of generation == observedGeneration would take
    # the stale status (latest created = latest ready = the version-2 revision) for the reverted
    # revision, and finish the rollback by sending 100% to version 2.
    while world.isvc["status"]["observedGeneration"] < world.isvc["metadata"]["generation"] + 1:
        world.kserve.bump_ksvc()
    cluster = FakeCluster(world, release=release, lag_gets=2, pods_after_gets=5)
    code, out = run(cluster, monkeypatch, "rollback", "--wait", "600")
    assert code == 0, out
    assert cluster.lagged_generations_matched  # the trap was set
    assert [p["spec"]["predictor"] for p in cluster.patches] == [
        {"canaryTrafficPercent": 0, "model": {"storageUri": f"{BASE}/1/"}}, {"canaryTrafficPercent": None}]
    assert "waiting:" in out and "finish the rollback" in out
    assert all((f"{BASE}/2/", 100) not in served for served in world.kserve.traffic_history[-8:])
    assert world.kserve.serving() == [(f"{BASE}/1/", 100)]
    assert (world.state().phase, world.state().stable) == ("stable", "1")
    # Without --wait: the first call pins, a second (once ready) finishes, a third has nothing to do.
    world = World("canary", release=release)
    world.do("canary", "2", 25)
    world.kserve.start_pods()
    cluster = FakeCluster(world, release=release)
    assert run(cluster, monkeypatch, "rollback")[0] == 0 and len(cluster.patches) == 1
    assert world.state().phase == "rolling-back"
    assert run(cluster, monkeypatch, "rollback")[0] == 3  # the reverted revision is not ready
    world.kserve.start_pods()
    assert run(cluster, monkeypatch, "rollback")[0] == 0 and len(cluster.patches) == 2
    code, out = run(cluster, monkeypatch, "rollback")
    assert code == 0 and len(cluster.patches) == 2 and "nothing to roll back" in out


@per_release
def test_serverless_rollback_of_a_canary_at_100_percent_rolls_forward_to_stable(release):
    world = World("canary", release=release)
    world.do("canary", "2", 100)
    world.kserve.start_pods()
    # KServe counts a revision with 100% as rolled out; the stable version is the one before.
    assert world.isvc["status"]["components"]["predictor"]["latestRolledoutRevision"].endswith("00002")
    state = world.state()
    assert (state.phase, state.stable, state.canary, state.percent) == ("canary", "1", "2", 100)
    plan = world.do("rollback")
    assert plan.patch["spec"] == {"predictor": {"canaryTrafficPercent": None, "model": {"storageUri": f"{BASE}/1/"}}}
    state = world.state()
    assert (state.phase, state.drift) == ("updating", ())  # written by cubeserve rollout: no drift
    assert world.kserve.serving() == [(f"{BASE}/2/", 100)]  # until version 1's new revision is ready
    world.kserve.start_pods()
    assert world.kserve.serving() == [(f"{BASE}/1/", 100)]
    assert (world.state().phase, world.state().stable) == ("stable", "1")


@per_release
def test_serverless_canary_turns_on_tag_routing(release):
    isvc = overlay_isvc("canary")
    del isvc["metadata"]["annotations"][plans.TAG_ROUTING_ANNOTATION]
    world = World(isvc=isvc, release=release)
    plan = world.do("canary", "2", 10)
    assert plan.patch["metadata"]["annotations"][plans.TAG_ROUTING_ANNOTATION] == "true"
    world.kserve.start_pods()
    assert [t.tag for t in world.state().traffic] == ["latest", "prev"]


# -- one writer per field: an overlay applied again after a promote ---------------------------------

@per_release
def test_applying_the_overlay_server_side_after_a_promote_moves_no_traffic(release):
    world = World("canary", release=release)
    world.do("canary", "2", 10)
    world.kserve.start_pods()
    world.do("promote")
    before = world.isvc
    # `kubectl apply --server-side -k k8s/overlays/canary` (field manager kubectl): the overlay
    # still says version 1, a field cubeserve-rollout wrote last: the API server refuses.
    with pytest.raises(ApiError) as refused:
        world.store.apply(world.overlay, manager="kubectl")
    assert refused.value.status == 409
    assert 'conflict with "cubeserve-rollout": .spec.predictor.model.storageUri' in refused.value.message
    assert world.isvc == before and world.kserve.serving() == [(f"{BASE}/2/", 100)]
    # With the overlay's storageUri at the serving version, other changes apply (shared field).
    updated = copy.deepcopy(world.overlay)
    updated["spec"]["predictor"]["model"]["storageUri"] = f"{BASE}/2/"
    updated["spec"]["predictor"]["model"]["resources"]["limits"]["cpu"] = "12"
    world.store.apply(updated, manager="kubectl")
    world.kserve.reconcile()
    assert world.isvc["spec"]["predictor"]["model"]["resources"]["limits"]["cpu"] == "12"
    assert world.state().stable == "2" and world.state().drift == ()


@per_release
def test_applying_the_overlay_client_side_after_a_promote_is_reported_as_drift(release, monkeypatch):
    world = World("canary", release=release)
    world.do("canary", "2", 10)
    world.kserve.start_pods()
    world.do("promote")
    # Plain `kubectl apply -k` (client-side): kubectl's three-way merge sets every field whose
    # value in the overlay differs from the live object (k8s.io/kubectl pkg/cmd/apply, patcher.go:
    # jsonmergepatch.CreateThreeWayJSONMergePatch), as an update by kubectl-client-side-apply.
    world.store.update({"spec": {"predictor": {"model": {"storageUri": f"{BASE}/1/"}}}}, "kubectl-client-side-apply")
    world.kserve.reconcile()
    state = world.state()
    assert state.phase == "updating" and state.phase != "stable"
    assert len(state.drift) == 1 and "kubectl-client-side-apply" in state.drift[0] and "without a canary" in state.drift[0]
    with pytest.raises(r.RolloutError, match="kubectl-client-side-apply"):
        world.plan("canary", "3", 10)
    code, out = run(FakeCluster(world, release=release), monkeypatch, "status")
    assert code == cli.DRIFT and "DRIFT: spec.predictor.model.storageUri was changed by kubectl-client-side-apply" in out


@per_release
def test_applying_the_overlay_client_side_during_a_canary_is_reported_as_drift(release, monkeypatch):
    """The overlay re-applied client-side while a canary of version 2 runs writes version 1's
    storageUri back (the overlay never sets canaryTrafficPercent, so the share stays): KServe
    now splits 10 % between two revisions of version 1. Reported as drift in this phase too, so
    that promote refuses instead of answering "nothing to promote"."""
    world = World("canary", release=release)
    world.do("canary", "2", 10)
    world.kserve.start_pods()
    world.store.update({"spec": {"predictor": {"model": {"storageUri": f"{BASE}/1/"}}}}, "kubectl-client-side-apply")
    world.kserve.reconcile()
    world.kserve.start_pods()
    state = world.state()
    assert len(state.drift) == 1 and "changed by kubectl-client-side-apply while cubeserve rollout's canary share " \
        "(10%) was set" in state.drift[0], state
    for action in ("promote", "canary"):
        with pytest.raises(r.RolloutError, match="kubectl-client-side-apply"):
            world.plan(action, *(("3", 10) if action == "canary" else ()))
    code, out = run(FakeCluster(world, release=release), monkeypatch, "status")
    assert code == cli.DRIFT and "DRIFT: spec.predictor.model.storageUri was changed by kubectl-client-side-apply" in out
    # A rollback is still allowed: it writes storageUri and the share again (ours once more).
    world.do("rollback", force=True)
    assert world.state().drift == ()


# -- what each KServe release reports (tests/kserve_standin.py, per release) ---------------------------

def _edit_storage_uri(world: World, version: str, manager: str = "kubectl-edit") -> None:
    """`kubectl edit` (or a script's merge patch) of the stable storageUri; KServe reconciles."""
    world.store.update({"spec": {"predictor": {"model": {"storageUri": f"{BASE}/{version}/"}}}}, manager)
    world.kserve.reconcile()


@per_release
def test_raw_storage_uri_edited_before_the_first_promote_is_drift(release, monkeypatch):
    """RawDeployment, nothing promoted yet (no predictor name): an edit of storageUri rolls the
    Deployment to another version without a canary. KServe's raw status names no URI, so the
    tool reads the Deployment's ReplicaSets: the old pod serves version 1 until the new one is
    available, and that is reported as drift, as the same edit is in Serverless."""
    world = World("raw-canary", release=release)
    assert (world.state().phase, world.state().drift) == ("stable", ())
    _edit_storage_uri(world, "2")
    assert world.kserve.serving() == [(f"{BASE}/1/", 100)]  # the old pod, until the new one is available
    state = world.state()
    assert (state.phase, state.stable, state.canary, state.ready) == ("updating", "1", "2", False)
    assert len(state.drift) == 1 and "changed by kubectl-edit, not by cubeserve rollout: version 2 replaces " \
        "version 1 on the pods of cube3d-predictor without a canary" in state.drift[0]
    assert [(t.version, t.percent) for t in state.traffic] == [("1", 100)]
    with pytest.raises(r.RolloutError, match="kubectl-edit"):
        world.plan("canary", "3", 0)
    code, out = run(FakeCluster(world, release=release), monkeypatch, "status")
    assert code == cli.DRIFT and "DRIFT: spec.predictor.model.storageUri was changed by kubectl-edit" in out
    assert "updating: version 2 takes all the traffic once ready (now: version 1)" in out
    # The edit undone before the new pod came up: the Deployment takes its first ReplicaSet back
    # (a new revision number, the same pod): nothing restarts, nothing to report.
    starts = len(world.kserve.model_starts)
    _edit_storage_uri(world, "1")
    assert len(world.kserve.model_starts) == starts
    revisions = {rs.uri: rs.revision for rs in world.revisions()}
    assert revisions == {f"{BASE}/1/": 3, f"{BASE}/2/": 2}
    assert (world.state().phase, world.state().stable, world.state().drift) == ("stable", "1", ())
    # Edited again and left to finish: once the new pod serves, version 2 is what runs.
    _edit_storage_uri(world, "2")
    world.kserve.start_pods()
    assert world.kserve.serving() == [(f"{BASE}/2/", 100)]
    assert (world.state().phase, world.state().stable, world.state().drift) == ("stable", "2", ())


@per_release
def test_raw_readiness_and_a_stalled_roll_as_each_release_reports_them(release):
    """PredictorReady during a rolling update and after the progress deadline, as each release's
    PropagateRawStatus derives it from the Deployment's conditions: before v0.16.0 Available alone
    (True: the old pod serves; a stalled roll is never reported); v0.16.0-v0.19.x Unknown while
    Progressing says ReplicaSetUpdated; v0.20.0 True while Available is. From v0.16.0 a roll past
    its deadline is PredictorReady False (ProgressDeadlineExceeded), which the tool reports."""
    from cubeserve.rollout.state import condition_of

    world = World("raw-canary", release=release)
    assert condition_of(world.isvc, "PredictorReady")["status"] == "True" and world.state().ready
    _edit_storage_uri(world, "2")
    during = "Unknown" if kserve_version("v0.16.0") <= kserve_version(release) < kserve_version("v0.20.0") else "True"
    assert condition_of(world.isvc, "PredictorReady")["status"] == during
    if kserve_version(release) < kserve_version("v0.15.0"):  # v0.14.x: the Deployment's revision number
        assert world.isvc["status"]["components"]["predictor"]["latestCreatedRevision"] == "2"
    world.kserve.fail_pods("cube3d-predictor")
    state = world.state()
    if kserve_version(release) >= kserve_version("v0.16.0"):
        ready = condition_of(world.isvc, "PredictorReady")
        assert (ready["status"], ready["reason"]) == ("False", "ProgressDeadlineExceeded")
        assert state.failure.startswith("ProgressDeadlineExceeded: ReplicaSet \"cube3d-predictor-")
    else:
        assert condition_of(world.isvc, "PredictorReady")["status"] == "True" and state.failure is None
    assert world.kserve.serving() == [(f"{BASE}/1/", 100)]  # the old pod still serves either way


@per_release
def test_a_failed_canary_revision_is_reported_not_waited_for(release, monkeypatch, capsys):
    """Knative marks a revision whose pods never become ready failed (ConfigurationsReady False,
    RevisionFailed); KServe copies it as PredictorConfigurationReady. `promote --wait` refuses at
    once with KServe's message instead of waiting out its time, and the rollback still works."""
    world = World("canary", release=release)
    world.do("canary", "2", 10)
    world.kserve.fail_pods("cube3d-predictor-00002")
    state = world.state()
    assert state.ready is False and state.failure.startswith(
        'RevisionFailed: Revision "cube3d-predictor-00002" failed with message: ')
    assert world.kserve.serving() == [(f"{BASE}/1/", 10), (f"{BASE}/1/", 90)]  # version 1 serves all of it
    with pytest.raises(r.RolloutError, match="KServe reports a failure: RevisionFailed") as refused:
        world.plan("promote")
    assert not isinstance(refused.value, r.NotReady)
    cluster = FakeCluster(world, release=release)
    code, _ = run(cluster, monkeypatch, "promote", "--wait", "600")
    assert code == cli.REFUSED and "KServe reports a failure" in capsys.readouterr().err and cluster.gets <= 2
    code, out = run(cluster, monkeypatch, "status")
    assert "FAILED: RevisionFailed: Revision \"cube3d-predictor-00002\" failed" in out
    code, out = run(cluster, monkeypatch, "rollback")  # pinned to version 1; its new revision starts
    assert code == 0 and cluster.patches[-1]["spec"]["predictor"]["canaryTrafficPercent"] == 0
    world.kserve.start_pods()
    assert run(cluster, monkeypatch, "rollback")[0] == 0
    assert (world.state().phase, world.state().stable, world.state().failure) == ("stable", "1", None)


@per_release
def test_annotations_kserve_keeps_off_the_template_make_no_new_revision(release):
    """ServiceAnnotationDisallowedList at each release: kubectl's last-applied-configuration
    (written by every client-side apply) never reaches a revision, so it restarts nothing;
    `modelFormat` does until v0.17.0; any other annotation makes a new revision."""
    world = World("canary", release=release)
    starts = len(world.kserve.model_starts)

    def annotate(key: str) -> int:
        world.store.update({"metadata": {"annotations": {key: f"changed {len(world.kserve.model_starts)}"}}},
                           "kubectl-client-side-apply")
        world.kserve.reconcile()
        return len(world.kserve.model_starts)

    assert annotate("kubectl.kubernetes.io/last-applied-configuration") == starts
    assert annotate("modelFormat") == starts + (kserve_version(release) < kserve_version("v0.17.0"))
    assert annotate("example.com/owner") == starts + 1 + (kserve_version(release) < kserve_version("v0.17.0"))


# -- RawDeployment: spec.canary[] (KServe v0.20) ---------------------------------------------------------

def test_raw_canary_and_promote_without_a_restart():
    world = World("raw-canary")
    assert (world.state().phase, world.state().stable, world.state().ready) == ("stable", "1", True)
    plan = world.plan("canary", "2", 0)
    assert leaves(plan.patch) == {"metadata.resourceVersion", "spec.canary"}
    assert plan.patch["spec"]["canary"] == [{
        "predictor": {"name": "v2", "model": {"name": "kserve-container", "modelFormat": {"name": "triton"},
                                              "storageUri": f"{BASE}/2/"}},
        "trafficPercent": 0}]
    world.send(plan)
    assert_valid(world.isvc, releases=("v0.20.0",))
    assert set(world.kserve.deployments) == {"cube3d-predictor", "cube3d-v2-predictor"}
    with pytest.raises(r.NotReady):
        world.plan("promote")
    world.kserve.start_pods("cube3d-v2-predictor")
    isvc = world.isvc
    # KServe reports the stable Deployment's observedGeneration: it never catches up with the
    # InferenceService's generation after a canary, so readiness cannot be read from it.
    assert isvc["status"]["observedGeneration"] != isvc["metadata"]["generation"]
    assert world.state().ready
    starts = list(world.kserve.model_starts)

    plan = world.do("promote")
    assert plan.patch["spec"] == {"predictor": {"name": "v2", "model": {"storageUri": f"{BASE}/2/"}}, "canary": None}
    assert_valid(world.isvc, releases=("v0.20.0",))
    assert world.kserve.model_starts == starts  # the canary's Deployment is now the stable one
    assert world.kserve.deleted == ["cube3d-predictor"]
    assert world.kserve.serving() == [(f"{BASE}/2/", 100)]
    state = world.state()
    assert (state.phase, state.stable, state.ready, state.drift) == ("stable", "2", True, ())

    world.do("canary", "3", 0)
    world.kserve.start_pods()
    world.do("promote")
    assert world.isvc["spec"]["predictor"]["name"] == "v3" and world.kserve.deleted[-1] == "cube3d-v2-predictor"
    assert world.kserve.model_starts == [*starts, "cube3d-v3-predictor"]


def test_raw_share_and_rollback():
    world = World("raw-canary")
    world.do("canary", "2", 10)
    plan = world.do("canary", "2", 40)
    assert plan.changes == ("spec.canary[0].trafficPercent: 10 -> 40",)
    assert not world.plan("canary", "2", 40).changed
    plan = world.do("rollback")  # no readiness needed to go back
    assert plan.patch["spec"] == {"canary": None}
    assert world.kserve.deleted == ["cube3d-v2-predictor"] and world.isvc["spec"]["predictor"] == world.overlay["spec"]["predictor"]
    assert world.state().phase == "stable" and not world.plan("rollback").changed


def test_raw_status_shows_the_canary_gets_no_traffic(monkeypatch):
    """KServe v0.20.0 copies trafficPercent into canaryStatuses but routes nothing to a raw
    canary (tests/kserve_standin.py, predictor.go canaryReplicaCount): status says so instead of
    printing a 90/10 split nobody routes."""
    world = World("raw-canary")
    world.do("canary", "2", 10)
    assert world.isvc["status"]["canaryStatuses"][0]["trafficPercent"] == 10  # what KServe writes
    state = world.state()
    assert [(t.target, t.percent, t.version) for t in state.traffic] == [("predictor", 100, "1"), ("v2", 0, "2")]
    code, out = run(FakeCluster(world), monkeypatch, "status")
    assert "traffic 100%  predictor  version 1" in out
    assert "traffic   0%  v2  version 2  dark launch, no traffic (trafficPercent 10 sizes its replicas only)" in out
    assert "90%" not in out


def test_raw_overlay_applied_client_side_after_a_promote_is_drift():
    world = World("raw-canary")
    world.do("canary", "2", 0)
    world.kserve.start_pods()
    world.do("promote")
    world.store.update({"spec": {"predictor": {"model": {"storageUri": f"{BASE}/1/"}}}}, "kubectl-client-side-apply")
    state = world.state()
    assert state.drift and "the stable predictor v2 has the storageUri of version 1" in state.drift[0]
    with pytest.raises(r.RolloutError, match="kubectl-client-side-apply"):
        world.plan("canary", "3", 0)


def test_raw_canary_and_promote_pass_the_v0_20_webhooks():
    """KServe v0.20.0's defaulter rewrites the overlay's "RawDeployment" to "Standard", and its
    validating webhook then admits a canary only in that mode (validateCanarySpecs) and a new
    predictor name only with a new storageUri (validatePredictorNameChange): the tool's canary
    and promote pass both; the stand-in refuses what KServe refuses."""
    world = World("raw-canary")
    assert world.isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "Standard"
    world.do("canary", "2", 10)
    world.kserve.start_pods()
    world.do("promote")
    assert world.isvc["spec"]["predictor"]["name"] == "v2"
    with pytest.raises(ApiError, match="predictor.name change requires a model change"):
        world.store.update({"spec": {"predictor": {"name": "other"}}}, "kubectl-edit")
    entry = world.plan("canary", "3", 60).patch["spec"]["canary"][0]
    for canaries, message in (([entry, entry], "is duplicated"),
                              ([entry, {**entry, "predictor": {**entry["predictor"], "name": "v4"}}], "must be <= 100"),
                              ([{**entry, "predictor": {**entry["predictor"], "name": "v2"}}], "conflicts with stable")):
        with pytest.raises(ApiError, match=message):
            world.store.update({"spec": {"canary": canaries}}, "kubectl-edit")


def test_raw_canaries_need_kserve_0_20():
    world = World("raw-canary")
    canary = r.merge_patch(world.isvc, world.plan("canary", "2", 0).patch)
    promoted = r.merge_patch(world.isvc, {"spec": {"predictor": {"name": "v2"}}})
    assert "v0.20.0" in require_releases()
    for release in supported_releases():
        schema = require_crds(release)[("serving.kserve.io/v1beta1", "InferenceService")]
        errors, _ = check(world.isvc, world.plan("canary", "2", 0).patch, ClusterFacts(schema, "cube-serve-triton", True),
                          r.RAW)
        if release == "v0.20.0":
            assert errors == [] and crd_errors(canary, require_crds(release)) == []
        else:  # the API server would prune spec.canary and spec.predictor.name
            assert errors and "no field spec.canary (added in KServe v0.20.0)" in errors[0]
            assert any("canary" in e for e in crd_errors(canary, require_crds(release)))
            assert any("name" in e for e in crd_errors(promoted, require_crds(release)))


def test_preflight_checks_runtime_and_gateway_api():
    world = World("raw-canary")
    schema = require_crds("v0.20.0")[("serving.kserve.io/v1beta1", "InferenceService")]
    share = world.plan("canary", "2", 10).patch
    dark = world.plan("canary", "2", 0).patch
    facts = ClusterFacts(schema, "cube-serve-triton", True, gateway_api=False)
    assert check(world.isvc, dark, facts, r.RAW) == ([], [])
    errors, _ = check(world.isvc, share, facts, r.RAW)
    assert "plain Ingress" in errors[0] and "--percent 0" in errors[0]
    errors, _ = check(world.isvc, share, ClusterFacts(schema, "cube-serve-triton", True, gateway_api=None), r.RAW)
    assert "inferenceservice-config" in errors[0]
    errors, notes = check(world.isvc, share, ClusterFacts(schema, "cube-serve-triton", True, gateway_api=True), r.RAW)
    assert errors == [] and "v0.20.0 uses trafficPercent only to size" in notes[0]
    errors, _ = check(world.isvc, dark, ClusterFacts(schema, "cube-serve-triton", False), r.RAW)
    assert "ServingRuntime cube-serve-triton does not exist" in errors[0]
    errors, notes = check(world.isvc, dark, ClusterFacts(None, "cube-serve-triton", True), r.RAW)
    assert errors == [] and "strict field validation" in notes[0]


def test_the_modes_come_from_status_then_annotation():
    isvc = overlay_isvc("raw-canary")
    assert r.deployment_mode(isvc) == r.RAW
    isvc["metadata"]["annotations"][r.state.MODE_ANNOTATION] = "Standard"  # KServe's newer name
    assert r.deployment_mode(isvc) == r.RAW
    isvc["status"] = {"deploymentMode": "Knative"}  # what KServe resolved wins
    assert r.deployment_mode(isvc) == r.SERVERLESS
    assert r.deployment_mode(isvc, "raw") == r.RAW  # --mode
    del isvc["status"], isvc["metadata"]["annotations"][r.state.MODE_ANNOTATION]
    with pytest.raises(r.RolloutError, match="deployment mode"):
        r.rollout_state(isvc, REGISTRY)
    isvc["metadata"]["annotations"][r.state.MODE_ANNOTATION] = "ModelMesh"
    with pytest.raises(r.RolloutError, match="not supported"):
        r.rollout_state(isvc, REGISTRY)


# -- refusals: clear errors, nothing changed ----------------------------------------------------------

@pytest.mark.parametrize("overlay", ["canary", "raw-canary"])
@pytest.mark.parametrize("version, percent, message", [
    ("2", -1, "0 to 100"), ("2", 101, "0 to 100"), ("2", 12.5, "0 to 100"), ("2", True, "0 to 100"),
    ("2", "10", "0 to 100"), ("9", 10, "unknown version '9'"), ("V2!", 10, "invalid version"),
])
def test_bad_canary_arguments_are_refused(overlay, version, percent, message):
    world = World(overlay)
    before = world.isvc
    with pytest.raises(r.RolloutError, match=message):
        world.plan("canary", version, percent)
    assert world.isvc == before


@pytest.mark.parametrize("overlay, release", SERVERLESS_AND_RAW_CANARIES)
def test_a_rollout_while_another_is_unfinished_is_refused(overlay, release):
    world = World(overlay, release=release)
    with pytest.raises(r.RolloutError, match="already the stable version"):
        world.plan("canary", "1", 10)
    world.do("canary", "2", 0)
    with pytest.raises(r.RolloutError, match="canary of version 2 .* in progress"):
        world.plan("canary", "3", 10)
    if overlay == "raw-canary":
        two = world.isvc
        two["spec"]["canary"].append(copy.deepcopy(two["spec"]["canary"][0]))
        with pytest.raises(r.RolloutError, match="2 canaries"):
            r.plan_promote(two, REGISTRY)


@pytest.mark.parametrize("overlay, release", SERVERLESS_AND_RAW_CANARIES)
def test_a_roll_out_promotes_or_rolls_back_only_its_own_canary(overlay, release):
    """Two pipeline runs: run A started the canary of version 2, run B replaced it with version 3
    (after A's was rolled back). A's promote and rollback name version 2 and are refused; without
    a version (the CLI) they act on whatever canary there is."""
    world = World(overlay)
    world.do("canary", "2", 10)
    world.kserve.start_pods()
    world.do("rollback", force=True)
    world.kserve.start_pods()
    if world.state().phase == r.ROLLING_BACK:  # Serverless: pin, then clear once the old revision is ready
        world.do("rollback")
    world.do("canary", "3", 10)
    world.kserve.start_pods()
    for action in ("promote", "rollback"):
        with pytest.raises(r.RolloutError, match="canary of version 2: the canary is version 3"):
            world.plan(action, canary="2")
    assert world.plan("promote", canary="3").changed
    world.do("promote", canary="3")
    world.kserve.start_pods()
    with pytest.raises(r.RolloutError, match="cannot promote the canary of version 3: stable"):
        world.plan("promote", canary="3")  # promoted already: no canary of its own to act on


@pytest.mark.parametrize("release", MODELLED_KSERVE)
def test_a_serverless_roll_out_passes_the_deployment_mode_webhook_except_where_excluded(release):
    """The overlays annotate the mode with the names every release knows (Serverless); KServe's
    validating webhook compares it with the status (kserve_standin.validate_update, per release).
    On v0.16.0 every update is refused, so v0.16.0 is out of the declared range
    (k8s_validation.EXCLUDED_KSERVE, docs/deploy/compatibility.md); on every other release a canary and its promote pass."""

    world = World("canary", release=release)
    if release in EXCLUDED_KSERVE:
        assert world.isvc["status"]["deploymentMode"] == "Knative"
        with pytest.raises(ApiError, match="deploymentMode cannot be changed from 'Knative' to 'Serverless'"):
            world.do("canary", "2", 10)
        return
    world.do("canary", "2", 10)
    world.kserve.start_pods()
    world.do("promote")
    world.kserve.start_pods()
    assert (world.state().phase, world.state().stable) == ("stable", "2")


def test_the_compatibility_page_names_the_excluded_releases():

    table = (Path(__file__).resolve().parents[1] / "docs/deploy/compatibility.md").read_text()
    for release in EXCLUDED_KSERVE:
        assert f"not {release.rsplit('.', 1)[0]}.x" in table, release


@pytest.mark.parametrize("arm", ["a", "b"])
def test_an_arm_of_the_cross_pod_ab_test_gets_no_raw_canary_or_promote(arm):
    """k8s/overlays/ab: each arm is labelled; a raw promote would rename its predictor and KServe
    v0.20.0 would delete the Service `cube3d-<arm>-predictor` the HTTPRoute names (the stand-in
    deletes orphans as predictor.go 1002-1035 does), so the tool refuses before anything changes."""
    isvc = find(render("ab"), "InferenceService", f"cube3d-{arm}")
    isvc["metadata"]["namespace"] = "models"
    route = find(render("ab"), "HTTPRoute")
    assert f"cube3d-{arm}-predictor" in json.dumps(route)  # the Service a promote would take away
    world = World(isvc=isvc)
    with pytest.raises(r.RolloutError, match=f"cube3d-{arm} is arm {arm} of a cross-pod A/B test"):
        world.plan("canary", "3", 0)
    # A canary added by hand is not promoted either.
    world.store.update({"spec": {"canary": [{"predictor": {"name": "v3", "model": {
        "name": "kserve-container", "modelFormat": {"name": "triton"}, "storageUri": f"{BASE}/3/"}},
        "trafficPercent": 0}]}}, "kubectl-edit")
    world.kserve.reconcile()
    world.kserve.start_pods()
    with pytest.raises(r.RolloutError, match="would rename its predictor"):
        world.plan("promote")
    backends = {b["name"] for rule in route["spec"]["rules"] for b in rule["backendRefs"]}
    assert f"cube3d-{arm}-predictor" in backends & world.kserve.services  # still there for the route
    # What the refusal prevents: the same promote made by hand. KServe deletes the Service the
    # A/B route sends the arm's traffic to, and its own route of the old name is left behind,
    # pointing at nothing.
    world.store.update({"spec": {"predictor": {"name": "v3", "model": {"storageUri": f"{BASE}/3/"}}, "canary": None}},
                       "kubectl-edit")
    world.kserve.reconcile()
    assert f"cube3d-{arm}-predictor" not in world.kserve.services
    assert world.kserve.httproutes[f"cube3d-{arm}-predictor"] == f"cube3d-{arm}-predictor"
    assert world.kserve.httproutes[f"cube3d-{arm}"] == f"cube3d-{arm}-v3-predictor"


def test_the_versions_configmap_has_one_writer_per_field():
    """k8s/base/runtime/versions.yaml and the pipeline's record_version write different keys, so
    `kubectl apply --server-side` of an overlay after the pipeline recorded a version neither
    conflicts nor drops it (server-side apply's conflicts as kserve_standin.ObjectStore models
    them). Had the pipeline written the overlay's key, the re-apply would conflict, and forced,
    drop the version being served."""
    configmap = find(render("canary"), "ConfigMap", r.VERSIONS_CONFIGMAP)
    assert "packaged" not in configmap["data"]  # the manifests never declare the pipeline's key
    store = ObjectStore(configmap, manager="kubectl", operation="Apply")
    store.update({"data": {"packaged": "3"}}, r.FIELD_MANAGER)  # as record_version patches it
    store.apply(configmap, manager="kubectl")  # the overlay again: no conflict
    assert r.VersionRegistry.from_configmap(store.get()).versions == ("1", "2", "3")
    # The old way: one key, two writers.
    shared = ObjectStore(configmap, manager="kubectl", operation="Apply")
    shared.update({"data": {"versions": "1 2 3"}}, r.FIELD_MANAGER)
    with pytest.raises(ApiError, match='conflict with "cubeserve-rollout": .data.versions'):
        shared.apply(configmap, manager="kubectl")
    shared.apply(configmap, manager="kubectl", force=True)
    assert r.VersionRegistry.from_configmap(shared.get()).versions == ("1", "2")  # version 3 lost


def test_services_outside_the_registry_are_refused():
    with pytest.raises(r.RolloutError, match="no storageUri"):
        World("cpu").plan("canary", "2", 10)
    isvc = overlay_isvc("raw-canary")
    isvc["spec"]["predictor"]["model"]["storageUri"] = "gs://elsewhere/model"
    with pytest.raises(r.RolloutError, match="not a version of the registry"):
        World(isvc=isvc).plan("canary", "2", 10)


def test_the_registry_comes_from_its_configmap():
    configmap = find(render("canary"), "ConfigMap", r.VERSIONS_CONFIGMAP)
    assert r.VersionRegistry.from_configmap(configmap) == r.VersionRegistry(BASE, ("1", "2"))
    configmap["data"]["versions"] = "1, 2,3 3\n4"
    assert r.VersionRegistry.from_configmap(configmap).versions == ("1", "2", "3", "4")
    assert REGISTRY.version_of(f"{BASE}/2/") == "2" and REGISTRY.version_of(f"{BASE}/2") == "2" and REGISTRY.version_of(f"{BASE}/9/") is None
    assert REGISTRY.version_of(f"{BASE}x/2") is None
    with pytest.raises(r.RolloutError, match="baseUri"):
        r.VersionRegistry.from_configmap({"data": {"baseUri": "bucket/cube3d", "versions": "1"}})
    with pytest.raises(r.RolloutError, match="not a valid version"):
        r.VersionRegistry.from_configmap({"data": {"baseUri": BASE, "versions": "1 v_2"}})


# -- the cross-pod A/B overlay's HTTPRoute -------------------------------------------------------------

def route() -> dict:
    ab = find(render("ab"), "HTTPRoute")
    ab["metadata"].update(namespace="models", resourceVersion="300")
    return ab


def weighted_backends(obj: dict) -> list[tuple[str, int]]:
    rules = obj["spec"]["rules"]
    return [(b["name"], b["weight"]) for b in rules[plans.weighted_rule(obj)]["backendRefs"]]


def test_route_weights():
    ab = route()
    plan = r.plan_route_weights(ab, r.parse_weights("A=50,B=50"))
    assert leaves(plan.patch) == {"metadata.resourceVersion", "spec.rules"}
    assert plan.changes == ("spec.rules[2].backendRefs[0].weight: 80 -> 50", "spec.rules[2].backendRefs[1].weight: 20 -> 50")
    after = ObjectStore(ab)
    after.update(plan.patch | {"metadata": {}}, r.FIELD_MANAGER)
    after = after.get()
    for release in GATEWAY_API_RELEASES:
        assert gateway_api_errors(after, release) == [], release
    assert weighted_backends(after) == [("cube3d-a-predictor", 50), ("cube3d-b-predictor", 50)]
    # The pinned rules and every other field are as they were.
    assert after["spec"]["rules"][:2] == ab["spec"]["rules"][:2]
    assert {k: v for k, v in after["spec"].items() if k != "rules"} == {k: v for k, v in ab["spec"].items() if k != "rules"}
    assert not r.plan_route_weights(after, {"a": 50, "b": 50}).changed
    assert r.plan_route_weights(after, r.parse_weights("b=100,a=0")).changed


@pytest.mark.parametrize("weights, message", [
    ("a=80,b=30", "add up to 100"), ("a=100", "missing: b"), ("a=80,c=20", "no arm named c"),
    ("a=80,b=-20", "from 0 to 100"), ("a=x,b=20", "must be an integer"), ("a=50,a=50", "twice"),
    ("a:80", "NAME=WEIGHT"),
])
def test_bad_route_weights_are_refused(weights, message):
    ab = route()
    before = copy.deepcopy(ab)
    with pytest.raises(r.RolloutError, match=message):
        r.plan_route_weights(ab, r.parse_weights(weights))
    assert ab == before


def test_a_route_without_arm_headers_is_refused():
    ab = route()
    ab["spec"]["rules"][2]["backendRefs"][1].pop("filters")
    with pytest.raises(r.RolloutError, match="distinct x-cube3d-arm"):
        r.plan_route_weights(ab, {"a": 50, "b": 50})


def test_merge_patch_is_rfc_7386():
    assert r.merge_patch({"a": "b", "c": {"d": "e", "f": "g"}}, {"a": "z", "c": {"f": None}}) == {"a": "z", "c": {"d": "e"}}
    assert r.merge_patch({"a": [1, 2]}, {"a": [3]}) == {"a": [3]}
    assert r.merge_patch({"a": {"b": "c"}}, {"a": {"b": "d", "c": None}}) == {"a": {"b": "d"}}
    target = {"x": {"y": 1}}
    r.merge_patch(target, {"x": {"y": 2}})
    assert target == {"x": {"y": 1}}  # a copy


def test_the_api_server_stand_in_bumps_the_generation_on_spec_changes_only():
    store = ObjectStore(overlay_isvc("canary"))
    store.update({"metadata": {"annotations": {"team": "3d"}}}, "someone")
    store.write_status({"conditions": []})
    assert store.get()["metadata"]["generation"] == 1 and store.get()["metadata"]["resourceVersion"] == "3"
    store.update({"spec": {"predictor": {"minReplicas": 2}}}, "someone")
    assert store.get()["metadata"]["generation"] == 2
    with pytest.raises(ApiError, match="409"):
        store.update({"metadata": {"resourceVersion": "1"}, "spec": {"predictor": {"minReplicas": 3}}}, "someone")


# -- the command line, against the stand-ins in memory ------------------------------------------------

class FakeCluster:
    """`Cluster`'s interface over a World: KServe reconciles after `lag_gets` reads following a
    patch, and the new pods come up after `pods_after_gets` reads (None: never on their own)."""

    def __init__(self, world: World, lag_gets: int = 0, pods_after_gets: int | None = None,
                 release: str = "v0.20.0", gateway_api: bool | None = True):
        self.world, self.namespace, self.patches = world, "models", []
        self.lag_gets, self.pods_after_gets, self.pending, self.gets = lag_gets, pods_after_gets, None, 0
        self.release, self.gateway_api, self.objects = release, gateway_api, {}
        self.configmaps, self.applied = {}, []
        self.configmap_stores: dict[str, ObjectStore] = {}
        self.lagged_generations_matched = False

    def __call__(self, namespace=None, context=None):
        return self

    def get(self, api, name):
        if api == r.HTTPROUTE_API:
            return copy.deepcopy(self.objects[name])
        self.gets += 1
        if self.pending is not None:
            self.pending += 1
            isvc = self.world.isvc
            if isvc["metadata"]["generation"] == isvc["status"]["observedGeneration"]:
                self.lagged_generations_matched = True
            if self.pending > self.lag_gets:
                self.world.kserve.reconcile()
                self.pending = None
        if self.pods_after_gets is not None and self.gets >= self.pods_after_gets:
            self.world.kserve.start_pods()
        return self.world.isvc

    def patch(self, api, name, patch):
        if api == r.HTTPROUTE_API:
            store = ObjectStore(self.objects[name])
            store.obj["metadata"]["resourceVersion"] = self.objects[name]["metadata"]["resourceVersion"]
            self.objects[name] = store.update(patch, r.FIELD_MANAGER)
            self.patches.append(patch)
            return self.objects[name]
        try:
            self.world.store.update(patch, r.FIELD_MANAGER)
        except ApiError as exc:
            raise ApiException(exc.status, exc.reason) from None
        self.patches.append(patch)
        self.pending = 0
        if self.lag_gets == 0:
            self.world.kserve.reconcile()
            self.pending = None
        return self.world.isvc

    def registry(self, name):
        return REGISTRY

    def configmap(self, name):
        return copy.deepcopy(self.configmaps.get(name))

    def apply_configmap(self, body):
        """Server-side apply as cubeserve-rollout (kserve_standin.ObjectStore: field managers,
        conflicts, the resourceVersion precondition); creates a missing ConfigMap."""
        name = body["metadata"]["name"]
        store = self.configmap_stores.get(name)
        current = self.configmaps.get(name)
        if current is not None and (store is None or store.get() != current):
            # Put here by a test: stands for what this tool wrote before.
            store = self.configmap_stores[name] = ObjectStore(current, r.FIELD_MANAGER, "Apply",
                                                              current["metadata"].get("resourceVersion", "1"))
        try:
            if store is None:
                if body["metadata"].get("resourceVersion"):
                    raise ApiException(409, "Conflict")
                store = self.configmap_stores[name] = ObjectStore(body, r.FIELD_MANAGER, "Apply")
            else:
                store.apply(body, r.FIELD_MANAGER)
        except ApiError as exc:
            raise ApiException(exc.status, exc.reason) from exc
        self.configmaps[name] = store.get()
        self.applied.append(body)
        return store.get()

    def revisions(self, isvc):
        return {k: v for k, v in self.world.kserve.revision_uris().items()}

    def replica_sets(self, isvc):
        return r.replica_sets_of(self.world.kserve.replica_set_objects())

    def facts(self, isvc, kserve_namespace="kserve"):
        schema = require_crds(crd_release(self.release))[("serving.kserve.io/v1beta1", "InferenceService")]
        return ClusterFacts(schema, "cube-serve-triton", True, self.gateway_api)


class ApiException(Exception):
    """Stands for kubernetes.client.exceptions.ApiException (matched by name)."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status, self.reason = status, reason


def run(cluster, monkeypatch, *argv):
    monkeypatch.setattr(cli, "cluster_factory", cluster)
    monkeypatch.setattr(cli.time, "sleep", lambda seconds: None)
    parser = argparse.ArgumentParser(prog="cubeserve")  # as cubeserve/cli.py builds it
    r.add_rollout_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["rollout", *argv])
    out = io.StringIO()
    return args.func(args, out=out), out.getvalue()


def test_cli_canary_promote_and_status(monkeypatch):
    world = World("canary")
    cluster = FakeCluster(world)
    code, out = run(cluster, monkeypatch, "canary", "--version", "2", "--percent", "20", "-n", "models")
    assert code == 0 and len(cluster.patches) == 1
    assert out.splitlines() == [
        "canary of version 2 at 20% (stable: version 1)",
        "  spec.predictor.canaryTrafficPercent: (unset) -> 20",
        f"  spec.predictor.model.storageUri: {BASE}/1/ -> {BASE}/2/",
        "  note: the canary revision keeps at least 1 replica(s) of its own (minReplicas) beside the stable "
        "revision's, each revision scaling on its own traffic up to 4",
        "patched",
    ]
    code, out = run(cluster, monkeypatch, "canary", "--version", "2", "--percent", "20")
    assert code == 0 and len(cluster.patches) == 1 and "nothing to change" in out
    world.kserve.start_pods()
    code, out = run(cluster, monkeypatch, "status")
    assert code == 0 and "canary of version 2 at 20% (stable: version 1)" in out and "versions 1 2 3" in out
    assert "traffic  20%  cube3d-predictor-00002  version 2  latest" in out
    assert "traffic  80%  cube3d-predictor-00001  version 1  prev" in out
    code, out = run(cluster, monkeypatch, "promote", "--dry-run")
    assert code == 0 and len(cluster.patches) == 1 and "dry run" in out
    code, out = run(cluster, monkeypatch, "promote")
    assert code == 0 and len(cluster.patches) == 2
    assert "spec.predictor.canaryTrafficPercent: 20 -> (removed)" in out
    code, out = run(cluster, monkeypatch, "promote")
    assert code == 0 and len(cluster.patches) == 2 and "nothing to promote" in out
    code, out = run(cluster, monkeypatch, "status", "--json")
    assert code == 0 and json.loads(out)["stable"] == "2"


def test_a_patch_that_meets_a_status_write_is_planned_again(monkeypatch, capsys):
    """KServe writes the status between the tool's read and its patch (a reconcile moves the
    resourceVersion): the precondition fails with 409; the command reads again, plans again from
    what it finds and patches once. A conflict that does not stop is reported, nothing changed."""
    world = World("canary")
    cluster = FakeCluster(world)
    send = cluster.patch
    status_writes = iter([True, True])

    def patch_after_a_status_write(api, name, body):
        if next(status_writes, False):
            world.kserve.reconcile()
        return send(api, name, body)

    cluster.patch = patch_after_a_status_write
    code, out = run(cluster, monkeypatch, "canary", "--version", "2", "--percent", "10")
    assert code == 0 and len(cluster.patches) == 1 and world.state().canary == "2", out
    status_writes = iter(lambda: True, None)  # KServe writes before every patch
    before = world.isvc["spec"]
    code, _ = run(cluster, monkeypatch, "canary", "--version", "2", "--percent", "30")
    assert code == cli.API_ERROR and "409" in capsys.readouterr().err
    assert world.isvc["spec"] == before and len(cluster.patches) == 1


def test_cli_refusals_change_nothing(monkeypatch, capsys):
    world = World("raw-canary")
    cluster = FakeCluster(world)
    assert run(cluster, monkeypatch, "canary", "--version", "2", "--percent", "0")[0] == 0
    for argv, words in ((["canary", "--version", "3", "--percent", "10"], "in progress"),
                        (["canary", "--version", "2", "--percent", "150"], "0 to 100"),
                        (["canary", "--version", "7", "--percent", "10"], "unknown version")):
        code, out = run(cluster, monkeypatch, *argv)
        assert code == 2 and out == "" and words in capsys.readouterr().err
    assert len(cluster.patches) == 1
    with pytest.raises(SystemExit):  # argparse: not an integer
        run(cluster, monkeypatch, "canary", "--version", "2", "--percent", "ten")


@pytest.mark.parametrize("release, gateway_api, refusal", [
    ("v0.19.0", True, "no field spec.canary (added in KServe v0.20.0)"),
    ("v0.20.0", False, "plain Ingress"),
])
def test_cli_preflight_refuses_what_the_cluster_cannot_do(monkeypatch, capsys, release, gateway_api, refusal):
    world = World("raw-canary")
    cluster = FakeCluster(world, release=release, gateway_api=gateway_api)
    code, _ = run(cluster, monkeypatch, "canary", "--version", "2", "--percent", "10")
    assert code == 2 and refusal in capsys.readouterr().err and cluster.patches == []


def test_cli_waits_for_readiness_and_reports_conflicts(monkeypatch, capsys):
    world = World("raw-canary")
    world.do("canary", "2", 0)
    cluster = FakeCluster(world)
    code, _ = run(cluster, monkeypatch, "promote")
    assert code == 3 and "not ready" in capsys.readouterr().err and cluster.patches == []
    cluster = FakeCluster(world, pods_after_gets=3)
    code, out = run(cluster, monkeypatch, "promote", "--wait", "60")
    assert code == 0 and out.startswith("waiting:") and len(cluster.patches) == 1

    world = World("raw-canary")
    world.do("canary", "2", 0)
    cluster = FakeCluster(world)
    stale = cluster.patch
    cluster.patch = lambda api, name, patch: stale(api, name, {**patch, "metadata": {"resourceVersion": "1"}})
    code, _ = run(cluster, monkeypatch, "rollback")
    assert code == 1 and "run it again" in capsys.readouterr().err


def test_cli_ab_route_weights(monkeypatch, capsys):
    cluster = FakeCluster(World("raw-canary"))
    cluster.objects["cube3d-ab"] = route()
    code, out = run(cluster, monkeypatch, "ab", "--httproute", "cube3d-ab", "--weights", "A=60,B=40")
    assert code == 0 and "weights a=80,b=20 -> a=60,b=40" in out
    assert weighted_backends(cluster.objects["cube3d-ab"]) == [("cube3d-a-predictor", 60), ("cube3d-b-predictor", 40)]
    code, _ = run(cluster, monkeypatch, "ab", "--httproute", "cube3d-ab", "--weights", "A=60,B=60")
    assert code == 2 and "add up to 100" in capsys.readouterr().err and len(cluster.patches) == 1
    code, _ = run(cluster, monkeypatch, "ab", "--weights", "a=50,b=50")
    assert code == 2 and "--httproute" in capsys.readouterr().err and len(cluster.patches) == 1
    code, out = run(cluster, monkeypatch, "status", "--httproute", "cube3d-ab")
    assert code == 0 and "HTTPRoute models/cube3d-ab: a=60% (cube3d-a-predictor), b=40% (cube3d-b-predictor)" in out


def experiment_world() -> FakeCluster:
    """The experiment overlay's InferenceService: its pods load the version set 1-2."""
    return FakeCluster(World("experiment"))


def written(cluster: FakeCluster):
    from cubeserve.serving.experiment import parse

    return parse(cluster.configmaps["cube3d-experiment"]["data"]["experiment.json"])


def test_cli_ab_sets_the_in_server_experiment(monkeypatch):
    from cubeserve.serving.experiment import Arm, Shadow

    cluster = experiment_world()
    code, out = run(cluster, monkeypatch, "ab", "--set", "control=1:90,candidate=2:10", "--name", "decoder-v2",
                    "--dry-run")
    assert code == 0 and "dry run" in out and cluster.applied == []
    code, out = run(cluster, monkeypatch, "ab", "--set", "control=1:90,candidate=2:10", "--name", "decoder-v2")
    assert code == 0, out
    assert out.splitlines()[0] == ("ConfigMap cube3d-experiment (new): experiment 'decoder-v2': "
                                   "arms control=version 1 (90%), candidate=version 2 (10%)")
    [body] = cluster.applied
    assert (body["apiVersion"], body["kind"], body["metadata"]["name"], body["metadata"]["namespace"]) == \
        ("v1", "ConfigMap", "cube3d-experiment", "models")
    assert set(body["data"]) == {"experiment.json"}
    exp = written(cluster)
    assert exp.arms == (Arm("control", 1, 90), Arm("candidate", 2, 10)) and exp.shadow is None
    # Every pod parses the written text on its own: each user gets the same arm in all of them,
    # and the arms' shares follow the weights.
    pods = [written(cluster) for _ in range(2)]
    users = [f"user-{i}" for i in range(2000)]
    arms = [[pod.arm_for(u).name for u in users] for pod in pods]
    assert arms[0] == arms[1]
    assert 0.08 < arms[0].count("candidate") / len(users) < 0.12

    # More traffic to the candidate, same experiment: the name (and so the salt) is kept, and
    # users already in the candidate stay there.
    in_candidate = [u for u in (f"user-{i}" for i in range(400)) if exp.arm_for(u).name == "candidate"]
    code, out = run(cluster, monkeypatch, "ab", "--set", "control=1:50,candidate=2:50", "--shadow", "2:0.25")
    assert code == 0, out
    exp = written(cluster)
    assert exp.name == "decoder-v2" and exp.shadow == Shadow(2, 0.25)
    assert in_candidate and all(exp.arm_for(u).name == "candidate" for u in in_candidate)
    assert cluster.applied[-1]["metadata"]["resourceVersion"] == "1"  # a precondition on what was read
    code, out = run(cluster, monkeypatch, "ab", "--set", "control=1:50,candidate=2:50", "--shadow", "2:0.25")
    assert code == 0 and "nothing to change" in out and len(cluster.applied) == 2

    code, out = run(cluster, monkeypatch, "status")
    assert "ConfigMap cube3d-experiment: experiment 'decoder-v2': arms control=version 1 (50%), candidate=version 2 " \
           "(50%); shadow version 2 on 25% of requests (at most 4 in flight)" in out
    assert "  loads versions 1, 2 (a version set" in out
    # Without the right to read ConfigMaps, status still reports the rest.
    cluster.configmap = lambda name: (_ for _ in ()).throw(ApiException(403, "Forbidden"))
    code, out = run(cluster, monkeypatch, "status")
    assert code == 0 and "cube3d-experiment: not readable (403)" in out and "traffic 100%" in out
    del cluster.configmap

    code, out = run(cluster, monkeypatch, "ab", "--clear")
    assert code == 0 and written(cluster) is None
    assert cluster.configmaps["cube3d-experiment"]["data"]["experiment.json"] == ""
    assert "cube3d-experiment: no experiment" in run(cluster, monkeypatch, "status")[1]


@pytest.mark.parametrize("argv, message", [
    (["--set", "control=1:90,candidate=2:10"], "--name: a new experiment needs a name"),
    (["--set", "control=1,candidate=2", "--name", "x"], "NAME=VERSION:WEIGHT"),
    (["--set", "control=1:ninety", "--name", "x"], "the weight of arm 'control' must be a number"),
    (["--set", "control=one:90", "--name", "x"], "--set: the version must be an integer >= 1"),
    (["--set", "control=1:-5", "--name", "x"], r"experiment.arms\[0\].weight: must be a number in \[0, 1e\+06\]"),
    (["--set", "a=1:0,b=2:0", "--name", "x"], "the weights must not all be 0"),
    (["--set", "a=1:50,a=2:50", "--name", "x"], "arm names must be unique"),
    (["--set", "shadow=1:50", "--name", "x"], "other than 'shadow'"),
    (["--shadow", "2:1.5", "--name", "x"], r"experiment.shadow.share: must be a number in \[0, 1\]"),
    (["--shadow", "2", "--name", "x"], "VERSION:SHARE"),
    (["--shadow", "2:0.5:0", "--name", "x"], r"max_in_flight: must be an integer in \[1, 1024\]"),
    (["--name", "x"], "give --set"),
    (["--clear", "--shadow", "2:0.5"], "--clear takes no --shadow"),
    (["--set", "a=1:50,b=7:50", "--name", "x"], "version 7 is not in the registry"),
    (["--set", "a=1:50,b=3:50", "--name", "x"], "loads versions 1, 2 only; the experiment also needs 3"),
])
def test_cli_ab_refuses_bad_experiments_naming_the_field(monkeypatch, capsys, argv, message):
    cluster = experiment_world()
    code, out = run(cluster, monkeypatch, "ab", *argv)
    err = capsys.readouterr().err
    assert code == 2 and out == "" and err.startswith("refused: ")
    assert re.search(message, err), err
    assert cluster.applied == []


def test_cli_ab_refuses_versions_a_single_version_service_does_not_load(monkeypatch, capsys):
    cluster = FakeCluster(World("raw-canary"))  # storageUri <base>/1/: version 1 only
    code, _ = run(cluster, monkeypatch, "ab", "--set", "a=1:50,b=2:50", "--name", "x")
    assert code == 2 and "loads versions 1 only" in capsys.readouterr().err and cluster.applied == []
    code, _ = run(cluster, monkeypatch, "ab", "--set", "a=1:50,b=2:50", "--name", "x", "--skip-preflight")
    assert code == 0 and len(cluster.applied) == 1
    # A hand-written ConfigMap the server would refuse is shown as such, not hidden.
    cluster.configmaps["cube3d-experiment"]["data"]["experiment.json"] = '{"name": "x", "arms": "a"}'
    code, out = run(cluster, monkeypatch, "status")
    assert "cube3d-experiment: INVALID:" in out


def test_cubeserve_cli_has_rollout(monkeypatch):
    from cubeserve import cli as cubeserve_cli

    parser = cubeserve_cli.build_parser()
    subcommands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert "rollout" in subcommands
    world = World("raw-canary")
    world.do("canary", "2", 0)
    cluster = FakeCluster(world)
    monkeypatch.setattr(cli, "cluster_factory", cluster)
    assert cubeserve_cli.main(["rollout", "rollback"]) == 0 and len(cluster.patches) == 1


# -- the thin client over HTTP, against a stub API server on 127.0.0.1 ---------------------------------

ISVC_PATH = "/apis/serving.kserve.io/v1beta1/namespaces/models/inferenceservices/cube3d"
VERSIONS_PATH = "/api/v1/namespaces/models/configmaps/cube3d-versions"
REPLICASETS_PATH = "/apis/apps/v1/namespaces/models/replicasets"


class StubApiServer:
    """The API server for the calls `Cluster` makes: the InferenceService (a World's store, with
    KServe reconciling after each patch; `fieldValidation=Strict` checked against the CRD of
    `release`, unknown fields otherwise pruned, as the API server does), ConfigMaps (merge patch
    with a resourceVersion precondition), Knative revisions, the CRD, the ServingRuntime and
    KServe's inferenceservice-config.

    `rules`: a Role's rules (the caller's service account, bound in namespace "models"): every
    request they do not allow is refused 403 Forbidden, as the API server's RBAC authorizer does
    (k8s_validation.rbac_allows, request_attributes); `authorized` records each request's
    attributes and the answer."""

    def __init__(self, world: World, objects: dict | None = None, release: str = "v0.20.0", gateway_api: bool = True,
                 rules: list[dict] | None = None):
        import http.server
        import threading

        from kserve_standin import json_merge_patch

        self.world, self.requests = world, []
        self.rules, self.authorized = rules, []
        self.stores: dict[str, ObjectStore] = {}  # the objects patched so far, with their field managers
        crd = copy.deepcopy(kserve_crd(release, "serving.kserve.io_inferenceservices.yaml"))
        runtime = find(render("raw"), "ServingRuntime")
        self.objects = {
            VERSIONS_PATH: {**find(render("raw"), "ConfigMap"), "metadata": {"name": "cube3d-versions", "namespace": "models", "resourceVersion": "7"}},
            "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/inferenceservices.serving.kserve.io": crd,
            "/apis/serving.kserve.io/v1alpha1/namespaces/models/servingruntimes/cube-serve-triton": runtime,
            "/api/v1/namespaces/kserve/configmaps/inferenceservice-config": {
                "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "inferenceservice-config"},
                "data": {"ingress": json.dumps({"enableGatewayApi": gateway_api})}},
            **(objects or {})}
        strict = require_crds(release)
        stub = self

        class Handler(ApiHandler):
            api, namespace = stub, "models"

            def do_GET(self):
                url = urlparse(self.path)
                stub.requests.append(("GET", url.path, None, None, parse_qs(url.query)))
                if self._forbidden("GET", url.path):
                    return
                if url.path == ISVC_PATH:
                    return self._send(200, stub.world.isvc)
                if "/revisions/" in url.path:
                    revision = stub.world.kserve.revision_object(url.path.rsplit("/", 1)[-1])
                    return self._send(200, revision) if revision else self._error(404, "NotFound")
                if url.path == REPLICASETS_PATH:  # a list by label selector (key=value)
                    key, _, value = parse_qs(url.query).get("labelSelector", ["="])[0].partition("=")
                    items = [rs for rs in stub.world.kserve.replica_set_objects()
                             if rs["metadata"]["labels"].get(key) == value]
                    return self._send(200, {"apiVersion": "apps/v1", "kind": "ReplicaSetList", "metadata": {},
                                            "items": items})
                obj = stub.objects.get(url.path)
                return self._send(200, obj) if obj else self._error(404, "NotFound")

            def do_PATCH(self):
                url = urlparse(self.path)
                query = parse_qs(url.query)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                stub.requests.append(("PATCH", url.path, self.headers["Content-Type"], body, query))
                if self._forbidden("PATCH", url.path):
                    return
                manager = query.get("fieldManager", ["unknown"])[0]
                if url.path == ISVC_PATH:
                    after = json_merge_patch(stub.world.isvc, body)
                    after.pop("status", None)
                    unknown = [e for e in crd_errors(after, strict) if "Additional properties" in e]
                    if unknown and query.get("fieldValidation") == ["Strict"]:
                        # As a real kube-apiserver (v1.36) answers a merge patch of a custom
                        # object with an unknown field (tests/test_cluster.py): 422, the object quoted.
                        return self._error(422, "Invalid", f'"" is invalid: patch: Invalid value: "{json.dumps(after)}": '
                                           "strict decoding error: " + ", ".join(_unknown_fields(unknown)))
                    try:
                        stub.world.store.update(_pruned(body, unknown), manager)
                    except ApiError as exc:
                        return self._error(exc.status, exc.reason, exc.message)
                    stub.world.kserve.reconcile()
                    return self._send(200, stub.world.isvc)
                # Every other object as the API server keeps it (kserve_standin.ObjectStore): a
                # merge patch is an update by its field manager, an apply-patch is server-side
                # apply (a field another manager owns is a 409 conflict unless force=true) and
                # creates a missing object; a resourceVersion in the body is a precondition.
                applying = self.headers["Content-Type"] == "application/apply-patch+yaml"
                store = stub.stores.get(url.path)
                try:
                    if store is None and url.path in stub.objects:  # as the manifests created it
                        current = stub.objects[url.path]
                        store = ObjectStore(current, "kubectl", "Apply", current["metadata"].get("resourceVersion", "1"))
                    if store is None:
                        if not applying:
                            return self._error(404, "NotFound")
                        if body.get("metadata", {}).get("resourceVersion"):
                            return self._error(409, "Conflict", "the object has been deleted or never existed")
                        store = ObjectStore(body, manager, "Apply")
                    elif applying:
                        store.apply(body, manager, force=query.get("force") == ["true"])
                    else:
                        store.update(body, manager)
                except ApiError as exc:
                    return self._error(exc.status, exc.reason, exc.message)
                stub.stores[url.path] = store
                stub.objects[url.path] = store.get()
                self._send(200, stub.objects[url.path])

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

    def patches(self, path: str = ISVC_PATH) -> list[dict]:
        return [body for method, p, _, body, _ in self.requests if method == "PATCH" and p == path]

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _unknown_fields(unknown: list[str]) -> list[str]:
    """crd_errors' "Additional properties" errors as the API server names them: unknown field "spec.canary"."""
    fields = []
    for error in unknown:  # "InferenceService spec: Additional properties are not allowed ('canary' was unexpected)"
        where, _, rest = error.partition(": ")
        path = where.split(" ", 1)[1] + "." if " " in where else ""
        fields += [f'unknown field "{path}{name}"' for name in rest.split("'")[1::2]]
    return fields


def _pruned(patch: dict, unknown: list[str]) -> dict:
    """The patch without the fields the CRD does not know (the API server's pruning)."""
    patch = copy.deepcopy(patch)
    for error in unknown:  # "InferenceService spec: Additional properties are not allowed ('canary' was unexpected)"
        where, _, rest = error.partition(": ")
        path = where.split(" ", 1)[1].split(".") if " " in where else []
        node = patch
        for key in path:
            node = node.get(key, {}) if isinstance(node, dict) else {}
        for name in rest.split("'")[1::2]:
            if isinstance(node, dict):
                node.pop(name, None)
    return patch


def cli_over_http(stub: StubApiServer, tmp_path, monkeypatch, *argv) -> tuple[int, str]:
    monkeypatch.setenv("KUBECONFIG", str(stub.kubeconfig(tmp_path / "kubeconfig")))
    parser = argparse.ArgumentParser(prog="cubeserve")
    r.add_rollout_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["rollout", *argv])
    out = io.StringIO()
    return args.func(args, out=out), out.getvalue()


def test_cluster_client_over_http(tmp_path, monkeypatch):
    world = World("canary")
    stub = StubApiServer(world)
    try:
        code, out = cli_over_http(stub, tmp_path, monkeypatch, "canary", "--version", "2", "--percent", "10")
        assert code == 0, out
        method, path, content_type, body, query = [q for q in stub.requests if q[0] == "PATCH"][-1]
        assert (path, content_type) == (ISVC_PATH, "application/merge-patch+json")
        assert query["fieldManager"] == ["cubeserve-rollout"] and query["fieldValidation"] == ["Strict"]
        assert body["spec"]["predictor"] == {"canaryTrafficPercent": 10, "model": {"storageUri": f"{BASE}/2/"}}
        assert r.FIELD_MANAGER in r.state.writers(world.isvc, r.state.STORAGE_URI)
        world.kserve.start_pods()
        code, out = cli_over_http(stub, tmp_path, monkeypatch, "status")
        assert code == 0 and "canary of version 2 at 10% (stable: version 1)" in out and "version 2  latest" in out
        assert any("/revisions/cube3d-predictor-00002" in q[1] for q in stub.requests)
        code, out = cli_over_http(stub, tmp_path, monkeypatch, "promote")
        assert code == 0 and world.kserve.serving() == [(f"{BASE}/2/", 100)]
    finally:
        stub.close()


# Reads the roll-out's preflight makes and can do without (docs/pipeline.md, "Permissions": it says so and
# relies on strict field validation): the cluster-scoped CRD, KServe's own ConfigMap.
OPTIONAL_PREFLIGHT_READS = {
    ("apiextensions.k8s.io", "customresourcedefinitions", "get", "inferenceservices.serving.kserve.io"),
    ("", "configmaps", "get", "inferenceservice-config")}


def rollout_role_rules() -> list[dict]:
    """The rules of the Role `cubeserve rollout` runs under in the pipeline (k8s/pipeline)."""
    from k8s_validation import _rendered

    objects = [o for o in yaml.safe_load_all(_rendered(str(Path(__file__).resolve().parents[1] / "k8s" / "pipeline"))) if o]
    return next(o for o in objects if o["kind"] == "Role" and o["metadata"]["name"] == "cube-serve-rollout")["rules"]


def test_a_raw_roll_out_over_http_reads_the_replica_sets_under_the_role(tmp_path, monkeypatch):
    """RawDeployment with the real `kubernetes` client and the pipeline's Role (RBAC as the API
    server applies it): status lists the predictor's ReplicaSets by KServe's label and reports an
    in-place edit as drift; once the Deployment has rolled, a canary and its promote go through."""
    from k8s_validation import rbac_allows

    world = World("raw-canary")
    stub = StubApiServer(world, rules=rollout_role_rules())
    try:
        _edit_storage_uri(world, "2")
        code, out = cli_over_http(stub, tmp_path, monkeypatch, "status")
        assert code == cli.DRIFT and "DRIFT: spec.predictor.model.storageUri was changed by kubectl-edit" in out, out
        lists = [q for q in stub.requests if q[1] == REPLICASETS_PATH]
        assert lists and lists[-1][4]["labelSelector"] == ["serving.kserve.io/inferenceservice=cube3d"]
        world.kserve.start_pods()
        stub.objects[VERSIONS_PATH]["data"]["versions"] = "1 2 3"
        for argv in (("canary", "--version", "3", "--percent", "0"), ("promote", "--wait", "60")):
            code, out = cli_over_http(stub, tmp_path, monkeypatch, *argv)
            assert code == 0, out
            world.kserve.start_pods()
        assert world.isvc["spec"]["predictor"]["name"] == "v3" and world.kserve.serving() == [(f"{BASE}/3/", 100)]
        # `status` also shows the in-server experiment where it may read it (the pipeline never asks).
        refused = {attrs[:4] for attrs, allowed in stub.authorized if not allowed}
        assert refused <= OPTIONAL_PREFLIGHT_READS | {("", "configmaps", "get", "cube3d-experiment")}, refused
        used = [attrs for attrs, allowed in stub.authorized if allowed]
        assert any(rbac_allows([rule], *attrs[:4]) for attrs in used for rule in stub.rules
                   if rule["resources"] == ["replicasets"])
    finally:
        stub.close()


EXPERIMENT_PATH = "/api/v1/namespaces/models/configmaps/cube3d-experiment"


def test_the_experiment_is_written_by_server_side_apply_over_http(tmp_path, monkeypatch):
    from cubeserve.serving.experiment import parse

    world = World("experiment")
    stub = StubApiServer(world)
    try:
        code, out = cli_over_http(stub, tmp_path, monkeypatch, "ab", "--set", "control=1:90,candidate=2:10",
                                  "--name", "decoder-v2", "--shadow", "2:0.1")
        assert code == 0, out
        [(method, path, content_type, body, query)] = [q for q in stub.requests if q[0] == "PATCH"]
        assert (path, content_type) == (EXPERIMENT_PATH, "application/apply-patch+yaml")
        assert query["fieldManager"] == ["cubeserve-rollout"] and query["fieldValidation"] == ["Strict"]
        assert "resourceVersion" not in body["metadata"]  # created: nothing to hold it to
        exp = parse(stub.objects[EXPERIMENT_PATH]["data"]["experiment.json"])
        assert [(a.name, a.version, a.weight) for a in exp.arms] == [("control", 1, 90), ("candidate", 2, 10)]
        code, out = cli_over_http(stub, tmp_path, monkeypatch, "status")
        assert code == 0 and "cube3d-experiment: experiment 'decoder-v2': arms control=version 1 (90%)" in out
        code, out = cli_over_http(stub, tmp_path, monkeypatch, "ab", "--clear")
        assert code == 0, out
        body = stub.patches(EXPERIMENT_PATH)[-1]
        assert body["metadata"]["resourceVersion"] == "1" and body["data"] == {"experiment.json": ""}
        assert parse(stub.objects[EXPERIMENT_PATH]["data"]["experiment.json"]) is None
    finally:
        stub.close()


def test_an_experiment_edited_by_hand_is_a_conflict_for_server_side_apply(tmp_path, monkeypatch, capsys):
    """Server-side apply as the API server does it (kserve_standin.ObjectStore; Kubernetes
    docs, "Server-Side Apply", Conflicts): after a `kubectl edit` of the experiment (an update by
    manager kubectl-edit, which then owns data.experiment.json) the tool's apply is a 409
    conflict naming the field and its manager, not a silent overwrite; the CLI says what to do."""
    world = World("experiment")
    stub = StubApiServer(world)
    try:
        code, out = cli_over_http(stub, tmp_path, monkeypatch, "ab", "--set", "control=1:90,candidate=2:10",
                                  "--name", "decoder-v2")
        assert code == 0, out
        stub.stores[EXPERIMENT_PATH].update({"data": {"experiment.json": ""}}, "kubectl-edit")
        stub.objects[EXPERIMENT_PATH] = stub.stores[EXPERIMENT_PATH].get()
        managers = {m["manager"] for m in stub.objects[EXPERIMENT_PATH]["metadata"]["managedFields"]}
        assert "kubectl-edit" in managers
        code, out = cli_over_http(stub, tmp_path, monkeypatch, "ab", "--set", "control=1:50,candidate=2:50",
                                  "--name", "decoder-v2")
        err = capsys.readouterr().err
        assert code == cli.API_ERROR and "409" in err and "another field manager owns a field" in err, (out, err)
        assert stub.objects[EXPERIMENT_PATH]["data"]["experiment.json"] == ""  # nothing overwritten
    finally:
        stub.close()


def test_a_field_the_cluster_does_not_know_is_refused_never_pruned(tmp_path, monkeypatch, capsys):
    world = World("raw-canary")
    stub = StubApiServer(world, release="v0.19.0")
    try:
        before = world.isvc
        code, _ = cli_over_http(stub, tmp_path, monkeypatch, "canary", "--version", "2", "--percent", "0")
        assert code == 2 and "no field spec.canary (added in KServe v0.20.0)" in capsys.readouterr().err
        assert stub.patches() == []
        # Past the preflight, strict field validation makes the API server refuse the patch;
        # without it, the API server would have pruned spec.canary and answered 200.
        code, _ = cli_over_http(stub, tmp_path, monkeypatch, "canary", "--version", "2", "--percent", "0",
                                "--skip-preflight")
        err = capsys.readouterr().err
        assert code == 1 and "422" in err and 'strict decoding error: unknown field "spec.canary"' in err, err
        assert world.isvc["spec"] == before["spec"]
    finally:
        stub.close()


# -- version sets: one repository, several versions (for an experiment's pod) ----------------------------

def test_a_version_set_holds_every_version_and_serves_exactly_them(tmp_path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    from cubeserve.deploy import PREDICT_MODEL, STREAM_MODEL
    from cubeserve.rollout.version_sets import build_version_set, publish_version_set, served_versions, set_uri
    from cubeserve.serving.repository import build_version_repository

    store = tmp_path / "store"
    registry = r.VersionRegistry(f"file://{store}", ("1", "2", "3"))
    for v in (1, 3):  # as the pipeline's package step writes them: <baseUri>/<V>/
        weights = tmp_path / f"weights-{v}"
        weights.mkdir()
        (weights / "shape_gpt.safetensors").write_text(f"weights of version {v}")
        build_version_repository(weights, v, store / str(v), "cpu")
    uri = publish_version_set(registry, ["3", "1"])
    assert uri == set_uri(registry, [1, 3]) == f"file://{store}/sets/1-3/"
    assert served_versions(uri, registry) == {1, 3}
    served = store / "sets" / "1-3"
    for model in (PREDICT_MODEL, STREAM_MODEL):
        config = text_format.Parse((served / model / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())
        assert list(config.version_policy.specific.versions) == [1, 3]  # Triton loads both
        assert sorted(p.name for p in (served / model).iterdir() if p.is_dir()) == ["1", "3"]
    for v in (1, 3):
        assert (served / STREAM_MODEL / str(v) / "weights" / "shape_gpt.safetensors").read_text() == f"weights of version {v}"
    # What a pod cannot load, and what is not a set.
    with pytest.raises(r.RolloutError, match="unknown version '7'"):
        publish_version_set(registry, [1, 7])
    with pytest.raises(r.RolloutError, match="two or more different versions"):
        set_uri(registry, [1, 1])
    with pytest.raises(r.RolloutError, match="integers >= 1"):
        set_uri(registry, ["1", "a"])
    with pytest.raises(FileExistsError):
        build_version_set({1: store / "1", 3: store / "3"}, served)
    assert served_versions(f"file://{store}/sets/1-9/", registry) is None  # 9 is not a registry version
    assert served_versions(f"file://{store}/2/", registry) == {2}
    assert served_versions("gs://elsewhere/1/", registry) is None


def test_cli_version_set(tmp_path, monkeypatch, capsys):
    from cubeserve.serving.repository import build_version_repository

    store = tmp_path / "store"
    cluster = FakeCluster(World("raw-canary"))
    cluster.registry = lambda name: r.VersionRegistry(f"file://{store}", ("1", "2"))
    code, out = run(cluster, monkeypatch, "version-set", "--versions", "1,2", "--dry-run")
    assert code == 0 and f"to file://{store}/sets/1-2/" in out and not store.exists()
    code, _ = run(cluster, monkeypatch, "version-set", "--versions", "1,2")  # nothing uploaded yet
    assert code == 1 and "nothing to download" in capsys.readouterr().err
    for v in (1, 2):
        (tmp_path / f"w{v}").mkdir()
        (tmp_path / f"w{v}" / "config.yaml").write_text(f"version {v}")
        build_version_repository(tmp_path / f"w{v}", v, store / str(v), "gpu")
    code, out = run(cluster, monkeypatch, "version-set", "--versions", "2,1")
    assert code == 0 and out.strip() == f"file://{store}/sets/1-2/"
    assert (store / "sets" / "1-2" / "cube3d_stream" / "2" / "weights" / "config.yaml").read_text() == "version 2"
    code, _ = run(cluster, monkeypatch, "version-set", "--versions", "1")
    assert code == 2 and "two or more different versions" in capsys.readouterr().err


def test_cli_ab_replaces_an_experiment_the_server_refuses(monkeypatch):
    cluster = experiment_world()
    cluster.configmaps["cube3d-experiment"] = {"metadata": {"name": "cube3d-experiment", "resourceVersion": "4"},
                                               "data": {"experiment.json": '{"name": "x", "arms": [{"name": "a", "version": 0, "weight": 1}]}'}}
    code, out = run(cluster, monkeypatch, "ab", "--set", "a=1:50,b=2:50")
    assert code == 2  # no name to keep: the broken one has none the server accepts
    code, out = run(cluster, monkeypatch, "ab", "--set", "a=1:50,b=2:50", "--name", "fixed")
    assert code == 0 and out.startswith("ConfigMap cube3d-experiment: an experiment the server refuses -> "
                                        "experiment 'fixed'")
    assert written(cluster).name == "fixed"


@per_release
def test_raw_predictor_ready_unknown_while_the_stable_deployment_rolls_is_not_ready(release):
    """A change of the stable predictor's pod template that keeps its storageUri (here an
    annotation that reaches the template) rolls the Deployment: the phase stays stable (every pod
    serves the spec's version), the new pod is not available yet. KServe v0.16.0-v0.19.x report
    that as PredictorReady Unknown (PropagateRawStatus: Progressing True with a reason other than
    NewReplicaSetAvailable, inference_service_status.go 397 at v0.16.0, v0.17.0 and v0.19.0;
    v0.20.0 421 only where Available is not True): KServe has not said it is ready, so the tool
    must not read it as ready. Before v0.16.0 and on v0.20.0 the old pod's Available says True."""
    from cubeserve.rollout.state import condition_of

    world = World("raw-canary", release=release)
    assert (world.state().phase, world.state().ready) == ("stable", True)
    starts = len(world.kserve.model_starts)
    world.store.update({"metadata": {"annotations": {"example.com/owner": "another team"}}}, "kubectl-edit")
    world.kserve.reconcile()
    assert len(world.kserve.model_starts) == starts + 1  # a new pod starts; the old one serves meanwhile
    assert world.kserve.serving() == [(f"{BASE}/1/", 100)]
    unknown = kserve_version("v0.16.0") <= kserve_version(release) < kserve_version("v0.20.0")
    reported = condition_of(world.isvc, "PredictorReady")
    assert (reported["status"], reported.get("reason")) == (
        ("Unknown", "ReplicaSetUpdated") if unknown else
        ("True", "MinimumReplicasAvailable" if kserve_version(release) >= kserve_version("v0.16.0") else None)), reported
    state = world.state()
    assert (state.phase, state.stable, state.failure) == ("stable", "1", None)
    assert state.ready is (None if unknown else True), state
    world.kserve.start_pods()
    assert world.state().ready is True
