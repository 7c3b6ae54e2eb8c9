"""The model registry against the MLflow tracking server of k8s/mlflow/mlflow.yaml, run as a real
process with the manifest's flags (kfp_pipelines/local_services.py), over HTTP; and the embedded sqlite
registry for laptop use. Each test uses a model name of its own on one server."""

from __future__ import annotations

import time

import pytest
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from cubeserve.registry import (CHALLENGER, CHAMPION, MAX_TAG_CHARS, MlflowRegistry, Registry,
                                RegistryError, Version, embedded_uri, open_registry)
from cubeserve.server.local_triton import free_port
from kfp_pipelines.local_services import MANIFEST, MlflowServer, manifest_container, server_command

SHA_A, SHA_B = "a" * 64, "b" * 64
SEARCH = "/api/2.0/mlflow/registered-models/search?max_results=1"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with MlflowServer(tmp_path_factory.mktemp("mlflow") / "data") as server:
        yield server


@pytest.fixture
def registry(server, request) -> Registry:
    return open_registry(server.uri, f"cube3d-{request.node.name.replace('_', '-')}"[:100])


def s3_source(n: int) -> str:
    return f"s3://cube-serve/models/cube3d/{n}/"


# -- the server process is the manifest's ----------------------------------------------------------

def test_the_server_runs_the_manifests_command_with_only_host_port_and_data_replaced(tmp_path):
    container, _ = manifest_container()
    argv, env = server_command(tmp_path / "data", 5123)
    manifest_argv = container["command"]
    assert argv[:4] == [argv[0], "-m", "mlflow", "server"] and len(argv) == len(manifest_argv) + 2
    changed = {a: b for a, b in zip(manifest_argv[2:], argv[4:]) if a != b}
    data = str((tmp_path / "data").resolve())
    assert changed == {"0.0.0.0": "127.0.0.1", "5000": "5123", "sqlite:////data/mlflow.db": f"sqlite:///{data}/mlflow.db",
                       "/data/artifacts": f"{data}/artifacts"}
    assert "--serve-artifacts" in argv and "--allowed-hosts" in argv
    assert env == {e["name"]: e["value"] for e in container["env"]}


# -- sources and run ids: what the server accepts ----------------------------------------------------

def test_object_store_source_with_a_run_id_is_registered(registry):
    run_id = registry.start_run("pipeline-source-s3", {"checkpoint": "s3://cube-serve/checkpoints/x/"})
    v = registry.create(s3_source(1), {"sha256": SHA_A, "triton_version": "1"}, "first", run_id=run_id)
    assert isinstance(v, Version)
    assert (v.version, v.source, v.run_id, v.triton_version, v.aliases) == ("1", s3_source(1), run_id, 1, ())
    assert registry.get(1) == v and registry.versions() == [v]
    # The server accepts an object-store source with any run_id, even one that does not exist
    # (handlers.py `_validate_source_run` checks runs only for local, runs:/ and
    # mlflow-artifacts sources), so `create` checks the run itself.
    with pytest.raises(RegistryError, match=f"^registry {registry.uri}: reading run 0{{32}}"):
        registry.create(s3_source(2), {"sha256": SHA_B}, run_id="0" * 32)
    assert [x.version for x in registry.versions()] == ["1"]


def test_the_server_accepts_object_store_sources_without_checking_the_run(server):
    """What MLflow 3.17's server itself requires (raw MlflowClient, no cubeserve code)."""
    client = MlflowClient(tracking_uri=server.uri, registry_uri=server.uri)
    client.create_registered_model("raw-s3")
    for run_id in (None, "0" * 32):
        mv = client.create_model_version("raw-s3", s3_source(3), run_id=run_id)
        assert mv.source == s3_source(3) and (mv.run_id or None) == run_id


def test_a_local_path_source_is_refused_by_the_server(server, registry, tmp_path):
    """What the old register step did (the model store's local path, no run_id): mlflow 3.17.2
    mlflow/server/handlers.py `_create_model_version` -> `_validate_source_run(source, run_id)`:
    `if is_local_uri(source):` a source is accepted only `if run_id` and the run's artifact URI is
    local and contains it; otherwise MlflowException("Invalid model version source: ... To use a
    local path as a model version source, the run_id request parameter has to be specified and the
    local path has to be contained within the artifact directory of the run specified by the
    run_id.", INVALID_PARAMETER_VALUE). With --serve-artifacts a run's artifact URI is
    mlflow-artifacts:/..., never local, so a run_id does not help either."""
    client = MlflowClient(tracking_uri=server.uri, registry_uri=server.uri)
    client.create_registered_model("raw-local")
    local = str(tmp_path / "store" / "cube3d_stream" / "1")
    with pytest.raises(MlflowException, match="To use a local path as a model version source") as refused:
        client.create_model_version("raw-local", local)
    assert refused.value.error_code == "INVALID_PARAMETER_VALUE"
    run_id = registry.start_run("pipeline-local-path")
    assert client.get_run(run_id).info.artifact_uri.startswith("mlflow-artifacts:/")
    with pytest.raises(MlflowException, match="To use a local path as a model version source"):
        client.create_model_version("raw-local", local, run_id=run_id)
    # Through the registry: one error type, naming the registry and the server's reason.
    with pytest.raises(RegistryError, match=f"^registry {server.uri}: creating a version .*"
                                            "To use a local path as a model version source"):
        registry.create(local, {"sha256": SHA_A}, run_id=run_id)


# -- versions, aliases, tags -------------------------------------------------------------------------

def test_an_empty_registry_answers_empty(registry):
    assert registry.find_by_sha256(SHA_A) is None
    assert registry.versions() == []
    assert registry.by_alias(CHAMPION) is None
    registry.delete_alias(CHALLENGER)  # nothing to delete: no error
    with pytest.raises(RegistryError, match=f"^registry {registry.uri}: reading version 1 of {registry.name}"):
        registry.get(1)


def test_aliases_and_tags_round_trip(registry):
    run_id = registry.start_run("pipeline-aliases")
    v1 = registry.create(s3_source(1), {"sha256": SHA_A, "triton_version": 1}, run_id=run_id)
    v2 = registry.create(s3_source(2), {"sha256": SHA_B, "triton_version": 2, "long": "x" * 20000}, run_id=run_id)
    assert (v1.version, v2.version) == ("1", "2") and v1.tags["triton_version"] == "1"
    assert len(v2.tags["long"]) == MAX_TAG_CHARS and v2.tags["long"].endswith("...(truncated)")
    registry.set_alias(CHAMPION, 1)
    registry.set_alias(CHALLENGER, "2")
    assert registry.by_alias(CHAMPION).version == "1" and registry.by_alias(CHALLENGER).version == "2"
    assert [(v.version, v.aliases) for v in registry.versions()] == [("1", (CHAMPION,)), ("2", (CHALLENGER,))]
    registry.set_alias(CHAMPION, "2")  # moves it off version 1
    assert [(v.version, v.aliases) for v in registry.versions()] == [("1", ()), ("2", (CHALLENGER, CHAMPION))]
    registry.delete_alias(CHALLENGER)
    registry.delete_alias(CHALLENGER)
    assert registry.by_alias(CHALLENGER) is None and registry.get(2).aliases == (CHAMPION,)
    registry.set_tags(2, {"rollout.decision": "promoted", "rollout.canary_percent": 10})
    tags = registry.get(2).tags
    assert tags["rollout.decision"] == "promoted" and tags["rollout.canary_percent"] == "10"
    assert registry.find_by_sha256(SHA_B).version == "2" and registry.find_by_sha256(SHA_A).version == "1"
    assert registry.find_by_sha256("c" * 64) is None
    # MLflow's own URI scheme resolves the alias too.
    client = MlflowClient(tracking_uri=registry.uri, registry_uri=registry.uri)
    assert client.get_model_version_by_alias(registry.name, CHAMPION).source == s3_source(2)


# -- lineage: one run per pipeline run -------------------------------------------------------------

def test_start_run_is_reused_for_the_same_pipeline_run(registry):
    first = registry.start_run("pipeline-7", {"checkpoint": "s3://c/x/", "action": "new"})
    again = registry.start_run("pipeline-7", {"checkpoint": "s3://c/x/", "sha256": SHA_A})  # a later step
    other = registry.start_run("pipeline-8")
    assert first == again != other
    run = registry.get_run(first)
    assert run.pipeline_run_id == "pipeline-7" and run.status == "RUNNING"
    assert run.params == {"checkpoint": "s3://c/x/", "action": "new", "sha256": SHA_A}
    registry.end_run(first, "FAILED")
    assert registry.get_run(first).status == "FAILED"
    assert registry.start_run("pipeline-7") == first  # a retried step: the same run, running again
    assert registry.get_run(first).status == "RUNNING"
    with pytest.raises(RegistryError, match="has param action='new', not 'resume'"):
        registry.start_run("pipeline-7", {"action": "resume"})
    client = MlflowClient(tracking_uri=registry.uri)
    experiment = client.get_experiment_by_name(f"{registry.name}-pipeline")
    runs = client.search_runs([experiment.experiment_id], "tags.pipeline_run_id = 'pipeline-7'")
    assert [r.info.run_id for r in runs] == [first]
    registry.end_run(first)
    assert registry.get_run(first).status == "FINISHED"


def test_metrics_and_the_report_are_read_back(registry):
    run_id = registry.start_run("pipeline-metrics")
    registry.log_metrics(run_id, {"valid_share": 1.0, "time_per_output_token_s": 0.0125, "prompts": 3})
    report = "<html><body><h2>cube3d evaluation</h2><img src='data:image/png;base64,AAAA'></body></html>"
    registry.log_artifact_text(run_id, "evaluation.html", report)
    assert registry.get_run(run_id).metrics == {"valid_share": 1.0, "time_per_output_token_s": 0.0125, "prompts": 3.0}
    assert registry.read_artifact_text(run_id, "evaluation.html") == report
    # Stored through the server's proxied artifact store (--serve-artifacts), under its data folder.
    client = MlflowClient(tracking_uri=registry.uri)
    assert client.get_run(run_id).info.artifact_uri.startswith("mlflow-artifacts:/")
    assert [f.path for f in client.list_artifacts(run_id)] == ["evaluation.html"]


# -- errors ----------------------------------------------------------------------------------------

def test_an_unreachable_registry_raises_naming_the_uri_within_seconds():
    uri = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(RegistryError, match=f"^registry {uri}: unreachable"):
        open_registry(uri, "cube3d")
    assert time.monotonic() - t0 < 10
    # Past the connection check, MLflow's own retries (3, backoff factor 1) end in seconds too,
    # and neither the champion lookup nor the digest lookup reads "not there" (the old code's
    # None, which turned the champion comparison off).
    registry = MlflowRegistry(uri, "cube3d", check=False)
    for call in (lambda: registry.by_alias(CHAMPION), lambda: registry.find_by_sha256(SHA_A)):
        t0 = time.monotonic()
        with pytest.raises(RegistryError, match=f"^registry {uri}: .*Connection refused"):
            call()
        assert time.monotonic() - t0 < 15


def test_unknown_registry_scheme_is_refused():
    with pytest.raises(RegistryError, match="^ftp://x: no registry backend"):
        open_registry("ftp://x", "cube3d")


# -- the manifest's allowed hosts ------------------------------------------------------------------

@pytest.mark.parametrize("host", ["mlflow.mlflow.svc.cluster.local:5000", "mlflow.mlflow.svc:5000", "localhost:5000"])
def test_in_cluster_host_names_are_allowed(server, host):
    status, body = server.request(SEARCH, host=host)
    assert status == 200, body
    assert server.request("/health", host=host)[0] == 200


@pytest.mark.parametrize("host", ["evil.example.com", "evil.example.com:5000", "10.0.0.7:5000"])
def test_foreign_host_names_are_refused(server, host):
    # /health answers any Host (MLflow exempts it, so the kubelet's probes pass); the API does not.
    status, body = server.request(SEARCH, host=host)
    assert status == 403 and "Invalid Host header" in body


def test_manifest_allows_the_in_cluster_names():
    container, _ = manifest_container()
    command = container["command"]
    allowed = command[command.index("--allowed-hosts") + 1].split(",")
    assert {"mlflow.mlflow.svc.cluster.local:5000", "mlflow.mlflow.svc:5000", "localhost:*"} <= set(allowed)
    assert "*" not in allowed and MANIFEST.name == "mlflow.yaml"


# -- the embedded registry (laptop use) ---------------------------------------------------------------

def test_embedded_sqlite_registry(tmp_path):
    uri = embedded_uri(tmp_path / "registry")
    registry = open_registry(uri, "cube3d")
    assert isinstance(registry, Registry) and isinstance(registry, MlflowRegistry)
    assert registry.find_by_sha256(SHA_A) is None and registry.versions() == [] and registry.by_alias(CHAMPION) is None
    run_id = registry.start_run("laptop-1", {"checkpoint": "models/demo"})
    assert registry.start_run("laptop-1") == run_id
    v = registry.create(str(tmp_path / "store" / "1"), {"sha256": SHA_A, "triton_version": "1"}, run_id=run_id)
    registry.set_alias(CHAMPION, v.version)
    assert registry.by_alias(CHAMPION) == registry.get(1) and registry.get(1).aliases == (CHAMPION,)
    assert registry.find_by_sha256(SHA_A).run_id == run_id
    registry.log_metrics(run_id, {"valid_share": 0.5})
    registry.log_artifact_text(run_id, "evaluation.html", "<html></html>")
    assert registry.read_artifact_text(run_id, "evaluation.html") == "<html></html>"
    assert (tmp_path / "registry" / "artifacts").is_dir()  # beside the database, not ./mlruns
    registry.end_run(run_id)
    assert registry.get_run(run_id).status == "FINISHED" and registry.get_run(run_id).metrics == {"valid_share": 0.5}
