"""kfp_pipelines/pod_runner.py: the stand-in for a Kubeflow cluster that `make pipeline` and the
pipeline tests run on. A small compiled pipeline of probe steps checks the semantics it claims
from the KFP v2 backend: one empty folder per pod, only the Secrets' keys in the environment
(a missing Secret fails the step, an optional one does not), retries, dsl.If/Else with
dsl.OneOf, an exit handler that gets the DAG's status as the KFP v2 driver builds it
(kubeflow/pipelines backend/src/v2/driver/resolve.go at 7b70c7b, the TaskFinalStatus case: the
MLMD state COMPLETE or FAILED, an empty error), and pod deadlines."""

import shutil
import sys
from pathlib import Path

import pytest
from kfp import compiler, dsl, kubernetes
from kfp.dsl import HTML, Output, PipelineTaskFinalStatus

from kfp_pipelines.pod_runner import FAILED, SKIPPED, SUCCEEDED, PodRunner, evaluate_condition

IMAGE = "probe:1"


def probe(name: str, marker: str, fail_first: bool, fail: bool, state_dir: str, page: Output[HTML]) -> dict:
    """What the pod sees: its folder, its environment; writes `marker` into its folder."""
    import os

    seen = {"cwd": os.getcwd(), "files": sorted(os.listdir(".")), "home": os.environ["HOME"],
            "env": sorted(k for k in os.environ if not k.startswith(("LC_", "_")))}
    with open(marker, "w") as f:
        f.write(name)
    with open(page.path, "w") as f:
        f.write(f"<p>{name}</p>")
    attempts = os.path.join(state_dir, name)
    os.makedirs(state_dir, exist_ok=True)
    tried = os.path.exists(attempts)
    open(attempts, "a").close()
    if fail or (fail_first and not tried):
        raise RuntimeError(f"{name} failed on purpose")
    return seen


def pick(value: str) -> str:
    return value


def report(status: PipelineTaskFinalStatus, state_dir: str) -> str:
    import json
    import os

    os.makedirs(state_dir, exist_ok=True)
    with open(os.path.join(state_dir, "final_status.json"), "w") as f:
        json.dump({"state": status.state, "error": status.error_message}, f)
    return status.state


def build():
    p = dsl.component(probe, base_image=IMAGE, install_kfp_package=False)
    q = dsl.component(pick, base_image=IMAGE, install_kfp_package=False)
    r = dsl.component(report, base_image=IMAGE, install_kfp_package=False)

    @dsl.pipeline(name="probe")
    def pipeline(branch: str, fail_second: bool = False, state_dir: str = ""):
        final = r(state_dir=state_dir)
        with dsl.ExitHandler(final):
            first = p(name="first", marker="first.txt", fail_first=True, fail=False, state_dir=state_dir)
            first.set_retry(num_retries=1).set_caching_options(False)
            kubernetes.use_secret_as_env(first, "store", {"KEY": "STORE_KEY"})
            kubernetes.use_secret_as_env(first, "optional-one", {"X": "OPTIONAL_X"}, optional=True)
            with dsl.If(branch == "a"):
                a = q(value="took a").after(first)
            with dsl.Else():
                b = q(value="took b").after(first)
            chosen = dsl.OneOf(a.output, b.output)
            p(name=chosen, marker="second.txt", fail_first=False, fail=fail_second, state_dir=state_dir)

    return pipeline


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    path = tmp_path_factory.mktemp("probe") / "probe.yaml"
    compiler.Compiler().compile(build(), str(path))
    return path


def runner(compiled, tmp_path, secrets) -> PodRunner:
    def upload(local: Path, uri: str):
        Path(uri).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(local, uri)

    return PodRunner(compiled, images={IMAGE: Path(sys.executable).parent}, secrets=secrets,
                     pipeline_root=str(tmp_path / "root"), workdir=tmp_path / "pods", upload=upload,
                     keep_pods=True, log=lambda line: None)


def test_each_step_is_a_pod_with_its_own_folder_and_only_its_secrets(compiled, tmp_path):
    state = tmp_path / "state"
    result = runner(compiled, tmp_path, {"store": {"KEY": "s3cr3t"}}).run({"branch": "a", "state_dir": str(state)})
    assert result.state == SUCCEEDED, result.error
    first, second = result.task("probe").outputs["Output"], result.task("probe-2").outputs["Output"]
    # An empty folder each (the marker the first step wrote is not in the second's), a home of its own.
    assert first["files"] == [] and second["files"] == [] and first["cwd"] != second["cwd"]
    assert first["home"] != second["home"] and not first["home"].startswith(str(Path.home()))
    # The Secret's key under the name the pipeline gave it; the optional Secret is absent; the
    # machine's own environment (e.g. this test's variables) is not there.
    assert "STORE_KEY" in first["env"] and "OPTIONAL_X" not in first["env"]
    assert "STORE_KEY" not in second["env"] and "PYTEST_CURRENT_TEST" not in first["env"]
    # The failing first attempt was retried; dsl.If took branch a, dsl.OneOf passed its value on.
    assert result.task("probe").attempts == 2
    assert result.ran("pick") and not result.ran("pick-2") and result.task("condition-4").state == SKIPPED
    assert (state / "took a").exists()  # the second probe was named by the OneOf's value
    # Output artifacts went to the pipeline root, under the run and the task.
    page = Path(result.task("probe").artifacts["page"])
    assert page.read_text() == "<p>first</p>" and result.run_id in str(page)
    # As the driver builds it (backend/src/v2/driver/resolve.go): the DAG's MLMD state, no error.
    assert (state / "final_status.json").read_text() == '{"state": "COMPLETE", "error": null}'


def test_a_failure_skips_what_follows_and_the_exit_handler_sees_it(compiled, tmp_path):
    state = tmp_path / "state"
    result = runner(compiled, tmp_path, {"store": {"KEY": "k"}}).run(
        {"branch": "b", "fail_second": True, "state_dir": str(state)})
    assert result.state == FAILED and "took b failed on purpose" in result.error
    assert result.task("probe-2").state == FAILED and result.task("probe-2").attempts == 1  # no retry policy
    assert result.task("report").state == SUCCEEDED
    assert (state / "final_status.json").read_text() == '{"state": "FAILED", "error": null}'


def test_a_missing_secret_fails_the_step_like_the_kubelet(compiled, tmp_path):
    state = tmp_path / "state"
    result = runner(compiled, tmp_path, {}).run({"branch": "a", "state_dir": str(state)})
    assert result.state == FAILED
    assert "CreateContainerConfigError: Secret 'store' not found" in result.task("probe").error
    assert result.task("condition-branches-2").state == SKIPPED and result.task("report").state == SUCCEEDED


def test_an_unknown_image_cannot_be_pulled(compiled, tmp_path):
    r = runner(compiled, tmp_path, {"store": {"KEY": "k"}})
    r.images = {"other:1": Path(sys.executable).parent}
    result = r.run({"branch": "a", "state_dir": str(tmp_path)})
    assert result.state == FAILED and "image 'probe:1' cannot be pulled" in result.task("probe").error


def nap(seconds: float) -> str:
    import time

    time.sleep(seconds)
    return "awake"


def test_a_step_past_its_deadline_is_killed(tmp_path):
    """kfp-kubernetes' set_timeout is the pod's activeDeadlineSeconds: the kubelet kills the pod."""
    n = dsl.component(nap, base_image=IMAGE, install_kfp_package=False)

    @dsl.pipeline(name="nap")
    def pipeline(seconds: float):
        kubernetes.set_timeout(n(seconds=seconds), 2)

    path = tmp_path / "nap.yaml"
    compiler.Compiler().compile(pipeline, str(path))
    assert runner(path, tmp_path, {}).run({"seconds": 0.1}).state == SUCCEEDED
    result = runner(path, tmp_path, {}).run({"seconds": 30})
    assert result.state == FAILED and "DeadlineExceeded: killed after 2 s" in result.task("nap").error


@pytest.mark.parametrize("condition, params, expected", [
    ("inputs.parameter_values['pipelinechannel--a'] == 'new'", {"pipelinechannel--a": "new"}, True),
    ("!(inputs.parameter_values['pipelinechannel--a'] == 'new')", {"pipelinechannel--a": "new"}, False),
    ("int(inputs.parameter_values['pipelinechannel--n']) > 2 && true", {"pipelinechannel--n": 3}, True),
    ("inputs.parameter_values['pipelinechannel--a'] != 'x' || false", {"pipelinechannel--a": "x"}, False),
])
def test_conditions_as_the_compiler_writes_them(condition, params, expected):
    assert evaluate_condition(condition, params) is expected
