"""The model registry of checkpoint versions: MLflow's, used through `MlflowClient` only.

Embedded by default (a sqlite file plus a local artifact folder, no server), or an MLflow
tracking server on the cluster (`http://mlflow.mlflow.svc:5000`, k8s/mlflow/). Versions, tags
and aliases are MLflow's own, so `models:/cube3d@champion` resolves to the served version
with any MLflow client.

A registered version carries no logged MLflow model: its `source` is the packaged Triton
model repository version (`<store>/cube3d_stream/<N>`), and everything else is a tag:

    sha256            digest of the whole checkpoint (see cubeserve.pipeline.steps.checkpoint_digest)
    triton_version    N, the version directory in the model store
    model_store       the model store (Triton model repository root)
    config, files_sha256, metrics, source_uri, pipeline_run_id, rollout.*  (see the pipeline)

mlflow-skinny is enough: the sqlalchemy store needs `sqlalchemy` and `alembic`, nothing else.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CHAMPION, CHALLENGER = "champion", "challenger"
DEFAULT_MODEL = "cube3d"
# MLflow refuses longer tag values (5000 in the sqlalchemy store's schema of some versions).
MAX_TAG_CHARS = 5000


def embedded_uri(root: str | Path) -> str:
    """The sqlite registry inside a local folder (created on first use)."""
    root = Path(root).resolve()
    root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root / 'mlflow.db'}"


@dataclass(frozen=True)
class Version:
    name: str
    version: str
    source: str
    tags: dict[str, str]
    aliases: tuple[str, ...]

    @property
    def triton_version(self) -> int:
        return int(self.tags["triton_version"])


class ModelRegistry:
    """Versions of one registered model: find by digest, create with tags, move aliases."""

    def __init__(self, uri: str, name: str = DEFAULT_MODEL):
        # Imported here: mlflow is only needed by the pipeline, not by serving.
        os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
        from mlflow.tracking import MlflowClient

        self.uri, self.name = uri, name
        # An embedded sqlite store serves as both tracking and registry store.
        self.client = MlflowClient(tracking_uri=uri, registry_uri=uri)

    def _ensure_model(self) -> None:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_registered_model(self.name)
        except MlflowException:
            self.client.create_registered_model(
                self.name, description="Cube 3D checkpoints packaged as Triton model repository versions")

    def _wrap(self, mv) -> Version:
        return Version(mv.name, str(mv.version), mv.source, dict(mv.tags or {}), tuple(mv.aliases or ()))

    def versions(self) -> list[Version]:
        found = self.client.search_model_versions(f"name = '{self.name}'")
        # search results omit aliases in some stores: read each version once more.
        return sorted((self.get(mv.version) for mv in found), key=lambda v: int(v.version))

    def get(self, version: str | int) -> Version:
        return self._wrap(self.client.get_model_version(self.name, str(version)))

    def by_alias(self, alias: str) -> Version | None:
        from mlflow.exceptions import MlflowException

        try:
            return self._wrap(self.client.get_model_version_by_alias(self.name, alias))
        except MlflowException:  # no such alias (or no such model yet)
            return None

    def find_by_sha256(self, sha256: str) -> Version | None:
        """The version already registered for this checkpoint digest, if any."""
        try:
            found = self.client.search_model_versions(f"name = '{self.name}' and tag.sha256 = '{sha256}'")
        except Exception:  # the model does not exist yet
            return None
        return self.get(found[0].version) if found else None

    def create(self, source: str, tags: dict[str, str], description: str = "") -> Version:
        self._ensure_model()
        tags = {k: _tag_value(v) for k, v in tags.items()}
        mv = self.client.create_model_version(self.name, source, tags=tags, description=description)
        return self.get(mv.version)

    def set_tags(self, version: str | int, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self.client.set_model_version_tag(self.name, str(version), key, _tag_value(value))

    def set_alias(self, alias: str, version: str | int) -> None:
        """Point `alias` at `version` (MLflow moves it off any other version)."""
        self.client.set_registered_model_alias(self.name, alias, str(version))

    def delete_alias(self, alias: str) -> None:
        if self.by_alias(alias) is not None:
            self.client.delete_registered_model_alias(self.name, alias)


def _tag_value(value) -> str:
    text = value if isinstance(value, str) else str(value)
    if len(text) > MAX_TAG_CHARS:
        text = text[: MAX_TAG_CHARS - 15] + " ...(truncated)"
    return text
