"""The thin client: reads what the plans need from the cluster, checks, and sends the patch.

`Cluster` is the Kubernetes API (the `kubernetes` client, current kubeconfig or the pod's service
account). `Rollout` is one InferenceService on it: the CLI and the pipeline's KServe target both
go through it, so both check and patch the same way.
"""

from __future__ import annotations

import json
import os
import time
from typing import Callable, Mapping

from cubeserve.rollout.errors import NotReady, RolloutError
from cubeserve.rollout.plans import Plan, plan_canary, plan_promote, plan_rollback
from cubeserve.rollout.preflight import ClusterFacts, check
from cubeserve.rollout.state import (FIELD_MANAGER, ISVC_LABEL, REVISION_URI_ANNOTATION, SERVERLESS, ReplicaSet,
                                     Revisions, RolloutState, deployment_mode, get, replica_sets_of, rollout_state)
from cubeserve.rollout.versions import VERSIONS_CONFIGMAP, VersionRegistry

GROUP = "serving.kserve.io"
ISVC_API = ("v1beta1", "inferenceservices")
# (version, plural, group): the Gateway API route of the cross-pod A/B overlay (k8s/overlays/ab).
HTTPROUTE_API = ("v1", "httproutes", "gateway.networking.k8s.io")
ISVC_CRD = "inferenceservices.serving.kserve.io"
KSERVE_CONFIG = "inferenceservice-config"  # KServe's own ConfigMap, in its namespace
DEFAULT_ISVC = "cube3d"
DEFAULT_HTTPROUTE = "cube3d-ab"
# Patches refused in a row because the object moved since it was read (409: KServe's own status
# writes move its resourceVersion too), each planned again from a fresh read, before giving up.
CONFLICT_RETRIES = 5


def _status(exc: Exception) -> int | None:
    return getattr(exc, "status", None) if type(exc).__name__ == "ApiException" else None


class Cluster:
    """get/patch on serving.kserve.io objects, Knative revisions, the predictors' ReplicaSets,
    the registry ConfigMap and the facts the preflight reads."""

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
        self.apps = client.AppsV1Api()
        self.extensions = client.ApiextensionsV1Api()

    def get(self, api: tuple[str, ...], name: str) -> dict:
        group = api[2] if len(api) > 2 else GROUP
        return self.custom.get_namespaced_custom_object(group, api[0], self.namespace, api[1], name)

    def patch(self, api: tuple[str, ...], name: str, patch: dict) -> dict:
        # A dict body is sent as application/merge-patch+json. The field manager records these
        # fields as cubeserve-rollout's (metadata.managedFields), so a server-side apply of an
        # overlay that would change them conflicts instead of moving traffic; strict validation
        # refuses a field the CRD does not know instead of dropping it.
        group = api[2] if len(api) > 2 else GROUP
        return self.custom.patch_namespaced_custom_object(group, api[0], self.namespace, api[1], name, patch,
                                                          field_manager=FIELD_MANAGER, field_validation="Strict")

    def configmap(self, name: str) -> dict | None:
        """A ConfigMap of the namespace as the API server returns it; None if there is none."""
        try:
            return self._raw_json_or_raise(self.core.read_namespaced_config_map, name, self.namespace)
        except Exception as exc:  # noqa: BLE001 - the kubernetes client's ApiException
            if _status(exc) == 404:
                return None
            raise

    def apply_configmap(self, body: dict) -> dict:
        """Server-side apply of a ConfigMap (created if missing) as cubeserve-rollout: the fields
        in `body` become its own, a field another manager owns is a conflict (409), not taken
        over. The client (v30) has no apply call, so the request is made by hand."""
        return self.core.api_client.call_api(
            "/api/v1/namespaces/{namespace}/configmaps/{name}", "PATCH",
            {"namespace": self.namespace, "name": body["metadata"]["name"]},
            [("fieldManager", FIELD_MANAGER), ("fieldValidation", "Strict")],
            {"Content-Type": "application/apply-patch+yaml", "Accept": "application/json"},
            body=body, response_type="object", auth_settings=["BearerToken"], _return_http_data_only=True)

    def _raw_json_or_raise(self, call: Callable, *args, **kwargs) -> dict:
        return json.loads(call(*args, _preload_content=False, **kwargs).data)

    def registry(self, name: str = VERSIONS_CONFIGMAP) -> VersionRegistry:
        return VersionRegistry.from_configmap(self.core.read_namespaced_config_map(name, self.namespace).to_dict())

    def revisions(self, isvc: Mapping) -> dict[str, str]:
        """Knative revision name -> the storageUri it serves, for every revision the
        InferenceService's status names (needs get on revisions.serving.knative.dev)."""
        component = get(isvc, "status", "components", "predictor") or {}
        names = {component.get(k) for k in ("latestCreatedRevision", "latestReadyRevision",
                                             "latestRolledoutRevision", "previousRolledoutRevision")}
        names |= {t.get("revisionName") for t in component.get("traffic") or ()}
        found = {}
        for name in sorted(n for n in names if n):
            try:
                revision = self.custom.get_namespaced_custom_object("serving.knative.dev", "v1", self.namespace,
                                                                    "revisions", name)
            except Exception as exc:  # noqa: BLE001 - a revision Knative has garbage-collected
                if _status(exc) != 404:
                    raise
                continue
            uri = get(revision, "metadata", "annotations", REVISION_URI_ANNOTATION)
            if uri:
                found[name] = uri
        return found

    def replica_sets(self, isvc: Mapping) -> tuple[ReplicaSet, ...]:
        """The ReplicaSets of the InferenceService's predictor Deployments (RawDeployment), by
        KServe's label on their pods (needs list on apps replicasets)."""
        listed = self._raw_json_or_raise(self.apps.list_namespaced_replica_set, self.namespace,
                                         label_selector=f"{ISVC_LABEL}={get(isvc, 'metadata', 'name')}")
        return replica_sets_of(listed.get("items") or ())

    def _raw_json(self, call: Callable, *args) -> dict | None:
        try:
            response = call(*args, _preload_content=False)
        except Exception as exc:  # noqa: BLE001 - not allowed or not there: the fact is unknown
            if _status(exc) in (401, 403, 404):
                return None
            raise
        return json.loads(response.data)

    def facts(self, isvc: Mapping, kserve_namespace: str = "kserve") -> ClusterFacts:
        crd = self._raw_json(self.extensions.read_custom_resource_definition, ISVC_CRD)
        schema = None
        for version in get(crd, "spec", "versions", default=()) or ():
            if version.get("name") == ISVC_API[0]:
                schema = get(version, "schema", "openAPIV3Schema")
        runtime = get(isvc, "spec", "predictor", "model", "runtime")
        found = None
        if runtime:
            found = self._runtime_exists(runtime)
        config = self._raw_json(self.core.read_namespaced_config_map, KSERVE_CONFIG, kserve_namespace)
        gateway = None
        if config is not None:
            try:
                gateway = bool(json.loads(get(config, "data", "ingress", default="{}")).get("enableGatewayApi", False))
            except ValueError:
                gateway = None
        return ClusterFacts(schema, runtime, found, gateway)

    def _runtime_exists(self, name: str) -> bool | None:
        """A ServingRuntime in the namespace or a ClusterServingRuntime of that name?"""
        for call, args in ((self.custom.get_namespaced_custom_object, (GROUP, "v1alpha1", self.namespace, "servingruntimes", name)),
                           (self.custom.get_cluster_custom_object, (GROUP, "v1alpha1", "clusterservingruntimes", name))):
            try:
                call(*args)
                return True
            except Exception as exc:  # noqa: BLE001 - the kubernetes client's ApiException
                if _status(exc) in (401, 403):
                    return None
                if _status(exc) != 404:
                    raise
        return False


class Rollout:
    """One InferenceService on one cluster: what the plans need is read fresh for every plan;
    a change is checked (preflight) and sent as one merge patch."""

    def __init__(self, cluster, isvc: str = DEFAULT_ISVC, versions_configmap: str = VERSIONS_CONFIGMAP,
                 mode: str | None = None, kserve_namespace: str = "kserve", preflight: bool = True):
        self.cluster, self.isvc, self.versions_configmap = cluster, isvc, versions_configmap
        self.mode, self.kserve_namespace, self.preflight = mode, kserve_namespace, preflight

    def read(self) -> tuple[dict, VersionRegistry, Revisions]:
        """The InferenceService, the registry and what its pods serve (state.rollout_state)."""
        registry = self.cluster.registry(self.versions_configmap)
        isvc = self.cluster.get(ISVC_API, self.isvc)
        if deployment_mode(isvc, self.mode) == SERVERLESS:
            return isvc, registry, self.cluster.revisions(isvc)
        return isvc, registry, self.cluster.replica_sets(isvc)

    def state(self) -> RolloutState:
        isvc, registry, revisions = self.read()
        return rollout_state(isvc, registry, revisions, self.mode)

    def plan(self, action: str, version: str | None = None, percent: int | None = None,
             force: bool = False) -> tuple[dict, Plan]:
        isvc, registry, revisions = self.read()
        if action == "canary":
            return isvc, plan_canary(isvc, registry, version, percent, revisions, self.mode)
        # promote / rollback: `version` names the canary they may act on (None: whichever).
        planner = {"promote": plan_promote, "rollback": plan_rollback}[action]
        return isvc, planner(isvc, registry, revisions, self.mode, force, canary=version)

    def apply(self, isvc: dict, plan: Plan, dry_run: bool = False) -> list[str]:
        """Check and send `plan`'s patch (not with dry_run); returns the preflight's notes."""
        notes: list[str] = []
        if not plan.changed:
            return notes
        if self.preflight:
            errors, notes = check(isvc, plan.patch, self.cluster.facts(isvc, self.kserve_namespace),
                                  deployment_mode(isvc, self.mode))
            if errors:
                raise RolloutError("preflight: " + "; ".join(errors))
        if not dry_run:
            self.cluster.patch(ISVC_API, self.isvc, plan.patch)
        return notes

    def run(self, action: str, **kwargs) -> Plan:
        """Plan and apply one step (the pipeline's entry point), as run_until_done without waiting."""
        return self.run_until_done(action, **kwargs)[-1]

    def run_until_done(self, action: str, wait: float = 0.0, dry_run: bool = False,
                       on_plan=lambda plan, notes: None, on_wait=lambda exc, seconds: time.sleep(seconds),
                       **kwargs) -> list[Plan]:
        """Plan and apply `action` the way `cubeserve rollout ACTION --wait SECONDS` does (the CLI
        and the pipeline share this): a plan refused as NotReady is asked again until `wait`
        seconds have passed (then NotReady is raised); a Serverless rollback takes two patches
        (pin traffic to the previous revision, then drop the split once the reverted revision is
        ready), and with `wait` the second follows in the same call, so a rollback never stops
        halfway. A patch refused because the object changed since it was read (409) is planned
        again from a fresh read, up to CONFLICT_RETRIES times in a row: the plan is checked
        against what is there now, so another writer's change is never overwritten.
        `on_plan(plan, notes)` sees each plan; `on_wait(exc, seconds)` waits (and may report
        why). Returns the plans applied."""
        deadline = time.monotonic() + wait
        applied: list[Plan] = []
        conflicts = 0
        while True:
            try:
                isvc, plan = self.plan(action, **kwargs)
            except NotReady as exc:
                if time.monotonic() >= deadline:
                    raise
                on_wait(exc, min(10.0, max(0.5, deadline - time.monotonic())))
                continue
            if applied and not plan.changed:
                return applied
            try:
                notes = self.apply(isvc, plan, dry_run)
            except Exception as exc:  # noqa: BLE001 - the kubernetes client's ApiException
                if _status(exc) != 409 or conflicts >= CONFLICT_RETRIES:
                    raise
                conflicts += 1
                continue
            conflicts = 0
            on_plan(plan, notes)
            applied.append(plan)
            if not (plan.changed and wait and action == "rollback" and not dry_run):
                return applied
            # Finishing the rollback this call started: whichever canary it named is gone now.
            kwargs["version"] = None

