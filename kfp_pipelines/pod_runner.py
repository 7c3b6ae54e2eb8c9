"""Run a compiled pipeline (the YAML uploaded in the Kubeflow UI) the way a Kubeflow cluster runs it,
on one machine: each step as a "pod".

It follows the KFP v2 backend's driver and launcher (kubeflow/pipelines, backend/src/v2, read at
commit 7b70c7b); the lines are cited where each rule is implemented:
* a step runs the executor's exact `command` and `args` from the compiled YAML, with `{{$}}`
  replaced by the executor input as protojson writes it (component/launcher_v2.go,
  compileCmdAndArgs), run by `sh` with the image's `python3` first on PATH; the image is looked
  up in `images` (an unknown image fails the step, as one that cannot be pulled does);
* its own empty working directory, HOME and TMPDIR: nothing of another step's disk;
* an environment holding only PATH, the locale, the executor's `env`, the keys of the Secrets
  that kfp-kubernetes' `use_secret_as_env` names (driver/k8s.go: secretKeyRef, `optional` as
  given), and KFP's pod variables. A missing Secret that is not optional fails the step at once
  with the kubelet's reason (CreateContainerConfigError); on a cluster the pod waits in that
  state until the step's `activeDeadlineSeconds` (kfp-kubernetes set_timeout, driver/k8s.go),
  which also bounds each attempt here;
* output artifacts written to a local path and then uploaded under the pipeline root (an S3
  URI), as the launcher does (the component sees a local URI where a pod sees `/s3/...`).

The DAG: `dependentTasks` and input producers order the tasks; `triggerPolicy.condition`
(dsl.If/Elif/Else, a CEL expression: driver/container.go) skips a sub-DAG whose condition is
false; `dagOutputs` with `valueFromOneof` take the branch that ran (dsl.OneOf); after a failure no
new task starts, except those with `strategy: ALL_UPSTREAM_TASKS_COMPLETED` (dsl.ExitHandler's
exit task), which get the `PipelineTaskFinalStatus` of the DAG they watch as the driver builds it
(driver/resolve.go, the TaskFinalStatus case): `state` is that DAG execution's MLMD state at the
time, and `error` is empty (the backend does not fill it in yet).

That MLMD state is not the run's outcome, and the runner keeps it as the backend does, per
release (`backend`, one of BACKENDS; kubeflow/pipelines at tags 2.14.0 and 2.17.0):
* a driver creates each task's execution RUNNING, or CANCELED when its condition is false
  ("not triggered": driver/dag.go and driver/container.go, `ecfg.NotTriggered`;
  metadata/client.go CreateExecution); a DAG's execution records `total_dag_tasks`, the number
  of tasks in its spec (driver/dag.go);
* only a launcher changes a state: when its container ends it publishes COMPLETE or FAILED and
  then calls UpdateDAGExecutionsState on the container's parent DAG (component/launcher_v2.go,
  the deferred "DAG Status Update"), which sets the DAG COMPLETE when its COMPLETE, CACHED and
  CANCELED children number `total_dag_tasks`, else FAILED when one child FAILED, else leaves it
  (metadata/client.go). A pod that never ran its launcher (a missing Secret, an image that
  cannot be pulled, killed at its deadline) leaves its execution RUNNING and updates nothing;
  a retried step keeps its execution, so its last attempt's state counts;
* up to 2.16.x that update stops at the parent: a DAG whose children are all sub-DAGs (an
  If/Elif/Else's `condition-branches`) is never updated, so an exit handler around one sees
  RUNNING for a run that succeeded, and RUNNING for one that failed inside a branch. From 2.17.0
  (kubeflow/pipelines#13322) a DAG that reaches COMPLETE or FAILED updates its parent in turn,
  up to the root; a `condition-branches` DAG none of whose branches ran still has no launcher
  below it, so a run that took no branch still ends RUNNING for its exit handler.
`retryPolicy` reruns a failed step (without the backoff wait). Caching is never used: every step
runs.

Not supported (this project's pipelines use none of them; each is refused by name): input
artifacts, ParallelFor, importers, other placeholders than `{{$}}` and the run's own
`{{$.pipeline_job_*}}` values.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import yaml

SUCCEEDED, FAILED, SKIPPED = "SUCCEEDED", "FAILED", "SKIPPED"
EXIT_STRATEGY = "ALL_UPSTREAM_TASKS_COMPLETED"
# MLMD's Execution.State names, what an exit task sees (driver/resolve.go).
RUNNING, COMPLETE, CANCELED = "RUNNING", "COMPLETE", "CANCELED"
# The KFP backends whose DAG-state rules the runner follows (module docstring): 2.14.0 to 2.16.x
# share one UpdateDAGExecutionsState; 2.17.0 propagates a DAG's end to its parents.
BACKENDS = ("2.14.0", "2.17.0")


@dataclass
class _Execution:
    """A task's MLMD execution: its state and, for a DAG, its children and `total_dag_tasks`."""
    state: str
    parent: "_Execution | None" = None
    total_tasks: int = 0  # 0: a container, or the root DAG (never updated: 2.17's client.go skips it)
    children: list = field(default_factory=list)


class PipelineSpecError(ValueError):
    """The compiled pipeline uses something this runner does not model."""


@dataclass
class TaskResult:
    name: str  # the task's path in the DAG, e.g. "exit-handler-1/condition-2/package"
    state: str
    outputs: dict = field(default_factory=dict)  # output parameters
    artifacts: dict = field(default_factory=dict)  # output artifact name -> uri
    attempts: int = 0
    error: str = ""
    log: str = ""
    mlmd_state: str = ""  # the task's MLMD execution state ("" when no driver ran for it)
    launched: bool = False  # the launcher ran the command to its end (not a pod that never started or was killed)
    pod: dict = field(default_factory=dict)  # the pod's nodeSelector and tolerations, as the driver set them
    execution: "_Execution | None" = field(default=None, repr=False)


@dataclass
class RunResult:
    run_id: str
    state: str
    tasks: dict[str, TaskResult]
    error: str = ""

    def task(self, name: str) -> TaskResult:
        """The result of the task whose last path component is `name`."""
        found = [t for path, t in self.tasks.items() if path.rsplit("/", 1)[-1] == name]
        if len(found) != 1:
            raise KeyError(f"{len(found)} tasks named {name!r}: {sorted(self.tasks)}")
        return found[0]

    def ran(self, name: str) -> bool:
        return any(p.rsplit("/", 1)[-1] == name and t.state != SKIPPED for p, t in self.tasks.items())


def load_pipeline(path: str | Path) -> tuple[dict, dict]:
    """The pipeline spec and the Kubernetes platform spec (kfp-kubernetes) of a compiled YAML."""
    docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d]
    spec = next(d for d in docs if "root" in d)
    platform = next((d for d in docs if "platforms" in d), {}).get("platforms", {}).get("kubernetes", {})
    return spec, platform


class PodRunner:
    """Runs one compiled pipeline; see the module docstring for what a step sees.

    images: image name -> the directory holding that image's `python3` (a virtual environment's
        bin/ stands in for the image's interpreter).
    secrets: Secret name -> {key: value}, what the namespace holds.
    pipeline_root: where output artifacts go (s3://bucket/prefix, or a local folder).
    workdir: under which each pod gets its own folder (deleted after the step unless keep_pods).
    upload: (local_path, uri) -> None, the launcher's artifact upload.
    """

    def __init__(self, compiled: str | Path, images: dict[str, str | Path], secrets: dict[str, dict[str, str]],
                 pipeline_root: str, workdir: str | Path, upload: Callable[[Path, str], None],
                 keep_pods: bool = False, log: Callable[[str], None] = print, step_timeout: float = 1800,
                 backend: str = BACKENDS[0]):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.backend = backend
        self.spec, self.platform = load_pipeline(compiled)
        self.images = {k: Path(v) for k, v in images.items()}
        self.secrets = secrets
        self.pipeline_root = pipeline_root.rstrip("/")
        self.workdir = Path(workdir)
        self.upload = upload
        self.keep_pods, self.log, self.step_timeout = keep_pods, log, step_timeout
        self.components = self.spec["components"]
        self.executors = self.spec["deploymentSpec"]["executors"]
        self.k8s_executors = self.platform.get("deploymentSpec", {}).get("executors", {})

    # -- a run -----------------------------------------------------------------------------------

    def run(self, arguments: dict, run_id: str | None = None) -> RunResult:
        self.run_id = run_id or str(uuid.uuid4())
        self.results: dict[str, TaskResult] = {}
        root = self.spec["root"]
        inputs = {}
        for name, definition in (root.get("inputDefinitions", {}).get("parameters") or {}).items():
            if name in arguments:
                inputs[name] = arguments[name]
            elif "defaultValue" in definition:
                inputs[name] = definition["defaultValue"]
            elif not definition.get("isOptional"):
                raise PipelineSpecError(f"pipeline parameter {name!r} has no value and no default")
        unknown = sorted(set(arguments) - set(inputs))
        if unknown:
            raise PipelineSpecError(f"unknown pipeline parameters: {', '.join(unknown)}")
        state, _, error = self._run_dag(root["dag"], inputs, "", _Execution(RUNNING))
        return RunResult(self.run_id, state, self.results, error)

    def _run_dag(self, dag: dict, inputs: dict, scope: str, execution: _Execution) -> tuple[str, dict, str]:
        """Run a DAG's tasks in dependency order; returns (state, output parameters, first error).

        Argo starts every task whose dependencies are done at once, so their drivers (which
        create the executions, CANCELED for a false condition) all run before any of their pods
        ends: the runner drives each ready task before it runs the next one's pod."""
        tasks = dag.get("tasks") or {}
        order = _topological(tasks)
        done: dict[str, TaskResult] = {}
        driven: dict[str, TaskResult | tuple] = {}
        failed_error = ""
        for name in order:
            task = tasks[name]
            path = f"{scope}/{name}".lstrip("/")
            upstream = [done[d] for d in _dependencies(task)]
            exit_task = task.get("triggerPolicy", {}).get("strategy") == EXIT_STRATEGY
            if not exit_task and (failed_error or any(u.state == FAILED for u in upstream)):
                result = TaskResult(path, SKIPPED, error="not started: an earlier task failed")
            else:
                for other in order:  # the drivers of every task that is ready now
                    if other not in driven and other not in done and (
                            other == name or all(d in done for d in _dependencies(tasks[other]))):
                        driven[other] = self._drive(tasks[other], f"{scope}/{other}".lstrip("/"), inputs, done,
                                                    execution)
                drove = driven.pop(name)
                result = drove if isinstance(drove, TaskResult) else self._run_task(task, path, *drove)
            if result.execution is not None:
                result.mlmd_state = result.execution.state
            done[name] = self.results[path] = result
            if result.state == FAILED and not failed_error:  # a sub-DAG's error names its failed step
                failed_error = result.error if result.error.startswith(path + "/") else f"{path}: {result.error}"
        outputs = self._dag_outputs(dag, done)
        return (FAILED if failed_error else SUCCEEDED), outputs, failed_error

    def _drive(self, task: dict, path: str, scope_inputs: dict, done: dict, parent: _Execution):
        """The driver: resolves the inputs and creates the task's execution in its parent DAG
        (CANCELED when its condition is false). Returns a TaskResult when the task will not run,
        else what _run_task needs."""
        try:
            params = self._resolve_inputs(task, scope_inputs, done)
        except _UpstreamSkipped as exc:
            return TaskResult(path, SKIPPED, error=str(exc))
        component = self.components[task["componentRef"]["name"]]
        execution = _Execution(RUNNING, parent, len((component.get("dag") or {}).get("tasks") or {}))
        parent.children.append(execution)
        condition = task.get("triggerPolicy", {}).get("condition")
        if condition and not evaluate_condition(condition, params):
            execution.state = CANCELED  # not triggered
            return TaskResult(path, SKIPPED, error=f"condition not met: {condition}", execution=execution)
        return component, params, execution, scope_inputs

    def _run_task(self, task: dict, path: str, component: dict, params: dict, execution: _Execution,
                  scope_inputs: dict) -> TaskResult:
        if task.get("iteratorPolicy") or task.get("parameterIterator") or task.get("artifactIterator"):
            raise PipelineSpecError(f"{path}: ParallelFor is not supported")
        if "dag" in component:
            self.log(f"[{path}] sub-DAG")
            state, outputs, error = self._run_dag(component["dag"], params, path, execution)
            return TaskResult(path, state, outputs, error=error, execution=execution)
        result = self._run_container(task, component, path, params, execution, scope_inputs)
        result.execution = execution
        return result

    def _launcher_ended(self, execution: _Execution, state: str) -> None:
        """What a launcher does when its container ends: publish the execution's state, then
        UpdateDAGExecutionsState on its parent DAG (module docstring)."""
        execution.state = state
        dag = execution.parent
        while dag is not None and dag.total_tasks:
            states = [child.state for child in dag.children]
            if sum(s in (COMPLETE, "CACHED", CANCELED) for s in states) == dag.total_tasks:
                dag.state = COMPLETE
            elif FAILED in states:
                dag.state = FAILED
            else:
                return  # "DAG is still running"
            if _release(self.backend) < (2, 17):
                return  # no upward propagation before kubeflow/pipelines#13322
            dag = dag.parent

    # -- inputs and outputs ----------------------------------------------------------------------

    def _resolve_inputs(self, task: dict, scope_inputs: dict, done: dict) -> dict:
        spec_inputs = task.get("inputs") or {}
        if spec_inputs.get("artifacts"):
            raise PipelineSpecError(f"{task['taskInfo']['name']}: input artifacts are not supported")
        params = {}
        for name, source in (spec_inputs.get("parameters") or {}).items():
            if "componentInputParameter" in source:
                key = source["componentInputParameter"]
                if key in scope_inputs:
                    params[name] = scope_inputs[key]
            elif "taskOutputParameter" in source:
                ref = source["taskOutputParameter"]
                producer = done[ref["producerTask"]]
                if producer.state != SUCCEEDED:
                    raise _UpstreamSkipped(f"input {name}: {ref['producerTask']} did not run")
                if ref["outputParameterKey"] not in producer.outputs:
                    raise PipelineSpecError(f"{ref['producerTask']} has no output {ref['outputParameterKey']!r}")
                params[name] = producer.outputs[ref["outputParameterKey"]]
            elif "runtimeValue" in source:
                params[name] = self._placeholders(source["runtimeValue"]["constant"])
            elif "taskFinalStatus" in source:
                producer = done[source["taskFinalStatus"]["producerTask"]]
                if producer.execution is None:
                    raise PipelineSpecError(f"input {name}: {producer.name} has no execution")
                params[name] = {"state": producer.execution.state, "pipelineJobResourceName": self.run_id,
                                "pipelineTaskName": producer.name.rsplit("/", 1)[-1], "error": {}}
            else:
                raise PipelineSpecError(f"input {name}: unsupported source {sorted(source)}")
        return params

    def _placeholders(self, value: Any) -> Any:
        if not isinstance(value, str):
            return value
        value = value.replace("{{$.pipeline_job_uuid}}", self.run_id)
        value = value.replace("{{$.pipeline_job_name}}", self.run_id)
        if "{{$" in value:
            raise PipelineSpecError(f"unsupported placeholder in {value!r}")
        return value

    def _dag_outputs(self, dag: dict, done: dict) -> dict:
        outputs = {}
        for name, source in ((dag.get("outputs") or {}).get("parameters") or {}).items():
            if "valueFromParameter" in source:
                selectors = [source["valueFromParameter"]]
            elif "valueFromOneof" in source:
                selectors = source["valueFromOneof"]["parameterSelectors"]
            else:
                raise PipelineSpecError(f"DAG output {name}: unsupported source {sorted(source)}")
            for selector in selectors:
                producer = done.get(selector["producerSubtask"])
                if producer is not None and producer.state == SUCCEEDED:
                    outputs[name] = producer.outputs[selector["outputParameterKey"]]
                    break
        return outputs

    # -- one pod ---------------------------------------------------------------------------------

    def _run_container(self, task: dict, component: dict, path: str, params: dict,
                       execution: _Execution, scope_inputs: dict) -> TaskResult:
        label = component["executorLabel"]
        container = self.executors[label]["container"]
        retries = int((task.get("retryPolicy") or {}).get("maxRetryCount", 0))
        result = TaskResult(path, FAILED)
        for attempt in range(1, retries + 2):
            result = self._attempt(label, container, component, path, params)
            result.pod = self._scheduling(label, scope_inputs)
            result.attempts = attempt
            if result.launched:
                self._launcher_ended(execution, COMPLETE if result.state == SUCCEEDED else FAILED)
            if result.state == SUCCEEDED:
                break
            self.log(f"[{path}] attempt {attempt} of {retries + 1} failed: {result.error}")
        return result

    def _attempt(self, label: str, container: dict, component: dict, path: str, params: dict) -> TaskResult:
        pod = self.workdir / f"{path.replace('/', '.')}-{uuid.uuid4().hex[:8]}"
        work, home, tmp, out = (pod / d for d in ("work", "home", "tmp", "outputs"))
        for d in (work, home, tmp, out):
            d.mkdir(parents=True)
        try:
            env = self._pod_env(label, container, home, tmp, path)
        except KeyError as exc:
            return TaskResult(path, FAILED, error=str(exc.args[0]))
        executor_input, artifact_paths = self._executor_input(component, params, out)
        command = [_substitute(part, executor_input) for part in container["command"] + container.get("args", [])]
        self.log(f"[{path}] pod {pod.name}: {container['image']}")
        started = time.monotonic()
        deadline = float(self.k8s_executors.get(label, {}).get("activeDeadlineSeconds") or self.step_timeout)
        try:
            proc = subprocess.run(command, cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                                  text=True, timeout=deadline)
            log, code = proc.stdout + proc.stderr, proc.returncode
            launched = True
        except subprocess.TimeoutExpired as exc:
            out = (exc.stdout or b"") + (exc.stderr or b"")
            log = (out.decode(errors="replace") if isinstance(out, bytes) else out)
            log, code = log + f"\nDeadlineExceeded: killed after {deadline:.0f} s", -9
            launched = False  # the kubelet killed the pod, launcher and all
        for line in log.rstrip().splitlines()[-15:]:
            self.log(f"[{path}]   {line}")
        try:
            if code != 0:
                last = next((ln for ln in reversed(log.strip().splitlines()) if ln.strip()), "")
                return TaskResult(path, FAILED, error=f"exit code {code}: {last}", log=log, launched=launched)
            outputs = _read_parameters(component, executor_input)
            artifacts = {}
            for name, local in artifact_paths.items():
                if local.exists():
                    uri = f"{self.pipeline_root}/{self.run_id}/{path}/{name}"
                    self.upload(local, uri)
                    artifacts[name] = uri
            self.log(f"[{path}] succeeded in {time.monotonic() - started:.1f} s")
            return TaskResult(path, SUCCEEDED, outputs, artifacts, log=log, launched=True)
        finally:
            if not self.keep_pods:
                shutil.rmtree(pod, ignore_errors=True)

    def _scheduling(self, label: str, scope_inputs: dict) -> dict:
        """The pod's nodeSelector and tolerations as the driver sets them from kfp-kubernetes'
        config (backend/src/v2/driver/k8s.go, initPodSpecPatch, 2.14.0 to 2.17.0): a `*Json`
        field takes the value of the pipeline input it names (resolved in the task's DAG); a
        null one is skipped; a toleration is one dict or a list of them, an empty one ignored."""
        config = self.k8s_executors.get(label, {})
        pod: dict = {}

        def value(spec: dict):
            if "componentInputParameter" in spec:
                return scope_inputs.get(spec["componentInputParameter"])
            if "runtimeValue" in spec:
                return spec["runtimeValue"].get("constant")
            raise PipelineSpecError(f"{label}: unsupported parameter source {sorted(spec)}")

        selector = config.get("nodeSelector")
        if selector is not None:
            labels = value(selector["nodeSelectorJson"]) if "nodeSelectorJson" in selector else selector.get("labels")
            if labels is not None:
                pod["nodeSelector"] = dict(labels)
        tolerations = []
        for toleration in config.get("tolerations") or []:
            if "tolerationJson" in toleration:
                given = value(toleration["tolerationJson"])
                tolerations += [given] if isinstance(given, dict) and given else list(
                    given if isinstance(given, list) else [])
            else:
                tolerations.append(toleration)
        if tolerations:
            pod["tolerations"] = tolerations
        return pod

    def _pod_env(self, label: str, container: dict, home: Path, tmp: Path, path: str) -> dict:
        image = container["image"]
        if image not in self.images:
            raise KeyError(f"image {image!r} cannot be pulled (known here: {', '.join(self.images) or 'none'})")
        env = {"PATH": f"{self.images[image]}:/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "TMPDIR": str(tmp),
               "LANG": "C.UTF-8", "PYTHONUNBUFFERED": "1",
               "KFP_POD_NAME": path.replace("/", "-"), "KFP_POD_UID": str(uuid.uuid4())}
        for item in container.get("env") or []:
            env[item["name"]] = item.get("value", "")
        for use in self.k8s_executors.get(label, {}).get("secretAsEnv") or []:
            name = use["secretName"]
            secret = self.secrets.get(name)
            for pair in use.get("keyToEnv") or []:
                if secret is not None and pair["secretKey"] in secret:
                    env[pair["envVar"]] = secret[pair["secretKey"]]
                elif not use.get("optional"):
                    missing = f"Secret {name!r}" if secret is None else f"key {pair['secretKey']!r} of Secret {name!r}"
                    raise KeyError(f"CreateContainerConfigError: {missing} not found")
        return env

    def _executor_input(self, component: dict, params: dict, out: Path) -> tuple[dict, dict]:
        outputs = component.get("outputDefinitions") or {}
        artifacts, paths = {}, {}
        for name, definition in (outputs.get("artifacts") or {}).items():
            local = out / "artifacts" / name
            local.parent.mkdir(parents=True, exist_ok=True)
            paths[name] = local
            artifacts[name] = {"artifacts": [{"name": name, "type": definition["artifactType"],
                                              "uri": str(local), "metadata": {}}]}
        executor_input = {
            "inputs": {"parameterValues": _as_go_json(params)},
            "outputs": {"parameters": {n: {"outputFile": str(out / "parameters" / n)}
                                       for n in (outputs.get("parameters") or {})},
                        "artifacts": artifacts, "outputFile": str(out / "executor_output.json")},
        }
        return executor_input, paths


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def _as_go_json(value: Any) -> Any:
    """Values as the launcher writes them into the executor input (protojson.Marshal in
    compileCmdAndArgs): a number is a protobuf double, and protojson prints a whole one without a
    fraction (5, not 5.0), so an int parameter arrives as an int, and so does a whole float."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _as_go_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_go_json(v) for v in value]
    return value


class _UpstreamSkipped(Exception):
    pass


def _dependencies(task: dict) -> list[str]:
    deps = list(task.get("dependentTasks") or [])
    for source in ((task.get("inputs") or {}).get("parameters") or {}).values():
        for key in ("taskOutputParameter", "taskFinalStatus"):
            if key in source:
                deps.append(source[key]["producerTask"])
    return list(dict.fromkeys(deps))


def _topological(tasks: dict) -> list[str]:
    order, seen = [], set()

    def visit(name: str, stack: tuple = ()):
        if name in seen:
            return
        if name in stack:
            raise PipelineSpecError(f"dependency cycle: {' -> '.join(stack + (name,))}")
        for dep in _dependencies(tasks[name]):
            visit(dep, stack + (name,))
        seen.add(name)
        order.append(name)

    for name in tasks:  # the compiler's order, dependencies first
        visit(name)
    return order


def _substitute(part: str, executor_input: dict) -> str:
    if "{{$}}" in part:
        part = part.replace("{{$}}", json.dumps(executor_input))
    if re.search(r"\{\{\$[.\w]", part):
        raise PipelineSpecError(f"unsupported placeholder in the command: {part[:80]!r}")
    return part


def _read_parameters(component: dict, executor_input: dict) -> dict:
    """Output parameters from the executor output file (where KFP's executor writes a component's
    return values), else from each parameter's own output file (dsl.OutputPath)."""
    names = list(((component.get("outputDefinitions") or {}).get("parameters") or {}))
    out_file = Path(executor_input["outputs"]["outputFile"])
    values = json.loads(out_file.read_text()).get("parameterValues", {}) if out_file.exists() else {}
    for name in names:
        if name not in values:
            f = Path(executor_input["outputs"]["parameters"][name]["outputFile"])
            if f.exists():
                values[name] = json.loads(f.read_text())
    missing = [n for n in names if n not in values]
    if missing:
        raise PipelineSpecError(f"the step wrote no value for its outputs {missing}")
    return values


# -- conditions ----------------------------------------------------------------------------------

_PARAM = re.compile(r"inputs\.parameter_values\[\s*'([^']+)'\s*\]")


def evaluate_condition(condition: str, params: dict) -> bool:
    """A dsl.If condition as the KFP compiler writes it (a small CEL subset: comparisons of input
    parameters with literals, `int(...)`/`double(...)` casts, `!`, `&&`, `||`)."""
    values = {}

    def name_for(match: re.Match) -> str:
        key = f"_p{len(values)}"
        values[key] = params.get(match.group(1))
        return key

    expr = _PARAM.sub(name_for, condition)
    expr = re.sub(r"!(?!=)", " not ", expr).replace("&&", " and ").replace("||", " or ")
    expr = expr.replace("true", "True").replace("false", "False")
    allowed = {"int": int, "double": float, "string": str, "bool": bool, **values}
    if re.search(r"[A-Za-z_]\w*", _strip_strings(expr)) and not set(
            re.findall(r"[A-Za-z_]\w*", _strip_strings(expr))) <= set(allowed) | {"not", "and", "or", "True", "False"}:
        raise PipelineSpecError(f"unsupported condition: {condition}")
    return bool(eval(expr, {"__builtins__": {}}, allowed))  # noqa: S307 - names checked above


def _strip_strings(expr: str) -> str:
    return re.sub(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", "''", expr)
