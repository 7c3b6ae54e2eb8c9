"""A/B and shadow tests inside one real tritonserver (serving/experiment.py): sticky arms by user
key at the configured weights, per-version and per-arm measurements, weights changed without a
restart or a dropped request, and a shadow version that is measured and never seen by clients,
even when it hangs or dies."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import tritonclient.http as httpclient

from cube3d_client import Cube3DClient
from cubeserve.checkpoint import write_random_weights
from cubeserve.config import TINY
from cubeserve.serving import experiment, metrics as names
from cubeserve.server.local_triton import LocalTriton, copy_model_repository, free_port
from cubeserve.serving.stubs import python_stubs
from serving_helpers import wait_until

# Versions of cube3d_stream: 1 and 2 hold the same weights (a healthy candidate agrees with the
# control exactly), 3 other weights (a candidate that disagrees), 4 a slow one (1024 shape tokens
# an object where the others make 32).
VERSIONS = {1: 0, 2: 0, 3: 7, 4: 1}  # version -> seed of its random weights
SLOW = dataclasses.replace(TINY, name="tiny-slow",
                           tokenizer=dataclasses.replace(TINY.tokenizer, num_encoder_latents=1024))


def start_server(tmp_path_factory, experiment_file: Path, versions: dict[int, int]) -> LocalTriton:
    """A tritonserver whose cube3d and cube3d_stream have `versions` (version -> seed of the
    engine's random weights; version 4 holds SLOW weights), the experiment file at `experiment_file`."""
    root = copy_model_repository(tmp_path_factory.mktemp("model_repository"))
    for model in ("cube3d", "cube3d_stream"):
        for v in versions:
            if v != 1:
                shutil.copytree(root / model / "1", root / model / str(v))
        config = root / model / "config.pbtxt"
        config.write_text(config.read_text().replace("latest { num_versions: 1 }", "all {}"))
    for v, seed in versions.items():
        write_random_weights(SLOW if v == 4 else "tiny", root / "cube3d_stream" / str(v) / "weights", seed=seed)
    log = tmp_path_factory.mktemp("logs") / "tritonserver.log"
    return LocalTriton(root, free_port(), free_port(), free_port(), log_path=log,
                       extra_args=("--model-control-mode=explicit", "--load-model=cube3d_stream",
                                   "--load-model=cube3d"),
                       env={experiment.EXPERIMENT_FILE_ENV: str(experiment_file)}).start()


@pytest.fixture(scope="module")
def experiment_file(tmp_path_factory):
    return tmp_path_factory.mktemp("experiment") / "experiment.json"


@pytest.fixture(scope="module")
def server(tmp_path_factory, experiment_file):
    """The module's server, shared by its tests: none may leave it changed (a stub killed, a
    model unloaded, an experiment file left behind). A test that must break it starts its own."""
    triton = start_server(tmp_path_factory, experiment_file, VERSIONS)
    try:
        yield triton
    finally:
        triton.stop()


@pytest.fixture(autouse=True)
def no_experiment_file(experiment_file):
    """Every test starts, and leaves, without the experiment file (which takes precedence over
    the experiment that set_experiment gives), whatever ran before it and however it ended."""
    experiment_file.unlink(missing_ok=True)
    yield
    experiment_file.unlink(missing_ok=True)


def set_experiment(server, body: dict | None) -> None:
    """Reload the predict model with the experiment as its config parameter (model control)."""
    admin = httpclient.InferenceServerClient(server.http_url)
    try:
        config = admin.get_model_config("cube3d")
        config["parameters"]["experiment"] = {"string_value": json.dumps(body) if body else ""}
        admin.load_model("cube3d", config=json.dumps(config), headers=server.admin_headers)
    finally:
        admin.close()


def samples(server) -> list[tuple[str, dict, float]]:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    out = []
    for line in text.splitlines():
        m = re.match(r"(cube3d_\w+)\{(.*)\} ([0-9.e+-]+)$", line)
        if m:
            out.append((m.group(1), dict(re.findall(r'(\w+)="([^"]*)"', m.group(2))), float(m.group(3))))
    return out


def total(server, name: str, **labels) -> float:
    return sum(v for n, lab, v in samples(server) if n == name and all(lab.get(k) == str(x) for k, x in labels.items()))


def counts(server, *keys: tuple) -> list[float]:
    """total() of each (name, {labels}) in `keys`: read before a test's requests, so that its
    assertions count what it caused, not what the tests before it left on the shared server."""
    return [total(server, name, **labels) for name, labels in keys]


def generate(server, user: str | None = None, **fields):
    with Cube3DClient(server.http_url, "http", user=user, retries=0) as client:
        return client.generate(fields.pop("prompt", "a chair"), resolution=fields.pop("resolution", 4), **fields)


AB = {"name": "ab-test", "arms": [{"name": "control", "version": 1, "weight": 70},
                                  {"name": "candidate", "version": 3, "weight": 30}]}


def test_users_keep_their_arm_and_the_split_follows_the_weights(server):
    set_experiment(server, AB)
    measured = [(names.REQUESTS, dict(model="cube3d", version=3, arm="candidate", outcome="ok")),
                (names.MESHES, dict(version=1, arm="control")),
                (names.TIME_PER_OUTPUT_TOKEN + "_count", dict(version=3, arm="candidate")),
                (names.REQUEST_DURATION + "_count", dict(version=1, arm="control"))]
    before = counts(server, *measured)
    users = [f"user-{i}" for i in range(120)]
    with ThreadPoolExecutor(8) as pool:
        first = dict(zip(users, pool.map(lambda u: generate(server, u), users)))
        again = dict(zip(users[:40], pool.map(lambda u: generate(server, u), users[:40])))
    arms = {u: (r.arm, r.model_version) for u, r in first.items()}
    assert set(arms.values()) == {("control", "1"), ("candidate", "3")}
    assert all(arms[u] == (r.arm, r.model_version) for u, r in again.items())  # sticky
    expected = experiment.parse(json.dumps(AB))
    assert all(arms[u][0] == expected.arm_for(u).name for u in users)  # any replica agrees
    candidates = sum(a == "candidate" for a, _ in arms.values())
    n, p = len(users), 0.3
    assert abs(candidates - n * p) <= 3.5 * math.sqrt(n * p * (1 - p)), candidates
    # the arms are measured apart, each under its checkpoint version (this test's requests only)
    requests, meshes, per_token, durations = (a - b for a, b in zip(counts(server, *measured), before))
    assert requests >= candidates and per_token >= candidates, (requests, per_token, candidates)
    assert meshes >= n - candidates and durations >= n - candidates, (meshes, durations, n - candidates)


def test_a_user_header_over_grpc_and_a_pinned_arm(server):
    set_experiment(server, AB)
    user = next(u for u in (f"g{i}" for i in range(100)) if experiment.parse(json.dumps(AB)).arm_for(u).name == "candidate")
    with Cube3DClient(server.grpc_url, "grpc", user=user, retries=0) as client:
        assert client.generate("a lamp", resolution=4).arm == "candidate"
    body = {"inputs": [{"name": "PROMPT", "shape": [1], "datatype": "BYTES", "data": ["a lamp"]},
                       {"name": "RESOLUTION", "shape": [1], "datatype": "INT32", "data": [4]}],
            "parameters": {experiment.PIN_ARM_KEY: "control"}}
    reply = _post(server, body, headers={"X-Cube3D-User": user})  # the pin wins over the hash
    outputs = {o["name"]: o["data"] for o in reply["outputs"]}
    assert outputs["ARM"] == ["control"] and outputs["MODEL_VERSION"] == ["1"]
    body["parameters"] = {experiment.PIN_ARM_KEY: "nope"}
    with pytest.raises(urllib.error.HTTPError) as err:
        _post(server, body)
    assert err.value.code == 400 and experiment.PIN_ARM_KEY in err.value.read().decode()


@pytest.mark.parametrize("kind", ["rest", "grpc"])
def test_kserve_sdk_users_get_their_arm_by_header(server, kind):
    """KServe's own SDK, as a KServe user's code calls it, with the user key as a header."""
    set_experiment(server, AB)
    chosen = experiment.parse(json.dumps(AB))
    users = {arm: next(u for u in (f"sdk{i}" for i in range(200)) if chosen.arm_for(u).name == arm)
             for arm in ("control", "candidate")}
    sdk = Path(__file__).with_name("kserve_sdk_client.py")
    url = server.http_url if kind == "rest" else server.grpc_url
    for arm, user in users.items():
        proc = subprocess.run([sys.executable, str(sdk), kind, url, "a lamp", "0", "4", user],
                              capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        assert got["arm"] == arm and got["model_version"] == str(chosen.arm_for(user).version), got


def _post(server, body: dict, headers: dict | None = None) -> dict:
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/cube3d/infer", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())


def test_new_weights_apply_without_a_restart_or_a_dropped_request(server, experiment_file):
    set_experiment(server, AB)
    results, errors = [], []

    def client_loop(stop):
        i = 0
        while not stop.is_set():
            try:
                results.append(generate(server, f"loop-{i % 5}"))
            except Exception as exc:  # noqa: BLE001 - any failure is the finding
                errors.append(exc)
            i += 1

    def after_more_answers(count=3):  # requests straddle each change, however loaded the machine
        target = len(results) + len(errors) + count
        wait_until(lambda: len(results) + len(errors) >= target, 120, "the clients' answers", poll=0.2)

    stop = threading.Event()
    threads = [threading.Thread(target=client_loop, args=(stop,)) for _ in range(3)]
    for t in threads:
        t.start()
    after_more_answers()
    everyone_on_candidate = {**AB, "arms": [{**AB["arms"][0], "weight": 0}, AB["arms"][1]]}
    set_experiment(server, everyone_on_candidate)  # through model control: reloads cube3d
    after_more_answers()
    experiment_file.write_text(json.dumps({**AB, "name": "from-file", "arms": [
        {"name": "only", "version": 2, "weight": 1}]}))  # the file wins while it exists
    after_more_answers()
    stop.set()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a client's request did not end"
    try:
        assert not errors, errors[:3]
        assert {r.arm for r in results} >= {"candidate", "only"}
        assert generate(server, "loop-0").arm == "only" and generate(server, "x").model_version == "2"
        # A broken file keeps the experiment in force, the file's "only" (not the parameter's
        # "candidate", which a fallback would give: the two differ, so this can fail).
        experiment_file.write_text("{not json")
        assert generate(server, "loop-0").arm == "only"
        # so does one naming a version the server has not loaded
        experiment_file.write_text(json.dumps({"name": "v9", "arms": [{"name": "x", "version": 9, "weight": 1}]}))
        assert generate(server, "loop-0").arm == "only"
        experiment_file.unlink()
        assert generate(server, "loop-0").arm == "candidate"  # the parameter again
    finally:
        experiment_file.unlink(missing_ok=True)


def test_a_shadow_is_measured_and_never_seen(server):
    agreement = names.SHADOW_AGREEMENT
    measured = [(agreement + "_count", dict(version=2, measure="tokens")),
                (agreement + "_count", dict(version=2, measure="mesh_iou")),
                (agreement + "_bucket", dict(version=2, measure="tokens", le="1")),
                (agreement + "_bucket", dict(version=2, measure="tokens", le="0.999")),
                (agreement + "_bucket", dict(version=2, measure="mesh_iou", le="0.999")),
                (names.SHADOW_REQUESTS, dict(version=2, baseline=1)),
                (names.SHADOW_REQUESTS, dict(version=2, baseline=1, outcome="ok")),
                (names.MESHES, dict(version=2, arm="shadow"))]
    before = counts(server, *measured)

    def new():
        return [a - b for a, b in zip(counts(server, *measured), before)]

    # Room for every copy: the first copies can wait on version 2's engine where no test before
    # used it (a fresh engine's first step), and past max_in_flight (default 4) a copy is skipped,
    # by design (tested with the hung shadow).
    set_experiment(server, {"name": "shadow", "arms": [{"name": "control", "version": 1, "weight": 1}],
                            "shadow": {"version": 2, "share": 1.0, "max_in_flight": 16}})
    greedy = [generate(server, f"s{i}") for i in range(6)]
    sampled = [generate(server, f"t{i}", top_p=0.9, seed=i) for i in range(3)]
    assert all(r.arm == "control" and r.model_version == "1" for r in greedy + sampled)
    # every copy ends (each in its own time, after the served answer) and is measured
    wait_until(lambda: new()[5] >= 9, 120, "the 9 shadow copies measured", poll=0.5)
    try:
        wait_until(lambda: new()[0] >= 6 and new()[1] >= 3, 60, "the copies compared", poll=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {dict(zip(('tokens', 'ious', 'identical', 'below', 'iou_below_one', 'copies', 'ok', 'meshes'), new()))}, "
                             f"shadow outcomes {[(lab, v) for n, lab, v in samples(server) if n == names.SHADOW_REQUESTS]}") from None
    tokens, ious, identical, below, iou_below_one, copies, ok, meshes = new()
    # versions 1 and 2 hold the same weights: identical tokens, identical meshes
    assert tokens >= 6 and ious >= 3
    assert identical - below >= 6 and below == 0
    assert iou_below_one == 0
    assert ok >= 9
    # the shadow's generations are the engine's too, under arm "shadow", apart from served traffic
    assert meshes >= 9


def test_a_disagreeing_shadow_is_measured_as_such(server):
    measured = [(names.SHADOW_AGREEMENT + "_count", dict(version=3, measure="tokens")),
                (names.SHADOW_AGREEMENT + "_bucket", dict(version=3, measure="tokens", le="0.999"))]
    before = counts(server, *measured)

    def new():
        return [a - b for a, b in zip(counts(server, *measured), before)]

    set_experiment(server, {"name": "shadow3", "arms": [{"name": "control", "version": 1, "weight": 1}],
                            "shadow": {"version": 3, "share": 1.0}})
    for i in range(3):
        assert generate(server, f"d{i}").model_version == "1"
    wait_until(lambda: new()[0] >= 3, 60, "the 3 shadow copies compared", poll=0.5)
    compared, disagreeing = new()
    assert disagreeing >= 3, (compared, disagreeing)


def test_a_slow_shadow_never_holds_the_served_answer(server):
    set_experiment(server, {"name": "slow-shadow", "arms": [{"name": "control", "version": 1, "weight": 1}],
                            "shadow": {"version": 4, "share": 1.0}})

    def finished_copies():
        return total(server, names.SHADOW_REQUESTS, version=4, baseline=1)

    before = finished_copies()
    before_ok = total(server, names.SHADOW_REQUESTS, version=4, baseline=1, outcome="ok")
    served = generate(server, "slow-0")
    # the answer came while its copy (32 times the tokens) was still running: nothing waited on it
    assert served.model_version == "1" and len(served.tokens) == TINY.num_tokens
    assert finished_copies() == before
    wait_until(lambda: finished_copies() >= before + 1, 120, "the slow copy finished", poll=0.5)
    assert total(server, names.SHADOW_REQUESTS, version=4, baseline=1, outcome="ok") - before_ok >= 1


def _engine_pid(server, version: int) -> int:
    pids = [p for p, (model, v) in python_stubs(server.tritonserver_pid()).items() if model == "cube3d_stream" and v == str(version)]
    assert len(pids) == 1, pids
    return pids[0]


@pytest.fixture
def server_to_break(tmp_path_factory):
    """A server of the test's own (versions 1 and 3), for a test that kills an engine: Triton
    2.51 does not start a dead decoupled stub again, so the module's server would keep serving
    without it for every test after."""
    triton = start_server(tmp_path_factory, tmp_path_factory.mktemp("experiment") / "experiment.json",
                          {v: VERSIONS[v] for v in (1, 3)})
    try:
        yield triton
    finally:
        # Triton's shutdown waits on the dead stub it cannot unload: not what any test checks.
        triton.stop(timeout=10)


def test_a_hung_then_dead_shadow_never_fails_served_requests(server_to_break):
    server = server_to_break
    set_experiment(server, {"name": "bad-shadow", "arms": [{"name": "control", "version": 1, "weight": 1}],
                            "shadow": {"version": 3, "share": 1.0, "max_in_flight": 2}})
    shadow = _engine_pid(server, 3)

    def copies(*outcomes):
        return sum(total(server, names.SHADOW_REQUESTS, version=3, outcome=o) for o in outcomes)

    before_ok, before_bad = copies("ok"), copies("failed", "unavailable", "skipped")
    os.kill(shadow, signal.SIGSTOP)  # the shadow hangs (Triton finds its stub unhealthy)
    try:
        served = [generate(server, f"h{i}") for i in range(5)]
        assert all(r.model_version == "1" and r.arm == "control" for r in served)
        # each copy ends in its own time, after the served answer
        wait_until(lambda: copies("failed", "unavailable", "skipped") - before_bad >= 5, 30,
                   "the 5 copies to the hung shadow ended", poll=0.5)
        assert copies("ok") == before_ok
    finally:
        os.kill(shadow, signal.SIGKILL)  # then it dies
        os.kill(shadow, signal.SIGCONT)
    before_gone = copies("unavailable")
    served = [generate(server, f"k{i}") for i in range(3)]
    assert all(r.model_version == "1" for r in served)  # still serving
    # a copy to a dead engine: ended, not waited on forever
    wait_until(lambda: copies("unavailable") - before_gone >= 1, 30, "a copy to the dead shadow ended", poll=0.5)


# -- the salt: no server ----------------------------------------------------------------------------

def test_experiments_with_different_salts_assign_users_independently():
    """A user's arm comes from SHA-256(salt, key): two experiments (or one whose salt is changed,
    its name kept) split a population independently of each other. 2000 users, two 50/50 arms:
    were the two assignments independent, the users on the same arm in both would be
    Binomial(2000, 1/2) (mean 1000, sd 22.4) and each of the four (arm, arm) cells
    Binomial(2000, 1/4) (mean 500, sd 19.4); the bounds below are 6.7 and 6.2 sd wide (each
    exceeded by chance with probability below 1e-9; the hash of fixed keys makes the outcome the
    same on every run). The same salt (or none: the name) gives every user the same arm."""
    from collections import Counter

    def ab(**fields) -> experiment.Experiment:
        return experiment.parse(json.dumps({"arms": [{"name": "a", "version": 1, "weight": 50},
                                                     {"name": "b", "version": 2, "weight": 50}], **fields}))

    users = [f"user-{i}" for i in range(2000)]
    first = ab(name="checkout", salt="2024-q1")
    resalted = ab(name="checkout", salt="2024-q2")  # the same experiment, its users reshuffled
    other = ab(name="search")  # another experiment, salted by its name
    for one, two in ((first, resalted), (first, other), (resalted, other)):
        pairs = Counter((one.arm_for(u).name, two.arm_for(u).name) for u in users)
        agree = pairs["a", "a"] + pairs["b", "b"]
        assert 850 <= agree <= 1150, (one.salt, two.salt, pairs)
        assert all(380 <= pairs[cell] <= 620 for cell in [("a", "a"), ("a", "b"), ("b", "a"), ("b", "b")]), pairs
    for e in (first, resalted, other):
        assert 850 <= sum(e.arm_for(u).name == "a" for u in users) <= 1150
    # The salt is what decides: kept (or written out as the name it defaults to), nothing moves.
    assert [first.arm_for(u) for u in users] == [ab(name="renamed", salt="2024-q1").arm_for(u) for u in users]
    assert [other.arm_for(u) for u in users] == [ab(name="x", salt="search").arm_for(u) for u in users]
    assert experiment.parse(first.to_json()).salt == "2024-q1"


def test_a_fast_shadow_that_finishes_first_never_answers(server):
    """The reverse of the slow shadow: the served arm is the slow version 4 (1024 shape tokens)
    and the shadow the fast version 1 (32), so the copy finishes long before the served answer.
    That it did is seen on the server itself before the answer: the copy is measured while the
    served request is not yet counted (both are counted before anything is sent). The answer is
    then version 4's, by arm control, with its 1024 tokens; the shadow's would say version 1."""
    set_experiment(server, {"name": "fast-shadow", "arms": [{"name": "control", "version": 4, "weight": 1}],
                            "shadow": {"version": 1, "share": 1.0}})
    measured = [(names.SHADOW_REQUESTS, dict(version=1, baseline=4)),
                (names.REQUESTS, dict(model="cube3d", version=4, arm="control"))]
    for attempt in range(3):
        copies_before, served_before = counts(server, *measured)
        result: dict = {}
        client = threading.Thread(target=lambda: result.update(answer=generate(server, f"fast-shadow-{attempt}")))
        client.start()

        def copy_measured_or_request_counted() -> bool:
            copies, served = counts(server, *measured)
            return copies > copies_before or served > served_before

        wait_until(copy_measured_or_request_counted, 300, "the shadow copy measured or the request answered",
                   poll=0.2)
        # In this order: the copy measured, then the served request still not counted.
        copy_first = (counts(server, measured[0])[0] > copies_before
                      and counts(server, measured[1])[0] == served_before)
        client.join(300)
        answer = result["answer"]
        assert (answer.model_version, answer.arm, len(answer.tokens)) == ("4", "control", SLOW.num_tokens), (
            answer.model_version, answer.arm, len(answer.tokens))
        if copy_first:
            break
    else:
        pytest.fail("in 3 tries the shadow copy (32 tokens) never finished before the served request (1024)")
    assert counts(server, measured[1])[0] == served_before + 1  # measured before it was sent
