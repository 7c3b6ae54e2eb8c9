"""`cubeserve rollout`: canary, promote, roll back and A/B-split cube-serve on KServe.

Every command is two steps. First a pure plan: the InferenceService (or InferenceGraph) as the
API server returns it, plus the version registry, go in; a `Plan` comes out, holding one JSON
merge patch (RFC 7386) and the list of fields it changes, or a `RolloutError` saying why not.
Then a thin client applies that patch with the object's resourceVersion as a precondition, so
a concurrent edit makes the patch fail instead of being overwritten. Tests drive the plans
directly (tests/test_rollout.py); nothing here needs a cluster until `Cluster` is built.

Versions. A checkpoint version V is the Triton model repository at `<baseUri>/<V>/`. The known
versions live in the ConfigMap `cube3d-versions` (keys `baseUri`, `versions`; see
k8s/base/runtime/versions.yaml), not on the InferenceService: KServe copies the service's
annotations into the pod template, so every edit of them would restart the model servers.

Modes (annotation serving.kserve.io/deploymentMode, or status.deploymentMode once KServe set it):
* Serverless (Knative): the predictor's storageUri is the version being rolled out and
  `canaryTrafficPercent` its share; Knative keeps the last fully rolled-out revision for the
  rest. The stable version is remembered in the annotation `cube-serve.io/stable-version`,
  written only in the same patch as a storageUri change (which makes a new revision anyway).
  Promote removes canaryTrafficPercent. Rollback first pins all traffic to the previous
  revision while reverting storageUri (canaryTrafficPercent 0), then, once the reverted
  revision is ready, removes canaryTrafficPercent: two calls (or one with --wait).
* RawDeployment (Standard): the stable predictor stays as it is and the canary is an entry of
  `spec.canary[]` (its own Deployment, merged over the stable predictor by KServe). Promote
  moves the canary's storageUri into the stable predictor and drops spec.canary; rollback drops it.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Mapping

GROUP = "serving.kserve.io"
ISVC_API = ("v1beta1", "inferenceservices")
GRAPH_API = ("v1alpha1", "inferencegraphs")

MODE_ANNOTATION = "serving.kserve.io/deploymentMode"
TAG_ROUTING_ANNOTATION = "serving.kserve.io/enable-tag-routing"
STABLE_ANNOTATION = "cube-serve.io/stable-version"
VERSIONS_CONFIGMAP = "cube3d-versions"
DEFAULT_ISVC = "cube3d"
DEFAULT_GRAPH = "cube3d-ab"
# The predictor container's name in KServe; the CRD requires it in a spec.canary[] model.
PREDICTOR_CONTAINER = "kserve-container"

SERVERLESS, RAW = "Serverless", "RawDeployment"
# KServe's current names (Knative, Standard) and the older ones both occur in the wild.
_MODES = {"serverless": SERVERLESS, "knative": SERVERLESS, "rawdeployment": RAW, "raw": RAW,
          "standard": RAW}

# A version is one path segment of a storage URI and part of a Kubernetes name (the canary's
# Deployment in RawDeployment mode): lower-case letters, digits and '-'.
_VERSION_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,30}[a-z0-9])?$")

STABLE, CANARY, ROLLING_BACK = "stable", "canary", "rolling-back"


class RolloutError(ValueError):
    """The request was refused; nothing was changed."""


class NotReady(RolloutError):
    """KServe has not made the new revision or deployment ready yet: try again (or --wait)."""


# -- the version registry ----------------------------------------------------------------------

@dataclass(frozen=True)
class Registry:
    """Known checkpoint versions: version V is the model repository at `<base_uri>/<V>`."""

    base_uri: str
    versions: tuple[str, ...]

    @classmethod
    def from_configmap(cls, configmap: Mapping) -> "Registry":
        name = (configmap.get("metadata") or {}).get("name", VERSIONS_CONFIGMAP)
        data = configmap.get("data") or {}
        base = (data.get("baseUri") or "").strip().rstrip("/")
        if "://" not in base:
            raise RolloutError(f"ConfigMap {name}: data.baseUri must be a storage URI "
                               f"(s3://, gs://, pvc://, ...), got {base!r}")
        # Space- or comma-separated, in order, duplicates dropped.
        versions = tuple(v for v in dict.fromkeys(re.split(r"[\s,]+", data.get("versions") or "")) if v)
        for v in versions:
            if not _VERSION_RE.match(v):
                raise RolloutError(f"ConfigMap {name}: version {v!r} is not a valid version name "
                                   "(lower-case letters, digits and '-', at most 32 characters)")
        return cls(base, versions)

    def uri(self, version: str) -> str:
        # The trailing slash matters: KServe's storage initializer downloads every object whose
        # key starts with the URI's path, so `<base>/1` would also bring `<base>/10/...` into
        # /mnt/models/0/, and tritonserver would refuse the stray model folder.
        return f"{self.base_uri}/{version}/"

    def version_of(self, uri: str | None) -> str | None:
        """The version whose storage URI is `uri`, or None if it is not one of the registry's."""
        if not uri:
            return None
        uri = uri.rstrip("/")
        prefix = self.base_uri + "/"
        if uri.startswith(prefix) and uri[len(prefix):] in self.versions:
            return uri[len(prefix):]
        return None

    def require(self, version: str) -> str:
        """The storage URI of a known version; a RolloutError for anything else."""
        if not isinstance(version, str) or not _VERSION_RE.match(version):
            raise RolloutError(f"invalid version {version!r}: lower-case letters, digits and '-', "
                               "at most 32 characters")
        if version not in self.versions:
            known = ", ".join(self.versions) or "none"
            raise RolloutError(f"unknown version {version!r}: the registry knows {known} "
                               f"(add it to the ConfigMap {VERSIONS_CONFIGMAP} once {self.uri(version)} exists)")
        return self.uri(version)


def canary_name(version: str) -> str:
    """The spec.canary[] predictor name (and Deployment suffix) of a version: a DNS label."""
    return f"v{version}" if version[0].isdigit() else version


# -- reading an InferenceService ---------------------------------------------------------------

def _get(obj: Mapping | None, *path: str, default: Any = None) -> Any:
    for key in path:
        if not isinstance(obj, Mapping) or key not in obj:
            return default
        obj = obj[key]
    return obj


def deployment_mode(isvc: Mapping, override: str | None = None) -> str:
    """Serverless or RawDeployment: --mode, else what KServe recorded in the status, else the
    annotation. The cluster's default is not visible from here, so a missing one is an error."""
    for source in (override, _get(isvc, "status", "deploymentMode"),
                   _get(isvc, "metadata", "annotations", MODE_ANNOTATION)):
        if source and source.lower() != "auto":
            mode = _MODES.get(source.lower())
            if mode is None:
                raise RolloutError(f"deployment mode {source!r} is not supported (Serverless or RawDeployment)")
            return mode
    if _get(isvc, "spec", "canary"):
        return RAW
    raise RolloutError(f"cannot tell the deployment mode of {_name(isvc)}: set the annotation "
                       f"{MODE_ANNOTATION} (Serverless or RawDeployment) or pass --mode")


def _name(obj: Mapping) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '?')}".lstrip("/")


def _generation_observed(obj: Mapping) -> bool:
    generation = _get(obj, "metadata", "generation")
    observed = _get(obj, "status", "observedGeneration")
    return generation is not None and observed == generation


@dataclass(frozen=True)
class RolloutState:
    """What an InferenceService is doing, as far as rollouts go."""

    name: str
    mode: str
    phase: str  # stable | canary | rolling-back
    stable: str | None  # the version serving the non-canary traffic (None: not a registry URI)
    canary: str | None = None  # the version being rolled out (its URI if not in the registry)
    percent: int | None = None  # the canary's share of the traffic
    ready: bool | None = None  # the new revision / canary deployment is ready (None: unknown)
    storage_uri: str | None = None  # spec.predictor.model.storageUri as it is
    stable_uri: str | None = None  # where a rollback returns to
    canary_uri: str | None = None  # what a promote makes stable
    traffic: tuple = field(default=())  # Serverless: status traffic targets, for `status`

    def summary(self) -> str:
        if self.stable:
            stable = f"version {self.stable}"
        else:
            stable = f"{self.storage_uri} (not in the registry)" if self.storage_uri else "no storageUri"
        if self.phase == STABLE:
            return f"stable: {stable}"
        if self.phase == ROLLING_BACK:
            return f"rolling back to {stable}: waiting for its new revision to be ready"
        return f"canary of version {self.canary} at {self.percent}% (stable: {stable})"


def rollout_state(isvc: Mapping, registry: Registry, mode: str | None = None) -> RolloutState:
    mode = deployment_mode(isvc, mode)
    name = _name(isvc)
    predictor = _get(isvc, "spec", "predictor") or {}
    uri = _get(predictor, "model", "storageUri")
    version = registry.version_of(uri)
    if mode == SERVERLESS:
        percent = predictor.get("canaryTrafficPercent")
        traffic = tuple(_get(isvc, "status", "components", "predictor", "traffic", default=()) or ())
        common = dict(ready=_serverless_ready(isvc), storage_uri=uri, traffic=traffic)
        if percent is None:
            # The latest revision gets everything: storageUri is stable, and the annotation (left
            # as it was by a promote, so that no new revision is made) is history.
            return RolloutState(name, mode, STABLE, version, stable_uri=uri, **common)
        # Without the annotation (an InferenceService this tool never rolled out), storageUri
        # is taken as stable.
        stable = _get(isvc, "metadata", "annotations", STABLE_ANNOTATION) or version
        stable_uri = registry.uri(stable) if stable in registry.versions else None
        if stable != version:
            return RolloutState(name, mode, CANARY, stable, version or uri, percent,
                                stable_uri=stable_uri, canary_uri=uri, **common)
        if percent == 0:  # storageUri reverted, traffic pinned to the old revision: half a rollback
            return RolloutState(name, mode, ROLLING_BACK, stable, percent=0, stable_uri=stable_uri, **common)
        # No canary: canaryTrafficPercent is the share the next storageUri change will get
        # (k8s/overlays/canary keeps 10, with stable-version equal to storageUri's version).
        return RolloutState(name, mode, STABLE, stable, stable_uri=stable_uri, **common)
    canaries = _get(isvc, "spec", "canary") or []
    if not canaries:
        return RolloutState(name, mode, STABLE, version, storage_uri=uri, stable_uri=uri)
    if len(canaries) > 1:
        names = ", ".join(str(_get(c, "predictor", "name")) for c in canaries)
        raise RolloutError(f"{name} has {len(canaries)} canaries ({names}); `cubeserve rollout` "
                           "handles one: edit spec.canary by hand")
    entry = canaries[0]
    canary_uri = _get(entry, "predictor", "model", "storageUri")
    return RolloutState(name, mode, CANARY, version, registry.version_of(canary_uri) or canary_uri,
                        entry.get("trafficPercent", 0), _raw_canary_ready(isvc, entry), uri, uri, canary_uri)


def _serverless_ready(isvc: Mapping) -> bool | None:
    """Is the latest revision (the one the spec now describes) ready? None while KServe has not
    caught up with the spec or reported revisions."""
    if not _generation_observed(isvc):
        return None
    component = _get(isvc, "status", "components", "predictor") or {}
    created = component.get("latestCreatedRevision")
    if not created:
        return None
    return created == component.get("latestReadyRevision")


def _raw_canary_ready(isvc: Mapping, entry: Mapping) -> bool | None:
    if not _generation_observed(isvc):
        return None
    name = _get(entry, "predictor", "name")
    for status in _get(isvc, "status", "canaryStatuses", default=()) or ():
        if status.get("name") == name:
            return bool(status.get("ready"))
    return None


# -- plans ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    """What a command will do: `patch` (a JSON merge patch, None when nothing changes) and, for
    people, a one-line `summary` and the `changes` it makes, one field per line."""

    summary: str
    patch: dict | None = None
    changes: tuple[str, ...] = ()

    @property
    def changed(self) -> bool:
        return self.patch is not None


def _plan(obj: Mapping, summary: str, patch: dict) -> Plan:
    patch = copy.deepcopy(patch)
    version = _get(obj, "metadata", "resourceVersion")
    if version:  # optimistic concurrency: the API server refuses the patch if obj changed since
        patch.setdefault("metadata", {})["resourceVersion"] = version
    return Plan(summary, patch, tuple(describe_changes(obj, patch)))


def _percent(percent: Any) -> int:
    if isinstance(percent, bool) or not isinstance(percent, int) or not 0 <= percent <= 100:
        raise RolloutError(f"--percent must be an integer from 0 to 100, got {percent!r}")
    return percent


def plan_canary(isvc: Mapping, registry: Registry, version: str, percent: int,
                mode: str | None = None) -> Plan:
    """Start a canary of `version` with `percent` of the traffic, or change the share of the
    canary of that same version. Refuses while another rollout is unfinished."""
    percent = _percent(percent)
    uri = registry.require(version)
    state = rollout_state(isvc, registry, mode)
    if state.phase == ROLLING_BACK:
        raise RolloutError(f"{state.name}: the rollback to version {state.stable} is not finished: "
                           "run `cubeserve rollout rollback` again once its revision is ready")
    if state.phase == CANARY:
        if state.canary != version:
            raise RolloutError(f"{state.name}: a canary of version {state.canary} ({state.percent}%) is "
                               "in progress: promote it or roll it back first")
        if state.percent == percent:
            return Plan(f"canary of version {version} already at {percent}%: nothing to change")
        if state.mode == SERVERLESS:
            patch = {"spec": {"predictor": {"canaryTrafficPercent": percent}}}
        else:
            entry = copy.deepcopy(isvc["spec"]["canary"][0])
            entry["trafficPercent"] = percent
            patch = {"spec": {"canary": [entry]}}
        return _plan(isvc, f"canary of version {version}: {state.percent}% -> {percent}%", patch)
    # Stable: start a canary.
    if state.storage_uri is None:
        raise RolloutError(f"{state.name} has no storageUri (it serves the model inside its image): "
                           "nothing to roll out")
    if state.stable is None:
        raise RolloutError(f"{state.name}: its storageUri {state.storage_uri} is not a version of the "
                           f"registry ({registry.base_uri}/<version>), so a rollback would have "
                           "nothing to return to")
    if version == state.stable:
        raise RolloutError(f"{state.name}: version {version} is already the stable version")
    if state.mode == SERVERLESS:
        annotations = {STABLE_ANNOTATION: state.stable}
        if _get(isvc, "metadata", "annotations", TAG_ROUTING_ANNOTATION) != "true":
            annotations[TAG_ROUTING_ANNOTATION] = "true"  # latest-/prev- URLs for both revisions
        patch = {"metadata": {"annotations": annotations},
                 "spec": {"predictor": {"canaryTrafficPercent": percent, "model": {"storageUri": uri}}}}
    else:
        stable_format = _get(isvc, "spec", "predictor", "model", "modelFormat") or {"name": "triton"}
        entry = {"predictor": {"name": canary_name(version),
                               "model": {"name": PREDICTOR_CONTAINER,
                                         "modelFormat": copy.deepcopy(stable_format),
                                         "storageUri": uri}},
                 "trafficPercent": percent}
        patch = {"spec": {"canary": [entry]}}
    return _plan(isvc, f"canary of version {version} at {percent}% (stable: version {state.stable})", patch)


def plan_promote(isvc: Mapping, registry: Registry, mode: str | None = None, force: bool = False) -> Plan:
    """Give the canary all the traffic and make it the stable version."""
    state = rollout_state(isvc, registry, mode)
    if state.phase == STABLE:
        return Plan(f"{state.name}: no canary in progress ({state.summary()}): nothing to promote")
    if state.phase == ROLLING_BACK:
        raise RolloutError(f"{state.name}: a rollback to version {state.stable} is in progress: "
                           "finish it with `cubeserve rollout rollback`")
    _require_ready(state, force, "promote")
    if state.mode == SERVERLESS:
        patch = {"spec": {"predictor": {"canaryTrafficPercent": None}}}
    else:
        patch = {"spec": {"predictor": {"model": {"storageUri": state.canary_uri}}, "canary": None}}
    return _plan(isvc, f"promote version {state.canary} to stable (was version {state.stable})", patch)


def plan_rollback(isvc: Mapping, registry: Registry, mode: str | None = None, force: bool = False) -> Plan:
    """Send all the traffic back to the stable version and drop the canary."""
    state = rollout_state(isvc, registry, mode)
    if state.phase == STABLE:
        return Plan(f"{state.name}: no canary in progress ({state.summary()}): nothing to roll back")
    if state.mode == RAW:
        return _plan(isvc, f"roll back the canary of version {state.canary}: version {state.stable} "
                           "gets all the traffic", {"spec": {"canary": None}})
    if state.phase == ROLLING_BACK:
        _require_ready(state, force, "finish the rollback")
        return _plan(isvc, f"finish the rollback: the new revision of version {state.stable} gets "
                           "all the traffic", {"spec": {"predictor": {"canaryTrafficPercent": None}}})
    if state.stable_uri is None:
        raise RolloutError(f"{state.name}: the stable version {state.stable!r} "
                           f"({STABLE_ANNOTATION}) is not in the registry: cannot roll back to it")
    if state.percent == 100:
        # Knative already counts the canary revision as rolled out, so pinning "prev" would point
        # at it as soon as the reverted revision is ready. Roll forward to the stable version
        # instead: the canary keeps serving until that revision is ready, then takes over.
        patch = {"spec": {"predictor": {"canaryTrafficPercent": None, "model": {"storageUri": state.stable_uri}}}}
        return _plan(isvc, f"roll back version {state.canary} (at 100%): version {state.stable} takes "
                           "all the traffic once its new revision is ready", patch)
    patch = {"spec": {"predictor": {"canaryTrafficPercent": 0, "model": {"storageUri": state.stable_uri}}}}
    return _plan(isvc, f"roll back version {state.canary}: all traffic to the previous revision "
                       f"(version {state.stable}) now; run `rollback` again once the reverted "
                       "revision is ready to finish", patch)


def _require_ready(state: RolloutState, force: bool, action: str) -> None:
    if force or state.ready:
        return
    what = "the canary deployment" if state.mode == RAW else "the latest revision"
    why = "is not ready yet" if state.ready is False else "has no readiness reported yet (KServe has not caught up)"
    raise NotReady(f"{state.name}: cannot {action}: {what} {why}; try again, pass --wait SECONDS, "
                   "or --force")


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


def plan_ab(graph: Mapping, weights: Mapping[str, int], node: str = "root") -> Plan:
    """Set the weights of the Splitter node's steps, by step name (case-insensitive)."""
    name = _name(graph)
    router = _get(graph, "spec", "nodes", node)
    if not router or router.get("routerType") != "Splitter":
        raise RolloutError(f"InferenceGraph {name}: node {node!r} is not a Splitter")
    steps = router.get("steps") or []
    names = [str(s.get("name", "")).lower() for s in steps]
    if "" in names:
        raise RolloutError(f"InferenceGraph {name}: every step of {node!r} needs a name to be weighted")
    weights = {k.lower(): v for k, v in weights.items()}
    for key, weight in weights.items():
        if isinstance(weight, bool) or not isinstance(weight, int) or not 0 <= weight <= 100:
            raise RolloutError(f"the weight of {key!r} must be an integer from 0 to 100, got {weight!r}")
    unknown = sorted(set(weights) - set(names))
    missing = [n for n in names if n not in weights]
    if unknown:
        raise RolloutError(f"InferenceGraph {name}: no step named {', '.join(unknown)} (steps: {', '.join(names)})")
    if missing:
        raise RolloutError(f"InferenceGraph {name}: give a weight to every step (missing: {', '.join(missing)})")
    if sum(weights.values()) != 100:
        raise RolloutError(f"the weights must add up to 100, got {sum(weights.values())}")
    before = ",".join(f"{n}={s.get('weight')}" for n, s in zip(names, steps))
    after = ",".join(f"{n}={weights[n]}" for n in names)
    if before == after:
        return Plan(f"InferenceGraph {name}: weights already {after}: nothing to change")
    new_steps = [dict(copy.deepcopy(s), weight=weights[n]) for n, s in zip(names, steps)]
    return _plan(graph, f"InferenceGraph {name}: weights {before} -> {after}",
                 {"spec": {"nodes": {node: {"steps": new_steps}}}})


# -- JSON merge patches (RFC 7386) ---------------------------------------------------------------

def merge_patch(target: Any, patch: Any) -> Any:
    """`target` with `patch` applied as the API server applies a JSON merge patch (a copy)."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def describe_changes(before: Mapping, patch: Mapping, prefix: str = "") -> list[str]:
    """One `path: old -> new` line per field a merge patch changes."""
    lines = []
    for key, value in patch.items():
        path = f"{prefix}.{key}" if prefix else key
        if path == "metadata.resourceVersion":
            continue
        present = isinstance(before, Mapping) and key in before
        old = before[key] if present else None
        if isinstance(value, Mapping) and value:  # merged into the old value
            lines += describe_changes(old if isinstance(old, Mapping) else {}, value, path)
        elif value is None:
            if present:
                lines.append(f"{path}: {_show(old)} -> (removed)")
        else:  # replaces the old value
            lines += _replacement(old, value, path, present)
    return lines


def _replacement(old: Any, new: Any, path: str, present: bool = True) -> list[str]:
    if present and isinstance(old, Mapping) and isinstance(new, Mapping):
        lines = []
        for key in list(old) + [k for k in new if k not in old]:
            lines += _replacement(old.get(key), new.get(key), f"{path}.{key}", key in old) if key in new \
                else [f"{path}.{key}: {_show(old[key])} -> (removed)"]
        return lines
    if present and isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [line for i, (a, b) in enumerate(zip(old, new)) for line in _replacement(a, b, f"{path}[{i}]")]
    if present and old == new:
        return []
    return [f"{path}: {_show(old) if present else '(unset)'} -> {_show(new)}"]


def _show(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


# -- the thin client -----------------------------------------------------------------------------

class Cluster:
    """get/patch on serving.kserve.io objects and the registry ConfigMap, through the
    `kubernetes` client and the current kubeconfig (or the pod's service account)."""

    def __init__(self, namespace: str | None = None, context: str | None = None):
        from kubernetes import client, config

        kubeconfig = os.environ.get("KUBECONFIG")  # read now: the client reads it once, at import
        try:
            config.load_kube_config(config_file=kubeconfig, context=context)
            contexts, active = config.list_kube_config_contexts(config_file=kubeconfig)
            chosen = next((c for c in contexts if c["name"] == context), active) if context else active
            default_namespace = (chosen or {}).get("context", {}).get("namespace") or "default"
        except config.ConfigException:  # no kubeconfig: running in a pod?
            try:
                config.load_incluster_config()
            except config.ConfigException:
                raise config.ConfigException("no Kubernetes configuration: no kubeconfig (KUBECONFIG or "
                                             "~/.kube/config) and not running in a pod") from None
            with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
                default_namespace = f.read().strip()
        self.namespace = namespace or default_namespace
        self.custom = client.CustomObjectsApi()
        self.core = client.CoreV1Api()

    def get(self, api: tuple[str, str], name: str) -> dict:
        return self.custom.get_namespaced_custom_object(GROUP, api[0], self.namespace, api[1], name)

    def patch(self, api: tuple[str, str], name: str, patch: dict) -> dict:
        # A dict body is sent as application/merge-patch+json.
        return self.custom.patch_namespaced_custom_object(GROUP, api[0], self.namespace, api[1], name, patch)

    def registry(self, name: str) -> Registry:
        return Registry.from_configmap(self.core.read_namespaced_config_map(name, self.namespace).to_dict())


# Tests replace this to run the command line against objects in memory.
cluster_factory: Callable[..., Any] = Cluster


def _print_plan(plan: Plan, out, dry_run: bool) -> None:
    print(plan.summary, file=out)
    for line in plan.changes:
        print(f"  {line}", file=out)
    if plan.changed:
        print("dry run: nothing was changed" if dry_run else "patched", file=out)


def _status(cluster, args, out) -> int:
    registry = cluster.registry(args.versions_configmap)
    isvc = cluster.get(ISVC_API, args.isvc)
    state = rollout_state(isvc, registry, args.mode)
    if args.json:
        print(json.dumps(asdict(state), indent=2, default=str), file=out)
        return 0
    url = _get(isvc, "status", "url") or "(no URL yet)"
    print(f"InferenceService {cluster.namespace}/{args.isvc} ({state.mode}) {url}", file=out)
    print(f"  {state.summary()}", file=out)
    if state.phase != STABLE:
        ready = {True: "yes", False: "no", None: "unknown"}[state.ready]
        print(f"  new revision / canary ready: {ready}", file=out)
    for target in state.traffic:
        tag = target.get("tag") or ("latest" if target.get("latestRevision") else "")
        print(f"  traffic {target.get('percent', 0):>3}%  {target.get('revisionName', '?')}  {tag}  "
              f"{target.get('url', '')}".rstrip(), file=out)
    print(f"  registry {args.versions_configmap}: {registry.base_uri}/<version>, versions "
          f"{' '.join(registry.versions) or '(none)'}", file=out)
    if args.graph:
        graph = cluster.get(GRAPH_API, args.graph)
        steps = _get(graph, "spec", "nodes", "root", "steps", default=[]) or []
        print(f"InferenceGraph {cluster.namespace}/{args.graph}: " +
              ", ".join(f"{s.get('name')}={s.get('weight')}% ({s.get('serviceUrl') or s.get('serviceName')})"
                        for s in steps), file=out)
    return 0


def _plan_for(args, cluster) -> tuple[tuple[str, str], str, Plan]:
    if args.rollout_command == "ab":
        graph = cluster.get(GRAPH_API, args.graph)
        return GRAPH_API, args.graph, plan_ab(graph, parse_weights(args.weights))
    registry = cluster.registry(args.versions_configmap)
    isvc = cluster.get(ISVC_API, args.isvc)
    if args.rollout_command == "canary":
        return ISVC_API, args.isvc, plan_canary(isvc, registry, args.version, args.percent, args.mode)
    planner = plan_promote if args.rollout_command == "promote" else plan_rollback
    return ISVC_API, args.isvc, planner(isvc, registry, args.mode, args.force)


def run_rollout(args, out=None) -> int:
    """The `cubeserve rollout` handler. Exit codes: 0 done (or nothing to do), 1 Kubernetes API
    error, 2 refused, 3 not ready yet."""
    out = out or sys.stdout
    try:
        cluster = cluster_factory(namespace=args.namespace, context=args.context)
        if args.rollout_command == "status":
            return _status(cluster, args, out)
        wait = getattr(args, "wait", 0) or 0
        deadline = time.monotonic() + wait
        first = True
        while True:
            try:
                api, name, plan = _plan_for(args, cluster)
            except NotReady as exc:
                if time.monotonic() >= deadline:
                    raise
                print(f"waiting: {exc}", file=out, flush=True)
                time.sleep(min(10.0, max(0.5, deadline - time.monotonic())))
                continue
            if not first and not plan.changed:
                return 0
            if plan.changed and not args.dry_run:
                cluster.patch(api, name, plan.patch)
            _print_plan(plan, out, args.dry_run)
            first = False
            # A Serverless rollback takes two patches (pin, then finish); with --wait the second
            # follows as soon as KServe reports the reverted revision ready.
            if not (plan.changed and wait and args.rollout_command == "rollback" and not args.dry_run):
                return 0
    except NotReady as exc:
        print(f"not ready: {exc}", file=sys.stderr)
        return 3
    except RolloutError as exc:
        print(f"refused: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - the kubernetes client's errors, reported briefly
        if type(exc).__name__ != "ApiException" and type(exc).__module__.split(".")[0] not in ("kubernetes", "urllib3"):
            raise
        status = getattr(exc, "status", None)
        print(f"error: {type(exc).__name__}: {' '.join(str(p) for p in (status, getattr(exc, 'reason', None) or exc) if p)}",
              file=sys.stderr)
        if status == 409:
            print("the object changed while this command ran: run it again", file=sys.stderr)
        return 1


def add_rollout_parser(subparsers) -> argparse.ArgumentParser:
    """Add `rollout` to a `cubeserve` subparsers object; the handler is `args.func`."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-n", "--namespace", help="namespace (default: the kubeconfig context's)")
    common.add_argument("--context", help="kubeconfig context")
    common.add_argument("--isvc", default=DEFAULT_ISVC, help="InferenceService name (default: %(default)s)")
    common.add_argument("--versions-configmap", default=VERSIONS_CONFIGMAP,
                        help="ConfigMap listing the known versions (default: %(default)s)")
    common.add_argument("--mode", choices=["auto", "serverless", "raw"], default="auto",
                        help="deployment mode (default: from the InferenceService)")
    changing = argparse.ArgumentParser(add_help=False)
    changing.add_argument("--dry-run", action="store_true", help="print the change, do not patch")

    p = subparsers.add_parser(
        "rollout", help="canary / promote / rollback / A-B on the KServe InferenceService",
        description="Roll checkpoint versions out on KServe (see README, Deploying on KServe). "
                    "Version V is the model repository at <baseUri>/<V> of the ConfigMap cube3d-versions.")
    sub = p.add_subparsers(dest="rollout_command", required=True)
    s = sub.add_parser("status", parents=[common], help="stable version, canary, traffic")
    s.add_argument("--graph", help="also show this InferenceGraph's weights")
    s.add_argument("--json", action="store_true", help="the rollout state as JSON")
    c = sub.add_parser("canary", parents=[common, changing], help="start a canary, or change its share")
    c.add_argument("--version", required=True, help="checkpoint version to roll out")
    c.add_argument("--percent", required=True, type=int, help="share of the traffic, 0..100")
    for action, text in (("promote", "give the canary all the traffic and make it stable"),
                         ("rollback", "send all the traffic back to the stable version")):
        a = sub.add_parser(action, parents=[common, changing], help=text)
        a.add_argument("--wait", type=float, default=0, metavar="SECONDS",
                       help="wait up to this long for KServe to make the new revision ready")
        a.add_argument("--force", action="store_true", help="do not check readiness")
    ab = sub.add_parser("ab", parents=[common, changing], help="set the A/B weights of the InferenceGraph")
    ab.add_argument("--weights", required=True, help="step weights adding up to 100, e.g. a=80,b=20")
    ab.add_argument("--graph", default=DEFAULT_GRAPH, help="InferenceGraph name (default: %(default)s)")
    p.set_defaults(func=run_rollout)
    return p


def main(argv: list[str] | None = None) -> int:
    """`python -m cubeserve.rollout ...`, the same as `cubeserve rollout ...`."""
    parser = argparse.ArgumentParser(prog="cubeserve")
    add_rollout_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
