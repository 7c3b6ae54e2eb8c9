"""The in-server experiment on a cluster: `cubeserve rollout ab --set ... | --shadow ... | --clear`.

The predict model reads its experiment (arms, salt, shadow: cubeserve/serving/experiment.py) from
the file named by CUBE3D_EXPERIMENT_FILE; on KServe that file is the key `experiment.json` of the
ConfigMap `cube3d-experiment`, mounted into the predictor by k8s/components/experiment (optional,
so a pod starts without it; not a subPath mount, so the kubelet refreshes it within about a
minute and the server picks up the new experiment without a restart). No overlay declares the
ConfigMap: `cubeserve rollout` is its only writer (server-side apply, field manager
cubeserve-rollout), and an empty `experiment.json` means no experiment.

A pod can only send a request to a version it has loaded, so every version the experiment names
must be in the pod's model repository. A storageUri `<baseUri>/<V>/` holds version V alone; a
version set `<baseUri>/sets/<V1>-<V2>-.../` (cubeserve/rollout/version_sets.py writes it) holds
several. The plan refuses an experiment that names a version the InferenceService does not load.
"""

from __future__ import annotations

import json
from typing import Mapping

from cubeserve.rollout.errors import RolloutError
from cubeserve.rollout.patch import describe_changes
from cubeserve.rollout.plans import Plan
from cubeserve.rollout.state import STORAGE_URI, get
from cubeserve.rollout.versions import VersionRegistry
from cubeserve.rollout.version_sets import served_versions
from cubeserve.serving import experiment as serving_experiment

EXPERIMENT_CONFIGMAP = "cube3d-experiment"
EXPERIMENT_KEY = "experiment.json"


def _fail(option: str, message: str) -> RolloutError:
    return RolloutError(f"{option}: {message}")


def _version(option: str, text: str) -> int:
    try:
        version = int(text)
    except ValueError:
        raise _fail(option, f"the version must be an integer >= 1 (a checkpoint version), got {text!r}") from None
    if version < 1:
        raise _fail(option, f"the version must be an integer >= 1 (a checkpoint version), got {version}")
    return version


def parse_arms(text: str) -> list[dict]:
    """`control=1:90,candidate=2:10` -> the experiment's `arms` (NAME=VERSION:WEIGHT, in order:
    raising the last arm's weight moves users only into it)."""
    arms = []
    for part in (p.strip() for p in text.split(",")):
        name, sep, rest = part.partition("=")
        version, colon, weight = rest.partition(":")
        if not (sep and colon and name.strip() and version.strip() and weight.strip()):
            raise _fail("--set", f"takes NAME=VERSION:WEIGHT arms separated by commas, e.g. "
                                 f"control=1:90,candidate=2:10; got {text!r}")
        try:
            share = float(weight)
        except ValueError:
            raise _fail("--set", f"the weight of arm {name.strip()!r} must be a number in "
                                 f"[0, {serving_experiment.MAX_WEIGHT}], got {weight.strip()!r}") from None
        arms.append({"name": name.strip(), "version": _version("--set", version.strip()),
                     "weight": int(share) if share.is_integer() else share})
    return arms


def parse_shadow(text: str) -> dict:
    """`3:0.25` (version 3 gets a copy of 25% of the requests) or `3:0.25:8` (at most 8 copies in
    flight) -> the experiment's `shadow`."""
    parts = [p.strip() for p in text.split(":")]
    if len(parts) not in (2, 3) or not all(parts):
        raise _fail("--shadow", f"takes VERSION:SHARE[:MAX_IN_FLIGHT], e.g. 3:0.25; got {text!r}")
    try:
        share = float(parts[1])
    except ValueError:
        raise _fail("--shadow", f"the share must be a number in [0, 1], got {parts[1]!r}") from None
    shadow: dict = {"version": _version("--shadow", parts[0]), "share": share}
    if len(parts) == 3:
        try:
            shadow["max_in_flight"] = int(parts[2])
        except ValueError:
            raise _fail("--shadow", f"max_in_flight must be an integer in [1, 1024], got {parts[2]!r}") from None
    return shadow


def build(name: str | None, arms: str | None = None, shadow: str | None = None, salt: str | None = None,
          current: serving_experiment.Experiment | None = None) -> serving_experiment.Experiment:
    """The experiment the options describe, validated by the server's own parser (so the CLI
    never writes what the server would refuse). The name defaults to the running experiment's:
    users keep their arm when only the weights change, because the hash is salted by the name."""
    name = name or (current.name if current else None)
    if not name:
        raise RolloutError("--name: a new experiment needs a name (it salts the users' hash, so the "
                           "same name keeps each user in the same arm)")
    if not arms and not shadow:
        raise RolloutError("give --set (the arms) and/or --shadow, or --clear to end the experiment")
    body: dict = {"name": name}
    if salt:
        body["salt"] = salt
    elif current is not None and current.name == name and current.salt:
        body["salt"] = current.salt
    if arms:
        body["arms"] = parse_arms(arms)
    if shadow:
        body["shadow"] = parse_shadow(shadow)
    try:
        return serving_experiment.parse(json.dumps(body))
    except ValueError as exc:
        raise RolloutError(str(exc)) from None


def read(configmap: Mapping | None, strict: bool = True) -> serving_experiment.Experiment | None:
    """The experiment a ConfigMap holds (None: no ConfigMap, or an empty one). One the server
    would refuse (written by hand) is a RolloutError, or None when not `strict` (to replace it)."""
    text = get(configmap, "data", EXPERIMENT_KEY, default="") or ""
    try:
        return serving_experiment.parse(text)
    except ValueError as exc:
        if not strict:
            return None
        raise RolloutError(f"ConfigMap {EXPERIMENT_CONFIGMAP}: {exc}") from None


def describe(exp: serving_experiment.Experiment | None) -> str:
    """One line for people (rollout status)."""
    if exp is None:
        return "no experiment"
    parts = []
    if exp.arms:
        total = sum(a.weight for a in exp.arms)
        parts.append("arms " + ", ".join(f"{a.name}=version {a.version} ({100 * a.weight / total:.4g}%)"
                                         for a in exp.arms))
    if exp.shadow:
        parts.append(f"shadow version {exp.shadow.version} on {100 * exp.shadow.share:.4g}% of requests "
                     f"(at most {exp.shadow.max_in_flight} in flight)")
    salt = f", salt {exp.salt!r}" if exp.salt else ""
    return f"experiment {exp.name!r}{salt}: " + "; ".join(parts)


def plan_experiment(configmap: Mapping | None, exp: serving_experiment.Experiment | None,
                    registry: VersionRegistry, isvc: Mapping | None = None, namespace: str | None = None,
                    name: str = EXPERIMENT_CONFIGMAP) -> Plan:
    """The server-side apply of the ConfigMap that holds `exp` (None: no experiment). Refuses a
    version that is not in the registry, or (with `isvc`) that the InferenceService does not load."""
    if exp is not None:
        unknown = sorted(v for v in exp.versions if str(v) not in registry.versions)
        if unknown:
            raise RolloutError(f"version {', '.join(map(str, unknown))} is not in the registry (known: "
                               f"{', '.join(registry.versions) or 'none'})")
        if isvc is not None:
            loaded = served_versions(get(isvc, *STORAGE_URI), registry)
            isvc_name = get(isvc, "metadata", "name", default="?")
            if loaded is None:
                raise RolloutError(f"InferenceService {isvc_name} serves {get(isvc, *STORAGE_URI)!r}, neither a "
                                   f"version ({registry.base_uri}/<V>/) nor a version set "
                                   f"({registry.base_uri}/sets/<V1>-<V2>/): cannot tell which versions its pods "
                                   "load (--skip-preflight to write the experiment anyway)")
            missing = sorted(exp.versions - loaded)
            if missing:
                raise RolloutError(f"InferenceService {isvc_name} loads versions {', '.join(map(str, sorted(loaded)))} "
                                   f"only; the experiment also needs {', '.join(map(str, missing))}: point its "
                                   f"storageUri at a version set that holds them (docs/deploy/ab.md)")
    text = exp.to_json() if exp is not None else ""
    try:
        before = describe(read(configmap))
    except RolloutError:
        before = "an experiment the server refuses"
    if configmap is not None and (get(configmap, "data", EXPERIMENT_KEY, default="") or "") == text:
        return Plan(f"ConfigMap {name}: already {describe(exp)}: nothing to change")
    body: dict = {"apiVersion": "v1", "kind": "ConfigMap",
                  "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "cube-serve"}},
                  "data": {EXPERIMENT_KEY: text}}
    if namespace:
        body["metadata"]["namespace"] = namespace
    version = get(configmap, "metadata", "resourceVersion")
    if version:  # a precondition: refused if someone changed it since it was read
        body["metadata"]["resourceVersion"] = version
    summary = (f"ConfigMap {name}: {before} -> {describe(exp)}" if configmap is not None
               else f"ConfigMap {name} (new): {describe(exp)}")
    changes = describe_changes(configmap or {}, {"data": {EXPERIMENT_KEY: text}})
    return Plan(summary, body, tuple(changes))
