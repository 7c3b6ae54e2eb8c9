"""What an InferenceService is doing, as KServe reports it.

The spec says what was asked; only the status says what KServe has done. Readiness and traffic
therefore come from what KServe's controller writes (v0.14-v0.20,
pkg/apis/serving/v1beta1/inference_service_status.go and components/predictor.go), never from
`metadata.generation` against `status.observedGeneration`: KServe copies observedGeneration from
the Knative Service or from the stable Deployment (PropagateStatus, PropagateRawStatus), not from
the InferenceService, so the two are different counters.

* Serverless: `status.components.predictor` names the revisions (latestCreatedRevision,
  latestReadyRevision, latestRolledoutRevision, previousRolledoutRevision) and the traffic each
  gets. Which checkpoint a revision serves is read from the revision itself (`revisions`: name ->
  storage URI, from the annotation KServe puts on its template), so the status cannot be mistaken
  for the spec: the revision made for the current spec exists once latestCreatedRevision serves
  the spec's storageUri.
* RawDeployment (KServe v0.20+ canaries): `status.canaryStatuses` (one per spec.canary entry, by
  name, with the canary Deployment's readiness) and the PredictorReady condition. KServe's raw
  status names no storage URI, so what the stable predictor's pods serve is read from its
  Deployment's ReplicaSets (the Deployment's revisions: each keeps the pod template, with KServe's
  storage URI annotation, and counts its available pods): a storageUri edited in place rolls the
  Deployment, and until the new pod is available the old ReplicaSet's pods serve.
* A failure is KServe's condition as it reports it: a Knative revision that failed
  (PredictorConfigurationReady False, reason RevisionFailed) or a Deployment past its progress
  deadline (PredictorReady False; reported from KServe v0.16.0), so `--wait` stops at once
  instead of waiting for readiness that will not come.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from cubeserve.rollout.errors import RolloutError
from cubeserve.rollout.versions import VersionRegistry, predictor_name

MODE_ANNOTATION = "serving.kserve.io/deploymentMode"
# KServe's annotation on the predictor's pod template (and so on each Knative revision): the
# storageUri that revision downloads (constants.StorageInitializerSourceUriInternalAnnotationKey).
REVISION_URI_ANNOTATION = "internal.serving.kserve.io/storage-initializer-sourceuri"
# The field manager of every write `cubeserve rollout` makes (metadata.managedFields says who
# wrote each field last).
FIELD_MANAGER = "cubeserve-rollout"

SERVERLESS, RAW = "Serverless", "RawDeployment"
# KServe's current names (Knative, Standard) and the older ones both occur in the wild.
_MODES = {"serverless": SERVERLESS, "knative": SERVERLESS, "rawdeployment": RAW, "raw": RAW,
          "standard": RAW}

STABLE, CANARY, ROLLING_BACK, UPDATING = "stable", "canary", "rolling-back", "updating"

STORAGE_URI = ("spec", "predictor", "model", "storageUri")
CANARY_PERCENT = ("spec", "predictor", "canaryTrafficPercent")


def get(obj: Mapping | None, *path: str, default: Any = None) -> Any:
    for key in path:
        if not isinstance(obj, Mapping) or key not in obj:
            return default
        obj = obj[key]
    return obj


def object_name(obj: Mapping) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '?')}".lstrip("/")


def deployment_mode(isvc: Mapping, override: str | None = None) -> str:
    """Serverless or RawDeployment: --mode, else what KServe recorded in the status, else the
    annotation. The cluster's default is not visible from here, so a missing one is an error."""
    for source in (override, get(isvc, "status", "deploymentMode"), get(isvc, "metadata", "annotations", MODE_ANNOTATION)):
        if source and source.lower() != "auto":
            mode = _MODES.get(source.lower())
            if mode is None:
                raise RolloutError(f"deployment mode {source!r} is not supported (Serverless or RawDeployment)")
            return mode
    if get(isvc, "spec", "canary"):
        return RAW
    raise RolloutError(f"cannot tell the deployment mode of {object_name(isvc)}: set the annotation "
                       f"{MODE_ANNOTATION} (Serverless or RawDeployment) or pass --mode")


def writers(obj: Mapping, path: tuple[str, ...]) -> list[str]:
    """The field managers that own `path` in metadata.managedFields (who wrote it last)."""
    found = []
    for entry in get(obj, "metadata", "managedFields", default=()) or ():
        fields = entry.get("fieldsV1") or {}
        for key in path:
            fields = fields.get(f"f:{key}") if isinstance(fields, Mapping) else None
            if fields is None:
                break
        else:
            found.append(entry.get("manager", "?"))
    return found


def condition_of(obj: Mapping, kind: str) -> Mapping:
    """The status condition of type `kind` ({} if there is none)."""
    for c in get(obj, "status", "conditions", default=()) or ():
        if c.get("type") == kind:
            return c
    return {}


def condition(obj: Mapping, kind: str) -> bool | None:
    return {"True": True, "False": False}.get(condition_of(obj, kind).get("status"))


def _failure(isvc: Mapping, kind: str, reasons: tuple[str, ...] | None = None) -> str | None:
    """`kind` False (with one of `reasons`, when given) as "reason: message"; else None."""
    c = condition_of(isvc, kind)
    if c.get("status") != "False" or (reasons is not None and c.get("reason") not in reasons):
        return None
    return ": ".join(p for p in (c.get("reason"), c.get("message")) if p) or f"{kind} is False"


def _same_uri(a: str | None, b: str | None) -> bool:
    return bool(a) and bool(b) and a.rstrip("/") == b.rstrip("/")


@dataclass(frozen=True)
class Route:
    """One traffic target as KServe reports it."""

    target: str  # the Knative revision, or the Deployment's predictor name
    percent: int
    version: str | None  # the checkpoint version it serves (None: not a registry version / unknown)
    uri: str | None = None
    tag: str | None = None
    note: str | None = None  # what the share means where it is not a traffic split


# Kubernetes' Deployment controller: each ReplicaSet's place in the Deployment's history.
DEPLOYMENT_REVISION = "deployment.kubernetes.io/revision"
# KServe's label on a predictor's pods (and so on its ReplicaSets): the InferenceService's name.
ISVC_LABEL = "serving.kserve.io/inferenceservice"


@dataclass(frozen=True)
class ReplicaSet:
    """One revision of a RawDeployment predictor's Deployment: the storage URI its pod template
    downloads and how many of its pods are available (0 for the history kept after a roll)."""

    name: str
    deployment: str
    revision: int
    uri: str | None
    available: int


def replica_sets_of(objects: Sequence[Mapping]) -> tuple[ReplicaSet, ...]:
    """ReplicaSets as the API server lists them (apps/v1), those a Deployment owns."""
    found = []
    for rs in objects:
        owner = next((o.get("name") for o in get(rs, "metadata", "ownerReferences", default=()) or ()
                      if o.get("kind") == "Deployment" and o.get("controller")), None)
        if owner is None:
            continue
        try:
            revision = int(get(rs, "metadata", "annotations", DEPLOYMENT_REVISION, default="0"))
        except ValueError:
            revision = 0
        found.append(ReplicaSet(get(rs, "metadata", "name", default="?"), owner, revision,
                                get(rs, "spec", "template", "metadata", "annotations", REVISION_URI_ANNOTATION),
                                int(get(rs, "status", "availableReplicas", default=0) or 0)))
    return tuple(sorted(found, key=lambda r: (r.deployment, r.revision)))


def stable_deployment(isvc: Mapping) -> str:
    """The stable predictor's Deployment (and Service): KServe's PredictorServiceName."""
    name, predictor = get(isvc, "metadata", "name", default="?"), get(isvc, "spec", "predictor", "name")
    return f"{name}-{predictor}-predictor" if predictor else f"{name}-predictor"


@dataclass(frozen=True)
class RolloutState:
    """What an InferenceService is doing, as far as rollouts go."""

    name: str
    mode: str
    phase: str  # stable | canary | rolling-back | updating
    stable: str | None  # the checkpoint version serving the non-canary traffic (rollback target)
    canary: str | None = None  # the version being rolled out / the version the spec moves to
    percent: int | None = None  # the canary's share, as the spec asks
    ready: bool | None = None  # what the spec describes is ready (None: KServe has not caught up)
    storage_uri: str | None = None  # spec.predictor.model.storageUri as it is
    stable_uri: str | None = None  # where a rollback returns to
    canary_uri: str | None = None  # what a promote makes stable
    traffic: tuple[Route, ...] = ()  # as KServe reports it
    drift: tuple[str, ...] = field(default=())  # changes not made by `cubeserve rollout`
    failure: str | None = None  # why what the spec describes cannot become ready (KServe's condition)

    def summary(self) -> str:
        stable = f"version {self.stable}" if self.stable else "no rolled-out version"
        if self.phase == STABLE:
            return f"stable: {stable}"
        if self.phase == ROLLING_BACK:
            return f"rolling back to {stable}: waiting for its new revision to be ready"
        if self.phase == UPDATING:
            target = f"version {self.canary}" if self.canary else (self.storage_uri or "no storageUri")
            return f"updating: {target} takes all the traffic once ready (now: {stable})"
        if self.mode == RAW:  # KServe v0.20 routes nothing to it (see _raw_state)
            return (f"canary of version {self.canary}: dark launch, no traffic (trafficPercent {self.percent} "
                    f"sizes its replicas) (stable: {stable})")
        return f"canary of version {self.canary} at {self.percent}% (stable: {stable})"


Revisions = Mapping[str, str] | Sequence[ReplicaSet]


def rollout_state(isvc: Mapping, registry: VersionRegistry, revisions: Revisions | None = None,
                  mode: str | None = None) -> RolloutState:
    """The rollout state of `isvc`. `revisions`, what the pods serve, read from the cluster
    (Cluster.revisions): Serverless, Knative revision name -> the storage URI it serves, for the
    revisions its status names; RawDeployment, the ReplicaSets of its predictor Deployments."""
    mode = deployment_mode(isvc, mode)
    if mode == SERVERLESS:
        return _serverless_state(isvc, registry, revisions if isinstance(revisions, Mapping) else {})
    return _raw_state(isvc, registry, () if revisions is None or isinstance(revisions, Mapping) else revisions)


def _serverless_state(isvc: Mapping, registry: VersionRegistry, revisions: Mapping[str, str]) -> RolloutState:
    name = object_name(isvc)
    uri = get(isvc, *STORAGE_URI)
    version = registry.version_of(uri)
    percent = get(isvc, "spec", "predictor", "canaryTrafficPercent")
    component = get(isvc, "status", "components", "predictor") or {}
    created = component.get("latestCreatedRevision")
    rolled = component.get("latestRolledoutRevision")

    def version_of(revision: str | None) -> tuple[str | None, str | None]:
        served = revisions.get(revision) if revision else None
        return registry.version_of(served), served

    # The revision for the current spec exists once the latest created one serves its storageUri.
    fresh = bool(created) and _same_uri(revisions.get(created), uri)
    ready = (component.get("latestReadyRevision") == created) if fresh else None
    traffic = tuple(Route(t.get("revisionName", "?"), int(t.get("percent") or 0),
                          *version_of(t.get("revisionName")), tag=t.get("tag"))
                    for t in component.get("traffic") or ())
    # The rollback target: the last revision KServe rolled out to 100% (ksvc_reconciler routes the
    # rest of a canary's split to it, tag `prev`). KServe also counts a canary at 100% as rolled
    # out; then the one before it is the stable one.
    stable_revision = rolled
    if percent is not None and fresh and rolled == created:
        stable_revision = component.get("previousRolledoutRevision")
    stable, stable_uri = version_of(stable_revision)
    # Knative's verdict on the latest created revision, once it is the spec's (KServe copies
    # ConfigurationsReady as PredictorConfigurationReady).
    failure = _failure(isvc, "PredictorConfigurationReady", ("RevisionFailed",)) if fresh else None
    if failure:
        ready = False
    common = dict(ready=ready, storage_uri=uri, traffic=traffic, failure=failure)

    if percent is None:
        if fresh and rolled == created:
            return RolloutState(name, SERVERLESS, STABLE, version, stable_uri=uri, **common)
        # The spec's storageUri takes all the traffic as soon as its revision is ready: a
        # promote or a roll-forward in progress, or an edit that skipped the canary.
        drift = ()
        if version != stable and FIELD_MANAGER not in writers(isvc, STORAGE_URI):
            who = ", ".join(writers(isvc, STORAGE_URI)) or "another client"
            drift = (f"spec.predictor.model.storageUri was changed by {who}, not by cubeserve rollout: "
                     f"{'version ' + version if version else uri} takes all the traffic without a canary "
                     f"once its revision is ready (KServe now serves {'version ' + stable if stable else 'nothing rolled out'})",)
        return RolloutState(name, SERVERLESS, UPDATING, stable, version or uri, stable_uri=stable_uri,
                            canary_uri=uri, drift=drift, **common)
    # Every write of `cubeserve rollout` that sets a canary share also writes storageUri (start,
    # rollback); so while its share is set, a storageUri another client owns was written over its
    # canary (e.g. the overlay applied again client-side): whatever the phase says, that is drift.
    drift = ()
    if FIELD_MANAGER in writers(isvc, CANARY_PERCENT) and FIELD_MANAGER not in writers(isvc, STORAGE_URI):
        who = ", ".join(writers(isvc, STORAGE_URI)) or "another client"
        drift = (f"spec.predictor.model.storageUri was changed by {who} while cubeserve rollout's canary share "
                 f"({percent}%) was set: the spec now asks for {'version ' + version if version else uri} "
                 f"(rolled out: {'version ' + stable if stable else 'nothing'}); put it back with `cubeserve "
                 "rollout canary` or `rollback --force`",)
    common["drift"] = drift
    if stable is None and stable_revision is None:
        # Nothing rolled out yet (a new InferenceService): its first revision takes everything.
        return RolloutState(name, SERVERLESS, UPDATING, None, version or uri, canary_uri=uri, **common)
    if version != stable:
        return RolloutState(name, SERVERLESS, CANARY, stable, version or uri, percent,
                            stable_uri=stable_uri, canary_uri=uri, **common)
    if percent == 0:  # storageUri reverted, traffic pinned to the old revision: half a rollback
        return RolloutState(name, SERVERLESS, ROLLING_BACK, stable, percent=0, stable_uri=stable_uri, **common)
    # canaryTrafficPercent over two revisions of one version: nothing to roll out.
    return RolloutState(name, SERVERLESS, STABLE, stable, stable_uri=stable_uri, **common)


def _raw_state(isvc: Mapping, registry: VersionRegistry, replica_sets: Sequence[ReplicaSet]) -> RolloutState:
    name = object_name(isvc)
    uri = get(isvc, *STORAGE_URI)
    version = registry.version_of(uri)
    stable_predictor = get(isvc, "spec", "predictor", "name") or ""
    canaries = get(isvc, "spec", "canary") or []
    statuses = {s.get("name"): s for s in get(isvc, "status", "canaryStatuses", default=()) or ()}
    who = ", ".join(writers(isvc, STORAGE_URI)) or "another client"
    drift: tuple[str, ...] = ()
    if stable_predictor and version and stable_predictor != predictor_name(version):
        # `promote` names the stable predictor after its version; a storageUri written over it
        # (an overlay applied again) rolls that Deployment to another version.
        drift += (f"the stable predictor {stable_predictor} has the storageUri of version {version}, "
                  f"written by {who}, not by cubeserve rollout",)
    # Pods of the stable Deployment that serve another storage URI than the spec's: a rolling
    # update in progress (the tool never rolls the stable Deployment in place).
    deployment = stable_deployment(isvc)
    pods = [rs for rs in replica_sets if rs.deployment == deployment and rs.available > 0]
    old = [rs for rs in pods if rs.uri != uri and not _same_uri(rs.uri, uri)]
    previous = max(old, key=lambda rs: rs.revision) if old else None
    previous_version = registry.version_of(previous.uri) if previous else None
    if previous and FIELD_MANAGER not in writers(isvc, STORAGE_URI) and not drift:
        drift += (f"spec.predictor.model.storageUri was changed by {who}, not by cubeserve rollout: "
                  f"{'version ' + version if version else uri} replaces "
                  f"{'version ' + previous_version if previous_version else previous.uri} on the pods of "
                  f"{deployment} without a canary (a rolling update; its old pods serve until the new "
                  "ones are available)",)
    # From KServe v0.16.0, a Deployment past its progress deadline is reported (PropagateRawStatus).
    failure = _failure(isvc, "PredictorReady", ("ProgressDeadlineExceeded", "FailedCreate"))
    common = dict(storage_uri=uri, drift=drift)
    if not canaries:
        if statuses:  # KServe has not caught up with the removal of the canary yet
            return RolloutState(name, RAW, UPDATING, version, stable_uri=uri, **common)
        if previous:
            total = sum(rs.available for rs in pods)
            traffic = tuple(Route(rs.name, round(100 * rs.available / total), registry.version_of(rs.uri), rs.uri)
                            for rs in sorted(pods, key=lambda rs: rs.revision, reverse=True))
            return RolloutState(name, RAW, UPDATING, previous_version, version or uri, ready=False,
                                stable_uri=previous.uri, canary_uri=uri, traffic=traffic, failure=failure, **common)
        return RolloutState(name, RAW, STABLE, version, ready=condition(isvc, "PredictorReady"), stable_uri=uri,
                            traffic=(Route(stable_predictor or "predictor", 100, version, uri),), failure=failure,
                            **common)
    if len(canaries) > 1:
        names = ", ".join(str(get(c, "predictor", "name")) for c in canaries)
        raise RolloutError(f"{name} has {len(canaries)} canaries ({names}); `cubeserve rollout` "
                           "handles one: edit spec.canary by hand")
    entry = canaries[0]
    canary_uri = get(entry, "predictor", "model", "storageUri")
    reported = statuses.get(get(entry, "predictor", "name"))
    ready = bool(reported.get("ready")) if reported else None
    traffic = ()
    if reported:
        # KServe v0.20.0 copies the spec's trafficPercent into canaryStatuses but routes nothing
        # to a raw canary: the share only sizes its replicas (components/predictor.go
        # canaryReplicaCount; its Ingress and HTTPRoute name the stable predictor alone).
        share = int(reported.get("trafficPercent") or 0)
        traffic = (Route(stable_predictor or "predictor", 100, version, uri),
                   Route(get(entry, "predictor", "name"), 0, registry.version_of(canary_uri), canary_uri,
                         note=f"dark launch, no traffic (trafficPercent {share} sizes its replicas only)"))
    return RolloutState(name, RAW, CANARY, version, registry.version_of(canary_uri) or canary_uri,
                        entry.get("trafficPercent", 0), ready, stable_uri=uri, canary_uri=canary_uri,
                        traffic=traffic, **common)
