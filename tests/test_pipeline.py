"""The checkpoint pipeline (kfp_pipelines/checkpoint_rollout.py): one full kfp.local run of a
good checkpoint against a real tritonserver (explicit model control) on a tmp model store,
a second run of the same checkpoint, then every failure case on the component functions
(a full kfp.local run takes ~40 s on 2 cores), checking that the champion keeps serving."""

from __future__ import annotations

import inspect
import shutil
import typing
from pathlib import Path

import pytest
import torch

from cubeserve.checkpoint import GPT_FILE, CheckpointError, write_random_weights
from cubeserve.config import TINY, write_yaml
from cubeserve.pipeline import serving, steps
from cubeserve.registry import CHALLENGER, CHAMPION, ModelRegistry, embedded_uri
from cubeserve.serving.local_triton import LocalTriton, free_port
from kfp_pipelines import checkpoint_rollout as pipeline_module
from kfp_pipelines import compile as compile_module
from kfp_pipelines import run_local


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    store = root / "store"
    store.mkdir()
    good = write_random_weights("tiny", root / "good", seed=0)
    server = LocalTriton(store, free_port(), free_port(), free_port(), log_path=root / "tritonserver.log",
                         extra_args=("--model-control-mode=explicit",))
    with server:
        yield {"root": root, "store": store, "good": good, "server": server,
               "registry_uri": embedded_uri(root / "registry")}


@pytest.fixture(scope="module")
def champion(env):
    """The good checkpoint through every step with kfp.local: version 1, served, champion."""
    summary = run_local.run(str(env["good"]), str(env["store"]), env["registry_uri"], env["server"].http_url)
    return summary


def registry(env) -> ModelRegistry:
    return ModelRegistry(env["registry_uri"])


def assert_champion_still_serving(env):
    reg = registry(env)
    assert [v.version for v in reg.versions()] == ["1"]
    assert reg.by_alias(CHAMPION).version == "1" and reg.by_alias(CHALLENGER) is None
    assert serving.served_versions(env["server"].http_url) == [1]


def test_good_checkpoint_is_registered_served_and_champion(env, champion):
    reg = registry(env)
    (v,) = reg.versions()
    validation = steps.validate_checkpoint(str(env["good"]))
    assert v.version == "1" and v.aliases == (CHAMPION,)
    assert v.tags["sha256"] == validation["sha256"] and v.tags["triton_version"] == "1"
    assert v.tags["source_uri"] == str(env["good"].resolve()) and v.tags["pipeline_run_id"]
    assert v.tags["config_name"] == "tiny" and v.tags["checkpoint_version"] == "v0.1-style"
    assert float(v.tags["metric.valid_share"]) == 1.0 and float(v.tags["metric.time_per_output_token_s"]) > 0
    assert v.tags["rollout.decision"] == "promoted" and v.tags["rollout.reason"]
    assert Path(v.source) == env["store"].resolve() / "cube3d_stream" / "1"
    assert (env["store"] / "cube3d" / "1" / "model.py").is_file()
    assert (env["store"] / "cube3d_stream" / "1" / "weights" / GPT_FILE).is_file()
    assert serving.served_versions(env["server"].http_url) == [1]
    # MLflow's own URI scheme resolves the alias to the served version.
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=env["registry_uri"], registry_uri=env["registry_uri"])
    assert str(client.get_model_version_by_alias("cube3d", "champion").version) == "1"
    # The HTML report carries the previews inline.
    reports = [p for p in run_local.state_dir(env["store"]).glob("runs/*/evaluate/report") if p.is_file()]
    assert reports and "data:image/png;base64," in reports[0].read_text()


def test_same_checkpoint_again_is_detected_not_duplicated(env, champion):
    summary = run_local.run(str(env["good"]), str(env["store"]), env["registry_uri"], env["server"].http_url)
    assert [v["version"] for v in summary["versions"]] == ["1"]
    assert steps.store_versions(env["store"]) == [1]
    assert_champion_still_serving(env)


def validate_component(env, checkpoint):
    return pipeline_module.validate.python_func(checkpoint=str(checkpoint), registry_uri=env["registry_uri"],
                                                model_name="cube3d")


def test_pickled_file_stops_at_validate(env, champion, tmp_path):
    bad = Path(shutil.copytree(env["good"], tmp_path / "pickled"))
    torch.save({"w": torch.zeros(2)}, bad / GPT_FILE)  # a pickle behind a safetensors name
    with pytest.raises(CheckpointError, match=f"^{GPT_FILE}: .*pickled"):
        validate_component(env, bad)
    (bad / GPT_FILE).unlink()
    shutil.copy2(env["good"] / GPT_FILE, bad / GPT_FILE)
    torch.save({"w": torch.zeros(2)}, bad / "extra.bin")
    with pytest.raises(CheckpointError, match="^extra.bin: pickled"):
        validate_component(env, bad)
    assert_champion_still_serving(env)


def test_truncated_file_stops_at_validate(env, champion, tmp_path):
    bad = Path(shutil.copytree(env["good"], tmp_path / "truncated"))
    path = bad / "clip" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="^clip/model.safetensors: truncated"):
        validate_component(env, bad)
    assert_champion_still_serving(env)


def test_v05_weights_with_v01_config_stop_at_validate(env, champion, tmp_path):
    bad = write_random_weights("tiny-bbox", tmp_path / "mismatch", seed=0)
    write_yaml(TINY, bad / "config.yaml")
    with pytest.raises(CheckpointError, match="version mismatch: the weights are v0.5-style"):
        validate_component(env, bad)
    assert_champion_still_serving(env)


def test_failing_gate_stops_before_packaging(env, champion, tmp_path):
    challenger = write_random_weights("tiny", tmp_path / "challenger", seed=1)
    ev = steps.evaluate_checkpoint(str(challenger), ["a red chair"], resolution=4,
                                   champion_weights=str(env["store"] / "cube3d_stream" / "1" / "weights"))
    metrics = ev["metrics"]
    assert 0.0 <= metrics["token_agreement"] < 1.0  # other random weights, other tokens
    with pytest.raises(steps.GateFailed, match="token_agreement"):
        pipeline_module.gate.python_func(existing_version="", metrics=metrics, min_valid_share=1.0,
                                         min_watertight_share=0.0, min_token_agreement=0.99,
                                         max_time_per_output_token_s=1.0, min_shape_iou=0.0)
    with pytest.raises(steps.GateFailed, match="time_per_output_token_s"):
        steps.gate(metrics, 1.0, 0.0, 0.0, max_time_per_output_token_s=1e-9)
    assert_champion_still_serving(env)
    assert steps.store_versions(env["store"]) == [1]


def test_compiled_yaml_is_current():
    assert compile_module.stale() == [], "run: python -m kfp_pipelines.compile"


def test_every_component_input_and_output_is_typed():
    components = [pipeline_module.validate, pipeline_module.evaluate, pipeline_module.gate,
                  pipeline_module.package, pipeline_module.register, pipeline_module.roll_out]
    for component in components:
        func = component.python_func
        hints = typing.get_type_hints(func)
        for name in inspect.signature(func).parameters:
            assert name in hints, f"{component.name}: input {name} has no type"
        assert "return" in hints and hints["return"] is not None, f"{component.name}: untyped output"
        spec = component.component_spec
        for io in list((spec.inputs or {}).values()) + list((spec.outputs or {}).values()):
            assert io.type and io.type != "Any", f"{component.name}: untyped {io}"


def test_canary_that_is_rolled_back_leaves_the_champion_serving(env, champion, tmp_path):
    """Version 2 is loaded next to version 1 (canary), then unloaded again (rollback): the
    decision is tagged, the champion alias and the served version stay at 1."""
    challenger = write_random_weights("tiny", tmp_path / "canary", seed=2)
    validation = steps.validate_checkpoint(str(challenger))
    n = steps.package(str(challenger), str(env["store"]), validation["files_sha256"])
    version = steps.register(env["registry_uri"], "cube3d", str(env["store"]), n, validation,
                             {"valid_share": 1.0}, str(challenger), "test-run")
    assert registry(env).by_alias(CHALLENGER).version == version == "2" and n == 2
    result = serving.roll_out("local", env["registry_uri"], "cube3d", version, 10, 1, 0.0, ["a cup"],
                              triton_url=env["server"].http_url, store=str(env["store"]), force_rollback=True)
    assert result["decision"] == "rolled_back"
    v2 = registry(env).get("2")
    assert v2.tags["rollout.decision"] == "rolled_back" and "serving version 1 again" in v2.tags["rollout.reason"]
    assert registry(env).by_alias(CHAMPION).version == "1" and registry(env).by_alias(CHALLENGER) is None
    assert serving.served_versions(env["server"].http_url) == [1]
    assert "specific { versions: [1] }" in (env["store"] / "cube3d" / "config.pbtxt").read_text()


def test_object_store_uri_is_fetched_once_and_validated_like_a_directory(env):
    """Any fsspec filesystem serves as the object store; file:// runs here without credentials."""
    uri = Path(env["good"]).resolve().as_uri()
    local = steps.validate_checkpoint(str(env["good"]))
    remote = steps.validate_checkpoint(uri)
    assert remote["sha256"] == local["sha256"] and remote["files_sha256"] == local["files_sha256"]
    assert steps.local_checkpoint(uri) == steps.local_checkpoint(uri) != str(env["good"])
    with pytest.raises(CheckpointError, match="no such directory"):
        steps.validate_checkpoint(uri + "-missing")
