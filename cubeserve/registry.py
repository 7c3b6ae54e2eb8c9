"""The model registry of checkpoint versions, and the lineage of the pipeline runs that made them.

The pipeline sees the registry only through `Registry` (what it needs: versions, aliases, tags,
one run per pipeline run with its metrics and report) and gets one from `open_registry(uri,
model_name)`, which picks the backend by the URI's scheme (`BACKENDS`). The backend here is
MLflow's, used through `MlflowClient` only:

    http(s)://host:port   an MLflow tracking server (k8s/mlflow/: `http://mlflow.mlflow.svc:5000`)
    sqlite:///path.db     embedded, no server (laptop use: `embedded_uri(folder)`); the run's
                          artifacts go to `<folder>/artifacts`

Another backend (e.g. Kubeflow Model Registry) is one new module with a class that has the
methods of `Registry`, and one line in `BACKENDS`.

Versions, tags and aliases are MLflow's own, so `models:/cube3d@champion` resolves to the served
version with any MLflow client. A registered version carries no logged MLflow model: its `source`
is the object-store URI of the packaged version (`s3://bucket/prefix/<N>/`) and everything else is
a tag:

    sha256            digest of the whole checkpoint (see cubeserve.pipeline.steps.checkpoint_digest)
    triton_version    N, the version directory in the model store
    model_store       the model store
    config, files_sha256, metrics, source_uri, pipeline_run_id, rollout.*  (see the pipeline)

What an MLflow server accepts as a version's source (mlflow/server/handlers.py,
`_validate_source_run`, MLflow 3.17): a local path only with the run_id of a run whose artifact
directory is a local directory containing it (never with `--serve-artifacts`, whose runs have
`mlflow-artifacts:/` roots), so a model-store path on the pipeline's disk is refused; an
object-store URI (s3://, gs://) with any run_id or none, as the server checks neither that the run
exists nor where the source lies. `create` therefore checks that the run exists itself, so that
every version registered with a run_id points at a real run (tests/test_registry.py).

Lineage: one MLflow run per pipeline run, in the experiment `<model>-pipeline`, tagged
`pipeline_run_id` and found again by that tag, so a retried step and every later step of the same
pipeline run write to the same run (`start_run`).

Errors: anything the registry cannot answer (unreachable, refused, a server error) raises
`RegistryError`, whose message starts with the registry URI; a model that is not registered yet is
no error: it has no versions and no aliases. Against a server, MLflow retries failed HTTP
requests 7 times with a backoff factor of 2 by default (minutes for an unreachable server); this
module sets MLFLOW_HTTP_REQUEST_MAX_RETRIES=3 and MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR=1 (about 6 s
of waiting) unless they are set already, and leaves MLFLOW_HTTP_REQUEST_TIMEOUT (120 s per
request) alone so that a slow server is waited for. Opening a server registry first connects to
it with a 5 s connect timeout (`/health`, 3 tries), so that a host that drops packets fails in
seconds too rather than after 4 x 120 s.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol, runtime_checkable

CHAMPION, CHALLENGER = "champion", "challenger"
DEFAULT_MODEL = "cube3d"
# The tag that ties an MLflow run (and a registered version) to its pipeline run.
PIPELINE_RUN_TAG = "pipeline_run_id"
# MLflow refuses longer tag values (5000 in the sqlalchemy store's schema of some versions).
MAX_TAG_CHARS = 5000
RUN_STATUSES = ("RUNNING", "FINISHED", "FAILED", "KILLED")

# MLflow's HTTP retries while a server does not answer (see the module docstring).
HTTP_RETRY_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1"}
CONNECT_TIMEOUT_S, CONNECT_TRIES = 5.0, 3


class RegistryError(RuntimeError):
    """The registry could not answer; the message names the registry URI and the cause."""


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
    run_id: str = ""  # the MLflow run (pipeline run) that registered it; "" when none

    @property
    def triton_version(self) -> int:
        return int(self.tags["triton_version"])


@dataclass(frozen=True)
class Run:
    """One pipeline run's MLflow run, as read back."""
    run_id: str
    pipeline_run_id: str
    status: str
    params: dict[str, str] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)  # the latest value of each
    tags: dict[str, str] = field(default_factory=dict)


@runtime_checkable
class Registry(Protocol):
    """What the pipeline needs of a model registry (one registered model, `name`)."""

    uri: str
    name: str

    def versions(self) -> list[Version]:
        """Every version, oldest first ([] when the model is not registered yet)."""

    def get(self, version: str | int) -> Version:
        """One version; RegistryError when it does not exist."""

    def by_alias(self, alias: str) -> Version | None:
        """The version an alias points at, None when the alias (or the model) does not exist."""

    def find_by_sha256(self, sha256: str) -> Version | None:
        """The version registered for this checkpoint digest (tag `sha256`), if any."""

    def create(self, source: str, tags: dict[str, str], description: str = "", run_id: str = "") -> Version:
        """A new version of `source` (the packaged version's object-store URI) registered by
        `run_id`; the registered model is created on first use."""

    def set_tags(self, version: str | int, tags: dict[str, str]) -> None: ...

    def set_alias(self, alias: str, version: str | int) -> None:
        """Point `alias` at `version` (moving it off any other version)."""

    def delete_alias(self, alias: str) -> None:
        """Remove `alias` if it exists."""

    def start_run(self, pipeline_run_id: str, params: dict | None = None) -> str:
        """The run id of this pipeline run's run, created on first use, reused (and set
        RUNNING again) afterwards; `params` not logged yet are added."""

    def get_run(self, run_id: str) -> Run: ...

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int = 0) -> None: ...

    def tag_run(self, run_id: str, tags: dict[str, str]) -> None:
        """Tags on the run (a tag, unlike a param, can be set again)."""

    def log_artifact_text(self, run_id: str, name: str, text: str) -> None:
        """A text file (e.g. the evaluation's HTML report) stored with the run as `name`."""

    def read_artifact_text(self, run_id: str, name: str) -> str: ...

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        """FINISHED, FAILED or KILLED."""


# Backends by URI scheme: "module:Class", imported when used; the class takes (uri, model_name).
BACKENDS: dict[str, str] = {
    "http": "cubeserve.registry:MlflowRegistry",
    "https": "cubeserve.registry:MlflowRegistry",
    "sqlite": "cubeserve.registry:MlflowRegistry",
}


def open_registry(uri: str, model_name: str = DEFAULT_MODEL) -> Registry:
    """The registry at `uri` for `model_name`; raises RegistryError when it cannot be reached."""
    scheme = uri.split("://", 1)[0].lower() if "://" in uri else ""
    if scheme not in BACKENDS:
        raise RegistryError(f"{uri}: no registry backend for this URI (known schemes: "
                            f"{', '.join(s + '://' for s in sorted(BACKENDS))})")
    import importlib

    module, _, cls = BACKENDS[scheme].partition(":")
    factory: Callable[[str, str], Registry] = getattr(importlib.import_module(module), cls)
    return factory(uri, model_name)


def _tag_value(value) -> str:
    text = value if isinstance(value, str) else str(value)
    if len(text) > MAX_TAG_CHARS:
        text = text[: MAX_TAG_CHARS - 15] + " ...(truncated)"
    return text


def _quoted(value: str, what: str) -> str:
    """A value for an MLflow search filter (which has no escapes for quotes)."""
    if "'" in value or "\n" in value:
        raise ValueError(f"{what} {value!r}: quotes and newlines are not allowed")
    return f"'{value}'"


class MlflowRegistry:
    """`Registry` on MLflow: a tracking server over HTTP, or an embedded sqlite file."""

    def __init__(self, uri: str, name: str = DEFAULT_MODEL, check: bool = True):
        # Imported here: mlflow is only needed by the pipeline, not by serving.
        os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # no tqdm in step logs
        self.uri, self.name = uri, name
        self.is_server = uri.lower().startswith(("http://", "https://"))
        if self.is_server:
            for key, value in HTTP_RETRY_DEFAULTS.items():
                os.environ.setdefault(key, value)
            if check:
                self._check_reachable()
        from mlflow.tracking import MlflowClient

        # An embedded sqlite store serves as both tracking and registry store.
        self.client = MlflowClient(tracking_uri=uri, registry_uri=uri)

    # -- errors ----------------------------------------------------------------------------------

    def _error(self, what: str, exc: BaseException) -> RegistryError:
        cause = getattr(exc, "message", None) or str(exc) or type(exc).__name__
        return RegistryError(f"registry {self.uri}: {what}: {cause}")

    def _call(self, what: str, fn, *args, _absent: str = "", **kwargs):
        """fn(*args, **kwargs), with every failure raised as RegistryError, except an MLflow
        error whose code is `_absent` (e.g. RESOURCE_DOES_NOT_EXIST): None then."""
        try:
            return fn(*args, **kwargs)
        except RegistryError:
            raise
        except Exception as exc:  # MlflowException, requests' and the database's errors
            if _absent and getattr(exc, "error_code", None) == _absent:
                return None
            raise self._error(what, exc) from exc

    def _check_reachable(self) -> None:
        """Connect to the server (5 s connect timeout, 3 tries): a host that cannot be reached
        fails here in seconds. Only connection failures count: any HTTP answer is a server."""
        import requests

        from mlflow.environment_variables import MLFLOW_HTTP_REQUEST_TIMEOUT

        url = self.uri.rstrip("/") + "/health"
        for attempt in range(CONNECT_TRIES):
            try:
                requests.get(url, timeout=(CONNECT_TIMEOUT_S, MLFLOW_HTTP_REQUEST_TIMEOUT.get())).close()
                return
            except requests.exceptions.SSLError:
                return  # TLS settings are MLflow's business (MLFLOW_TRACKING_SERVER_CERT_PATH, ...)
            except (requests.exceptions.ConnectionError, requests.exceptions.ConnectTimeout) as exc:
                if attempt + 1 == CONNECT_TRIES:
                    raise self._error(f"unreachable after {CONNECT_TRIES} tries", exc) from exc
                time.sleep(1.0)

    # -- versions --------------------------------------------------------------------------------

    def _aliases(self) -> dict[str, str]:
        """{alias: version}; {} when the model is not registered yet. (Search results of a
        server carry no aliases, and a missing alias is INVALID_PARAMETER_VALUE, the same code
        as a malformed request, so aliases are read from the registered model.)"""
        model = self._call(f"reading model {self.name}", self.client.get_registered_model, self.name,
                           _absent="RESOURCE_DOES_NOT_EXIST")
        if model is None:
            return {}
        return {alias: str(version) for alias, version in (model.aliases or {}).items()}

    def _wrap(self, mv, aliases: dict[str, str]) -> Version:
        version = str(mv.version)
        return Version(mv.name, version, mv.source, dict(mv.tags or {}),
                       tuple(sorted(a for a, v in aliases.items() if v == version)), mv.run_id or "")

    def _search(self, filter_string: str) -> list:
        found, token = [], None
        while True:
            page = self._call(f"searching versions ({filter_string})", self.client.search_model_versions,
                              filter_string, max_results=1000, page_token=token)
            found.extend(page)
            token = page.token
            if not token:
                return found

    def versions(self) -> list[Version]:
        found = self._search(f"name = {_quoted(self.name, 'model name')}")
        aliases = self._aliases() if found else {}
        return sorted((self._wrap(mv, aliases) for mv in found), key=lambda v: int(v.version))

    def get(self, version: str | int) -> Version:
        mv = self._call(f"reading version {version} of {self.name}", self.client.get_model_version,
                        self.name, str(version))
        return self._wrap(mv, self._aliases())

    def by_alias(self, alias: str) -> Version | None:
        version = self._aliases().get(alias)
        return None if version is None else self.get(version)

    def find_by_sha256(self, sha256: str) -> Version | None:
        if not re.fullmatch(r"[0-9a-f]{64}", sha256):
            raise ValueError(f"sha256 {sha256!r}: not a sha256 hex digest")
        found = self._search(f"name = {_quoted(self.name, 'model name')} and tag.sha256 = '{sha256}'")
        if not found:
            return None
        return self.get(min(int(mv.version) for mv in found))

    def _ensure_model(self) -> None:
        what = f"creating model {self.name}"
        if self._call(what, self.client.get_registered_model, self.name, _absent="RESOURCE_DOES_NOT_EXIST"):
            return
        # RESOURCE_ALREADY_EXISTS: another step created it meanwhile.
        self._call(what, self.client.create_registered_model, self.name, _absent="RESOURCE_ALREADY_EXISTS",
                   description="Cube 3D checkpoints packaged as Triton model repository versions")

    def create(self, source: str, tags: dict[str, str], description: str = "", run_id: str = "") -> Version:
        if run_id:
            # The server does not check the run of an object-store source (module docstring).
            self._call(f"reading run {run_id} (the version's run_id)", self.client.get_run, run_id)
        self._ensure_model()
        tags = {k: _tag_value(v) for k, v in tags.items()}
        mv = self._call(f"creating a version of {self.name} from {source}", self.client.create_model_version,
                        self.name, source, run_id=run_id or None, tags=tags, description=description)
        return self.get(mv.version)

    def set_tags(self, version: str | int, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self._call(f"tagging version {version} of {self.name}", self.client.set_model_version_tag,
                       self.name, str(version), key, _tag_value(value))

    def set_alias(self, alias: str, version: str | int) -> None:
        self._call(f"setting alias {alias} of {self.name} to {version}", self.client.set_registered_model_alias,
                   self.name, alias, str(version))

    def delete_alias(self, alias: str) -> None:
        if alias in self._aliases():
            self._call(f"deleting alias {alias} of {self.name}", self.client.delete_registered_model_alias,
                       self.name, alias)

    # -- lineage: one MLflow run per pipeline run --------------------------------------------------

    @property
    def experiment_name(self) -> str:
        return f"{self.name}-pipeline"

    def _experiment_id(self) -> str:
        name = self.experiment_name
        what = f"reading experiment {name}"
        experiment = self._call(what, self.client.get_experiment_by_name, name)
        if experiment is None:
            # Embedded: the artifacts beside the database (MLflow's default is ./mlruns of
            # whatever folder the process runs in). A server: its own (--serve-artifacts).
            location = None
            if self.uri.startswith("sqlite:///"):
                location = (Path(self.uri[len("sqlite:///"):]).parent / "artifacts").resolve().as_uri()
            # RESOURCE_ALREADY_EXISTS: another step created it meanwhile.
            created = self._call(f"creating experiment {name}", self.client.create_experiment, name,
                                 artifact_location=location, tags={"cubeserve.model": self.name},
                                 _absent="RESOURCE_ALREADY_EXISTS")
            if created is not None:
                return created
            experiment = self._call(what, self.client.get_experiment_by_name, name)
        if experiment.lifecycle_stage == "deleted":
            self._call(f"restoring experiment {name}", self.client.restore_experiment, experiment.experiment_id)
        return experiment.experiment_id

    def _runs_of(self, experiment_id: str, pipeline_run_id: str) -> list:
        """The active runs tagged with this pipeline run, oldest first."""
        runs = self._call(
            f"searching the runs of pipeline run {pipeline_run_id}", self.client.search_runs, [experiment_id],
            f"tags.{PIPELINE_RUN_TAG} = {_quoted(pipeline_run_id, 'pipeline run id')}", max_results=100)
        return sorted(runs, key=lambda r: (r.info.start_time or 0, r.info.run_id))

    def start_run(self, pipeline_run_id: str, params: dict | None = None) -> str:
        if not pipeline_run_id:
            raise ValueError("start_run needs the pipeline run id")
        experiment_id = self._experiment_id()
        runs = self._runs_of(experiment_id, pipeline_run_id)
        if not runs:
            created = self._call(f"creating the run of pipeline run {pipeline_run_id}", self.client.create_run,
                                 experiment_id, tags={PIPELINE_RUN_TAG: pipeline_run_id}, run_name=pipeline_run_id)
            # Two steps that started at once each made one: all keep the oldest.
            runs = self._runs_of(experiment_id, pipeline_run_id) or [created]
            for run in runs[1:]:
                if run.info.run_id == created.info.run_id:
                    self._call(f"deleting duplicate run {run.info.run_id}", self.client.delete_run, run.info.run_id)
        run = runs[0]
        run_id = run.info.run_id
        if run.info.status != "RUNNING":  # a retried step, or a step after one that ended it
            self._call(f"reopening run {run_id}", self.client.update_run, run_id, status="RUNNING")
        self._log_params(run, params or {})
        return run_id

    def _log_params(self, run, params: dict) -> None:
        from mlflow.entities import Param

        logged = run.data.params or {}
        new = {}
        for key, value in params.items():
            value = _tag_value(value)
            if key not in logged:
                new[key] = value
            elif logged[key] != value:
                raise RegistryError(f"registry {self.uri}: run {run.info.run_id} of pipeline run "
                                    f"{run.data.tags.get(PIPELINE_RUN_TAG)} has param {key}={logged[key]!r}, "
                                    f"not {value!r} (MLflow params cannot change)")
        items = [Param(k, v) for k, v in new.items()]
        for i in range(0, len(items), 100):  # MLflow's batch limit for params
            self._call(f"logging params to run {run.info.run_id}", self.client.log_batch, run.info.run_id,
                       params=items[i:i + 100])

    def get_run(self, run_id: str) -> Run:
        run = self._call(f"reading run {run_id}", self.client.get_run, run_id)
        tags = dict(run.data.tags or {})
        return Run(run.info.run_id, tags.get(PIPELINE_RUN_TAG, ""), run.info.status, dict(run.data.params or {}),
                   dict(run.data.metrics or {}), tags)

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(key, float(value), now, step) for key, value in metrics.items()]
        for i in range(0, len(items), 1000):  # MLflow's batch limit for metrics
            self._call(f"logging metrics to run {run_id}", self.client.log_batch, run_id, metrics=items[i:i + 1000])

    def tag_run(self, run_id: str, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(k, _tag_value(v)) for k, v in tags.items()]
        self._call(f"tagging run {run_id}", self.client.log_batch, run_id, tags=items)

    def log_artifact_text(self, run_id: str, name: str, text: str) -> None:
        self._call(f"storing {name} with run {run_id}", self.client.log_text, run_id, text, name)

    def read_artifact_text(self, run_id: str, name: str) -> str:
        with tempfile.TemporaryDirectory(prefix="cubeserve-artifact-") as tmp:
            path = self._call(f"reading {name} of run {run_id}", self.client.download_artifacts, run_id, name, tmp)
            return Path(path).read_text(encoding="utf-8")

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        if status not in RUN_STATUSES[1:]:
            raise ValueError(f"end_run status {status!r}: one of {', '.join(RUN_STATUSES[1:])}")
        self._call(f"ending run {run_id} ({status})", self.client.set_terminated, run_id, status)
