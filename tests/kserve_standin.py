"""Stand-ins for the cluster parts that cannot run here, each following the source it cites.

* `ObjectStore`: what the Kubernetes API server does with a custom object: JSON merge patches
  (its own RFC 7386 implementation, not the one under test), the generation bumped only when
  something outside metadata and status changes, resourceVersion preconditions, field managers
  (metadata.managedFields) for updates, and server-side apply with its conflicts.
    - generation: k8s.io/apiextensions-apiserver pkg/registry/customresource/strategy.go,
      PrepareForUpdate (with the status subresource: "any changes to the spec increment the
      generation number").
    - managed fields and conflicts: https://kubernetes.io/docs/reference/using-api/server-side-apply/
      ("Conflicts", "Merge strategy"): an update takes the fields it changed from their other
      owners; an apply that would change a field another manager owns is a 409 Conflict unless
      forced; lists marked atomic (spec.canary: +listType=atomic) are one field.
* `KServeController`: what KServe's controller and webhooks do at the tag `release` (v0.14.0 to
  v0.20.0; where the tags differ, "Per release" below says how; spec.canary is v0.20.0's), with
  the Knative Serving and Kubernetes behaviour it relies on. Line numbers are at tag v0.20.0 of
  github.com/kserve/kserve unless a tag is named:
    - Serverless traffic: pkg/controller/v1beta1/inferenceservice/reconcilers/knative/
      ksvc_reconciler.go 133-164: with canaryTrafficPercent and a latestRolledoutRevision, the
      latest revision gets the percent (tag `latest` with tag routing) and the last rolled-out
      revision the rest (tag `prev`); otherwise the latest revision gets 100%.
    - Serverless status: pkg/apis/serving/v1beta1/inference_service_status.go 567-636
      (PropagateStatus): latestCreated/latestReady copied from the Knative Service, the rolled-out
      revisions tracked from its traffic, `observedGeneration` = the Knative Service's.
    - Knative: a `latestRevision: true` target routes to the latest *ready* revision; a new
      revision is made when the Knative Service's template changes (annotations and pod spec,
      not traffic).
    - Raw: pkg/controller/v1beta1/inferenceservice/components/predictor.go 913-1037
      (reconcileCanaryDeployments): one Deployment `<isvc>-<name>-predictor` per canary,
      canaryStatuses {name, ready = AvailableReplicas > 0, trafficPercent}, the
      CanaryPredictorReady condition, and orphaned predictor Deployments *and Services* deleted
      (1002-1035); the stable Deployment is named from spec.predictor.name (pkg/constants/
      constants.go 799-804).
    - Raw pods: the Deployment's pod template carries KServe's labels (serving.kserve.io/
      inferenceservice, component, app=isvc.<deployment>: predictor.go buildObjectMeta 498-519,
      reconcilers/deployment/deployment_reconciler.go createRawDefaultDeployment 140-175) and its
      annotations, among them the storage URI (predictor.go 294-300).
    - Raw traffic on v0.20.0: the Ingress / HTTPRoute points at the stable predictor's Service
      only (reconcilers/ingress/kube_ingress_reconciler.go 150, httproute_reconciler.go 266);
      trafficPercent sizes the canary's replicas (predictor.go 886-895) and routes nothing. With
      the Gateway API, KServe keeps an HTTPRoute named after the predictor's Service
      (httproute_reconciler.go reconcilePredictorHTTPRoute 696-757) and one named after the
      InferenceService (createRawTopLevelHTTPRoute 491-673); a renamed predictor gets a new route
      and nothing deletes the old one.
* Per release (`release`, the tag modelled), read at each tag:
    - Raw PredictorReady (inference_service_status.go PropagateRawStatus: v0.14.0 298, v0.15.0
      328, v0.16.0/v0.17.0 341, v0.20.0 360): before v0.16.0 the Deployment's Available condition
      as it is, but True without its reason and message (SetCondition, v0.15.2
      inference_service_status.go 513-522, marks True with MarkTrue; v0.20.0 with
      MarkTrueWithReason; v0.14.x is assumed the same, not read) (v0.14.x also writes the Deployment's revision number as
      latestCreatedRevision);
      from v0.16.0 Available, overridden by Progressing (False with a message, e.g.
      ProgressDeadlineExceeded: not ready; True with NewReplicaSetAvailable: ready; True with
      another reason: Unknown, from v0.20.0 only where Available is not True), Available False and
      ReplicaFailure True (not ready).
    - Serverless conditions (PropagateStatus, the same at every tag): PredictorReady,
      PredictorRouteReady and PredictorConfigurationReady are the Knative Service's Ready,
      RoutesReady and ConfigurationsReady as they are.
    - The annotations that never reach a revision or pod template (ServiceAnnotationDisallowedList,
      pkg/constants/constants.go): min-/max-scale, the storage URI, kubectl's
      last-applied-configuration, and from v0.17.0 modelFormat.
* Kubernetes' Deployment controller (github.com/kubernetes/kubernetes, pkg/controller/deployment):
  a changed pod template makes a new ReplicaSet `<deployment>-<pod-template-hash>` whose
  `deployment.kubernetes.io/revision` annotation is the highest so far plus one; a template equal
  to an old ReplicaSet's adopts that one again with a new revision number (sync.go
  getNewReplicaSet). With one replica and the default RollingUpdate (maxSurge 25% rounds up to 1,
  maxUnavailable 25% down to 0) the old pod serves until the new one is available, then the old
  ReplicaSet is scaled to 0 and kept as history. Conditions (util/deployment_util.go,
  progress.go): Available (MinimumReplicasAvailable / MinimumReplicasUnavailable), Progressing
  (ReplicaSetUpdated while rolling, NewReplicaSetAvailable when done, False with
  ProgressDeadlineExceeded once progressDeadlineSeconds pass), ReplicaFailure (FailedCreate).
* Knative Serving (github.com/knative/serving, knative-v1.15.0, pkg/apis/serving/v1):
  ConfigurationsReady is Unknown until the latest created revision is ready, False with reason
  RevisionFailed ("Revision %q failed with message: %s.", configuration_lifecycle.go 96-101) if it
  fails; the Service's Ready is the living condition set of ConfigurationsReady and RoutesReady
  (service_lifecycle.go 33-36).
* The deployment mode, per release:
    - status.deploymentMode: not written before v0.15.1; from v0.15.1 the controller records the
      mode it used (controller.go updateStatus, components/predictor.go), the annotation's value
      ("Serverless" / "RawDeployment") until v0.15.x; from v0.16.0 the new names "Knative" /
      "Standard" (pkg/constants/constants.go at v0.16.0, 464-467; utils.GetDeploymentMode maps
      the legacy annotation values to them).
    - the validating webhook on UPDATE, from v0.15.1 (inference_service_validation.go,
      validateDeploymentMode): the annotation, when present, must equal the old object's
      status.deploymentMode, else "update rejected: deploymentMode cannot be changed from ...".
      From v0.17.0 the defaulting (mutating) webhook first rewrites the legacy names in the
      object itself, on create and update ("RawDeployment" -> "Standard", "Serverless" ->
      "Knative": inference_service_defaults.go DefaultInferenceService, 163-176 at v0.20.0,
      kserve#5025); on v0.16.0 nothing does, so an object annotated "Serverless" whose status
      says "Knative" refuses every update.
    - v0.20.0's validating webhook also checks, on UPDATE, validatePredictorNameChange (a new
      predictor.name needs a new storageUri) and, on every write, validateCanarySpecs (canaries
      only with the annotation "Standard", after the defaulter; each canary named, not the
      stable predictor's name, no name twice, trafficPercent 0..100 and at most 100 in all,
      minReplicas at most the stable's, no maxReplicas): inference_service_validation.go
      ValidateUpdate 97-105, validateCanarySpecs 183-268, validatePredictorNameChange 703-713.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

ANNOTATION_URI = "internal.serving.kserve.io/storage-initializer-sourceuri"


def _release(release: str) -> tuple[int, ...]:
    return tuple(int(p) for p in release.lstrip("v").split("."))


MODE_ANNOTATION = "serving.kserve.io/deploymentMode"
_NEW_NAMES = {"Serverless": "Knative", "RawDeployment": "Standard"}


def status_mode(release: str, raw: bool) -> str | None:
    """status.deploymentMode as `release`'s controller writes it (module docstring)."""
    if _release(release) < (0, 15, 1):
        return None
    legacy = "RawDeployment" if raw else "Serverless"
    return _NEW_NAMES[legacy] if _release(release) >= (0, 16, 0) else legacy


def disallowed_annotations(release: str) -> tuple[str, ...]:
    """ServiceAnnotationDisallowedList at `release` (module docstring)."""
    names = ("autoscaling.knative.dev/min-scale", "autoscaling.knative.dev/max-scale", ANNOTATION_URI,
             "kubectl.kubernetes.io/last-applied-configuration")
    return names + (("modelFormat",) if _release(release) >= (0, 17, 0) else ())


# -- autoscaling, per release -------------------------------------------------------------------
# What KServe's controller turns a predictor's scaling fields into: the Knative revision's
# autoscaling annotations (Serverless) and the KEDA ScaledObject (raw mode, autoscaler class keda).
# tests/test_cluster.py checks the ScaledObject against what the real v0.20.0 manager writes.
AUTOSCALER_CLASS = "serving.kserve.io/autoscalerClass"


def knative_autoscaling(release: str, isvc: dict) -> tuple[dict, int | None]:
    """(the autoscaling.knative.dev annotations of the revision template, its containerConcurrency)
    for a Serverless predictor. The InferenceService's own annotations pass, but the disallowed ones
    (components/predictor.go buildPredictorResources 99-103); then SetAutoScalingAnnotations
    (pkg/controller/v1alpha1/utils/utils.go 48-81 at v0.20.0; the same function at v0.15.2,
    v0.16.0 and v0.19.0; v0.14.0 does the same inline, reconcilers/knative/ksvc_reconciler.go
    createKnativeService 74-101): class `kpa.autoscaling.knative.dev` unless set, `target` =
    scaleTarget, `metric` = scaleMetric, `min-scale` = minReplicas (1 when unset), `max-scale` =
    maxReplicas unless 0 (unlimited); all of them the revision template's annotations, and
    containerConcurrency its spec's (v0.20.0 ksvc_reconciler.go createKnativeService 88-110,
    200-213; v0.14.0 176)."""
    predictor = isvc["spec"]["predictor"]
    dropped = disallowed_annotations(release)
    annotations = {k: v for k, v in (isvc["metadata"].get("annotations") or {}).items()
                   if k.startswith("autoscaling.knative.dev/") and k not in dropped}
    annotations.setdefault("autoscaling.knative.dev/class", "kpa.autoscaling.knative.dev")
    if predictor.get("scaleTarget") is not None:
        annotations["autoscaling.knative.dev/target"] = str(int(predictor["scaleTarget"]))
    if predictor.get("scaleMetric") is not None:
        annotations["autoscaling.knative.dev/metric"] = predictor["scaleMetric"]
    annotations["autoscaling.knative.dev/min-scale"] = str(predictor.get("minReplicas", 1))
    if predictor.get("maxReplicas"):
        annotations["autoscaling.knative.dev/max-scale"] = str(predictor["maxReplicas"])
    return annotations, predictor.get("containerConcurrency")


def knative_target(annotations: dict, container_concurrency: int | None) -> float:
    """The concurrency per pod Knative's autoscaler aims at (knative/serving v0.48.1
    pkg/reconciler/autoscaling/resources/target.go ResolveMetricTarget 31-63): the `target`
    annotation, capped at containerConcurrency where that is set (without the annotation:
    containerConcurrency, or 100 where it is 0), times the utilization (the annotation
    target-utilization-percentage / 100, else the ConfigMap's default 0.7,
    pkg/autoscaler/config/config.go), at least 0.01 (autoscaling.TargetMin)."""
    cc = float(container_concurrency or 0)
    total = cc or 100.0
    if "autoscaling.knative.dev/target" in annotations:
        total = float(annotations["autoscaling.knative.dev/target"])
        if cc:
            total = min(total, cc)
    utilization = float(annotations.get("autoscaling.knative.dev/target-utilization-percentage", 70)) / 100
    return max(0.01, total * utilization)


def hpa_replicas(value: float, target: float, current: int, minimum: int, maximum: int,
                 tolerance: float = 0.1) -> int:
    """The replicas the HPA behind a KEDA ScaledObject asks for, for an External metric of type
    AverageValue (KServe writes no metricType: KEDA's default): Kubernetes v1.36.3
    pkg/controller/podautoscaler/replica_calculator.go GetExternalPerPodMetricReplicas 382-420:
    the current count while value / (target x current) is within the tolerance of 1 (isWithin
    56-58; --horizontal-pod-autoscaler-tolerance, 0.1 by default, config/v1alpha1/defaults.go),
    else ceil(value / target); then clamped to the HPA's [minReplicas, maxReplicas] (KEDA gives it
    minReplicaCount, at least 1, and maxReplicaCount). Stabilization windows come on top."""
    import math

    current = max(current, 1)
    ratio = value / (target * current)
    wanted = current if 1 - tolerance <= ratio <= 1 + tolerance else math.ceil(value / target)
    return min(max(wanted, minimum, 1), maximum)


# The windows KServe falls back to where the predictor's behavior sets none: the `autoscaler` entry
# of its shipped inferenceservice-config ConfigMap (config/configmap/inferenceservice.yaml,
# v0.16.0-v0.20.0: scale up "0", scale down "300"; keda_reconciler.go 212-226).
CONFIGMAP_WINDOWS = {"scaleUp": 0, "scaleDown": 300}


def _quantity_string(value: Any) -> str:
    return value if isinstance(value, str) else str(value)


def scaled_objects(release: str, isvc: dict) -> dict[str, dict]:
    """{name: ScaledObject} KServe writes for a raw InferenceService whose autoscaler class is
    `keda` (reconcilers/autoscaler/autoscaler_reconciler.go createAutoscaler 86-100; the class is
    the annotation of the component's metadata: the InferenceService's, overridden by the
    predictor's own annotations, components/predictor.go buildObjectMeta 498-519).

    keda_reconciler.go (v0.20.0 lines; v0.16.0 and v0.19.0 the same code): one trigger per
    External metric, type = backend, metadata serverAddress / query / threshold = the target value
    as written (getOriginalStringMQ; v0.15.x: fmt "%f" of it, 118), `namespace` only if set
    (getKedaMetrics 81-186); no metricType (KEDA's default AverageValue) and no
    activationThreshold; minReplicaCount = minReplicas (1 when unset), maxReplicaCount raised to
    it (createKedaScaledObject 187-283); the behavior's stabilization windows, each falling back to
    KServe's ConfigMap (CONFIGMAP_WINDOWS), as advanced.horizontalPodAutoscalerConfig.behavior
    (from v0.16.0; v0.15.x writes none). v0.14.x has no keda class (an error).

    Canaries (v0.20.0, spec.canary[]): each gets the stable predictor merged with its own, its
    autoscaling fields zeroed and minReplicas = its replica count (predictor.go buildCanaryPredictor
    897-910, canaryReplicaCount 886-895: its own minReplicas, else ceil(stable minReplicas x
    trafficPercent / 100)), and the same autoscaler class: with keda, a ScaledObject with no
    triggers. The stable minReplicas drops by the canaries' replicas, to at least 1 (780-803)."""
    import math

    if _release(release) < (0, 15, 0):
        raise ValueError(f"KServe {release} has no autoscaler class keda")
    meta, spec = isvc["metadata"], isvc["spec"]
    stable = spec["predictor"]
    canaries = spec.get("canary") or []

    def replicas(canary: dict) -> int:
        own = canary["predictor"].get("minReplicas")
        return own if own is not None else math.ceil(stable.get("minReplicas", 1) * canary["trafficPercent"] / 100)

    def one(predictor: dict, name: str) -> dict | None:
        annotations = {**(meta.get("annotations") or {}), **(predictor.get("annotations") or {})}
        if annotations.get(AUTOSCALER_CLASS) != "keda":
            return None
        triggers = []
        for metric in (predictor.get("autoScaling") or {}).get("metrics") or []:
            if metric["type"] != "External":
                continue
            source = metric["external"]["metric"]
            value = metric["external"]["target"].get("value", "0")
            threshold = (f"{float(value):f}" if _release(release) < (0, 16, 0) else _quantity_string(value))
            trigger = {"type": source.get("backend", ""),
                       "metadata": {"serverAddress": source.get("serverAddress", ""), "query": source.get("query", ""),
                                    "threshold": threshold}}
            if source.get("backend") == "prometheus" and source.get("namespace"):
                trigger["metadata"]["namespace"] = source["namespace"]
            triggers.append(trigger)
        minimum = predictor.get("minReplicas", 1)
        obj = {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
               "metadata": {"name": name, "namespace": meta.get("namespace", "default")},
               "spec": {"scaleTargetRef": {"name": name}, "triggers": triggers, "minReplicaCount": minimum,
                        "maxReplicaCount": max(predictor.get("maxReplicas", 0), minimum)}}
        if _release(release) >= (0, 16, 0):
            behavior = (predictor.get("autoScaling") or {}).get("behavior") or {}
            windows = {d: {"stabilizationWindowSeconds": (behavior.get(d) or {}).get("stabilizationWindowSeconds",
                                                                                      CONFIGMAP_WINDOWS[d])}
                       for d in ("scaleDown", "scaleUp")}
            # AdvancedConfig.ScalingModifiers has no omitempty: it is written as {}.
            obj["spec"]["advanced"] = {"horizontalPodAutoscalerConfig": {"behavior": windows}, "scalingModifiers": {}}
        return obj

    out = {}
    stable_predictor = copy.deepcopy(stable)
    if canaries and "minReplicas" in stable:
        stable_predictor["minReplicas"] = max(stable["minReplicas"] - sum(replicas(c) for c in canaries), 1)
    name = predictor_service_name(meta["name"], stable.get("name"))
    if (obj := one(stable_predictor, name)) is not None:
        out[name] = obj
    for canary in canaries:
        merged = {**copy.deepcopy(stable), **copy.deepcopy(canary["predictor"])}
        merged["annotations"] = {**(stable.get("annotations") or {}), **(canary["predictor"].get("annotations") or {})}
        for field in ("maxReplicas", "scaleTarget", "scaleMetric", "autoScaling"):
            merged.pop(field, None)
        merged["minReplicas"] = replicas(canary)
        name = predictor_service_name(meta["name"], canary["predictor"]["name"])
        if (obj := one(merged, name)) is not None:
            out[name] = obj
    return out


def _condition(kind: str, status: str, reason: str = "", message: str = "") -> dict:
    return {"type": kind, "status": status, **({"reason": reason} if reason else {}),
            **({"message": message} if message else {})}


def raw_predictor_ready(release: str, deployment_conditions: list[dict]) -> dict:
    """PredictorReady as `release`'s PropagateRawStatus derives it from the stable Deployment's
    conditions (module docstring)."""
    found = {c["type"]: c for c in deployment_conditions}
    available, progressing = found.get("Available"), found.get("Progressing")
    if _release(release) < (0, 16, 0):
        source = available or {"status": "Unknown"}
        if source["status"] == "True":  # SetCondition: MarkTrue, which drops reason and message
            return _condition("PredictorReady", "True")  # (v0.15.2 on a real cluster: tests/test_cluster.py)
        return _condition("PredictorReady", source["status"], source.get("reason", ""), source.get("message", ""))
    ready = _condition("PredictorReady", "False")
    if available and available["status"] == "True":
        ready = _condition("PredictorReady", "True", available.get("reason", ""), available.get("message", ""))
    if progressing is not None:
        reason, message = progressing.get("reason", ""), progressing.get("message", "")
        if progressing["status"] == "False":
            if message:
                ready = _condition("PredictorReady", "False", reason, message)
        elif progressing["status"] == "True":
            if reason == "NewReplicaSetAvailable":
                ready = _condition("PredictorReady", "True", reason, message)
            elif _release(release) < (0, 20, 0) or not (available and available["status"] == "True"):
                ready = _condition("PredictorReady", "Unknown", reason, message)
    if available and available["status"] == "False":
        ready = _condition("PredictorReady", "False", available.get("reason", ""), available.get("message", ""))
    failure = found.get("ReplicaFailure")
    if failure and failure["status"] == "True":
        ready = _condition("PredictorReady", "False", failure.get("reason", ""), failure.get("message", ""))
    return ready


def _living(conditions: list[dict]) -> dict:
    """A Knative living condition set's Ready: False if a dependent is False, else Unknown if
    one is Unknown, else True (knative.dev/pkg apis/condition_set.go)."""
    for status in ("False", "Unknown"):
        for c in conditions:
            if c["status"] == status:
                return _condition("Ready", status, c.get("reason", ""), c.get("message", ""))
    return _condition("Ready", "True")


def default_isvc(release: str, obj: dict) -> None:
    """`release`'s defaulting webhook, as far as the mode names go (module docstring)."""
    annotations = obj["metadata"].get("annotations") or {}
    if _release(release) >= (0, 17, 0) and annotations.get(MODE_ANNOTATION) in _NEW_NAMES:
        annotations[MODE_ANNOTATION] = _NEW_NAMES[annotations[MODE_ANNOTATION]]


def _denied(message: str) -> ApiError:
    """A denial as controller-runtime's admission.Denied answers it."""
    return ApiError(403, "Forbidden", 'admission webhook "inferenceservice.kserve-webhook-server.validator" '
                    f"denied the request: {message}")


def validate_update(release: str, old: dict, new: dict) -> None:
    """`release`'s validating webhook on an UPDATE, after the defaulter (module docstring)."""
    if _release(release) < (0, 15, 1):
        return
    recorded = (old.get("status") or {}).get("deploymentMode")
    annotation = (new["metadata"].get("annotations") or {}).get(MODE_ANNOTATION)
    if recorded and annotation is not None and annotation != recorded:
        raise _denied(f"update rejected: deploymentMode cannot be changed from '{recorded}' to '{annotation}'")
    if _release(release) < (0, 20, 0):
        return
    old_predictor, predictor = old["spec"]["predictor"], new["spec"]["predictor"]
    if old_predictor.get("name") != predictor.get("name") and \
            (old_predictor.get("model") or {}).get("storageUri") == (predictor.get("model") or {}).get("storageUri"):
        raise _denied("predictor.name change requires a model change (e.g. storageUri)")
    canaries = new["spec"].get("canary") or []
    if not canaries:
        return
    if annotation != "Standard":
        raise _denied("canary is only supported in Standard deployment mode")
    names, total = set(), 0
    for i, canary in enumerate(canaries):
        name = canary["predictor"].get("name") or ""
        if not name:
            raise _denied(f"canary[{i}] predictor.name is required")
        if name in names:
            raise _denied(f'canary predictor.name "{name}" is duplicated')
        if name == predictor.get("name"):
            raise _denied(f'canary predictor.name "{name}" conflicts with stable predictor name')
        names.add(name)
        percent = canary.get("trafficPercent", 0)
        if not 0 <= percent <= 100:
            raise _denied(f'canary "{name}" trafficPercent must be between 0 and 100, got {percent}')
        total += percent
        if canary["predictor"].get("maxReplicas"):
            raise _denied(f'canary "{name}" must not set maxReplicas (canary uses fixed replicas)')
        if canary["predictor"].get("minReplicas", 0) > predictor.get("minReplicas", 1):
            raise _denied(f'canary "{name}" minReplicas must not exceed stable predictor minReplicas')
    if total > 100:
        raise _denied(f"sum of canary trafficPercent values ({total}) must be <= 100")


class ApiError(Exception):
    """An API server error response (stands for kubernetes.client's ApiException)."""

    def __init__(self, status: int, reason: str, message: str = ""):
        super().__init__(f"{status} {reason}: {message}")
        self.status, self.reason, self.message = status, reason, message


def json_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386, section 2 (the pseudo-code, written out)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for name, value in patch.items():
        if value is None:
            result.pop(name, None)
        else:
            result[name] = json_merge_patch(result.get(name), value)
    return copy.deepcopy(result)


_SYSTEM_METADATA = {"resourceVersion", "generation", "managedFields", "uid", "creationTimestamp", "name", "namespace"}


def leaves(obj: Any, prefix: tuple = ()) -> dict[tuple, Any]:
    """Field path -> value, down to scalars; lists are atomic; system metadata left out."""
    out = {}
    if isinstance(obj, dict) and obj:
        for key, value in obj.items():
            if prefix == ("metadata",) and key in _SYSTEM_METADATA or prefix == () and key == "status":
                continue
            out.update(leaves(value, (*prefix, key)))
    elif prefix:
        out[prefix] = obj
    return out


def _fields_v1(paths) -> dict:
    tree: dict = {}
    for path in paths:
        node = tree
        for key in path:
            node = node.setdefault(f"f:{key}", {})
    return tree


def _without(obj: dict, paths) -> dict:
    obj = copy.deepcopy(obj)
    for path in sorted(paths, key=len, reverse=True):
        node = obj
        for key in path[:-1]:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(path[-1], None)
    return obj


class ObjectStore:
    """One custom object as the API server keeps it."""

    def __init__(self, obj: dict, manager: str = "kubectl", operation: str = "Apply", resource_version: str = "1"):
        self.obj = copy.deepcopy(obj)
        self.obj["metadata"].update(resourceVersion=resource_version, generation=1)
        self.owners: dict[str, set] = {manager: set(leaves(self.obj))}
        self.operations = {manager: operation}
        self.admission = None  # (old, new) -> None or ApiError: the validating webhooks on UPDATE
        self.mutation = None  # (new) -> None: the defaulting webhook, on every write but status
        self._render_managed_fields()

    def get(self) -> dict:
        return copy.deepcopy(self.obj)

    def _store(self, new: dict, admit: bool = True) -> dict:
        old = self.obj
        if admit and self.mutation is not None:  # not for status: the webhooks watch the resource, not /status
            self.mutation(new)
        if admit and self.admission is not None:
            self.admission(old, new)
        new["metadata"]["resourceVersion"] = str(int(old["metadata"]["resourceVersion"]) + 1)
        content = lambda o: {k: v for k, v in o.items() if k not in ("metadata", "status")}  # noqa: E731
        generation = old["metadata"]["generation"] + (content(new) != content(old))
        new["metadata"]["generation"] = generation
        self.obj = new
        self._render_managed_fields()
        return self.get()

    def _render_managed_fields(self) -> None:
        self.owners = {m: f for m, f in self.owners.items() if f}
        self.obj["metadata"]["managedFields"] = [
            {"manager": m, "operation": self.operations.get(m, "Update"), "apiVersion": self.obj.get("apiVersion", "v1"),
             "fieldsType": "FieldsV1", "fieldsV1": _fields_v1(sorted(fields))}
            for m, fields in sorted(self.owners.items())]

    def _check_precondition(self, patch: dict) -> None:
        wanted = (patch.get("metadata") or {}).get("resourceVersion")
        if wanted is not None and wanted != self.obj["metadata"]["resourceVersion"]:
            raise ApiError(409, "Conflict", "the object has been modified; please apply your changes to the latest version")

    def update(self, patch: dict, manager: str) -> dict:
        """A merge patch (operation Update) by `manager`."""
        self._check_precondition(patch)
        patch = copy.deepcopy(patch)
        patch.get("metadata", {}).pop("resourceVersion", None)
        before = leaves(self.obj)
        new = json_merge_patch(self.obj, patch)
        new["status"] = copy.deepcopy(self.obj.get("status"))
        if new["status"] is None:
            del new["status"]
        after = leaves(new)
        changed = {p for p, v in after.items() if before.get(p, object()) != v}
        gone = set(before) - set(after)
        for m in self.owners:
            self.owners[m] = {p for p in self.owners[m] if p not in changed and p not in gone
                              and not any(p[:len(c)] == c for c in changed)}
        self.owners.setdefault(manager, set()).update(changed)
        self.operations.setdefault(manager, "Update")
        return self._store(new)

    def apply(self, config: dict, manager: str, force: bool = False) -> dict:
        """Server-side apply of `config` (operation Apply) by `manager`; a resourceVersion in it
        is a precondition, as for an update."""
        self._check_precondition(config)
        config = copy.deepcopy(config)
        config.get("metadata", {}).pop("resourceVersion", None)
        live = leaves(self.obj)
        wanted = leaves(config)
        conflicts = sorted((p, m) for p, v in wanted.items() if live.get(p, object()) != v and p in live
                           for m, fields in self.owners.items() if m != manager and p in fields)
        if conflicts and not force:
            raise ApiError(409, "Conflict", "Apply failed with %d conflict(s): " % len(conflicts) + "; ".join(
                f'conflict with "{m}": .{".".join(p)}' for p, m in conflicts))
        # Fields this manager applied before and no longer applies are removed, unless shared.
        dropped = {p for p in self.owners.get(manager, set()) - set(wanted)
                   if not any(p in f for m, f in self.owners.items() if m != manager)}
        new = json_merge_patch(_without(self.obj, dropped), {k: v for k, v in config.items() if k != "status"})
        changed = {p for p, v in wanted.items() if live.get(p, object()) != v}
        for m in self.owners:
            if m != manager:
                self.owners[m] -= changed
        self.owners[manager] = set(wanted)
        self.operations[manager] = "Apply"
        return self._store(new)

    def write_status(self, status: dict) -> None:
        new = copy.deepcopy(self.obj)
        new["status"] = status
        self._store(new, admit=False)


DEPLOYMENT_REVISION = "deployment.kubernetes.io/revision"
ISVC_LABEL = "serving.kserve.io/inferenceservice"


class Deployment:
    """One Deployment with one replica and its ReplicaSets, as Kubernetes' Deployment controller
    keeps them (module docstring). `template` is the pod template (JSON), `uri` what it downloads."""

    def __init__(self, name: str, template: str, uri: str | None):
        self.name, self.generation = name, 1
        self.replica_sets: list[dict] = []  # {"name", "template", "uri", "revision", "available"}
        self.stalled = False  # progressDeadlineSeconds passed before the new pod was available
        self.replica_failure: str | None = None  # why the ReplicaSet cannot create its pod
        self._roll(template, uri)

    def _roll(self, template: str, uri: str | None) -> None:
        revision = max((rs["revision"] for rs in self.replica_sets), default=0) + 1
        for rs in self.replica_sets:
            if rs["template"] == template:  # sync.go getNewReplicaSet: the old one, adopted again
                rs["revision"] = revision
                break
        else:
            digest = hashlib.sha256(template.encode()).hexdigest()[:10]
            self.replica_sets.append({"name": f"{self.name}-{digest}", "template": template, "uri": uri,
                                      "revision": revision, "available": 0})
        self.template, self.uri, self.stalled = template, uri, False

    def update(self, template: str, uri: str | None) -> bool:
        """KServe writes the Deployment's pod template; True when a new pod must start (a rolling
        update, unless the template is that of a ReplicaSet whose pod still serves)."""
        if template == self.template:
            return False
        self.generation += 1
        self._roll(template, uri)
        return not self.new["available"]

    @property
    def new(self) -> dict:
        return next(rs for rs in self.replica_sets if rs["template"] == self.template)

    def start_pods(self) -> None:
        """The new pod is available: the rolling update scales the old ReplicaSets to 0."""
        for rs in self.replica_sets:
            rs["available"] = int(rs is self.new)
        self.stalled = False

    @property
    def serving(self) -> str | None:
        """The storage URI the available pods serve (the old one while a rolling update runs)."""
        pods = [rs for rs in self.replica_sets if rs["available"]]
        return pods[0]["uri"] if pods else None

    def conditions(self) -> list[dict]:
        new = self.new
        old = [rs for rs in self.replica_sets if rs is not new and rs["available"]]
        if new["available"] or old:
            conditions = [_condition("Available", "True", "MinimumReplicasAvailable", "Deployment has minimum availability.")]
        else:
            conditions = [_condition("Available", "False", "MinimumReplicasUnavailable",
                                     "Deployment does not have minimum availability.")]
        if new["available"] and not old:
            conditions.append(_condition("Progressing", "True", "NewReplicaSetAvailable",
                                         f'ReplicaSet "{new["name"]}" has successfully progressed.'))
        elif self.stalled:
            conditions.append(_condition("Progressing", "False", "ProgressDeadlineExceeded",
                                         f'ReplicaSet "{new["name"]}" has timed out progressing.'))
        else:
            conditions.append(_condition("Progressing", "True", "ReplicaSetUpdated",
                                         f'ReplicaSet "{new["name"]}" is progressing.'))
        if self.replica_failure:
            conditions.append(_condition("ReplicaFailure", "True", "FailedCreate", self.replica_failure))
        return conditions

    def replica_set_objects(self, isvc: str, namespace: str) -> list[dict]:
        """The ReplicaSets as the API server lists them (labels from the pod template plus
        pod-template-hash, the revision annotation, the owner reference)."""
        return [{
            "apiVersion": "apps/v1", "kind": "ReplicaSet",
            "metadata": {"name": rs["name"], "namespace": namespace,
                         "labels": {ISVC_LABEL: isvc, "component": "predictor", "app": f"isvc.{self.name}",
                                    "pod-template-hash": rs["name"].rsplit("-", 1)[1]},
                         "annotations": {DEPLOYMENT_REVISION: str(rs["revision"])},
                         "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment", "name": self.name,
                                              "uid": f"uid-{self.name}", "controller": True}]},
            "spec": {"replicas": int(rs is self.new or bool(rs["available"])),
                     "template": {"metadata": {"annotations": {ANNOTATION_URI: rs["uri"]}}}},
            "status": {"replicas": rs["available"], "readyReplicas": rs["available"],
                       "availableReplicas": rs["available"]}}
            for rs in self.replica_sets]


def predictor_service_name(isvc: str, predictor: str | None) -> str:
    """pkg/constants/constants.go 799-804."""
    return f"{isvc}-{predictor}-predictor" if predictor else f"{isvc}-predictor"


class KServeController:
    """Reconciles one InferenceService of an ObjectStore as KServe (and Knative) would; pods come
    up only when a test says so (`start_pods`)."""

    def __init__(self, store: ObjectStore, release: str = "v0.20.0"):
        self.store, self.release = store, release
        store.admission = lambda old, new: validate_update(release, old, new)
        store.mutation = lambda new: default_isvc(release, new)
        default_isvc(release, store.obj)  # it was created through the defaulter too
        self.revisions: list[dict] = []  # Knative: {"name", "uri", "template", "ready"}
        self.ksvc_generation = 0
        self.ksvc_template = None
        self.ksvc_spec = None
        self.deployments: dict[str, Deployment] = {}  # Raw: by name
        self.services: set[str] = set()  # Raw: KServe's predictor Services
        self.httproutes: dict[str, str] = {}  # Raw, Gateway API: KServe's HTTPRoutes -> the Service they send to
        self.model_starts: list[str] = []  # every model server that had to start (download + load)
        self.deleted: list[str] = []
        self.traffic_history: list[list[tuple[str, int]]] = []  # (uri, percent) served after each reconcile

    # -- Serverless -----------------------------------------------------------------------------

    def _annotations(self, isvc: dict) -> dict:
        """The InferenceService's annotations that reach a revision or pod template."""
        disallowed = disallowed_annotations(self.release)
        return {k: v for k, v in (isvc["metadata"].get("annotations") or {}).items() if k not in disallowed}

    def _template(self, isvc: dict) -> str:
        annotations = self._annotations(isvc)
        predictor = {k: v for k, v in isvc["spec"]["predictor"].items() if k != "canaryTrafficPercent"}
        return json.dumps({"annotations": annotations, "predictor": predictor}, sort_keys=True)

    def bump_ksvc(self) -> None:
        """KServe re-renders the Knative Service without a new revision (e.g. its ingress or
        deploy config changed): only the Knative Service's generation moves."""
        self.ksvc_generation += 1
        self.reconcile()

    def _reconcile_serverless(self, isvc: dict) -> dict:
        name = isvc["metadata"]["name"]
        template = self._template(isvc)
        status = copy.deepcopy(isvc.get("status") or {})
        component = status.setdefault("components", {}).setdefault("predictor", {})
        rolled = component.get("latestRolledoutRevision", "")
        if template != self.ksvc_template:
            self.ksvc_template = template
            uri = isvc["spec"]["predictor"]["model"].get("storageUri")
            self.revisions.append({"name": f"{name}-predictor-{len(self.revisions) + 1:05d}", "uri": uri,
                                   "ready": False, "failed": None})
            self.model_starts.append(self.revisions[-1]["name"])
        percent = isvc["spec"]["predictor"].get("canaryTrafficPercent")
        tag_routing = (isvc["metadata"].get("annotations") or {}).get("serving.kserve.io/enable-tag-routing") == "true"
        # ksvc_reconciler.go 133-164
        if percent is not None and rolled:
            targets = [{"latestRevision": True, "percent": percent, **({"tag": "latest"} if tag_routing else {})}]
            if percent < 100:
                targets.append({"revisionName": rolled, "latestRevision": False, "percent": 100 - percent, "tag": "prev"})
        else:
            targets = [{"latestRevision": True, "percent": 100, **({"tag": "latest"} if tag_routing else {})}]
        ksvc_spec = json.dumps([template, targets], sort_keys=True)
        if ksvc_spec != self.ksvc_spec:  # KServe updates the Knative Service: its generation moves
            self.ksvc_spec = ksvc_spec
            self.ksvc_generation += 1
        created = self.revisions[-1]["name"]
        ready_revisions = [r["name"] for r in self.revisions if r["ready"]]
        latest_ready = ready_revisions[-1] if ready_revisions else ""
        traffic = []
        for t in targets:  # Knative resolves `latestRevision` to the latest ready revision
            revision = latest_ready if t.get("latestRevision") else t["revisionName"]
            if revision:
                traffic.append({**t, "revisionName": revision})
        # inference_service_status.go 567-636 (PropagateStatus)
        revision_traffic: dict[str, int] = {}
        for t in traffic:
            revision_traffic[t["revisionName"]] = revision_traffic.get(t["revisionName"], 0) + t["percent"]
        component["latestCreatedRevision"] = created
        for t in traffic:
            if t["revisionName"] == latest_ready and t.get("latestRevision"):
                if component.get("latestRolledoutRevision") != latest_ready:
                    if t["percent"] == 100:
                        component["previousRolledoutRevision"] = component.get("latestRolledoutRevision", "")
                        component["latestRolledoutRevision"] = latest_ready
                elif latest_ready == created and t["percent"] < 100:
                    if revision_traffic.get(t["revisionName"]) == 100 and component.get("previousRolledoutRevision"):
                        component["latestRolledoutRevision"] = component["previousRolledoutRevision"]
        component["latestReadyRevision"] = latest_ready
        component["traffic"] = traffic
        # Knative's conditions, copied by PropagateStatus (module docstring).
        failed = self.revisions[-1]["failed"]
        if failed:
            configuration = _condition("ConfigurationsReady", "False", "RevisionFailed",
                                       f'Revision "{created}" failed with message: {failed}.')
        else:
            configuration = _condition("ConfigurationsReady", "True" if latest_ready == created else "Unknown")
        routes = _condition("RoutesReady", "True" if traffic else "Unknown")
        ready = _living([configuration, routes])
        status["conditions"] = [{**ready, "type": "PredictorReady"}, {**routes, "type": "PredictorRouteReady"},
                                {**configuration, "type": "PredictorConfigurationReady"}, ready]
        status["observedGeneration"] = self.ksvc_generation
        self._record_mode(status, raw=False)
        uris = {r["name"]: r["uri"] for r in self.revisions}
        self.traffic_history.append([(uris[t["revisionName"]], t["percent"]) for t in traffic])
        return status

    def revision_uris(self) -> dict[str, str]:
        return {r["name"]: r["uri"] for r in self.revisions}

    def revision_object(self, name: str) -> dict | None:
        for r in self.revisions:
            if r["name"] == name:
                return {"apiVersion": "serving.knative.dev/v1", "kind": "Revision",
                        "metadata": {"name": name, "annotations": {ANNOTATION_URI: r["uri"]}}}
        return None

    # -- RawDeployment ----------------------------------------------------------------------------

    def _pod_template(self, isvc: dict, predictor: dict) -> str:
        """What reaches the pod template: the allowed annotations and the predictor's pod spec
        (its name and replica bounds name and size the Deployment; they are not in the template)."""
        pod = {k: v for k, v in predictor.items() if k not in ("name", "minReplicas", "maxReplicas", "canaryTrafficPercent")}
        # The model's container is kserve-container whether the spec names it or not.
        pod["model"] = {"name": "kserve-container", **pod.get("model", {})}
        return json.dumps({"annotations": self._annotations(isvc), "predictor": pod}, sort_keys=True)

    def _deployment(self, name: str, isvc: dict, predictor: dict) -> Deployment:
        template, uri = self._pod_template(isvc, predictor), predictor["model"].get("storageUri")
        deployment = self.deployments.get(name)
        if deployment is None:
            deployment = self.deployments[name] = Deployment(name, template, uri)
            self.model_starts.append(name)
        elif deployment.update(template, uri):  # a rolling update: a new pod downloads and loads
            self.model_starts.append(name)
        self.services.add(name)  # its Service has the same name
        return deployment

    def _reconcile_raw(self, isvc: dict) -> dict:
        name = isvc["metadata"]["name"]
        spec = isvc["spec"]
        status = copy.deepcopy(isvc.get("status") or {})
        stable_name = predictor_service_name(name, spec["predictor"].get("name"))
        stable = self._deployment(stable_name, isvc, spec["predictor"])
        expected = {stable_name}
        canary_statuses = []
        for canary in spec.get("canary") or []:  # predictor.go 913-1000
            merged = json_merge_patch(spec["predictor"], canary["predictor"])
            deployment_name = predictor_service_name(name, canary["predictor"]["name"])
            expected.add(deployment_name)
            deployment = self._deployment(deployment_name, isvc, merged)
            canary_statuses.append({"name": canary["predictor"]["name"], "ready": deployment.serving is not None,
                                    "trafficPercent": canary["trafficPercent"]})
        conditions = [c for c in status.get("conditions", []) if c["type"] != "CanaryPredictorReady"]
        if canary_statuses:
            status["canaryStatuses"] = canary_statuses
            all_ready = all(c["ready"] for c in canary_statuses)
            conditions.append({"type": "CanaryPredictorReady", "status": "True" if all_ready else "False",
                               "reason": "AllCanariesReady" if all_ready else "CanariesNotReady"})
        else:
            status.pop("canaryStatuses", None)
        for orphan in sorted(set(self.deployments) - expected):  # predictor.go 1002-1035
            del self.deployments[orphan]  # its ReplicaSets go with it (owner references)
            self.services.discard(orphan)
            self.deleted.append(orphan)
        # httproute_reconciler.go: the predictor's route under its Service's name (a route of an
        # older name stays) and the InferenceService's own route, both to the stable predictor.
        self.httproutes[stable_name] = stable_name
        self.httproutes[name] = stable_name
        ready = raw_predictor_ready(self.release, stable.conditions())
        conditions = [c for c in conditions if c["type"] not in ("PredictorReady", "Ready")]
        conditions += [ready, {**ready, "type": "Ready"}]
        status["conditions"] = conditions
        if _release(self.release) < (0, 15, 0):  # v0.14.x: the Deployment's revision number
            component = status.setdefault("components", {}).setdefault("predictor", {})
            component["latestCreatedRevision"] = str(stable.new["revision"])
        status["observedGeneration"] = stable.generation
        self._record_mode(status, raw=True)
        # The Ingress sends everything to the stable predictor's Service (v0.20.0), whose pods
        # serve the old template until the new pod is available.
        self.traffic_history.append([(stable.serving, 100)] if stable.serving else [])
        return status

    def replica_set_objects(self, namespace: str = "models") -> list[dict]:
        return [rs for d in self.deployments.values()
                for rs in d.replica_set_objects(self.store.obj["metadata"]["name"], namespace)]

    # -- both -----------------------------------------------------------------------------------

    def _record_mode(self, status: dict, raw: bool) -> None:
        mode = status_mode(self.release, raw)
        if mode:
            status["deploymentMode"] = mode
        else:
            status.pop("deploymentMode", None)

    def raw(self) -> bool:
        mode = (self.store.obj["metadata"].get("annotations") or {}).get("serving.kserve.io/deploymentMode", "")
        return mode.lower() in ("rawdeployment", "standard")

    def reconcile(self) -> dict:
        isvc = self.store.get()
        status = self._reconcile_raw(isvc) if self.raw() else self._reconcile_serverless(isvc)
        self.store.write_status(status)
        return self.store.get()

    def start_pods(self, name: str | None = None) -> dict:
        """The pods of a revision or Deployment (default: every one) become ready; KServe then
        reconciles."""
        for r in self.revisions:
            if name in (None, r["name"]) and not r["failed"]:
                r["ready"] = True
        for deployment_name, d in self.deployments.items():
            if name in (None, deployment_name):
                d.start_pods()
        return self.reconcile()

    def fail_pods(self, name: str, message: str = "Container failed with: model download failed") -> dict:
        """The new pods of revision or Deployment `name` never become ready: Knative marks the
        revision failed; the Deployment's progress deadline passes."""
        for r in self.revisions:
            if r["name"] == name:
                r["failed"] = message
        if name in self.deployments:
            self.deployments[name].stalled = True
        return self.reconcile()

    def serving(self) -> list[tuple[str, int]]:
        """(storage URI, percent) that live traffic reaches now."""
        return self.traffic_history[-1] if self.traffic_history else []
