"""Plans: the rollout state and a request in, one JSON merge patch (or a refusal) out.

The checks every command shares live in plan_canary / plan_promote / plan_rollback; what the
patch looks like is the deployment mode's business, one strategy class each:

* Serverless (Knative): the predictor's storageUri is the version being rolled out and
  canaryTrafficPercent its share; KServe sends the rest to the last rolled-out revision. Promote
  removes canaryTrafficPercent: a route change, nothing restarts. Rollback first pins all the
  traffic to the old revision while reverting storageUri (canaryTrafficPercent 0), then, once the
  reverted revision is ready, removes canaryTrafficPercent.
* RawDeployment (KServe v0.20+): the canary is spec.canary[0], its own Deployment
  `<isvc>-v<V>-predictor`. Promote names the stable predictor after the canary and drops the
  entry: KServe keeps that Deployment as the stable one (no restart) and deletes the old one.
  Rollback drops the entry.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Mapping

from cubeserve.rollout.errors import NotReady, RolloutError
from cubeserve.rollout.patch import describe_changes
from cubeserve.rollout.state import (CANARY, RAW, ROLLING_BACK, SERVERLESS, STABLE, UPDATING, Revisions, RolloutState,
                                     get, object_name, rollout_state)
from cubeserve.rollout.versions import VersionRegistry, predictor_name

TAG_ROUTING_ANNOTATION = "serving.kserve.io/enable-tag-routing"
# The predictor container's name in KServe; the CRD requires it in a spec.canary[] model.
PREDICTOR_CONTAINER = "kserve-container"


@dataclass(frozen=True)
class Plan:
    """What a command will do: `patch` (a JSON merge patch, None when nothing changes) and, for
    people, a one-line `summary` and the `changes` it makes, one field per line."""

    summary: str
    patch: dict | None = None
    changes: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()  # what people should know beside the changes (e.g. what it costs)

    @property
    def changed(self) -> bool:
        return self.patch is not None


def _plan(obj: Mapping, summary: str, patch: dict, notes: tuple[str, ...] = ()) -> Plan:
    patch = copy.deepcopy(patch)
    version = get(obj, "metadata", "resourceVersion")
    if version:  # optimistic concurrency: the API server refuses the patch if obj changed since
        patch.setdefault("metadata", {})["resourceVersion"] = version
    return Plan(summary, patch, tuple(describe_changes(obj, patch)), notes)


class Serverless:
    def start(self, isvc: Mapping, version: str, uri: str, percent: int) -> dict:
        patch: dict[str, Any] = {"spec": {"predictor": {"canaryTrafficPercent": percent, "model": {"storageUri": uri}}}}
        if get(isvc, "metadata", "annotations", TAG_ROUTING_ANNOTATION) != "true":
            # latest-/prev- hosts for both revisions; in the same patch as the new storageUri,
            # which makes a new revision anyway.
            patch["metadata"] = {"annotations": {TAG_ROUTING_ANNOTATION: "true"}}
        return patch

    def share(self, isvc: Mapping, percent: int) -> dict:
        return {"spec": {"predictor": {"canaryTrafficPercent": percent}}}

    def promote(self, isvc: Mapping, state: RolloutState) -> dict:
        return {"spec": {"predictor": {"canaryTrafficPercent": None}}}

    def rollback(self, isvc: Mapping, state: RolloutState, force: bool) -> tuple[str, dict]:
        if state.phase == ROLLING_BACK:
            _require_ready(state, force, "finish the rollback")
            return (f"finish the rollback: the new revision of version {state.stable} gets all the traffic",
                    {"spec": {"predictor": {"canaryTrafficPercent": None}}})
        if state.stable_uri is None:
            raise RolloutError(f"{state.name}: KServe reports no rolled-out revision of a registry version "
                               "to go back to")
        if state.percent == 100:
            # KServe already counts the canary revision as rolled out, so pinning `prev` would point
            # at it. Roll forward to the stable version instead: the canary keeps serving until that
            # revision is ready, then it takes over.
            return (f"roll back version {state.canary} (at 100%): version {state.stable} takes all the "
                    "traffic once its new revision is ready",
                    {"spec": {"predictor": {"canaryTrafficPercent": None, "model": {"storageUri": state.stable_uri}}}})
        return (f"roll back version {state.canary}: all traffic to the previous revision (version "
                f"{state.stable}) now; run `rollback` again once the reverted revision is ready to finish",
                {"spec": {"predictor": {"canaryTrafficPercent": 0, "model": {"storageUri": state.stable_uri}}}})


class Raw:
    def start(self, isvc: Mapping, version: str, uri: str, percent: int) -> dict:
        model_format = get(isvc, "spec", "predictor", "model", "modelFormat") or {"name": "triton"}
        # Merged over spec.predictor by KServe: only the checkpoint differs. The name names the
        # canary's Deployment and Service (<isvc>-v<V>-predictor).
        entry = {"predictor": {"name": predictor_name(version),
                               "model": {"name": PREDICTOR_CONTAINER, "modelFormat": copy.deepcopy(dict(model_format)),
                                         "storageUri": uri}},
                 "trafficPercent": percent}
        return {"spec": {"canary": [entry]}}

    def share(self, isvc: Mapping, percent: int) -> dict:
        entry = copy.deepcopy(isvc["spec"]["canary"][0])
        entry["trafficPercent"] = percent
        return {"spec": {"canary": [entry]}}

    def promote(self, isvc: Mapping, state: RolloutState) -> dict:
        # The canary's Deployment becomes the stable one (KServe v0.20 InferenceServiceSpec.Canary:
        # "To promote a canary without restart, set predictor.name to the canary name and remove
        # the canary entry"); the old stable Deployment is deleted as an orphan.
        name = get(isvc, "spec", "canary", default=[{}])[0].get("predictor", {}).get("name")
        return {"spec": {"predictor": {"name": name, "model": {"storageUri": state.canary_uri}}, "canary": None}}

    def rollback(self, isvc: Mapping, state: RolloutState, force: bool) -> tuple[str, dict]:
        return (f"roll back the canary of version {state.canary}: version {state.stable} gets all the traffic",
                {"spec": {"canary": None}})


STRATEGIES = {SERVERLESS: Serverless(), RAW: Raw()}


def _percent(percent: Any) -> int:
    if isinstance(percent, bool) or not isinstance(percent, int) or not 0 <= percent <= 100:
        raise RolloutError(f"--percent must be an integer from 0 to 100, got {percent!r}")
    return percent


def _refuse_drift(state: RolloutState) -> None:
    if state.drift:
        raise RolloutError(f"{state.name}: " + "; ".join(state.drift) +
                           ". Settle it first (`cubeserve rollout status`), then run the command again")


# The label the A/B overlay puts on each arm (k8s/overlays/ab/a, b).
AB_ARM_LABEL = "cube-serve.io/ab-arm"


def _refuse_ab_arm(isvc: Mapping, state: RolloutState, action: str) -> None:
    """A raw promote renames the stable predictor, and KServe v0.20.0 then deletes the old
    predictor's Deployment and Service as orphans (components/predictor.go 1002-1035), the Service
    the A/B HTTPRoute names (`<isvc>-predictor`): the arm would lose its traffic. An arm changes
    version by a new InferenceService and the route's weights (`cubeserve rollout ab`)."""
    arm = get(isvc, "metadata", "labels", AB_ARM_LABEL)
    if arm and state.mode == RAW:
        raise RolloutError(f"{state.name} is arm {arm} of a cross-pod A/B test (label {AB_ARM_LABEL}): a raw "
                           f"{action} would rename its predictor and KServe would delete the Service "
                           f"{state.name}-predictor that the A/B HTTPRoute sends the arm's traffic to; change "
                           "the arms with `cubeserve rollout ab` instead")


def plan_canary(isvc: Mapping, registry: VersionRegistry, version: str, percent: int,
                revisions: Revisions | None = None, mode: str | None = None) -> Plan:
    """Start a canary of `version` with `percent` of the traffic, or change the share of the
    canary of that same version. Refuses while another rollout is unfinished, and on an arm of
    the cross-pod A/B test in RawDeployment mode (its promote would take the arm's Service away)."""
    percent = _percent(percent)
    uri = registry.require(version)
    state = rollout_state(isvc, registry, revisions, mode)
    strategy = STRATEGIES[state.mode]
    _refuse_ab_arm(isvc, state, "canary (and its promote)")
    _refuse_drift(state)
    if state.phase == ROLLING_BACK:
        raise RolloutError(f"{state.name}: the rollback to version {state.stable} is not finished: "
                           "run `cubeserve rollout rollback` again once its revision is ready")
    if state.phase == UPDATING:
        raise RolloutError(f"{state.name}: {state.summary()}; wait until KServe has finished")
    if state.phase == CANARY:
        if state.canary != version:
            raise RolloutError(f"{state.name}: a canary of version {state.canary} ({state.percent}%) is "
                               "in progress: promote it or roll it back first")
        if state.percent == percent:
            return Plan(f"canary of version {version} already at {percent}%: nothing to change")
        return _plan(isvc, f"canary of version {version}: {state.percent}% -> {percent}%", strategy.share(isvc, percent))
    if state.storage_uri is None:
        raise RolloutError(f"{state.name} has no storageUri (it serves the model inside its image): "
                           "nothing to roll out")
    if state.stable is None:
        raise RolloutError(f"{state.name}: its storageUri {state.storage_uri} is not a version of the "
                           f"registry ({registry.base_uri}/<version>/), so a rollback would have "
                           "nothing to return to")
    if version == state.stable:
        raise RolloutError(f"{state.name}: version {version} is already the stable version")
    _refuse_keda_raw_canary(isvc, state)
    return _plan(isvc, f"canary of version {version} at {percent}% (stable: version {state.stable})",
                 strategy.start(isvc, version, uri, percent), (canary_replicas(isvc, state.mode, percent),))


AUTOSCALER_CLASS_ANNOTATION = "serving.kserve.io/autoscalerClass"


def _refuse_keda_raw_canary(isvc: Mapping, state: RolloutState) -> None:
    """KServe v0.20.0 gives a spec.canary[] entry fixed replicas (its autoscaling fields zeroed:
    components/predictor.go buildCanaryPredictor 897-910) but the service's autoscaler class: with
    `keda`, a ScaledObject without triggers, which KEDA's CRD refuses (spec.triggers minItems 1,
    keda v2.20.2 apis/keda/v1alpha1/scaledobject_types.go 125), and the reconcile of the whole
    InferenceService fails there. Overriding the class on the canary alone would change its pod
    template, so the promote that renames it would restart its pods."""
    annotations = {**(get(isvc, "metadata", "annotations") or {}),
                   **(get(isvc, "spec", "predictor", "annotations") or {})}
    if state.mode == RAW and annotations.get(AUTOSCALER_CLASS_ANNOTATION) == "keda":
        raise RolloutError(
            f"{state.name} autoscales through KEDA ({AUTOSCALER_CLASS_ANNOTATION}: keda): KServe would give a "
            "RawDeployment canary a ScaledObject without triggers, which KEDA's CRD refuses, and stop "
            "reconciling the service. Roll out across two InferenceServices instead, each autoscaled on "
            "its own pods (k8s/overlays/ab and `cubeserve rollout ab --httproute ... --weights`), or use "
            "the Serverless mode")


def canary_replicas(isvc: Mapping, mode: str, percent: int) -> str:
    """What a canary costs in replicas (GPUs), as KServe sizes it."""
    predictor = get(isvc, "spec", "predictor") or {}
    minimum, maximum = predictor.get("minReplicas", 1), predictor.get("maxReplicas") or "unlimited"
    if mode == RAW:
        # components/predictor.go canaryReplicaCount 886-895 and the stable's minimum 795-803; the
        # canary's HPA raises a minimum below 1 to 1 (hpa_reconciler.go 154-157) (v0.20.0)
        canary = -(-minimum * percent // 100)
        return (f"the canary runs {max(canary, 1)} replica(s) (ceil(minReplicas {minimum} x {percent}%), at least 1), "
                f"fixed; the stable's minimum drops to {max(minimum - canary, 1)} meanwhile")
    return (f"the canary revision keeps at least {minimum} replica(s) of its own (minReplicas) beside the "
            f"stable revision's, each revision scaling on its own traffic up to {maximum}")


def _require_canary(state: RolloutState, canary: str | None, action: str) -> None:
    """A roll-out that started the canary of version `canary` acts on that one only: another
    roll-out may have replaced it since (the patch's resourceVersion covers the time after this
    read)."""
    if canary is not None and (state.phase in (STABLE, UPDATING) or state.canary != canary):
        now = f"the canary is version {state.canary}" if state.phase not in (STABLE, UPDATING) else state.summary()
        raise RolloutError(f"{state.name}: cannot {action} the canary of version {canary}: {now} "
                           "(another roll-out changed the InferenceService)")


def plan_promote(isvc: Mapping, registry: VersionRegistry, revisions: Revisions | None = None,
                 mode: str | None = None, force: bool = False, canary: str | None = None) -> Plan:
    """Give the canary all the traffic and make it the stable version (only if it is version
    `canary`, when given)."""
    state = rollout_state(isvc, registry, revisions, mode)
    _refuse_ab_arm(isvc, state, "promote")
    _refuse_drift(state)  # first: "nothing to promote" would hide a canary written over
    _require_canary(state, canary, "promote")
    if state.phase in (STABLE, UPDATING):
        return Plan(f"{state.name}: no canary in progress ({state.summary()}): nothing to promote")
    if state.phase == ROLLING_BACK:
        raise RolloutError(f"{state.name}: a rollback to version {state.stable} is in progress: "
                           "finish it with `cubeserve rollout rollback`")
    _require_ready(state, force, "promote")
    return _plan(isvc, f"promote version {state.canary} to stable (was version {state.stable})",
                 STRATEGIES[state.mode].promote(isvc, state))


def plan_rollback(isvc: Mapping, registry: VersionRegistry, revisions: Revisions | None = None,
                  mode: str | None = None, force: bool = False, canary: str | None = None) -> Plan:
    """Send all the traffic back to the stable version and drop the canary (only if it is
    version `canary`, when given)."""
    state = rollout_state(isvc, registry, revisions, mode)
    _require_canary(state, canary, "roll back")
    share = get(isvc, "spec", "predictor", "canaryTrafficPercent")
    if state.phase in (STABLE, UPDATING) and state.drift and state.mode == SERVERLESS and share is not None:
        # The canary's storageUri was written over (state.py): drop the share, back on the
        # rolled-out version, so that nothing splits traffic nobody rolls out.
        return _plan(isvc, f"drop the canary share ({share}%): all traffic to version {state.stable}",
                     {"spec": {"predictor": {"canaryTrafficPercent": None, "model": {"storageUri": state.stable_uri}}}})
    if state.phase in (STABLE, UPDATING):
        return Plan(f"{state.name}: no canary in progress ({state.summary()}): nothing to roll back")
    summary, patch = STRATEGIES[state.mode].rollback(isvc, state, force)
    return _plan(isvc, summary, patch)


def _require_ready(state: RolloutState, force: bool, action: str) -> None:
    if force or state.ready:
        return
    if state.failure:  # no use waiting: KServe says it will not become ready
        raise RolloutError(f"{state.name}: cannot {action}: KServe reports a failure: {state.failure}; "
                           "roll back with `cubeserve rollout rollback`")
    what = "the canary deployment" if state.mode == RAW else "the revision for the current spec"
    why = "is not ready yet" if state.ready is False else "has not been made by KServe yet"
    raise NotReady(f"{state.name}: cannot {action}: {what} {why}; try again, pass --wait SECONDS, "
                   "or --force")


# -- the cross-pod A/B overlay's HTTPRoute (k8s/overlays/ab) ----------------------------------------

# The response header the route adds per backend, naming the arm; it also names the backend here.
ARM_HEADER = "x-cube3d-arm"


def parse_weights(text: str) -> dict[str, int]:
    """`a=80,b=20` -> {"a": 80, "b": 20} (names lower-cased)."""
    weights: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",")):
        name, sep, value = part.partition("=")
        name = name.strip().lower()
        if not sep or not name:
            raise RolloutError(f"--weights takes NAME=WEIGHT pairs separated by commas, got {text!r}")
        try:
            weight = int(value)
        except ValueError:
            raise RolloutError(f"--weights: the weight of {name!r} must be an integer, got {value.strip()!r}") from None
        if not 0 <= weight <= 100:
            raise RolloutError(f"--weights: the weight of {name!r} must be from 0 to 100, got {weight}")
        if name in weights:
            raise RolloutError(f"--weights: {name!r} is given twice")
        weights[name] = weight
    return weights


def backend_arm(backend: Mapping) -> str | None:
    """The arm a backendRef serves: the value its ResponseHeaderModifier sets for ARM_HEADER."""
    for f in backend.get("filters") or ():
        for header in get(f, "responseHeaderModifier", "set", default=()) or ():
            if str(header.get("name", "")).lower() == ARM_HEADER:
                return str(header.get("value", "")).lower()
    return None


def weighted_rule(route: Mapping) -> int:
    """The index of the route's rule that splits by weight: the one with more than one backend."""
    rules = get(route, "spec", "rules", default=[]) or []
    found = [i for i, rule in enumerate(rules) if len(rule.get("backendRefs") or ()) > 1]
    if len(found) != 1:
        raise RolloutError(f"HTTPRoute {object_name(route)}: expected one rule with several backendRefs "
                           f"(the weighted split), found {len(found)}")
    return found[0]


def plan_route_weights(route: Mapping, weights: Mapping[str, int]) -> Plan:
    """Set the weights of the weighted rule's backends, by arm (case-insensitive), as percentages
    adding up to 100. Requests that pin an arm (header x-cube3d-arm) are not affected."""
    name = object_name(route)
    index = weighted_rule(route)
    rules = copy.deepcopy(get(route, "spec", "rules"))
    backends = rules[index]["backendRefs"]
    arms = [backend_arm(b) for b in backends]
    if None in arms or len(set(arms)) != len(arms):
        raise RolloutError(f"HTTPRoute {name}: every backend of the weighted rule needs a ResponseHeaderModifier "
                           f"setting a distinct {ARM_HEADER} (the arm's name)")
    weights = {k.lower(): v for k, v in weights.items()}
    for key, weight in weights.items():
        if isinstance(weight, bool) or not isinstance(weight, int) or not 0 <= weight <= 100:
            raise RolloutError(f"the weight of {key!r} must be an integer from 0 to 100, got {weight!r}")
    unknown = sorted(set(weights) - set(arms))
    missing = [a for a in arms if a not in weights]
    if unknown:
        raise RolloutError(f"HTTPRoute {name}: no arm named {', '.join(unknown)} (arms: {', '.join(arms)})")
    if missing:
        raise RolloutError(f"HTTPRoute {name}: give a weight to every arm (missing: {', '.join(missing)})")
    if sum(weights.values()) != 100:
        raise RolloutError(f"the weights must add up to 100, got {sum(weights.values())}")
    # An absent weight is 1 (Gateway API's default).
    before = ",".join(f"{a}={b.get('weight', 1)}" for a, b in zip(arms, backends))
    after = ",".join(f"{a}={weights[a]}" for a in arms)
    if before == after:
        return Plan(f"HTTPRoute {name}: weights already {after}: nothing to change")
    for arm, backend in zip(arms, backends):
        backend["weight"] = weights[arm]
    # spec.rules is an atomic list: a merge patch replaces it whole, the other rules as they were.
    return _plan(route, f"HTTPRoute {name}: weights {before} -> {after}", {"spec": {"rules": rules}})
