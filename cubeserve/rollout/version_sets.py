"""Version sets: one Triton model repository holding several checkpoint versions, so that one
pod loads every version of an in-server experiment (cubeserve/rollout/experiments.py).

Version V alone is the repository at `<baseUri>/<V>/` (cubeserve.serving.repository writes it:
cube3d/<V>/, cube3d_stream/<V>/weights/, configs that serve the latest version). The set of
versions V1 < V2 < ... is the repository at `<baseUri>/sets/<V1>-<V2>-.../`: every version's
directories side by side, and configs whose version policy names exactly those versions, so
Triton loads them all and a request can go to any of them (`version` on every metric).
Each loaded version of cube3d_stream holds its own weights on the GPU: the pod needs the memory
of all of them.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Mapping

from cubeserve.deploy import PREDICT_MODEL, STREAM_MODEL
from cubeserve.rollout.errors import RolloutError
from cubeserve.rollout.versions import VersionRegistry

SETS_DIR = "sets"
_VERSION_POLICY = re.compile(r"^version_policy:.*$", re.MULTILINE)


def _sorted_versions(versions: Iterable[int | str]) -> list[int]:
    found = []
    for v in versions:
        try:
            number = int(v)
        except (TypeError, ValueError):
            raise RolloutError(f"versions: a version set holds Triton model versions (integers >= 1), got {v!r}") from None
        if number < 1 or isinstance(v, bool):
            raise RolloutError(f"versions: a version set holds Triton model versions (integers >= 1), got {v!r}")
        found.append(number)
    if len(found) < 2 or len(set(found)) != len(found):
        raise RolloutError(f"versions: a version set needs two or more different versions, got {list(versions)}")
    return sorted(found)


def set_uri(registry: VersionRegistry, versions: Iterable[int | str]) -> str:
    """Where the set of `versions` lives (the trailing slash matters, as for one version)."""
    return f"{registry.base_uri}/{SETS_DIR}/{'-'.join(map(str, _sorted_versions(versions)))}/"


def served_versions(uri: str | None, registry: VersionRegistry) -> set[int] | None:
    """The versions a pod with this storageUri loads: {V} for `<baseUri>/<V>/`, the set for
    `<baseUri>/sets/...`; None for anything else (not the registry's)."""
    version = registry.version_of(uri)
    if version is not None:
        return {int(version)} if version.isdigit() else None
    prefix = f"{registry.base_uri}/{SETS_DIR}/"
    if not uri or not uri.startswith(prefix):
        return None
    name = uri[len(prefix):].rstrip("/")
    parts = name.split("-")
    if not all(p.isdigit() for p in parts) or any(p not in registry.versions for p in parts):
        return None
    return {int(p) for p in parts}


def build_version_set(repositories: Mapping[int, str | Path], target_dir: str | Path) -> Path:
    """Write the model repository of several versions into `target_dir` (which must not exist)
    from their single-version repositories ({version: directory}, as `<baseUri>/<V>/` holds
    them). The configs are the newest version's, serving exactly these versions."""
    versions = _sorted_versions(repositories)
    target = Path(target_dir)
    if target.exists():
        raise FileExistsError(f"{target} exists; a version set is written once, into a new directory")
    staging = target.with_name(f".{target.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    policy = f"version_policy: {{ specific {{ versions: [ {', '.join(map(str, versions))} ] }} }}"
    try:
        for model in (PREDICT_MODEL, STREAM_MODEL):
            for version in versions:
                source = Path(repositories[version]) / model / str(version)
                if not source.is_dir():
                    raise ValueError(f"repositories[{version}]: {source} is missing: not the repository of version {version}")
                shutil.copytree(source, staging / model / str(version))
            config = (Path(repositories[versions[-1]]) / model / "config.pbtxt").read_text()
            config, count = _VERSION_POLICY.subn(policy, config)
            if count == 0:
                config = config.rstrip("\n") + "\n" + policy + "\n"
            elif count > 1:
                raise ValueError(f"{model}/config.pbtxt of version {versions[-1]}: more than one version_policy")
            (staging / model / "config.pbtxt").write_text(config)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def publish_version_set(registry: VersionRegistry, versions: Iterable[int | str]) -> str:
    """Download each version's repository from the registry's store, write the set and upload it
    to set_uri(); returns that URI (the storageUri of an InferenceService that loads them all)."""
    from cubeserve import storage

    numbers = _sorted_versions(versions)
    for v in numbers:
        registry.require(str(v))
    with tempfile.TemporaryDirectory() as tmp:
        sources = {}
        for v in numbers:
            sources[v] = Path(tmp) / "versions" / str(v)
            storage.download_dir(registry.uri(str(v)), sources[v])
        built = build_version_set(sources, Path(tmp) / "set")
        uri = set_uri(registry, numbers)
        storage.upload_dir(built, uri)
    return uri
