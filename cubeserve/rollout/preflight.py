"""Checks against the cluster before a patch is sent.

An API server prunes the fields a CRD does not know (or, with strict field validation, refuses
them); either way a patch written for a newer KServe than the cluster runs would not do what it
says. So before writing, `cubeserve rollout` checks that the InferenceService CRD served here has
every field the patch writes, that the ServingRuntime exists, and, for a RawDeployment canary
with a share of the traffic, that KServe routes through the Gateway API at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from cubeserve.rollout.patch import written_paths
from cubeserve.rollout.state import RAW, get

# Fields the rollout may write that older KServe releases lack: the release that added them.
ADDED_IN = {("spec", "canary"): "v0.20.0", ("spec", "predictor", "name"): "v0.20.0"}


@dataclass(frozen=True)
class ClusterFacts:
    """What the preflight needs to know about the cluster; None where it could not be read."""

    isvc_schema: Mapping | None = None  # the served v1beta1 InferenceService openAPIV3Schema
    runtime: str | None = None  # the ServingRuntime the InferenceService names
    runtime_found: bool | None = None
    gateway_api: bool | None = None  # KServe's ingress config: enableGatewayApi


def _schema_has(schema: Mapping, path: tuple[str, ...]) -> bool:
    for key in path:
        if schema.get("x-kubernetes-preserve-unknown-fields"):
            return True
        if key == "[]":
            schema = schema.get("items") or {}
            continue
        properties = schema.get("properties")
        if properties is None:
            return schema.get("type") == "object" and "additionalProperties" in schema
        if key not in properties:
            return False
        schema = properties[key]
    return True


def check(isvc: Mapping, patch: Mapping, facts: ClusterFacts, mode: str) -> tuple[list[str], list[str]]:
    """(errors, notes) for sending `patch` to `isvc` on a cluster with `facts`."""
    errors, notes = [], []
    if facts.isvc_schema is None:
        notes.append("could not read the InferenceService CRD (needs get on customresourcedefinitions); "
                     "the patch is sent with strict field validation instead")
    else:
        for path in written_paths(patch):
            if path[0] == "metadata" or _schema_has(facts.isvc_schema, path):
                continue
            dotted = ".".join(p for p in path if p != "[]")
            added = next((f" (added in KServe {r})" for prefix, r in ADDED_IN.items() if path[:len(prefix)] == prefix), "")
            errors.append(f"the InferenceService CRD on this cluster has no field {dotted}{added}: "
                          "the API server would not keep it, so the rollout would not happen")
            break
    if facts.runtime_found is False:
        errors.append(f"ServingRuntime {facts.runtime} does not exist in this namespace "
                      "(kubectl apply --server-side -k k8s/base/runtime)")
    canaries = get(patch, "spec", "canary") or []
    if mode == RAW and any(c.get("trafficPercent") for c in canaries):
        if facts.gateway_api is None:
            errors.append("cannot tell whether KServe routes through the Gateway API (needs get on the "
                          "ConfigMap inferenceservice-config in KServe's namespace): give the canary "
                          "--percent 0, or pass --skip-preflight")
        elif not facts.gateway_api:
            errors.append("KServe here routes with a plain Ingress, which sends nothing to a "
                          "RawDeployment canary: its share would be 0% whatever the spec says. Use "
                          "--percent 0 (a dark launch: warm it up, test it on its own Service, then "
                          "promote without a restart) or the Serverless mode")
        else:
            notes.append("the canary gets its share only where the KServe controller weights the "
                         "HTTPRoute's backends (releases after v0.20.0); v0.20.0 uses trafficPercent "
                         "only to size the canary's replicas")
    return errors, notes
