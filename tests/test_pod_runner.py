"""kfp_pipelines/pod_runner.py: the stand-in for a Kubeflow cluster that `make pipeline` and the
pipeline tests run on. A small compiled pipeline of probe steps checks the semantics it claims
from the KFP v2 backend: one empty folder per pod, only the Secrets' keys in the environment
(a missing Secret fails the step, an optional one does not), retries, dsl.If/Else with
dsl.OneOf, an exit handler that gets the DAG's status as the KFP v2 driver builds it
(kubeflow/pipelines backend/src/v2/driver/resolve.go, the TaskFinalStatus case: the DAG's MLMD
state, an empty error), that state kept per backend release as its launcher and metadata client
keep it (pod_runner's docstring cites the lines), and pod deadlines."""

import shutil
import sys
from pathlib import Path

import pytest
from kfp import compiler, dsl, kubernetes
from kfp.dsl import HTML, Output, PipelineTaskFinalStatus

from kfp_pipelines.pod_runner import BACKENDS, FAILED, SKIPPED, SUCCEEDED, PodRunner, evaluate_condition

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


def runner(compiled, tmp_path, secrets, backend: str = BACKENDS[0]) -> PodRunner:
    def upload(local: Path, uri: str):
        Path(uri).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(local, uri)

    return PodRunner(compiled, images={IMAGE: Path(sys.executable).parent}, secrets=secrets,
                     pipeline_root=str(tmp_path / "root"), workdir=tmp_path / "pods", upload=upload,
                     keep_pods=True, log=lambda line: None, backend=backend)


def final_status(state_dir: Path) -> dict:
    import json

    return json.loads((state_dir / "final_status.json").read_text())


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
    # As the driver builds it (backend/src/v2/driver/resolve.go): the DAG's MLMD state (below),
    # no error.
    assert final_status(state)["error"] is None


def test_a_failure_skips_what_follows_and_the_exit_handler_sees_it(compiled, tmp_path):
    state = tmp_path / "state"
    result = runner(compiled, tmp_path, {"store": {"KEY": "k"}}).run(
        {"branch": "b", "fail_second": True, "state_dir": str(state)})
    assert result.state == FAILED and "took b failed on purpose" in result.error
    assert result.task("probe-2").state == FAILED and result.task("probe-2").attempts == 1  # no retry policy
    assert result.task("report").state == SUCCEEDED
    assert final_status(state) == {"state": "FAILED", "error": None}
    assert result.task("exit-handler-1").mlmd_state == "FAILED"


def test_a_missing_secret_fails_the_step_like_the_kubelet(compiled, tmp_path):
    state = tmp_path / "state"
    result = runner(compiled, tmp_path, {}).run({"branch": "a", "state_dir": str(state)})
    assert result.state == FAILED
    assert "CreateContainerConfigError: Secret 'store' not found" in result.task("probe").error
    assert result.task("condition-branches-2").state == SKIPPED and result.task("report").state == SUCCEEDED


# What the exit task is told, per backend (pod_runner's docstring; kubeflow/pipelines
# backend/src/v2/metadata/client.go UpdateDAGExecutionsState, component/launcher_v2.go's deferred
# DAG update, driver/dag.go total_dag_tasks; 2.17.0 adds #13322's upward propagation). The probe's
# first step fails once and is retried; the If/Else sits in a `condition-branches` DAG.
@pytest.mark.parametrize("backend, arguments, secrets, exit_state, branches_state", [
    # 2.14-2.16: the retried step's first attempt set the exit DAG FAILED, and nothing resets it:
    # the condition-branches DAG below it is never updated (no launcher of its own).
    ("2.14.0", {"branch": "a"}, {"store": {"KEY": "k"}}, "FAILED", "RUNNING"),
    # 2.17: the branch's end reaches condition-branches, then the exit DAG: COMPLETE.
    ("2.17.0", {"branch": "a"}, {"store": {"KEY": "k"}}, "COMPLETE", "COMPLETE"),
    # The step after the branches fails: FAILED on both.
    ("2.14.0", {"branch": "b", "fail_second": True}, {"store": {"KEY": "k"}}, "FAILED", "RUNNING"),
    ("2.17.0", {"branch": "b", "fail_second": True}, {"store": {"KEY": "k"}}, "FAILED", "COMPLETE"),
    # The first pod never starts (its Secret is missing): no launcher runs, the DAG stays RUNNING.
    ("2.14.0", {"branch": "a"}, {}, "RUNNING", None),
    ("2.17.0", {"branch": "a"}, {}, "RUNNING", None),
])
def test_the_exit_handler_gets_the_state_the_backend_keeps(compiled, tmp_path, backend, arguments, secrets,
                                                          exit_state, branches_state):
    state = tmp_path / "state"
    result = runner(compiled, tmp_path, secrets, backend).run({**arguments, "state_dir": str(state)})
    assert result.task("report").state == SUCCEEDED
    assert final_status(state)["state"] == exit_state == result.task("exit-handler-1").mlmd_state
    branches = [t for p, t in result.tasks.items() if p.rsplit("/", 1)[-1].startswith("condition-branches")]
    assert [t.mlmd_state or None for t in branches] == [branches_state]
    if branches_state:  # the branch not taken was never triggered
        assert sorted(t.mlmd_state for p, t in result.tasks.items()
                      if p.rsplit("/", 1)[-1] in ("condition-3", "condition-4")) == ["CANCELED", "COMPLETE"]


def test_an_unknown_backend_is_refused(compiled, tmp_path):
    with pytest.raises(ValueError, match="backend must be one of 2.14.0, 2.17.0"):
        runner(compiled, tmp_path, {}, backend="2.13.0")


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


def test_tolerations_and_node_selector_from_pipeline_inputs(tmp_path):
    """kfp-kubernetes' add_toleration_json / add_node_selector_json with pipeline inputs, resolved
    as the driver does (backend/src/v2/driver/k8s.go: a dict is one toleration, a list several,
    an empty one none)."""
    n = dsl.component(nap, base_image=IMAGE, install_kfp_package=False)

    @dsl.pipeline(name="scheduled")
    def pipeline(tolerations: list = [], selector: dict = {}, gpu: bool = True):
        with dsl.If(gpu == True):  # noqa: E712 - inside a sub-DAG: resolved in the task's own DAG
            task = n(seconds=0.0)
            kubernetes.add_toleration_json(task, tolerations)
            kubernetes.add_node_selector_json(task, selector)

    path = tmp_path / "scheduled.yaml"
    compiler.Compiler().compile(pipeline, str(path))
    gpu = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    result = runner(path, tmp_path, {}).run({"tolerations": [gpu, {"key": "pool", "value": "a"}],
                                             "selector": {"gpu": "h100"}})
    assert result.task("nap").pod == {"tolerations": [gpu, {"key": "pool", "value": "a"}],
                                      "nodeSelector": {"gpu": "h100"}}
    assert runner(path, tmp_path, {}).run({}).task("nap").pod == {"nodeSelector": {}}


@pytest.mark.parametrize("condition, params, expected", [
    ("inputs.parameter_values['pipelinechannel--a'] == 'new'", {"pipelinechannel--a": "new"}, True),
    ("!(inputs.parameter_values['pipelinechannel--a'] == 'new')", {"pipelinechannel--a": "new"}, False),
    ("int(inputs.parameter_values['pipelinechannel--n']) > 2 && true", {"pipelinechannel--n": 3}, True),
    ("inputs.parameter_values['pipelinechannel--a'] != 'x' || false", {"pipelinechannel--a": "x"}, False),
])
def test_conditions_as_the_compiler_writes_them(condition, params, expected):
    assert evaluate_condition(condition, params) is expected
