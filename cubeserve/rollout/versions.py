"""Checkpoint versions: which model repositories `cubeserve rollout` may deploy.

Checkpoint version V is the Triton model repository at `<baseUri>/<V>/`. The known versions live
in the ConfigMap `cube3d-versions` (k8s/base/runtime/versions.yaml), not on the InferenceService:
KServe copies the service's annotations into the pod template, so every edit of them would
restart the model servers. One writer per field: the manifests own `baseUri` and `versions` (the
versions they name), the pipeline's package step owns `packaged` (the versions it uploaded,
cubeserve.pipeline.serving.record_version). The known versions are both lists, so re-applying
the manifests (`kubectl apply --server-side`) neither conflicts with the pipeline's writes nor
drops a version it recorded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from cubeserve.rollout.errors import RolloutError

VERSIONS_CONFIGMAP = "cube3d-versions"
MANIFEST_KEY, PACKAGED_KEY = "versions", "packaged"

# A version is one path segment of a storage URI and part of a Kubernetes name (the canary's
# Deployment in RawDeployment mode): lower-case letters, digits and '-'.
_VERSION_RE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,30}[a-z0-9])?$")


@dataclass(frozen=True)
class VersionRegistry:
    """Known checkpoint versions: version V is the model repository at `<base_uri>/<V>/`."""

    base_uri: str
    versions: tuple[str, ...]

    @classmethod
    def from_configmap(cls, configmap: Mapping) -> "VersionRegistry":
        name = (configmap.get("metadata") or {}).get("name", VERSIONS_CONFIGMAP)
        data = configmap.get("data") or {}
        base = (data.get("baseUri") or "").strip().rstrip("/")
        if "://" not in base:
            raise RolloutError(f"ConfigMap {name}: data.baseUri must be a storage URI "
                               f"(s3://, gs://, pvc://, ...), got {base!r}")
        # Space- or comma-separated, in order (the manifests' first), duplicates dropped.
        listed = f"{data.get(MANIFEST_KEY) or ''} {data.get(PACKAGED_KEY) or ''}"
        versions = tuple(v for v in dict.fromkeys(re.split(r"[\s,]+", listed)) if v)
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


def predictor_name(version: str) -> str:
    """The predictor name (a DNS label) that carries checkpoint version `version` in
    RawDeployment mode: KServe names its Deployment and Service `<isvc>-<name>-predictor`."""
    return f"v{version}" if version[0].isdigit() else version
