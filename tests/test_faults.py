"""The real tritonserver under overload and faults: a bounded queue that refuses with 503 /
UNAVAILABLE, deadlines, clients that go away (waiting or mid-generation, on REST, gRPC and
streams), a model unloaded while requests wait, and the engine's stub process killed, under
the supervisor that production runs (k8s/: cubeserve.deploy.server_command)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from cube3d_client import Cube3DClient
from cubeserve.checkpoint import write_random_weights
from cubeserve.config import TINY
from cubeserve.engine import Engine, GenerationRequest
from cubeserve.engine.scheduler import Scheduler
from cubeserve.server.local_triton import LocalTriton, copy_model_repository, free_port
from cubeserve.serving.stubs import children, process_tree, python_stubs
from serving_helpers import metrics

# 1024 shape tokens on the tiny model: a generation lasts long enough to be interrupted.
LONG = dataclasses.replace(TINY, name="tiny-long",
                           tokenizer=dataclasses.replace(TINY.tokenizer, num_encoder_latents=1024))
MAX_OBJECTS, MAX_QUEUE = 1, 2


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = copy_model_repository(tmp_path_factory.mktemp("model_repository"),
                                 {"max_objects": str(MAX_OBJECTS), "max_queue": str(MAX_QUEUE), "dtype": "float32"})
    write_random_weights(LONG, root / "cube3d_stream" / "1" / "weights", seed=1)
    return root


@pytest.fixture(scope="module")
def server(repo, tmp_path_factory):
    """Supervised (restarts tritonserver when a stub dies), explicit model control."""
    log = tmp_path_factory.mktemp("logs") / "tritonserver.log"
    triton = LocalTriton(repo, free_port(), free_port(), free_port(), log_path=log, supervised=True, fault_grace=2,
                         extra_args=("--model-control-mode=explicit", "--load-model=cube3d_stream",
                                     "--load-model=cube3d"))
    with triton:
        yield triton


@pytest.fixture(scope="module")
def expected_tokens(repo):
    """expected_tokens(prompt, seed): the tokens made in process (on the scheduler: its decode
    path is the server's, and several times faster than Engine.generate_tokens here)."""
    engine = Engine.from_dir(repo / "cube3d_stream" / "1" / "weights", dtype="float32")
    cache = {}
    with Scheduler(engine, max_objects=1) as scheduler:
        def tokens(prompt: str, seed: int = 0) -> list[int]:
            if (prompt, seed) not in cache:
                cache[prompt, seed] = scheduler.generate(GenerationRequest(prompt, seed=seed, resolution=4)).tokens
            return cache[prompt, seed]

        yield tokens


def tritonserver_pid(server) -> int:
    return server.tritonserver_pid()


def engine_stubs(server) -> list[int]:
    """The pids of the engine's (cube3d_stream's) stub processes: one, but for a moment after a
    reload, while the unloaded version's process ends."""
    return [pid for pid, (model, _) in python_stubs(tritonserver_pid(server)).items() if model == "cube3d_stream"]


def describe_process(pid: int) -> str:
    """For a failure message: a process's state and what each of its threads waits in."""
    try:
        state = (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split() or ["?"])[0]
        threads = [f"{(task / 'comm').read_text().strip()}:{(task / 'wchan').read_text() or '-'}"
                   for task in sorted(Path(f"/proc/{pid}/task").iterdir())]
    except OSError as exc:
        return f"process {pid}: {exc}"
    return f"process {pid}, state {state}, threads (name:wait channel) {', '.join(threads)}"


def log_lines(server, *words: str, last: int = 30) -> str:
    lines = [line for line in server.log_path.read_text(errors="replace").splitlines() if any(w in line for w in words)]
    return "\n".join(lines[-last:])


def body(prompt: str, seed: int = 0, resolution: int = 4, timeout_us: int | None = None) -> bytes:
    request = {"inputs": [{"name": "PROMPT", "shape": [1], "datatype": "BYTES", "data": [prompt]},
                          {"name": "SEED", "shape": [1], "datatype": "INT64", "data": [seed]},
                          {"name": "RESOLUTION", "shape": [1], "datatype": "INT32", "data": [resolution]}],
               "outputs": [{"name": "SHAPE_TOKENS"}, {"name": "NUM_FACES"}]}
    if timeout_us is not None:
        request["parameters"] = {"timeout": timeout_us}  # the v2 per-request timeout, microseconds
    return json.dumps(request).encode()


def post(server, data: bytes, timeout: float = 120) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/cube3d/infer", data=data)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def wait_for(condition, timeout: float = 60, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"not within {timeout} s: {condition.__doc__ or condition}")


def in_flight(server) -> float:
    return metrics(server).get("cube3d_objects_in_flight/v1", 0)


def idle(server) -> bool:
    """no object in flight, nothing waiting"""
    m = metrics(server)
    return m.get("cube3d_objects_in_flight/v1", 0) == 0 and m.get("cube3d_requests_waiting/v1", 0) == 0


def start(target, *args) -> threading.Thread:
    thread = threading.Thread(target=target, args=args, daemon=True)
    thread.start()
    return thread


def grpc_inputs(prompt: str, stream: bool = False) -> list:
    import tritonclient.grpc as grpcclient

    tensor = grpcclient.InferInput("PROMPT", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    if not stream:
        return [tensor]
    progress = grpcclient.InferInput("STREAM_PROGRESS", [1], "BOOL")
    progress.set_data_from_numpy(np.array([True]))
    return [tensor, progress]


# -- overload -------------------------------------------------------------------------------------

def test_past_the_queue_requests_are_refused_at_once_with_503_and_the_rest_are_served(server, expected_tokens):
    wait_for(lambda: idle(server))
    before = metrics(server).get("cube3d_requests_dropped_total/v1/refused_busy", 0)
    results = {}
    threads = [start(lambda i: results.__setitem__(i, (post(server, body(f"burst {i}", seed=i)), time.monotonic())), i)
               for i in range(6)]
    for t in threads:
        t.join(300)
    accepted = {i: r for i, ((code, _), _) in results.items() if code == 200 for r in [results[i]]}
    refused = {i: r for i, ((code, _), _) in results.items() if code == 503 for r in [results[i]]}
    assert len(accepted) + len(refused) == 6
    assert len(accepted) >= MAX_OBJECTS + MAX_QUEUE and refused, results.keys()
    for i, ((_, reply), _) in refused.items():
        assert reply["error"].startswith("unavailable: the server is busy") and "max_queue 2" in reply["error"]
    # refused at once: before any accepted request finished
    assert max(t for _, t in refused.values()) < min(t for _, t in accepted.values())
    for i, ((_, reply), _) in accepted.items():
        tokens = {o["name"]: o["data"] for o in reply["outputs"]}["SHAPE_TOKENS"]
        assert tokens == expected_tokens(f"burst {i}", seed=i)
    assert metrics(server)["cube3d_requests_dropped_total/v1/refused_busy"] - before == len(refused)


def test_busy_is_grpc_unavailable_and_the_project_client_retries_it(server):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    wait_for(lambda: idle(server))
    blockers = [start(post, server, body(f"blocker {i}")) for i in range(MAX_OBJECTS + MAX_QUEUE)]
    wait_for(lambda: metrics(server).get("cube3d_requests_waiting/v1", 0) == MAX_QUEUE)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException) as err:
        client.infer("cube3d", grpc_inputs("one too many"))
    client.close()
    assert err.value.status() == "StatusCode.UNAVAILABLE" and "busy" in err.value.message()
    # The project's client backs off and retries a refusal until the queue has room, over REST and
    # over the stream (whose errors reach tritonclient without a status: the message says it).
    refused_before = metrics(server)["cube3d_requests_dropped_total/v1/refused_busy"]
    patient = {}

    def retrying(transport):
        url = server.http_url if transport == "http" else server.grpc_url
        with Cube3DClient(url, transport, retries=8, backoff=0.2) as client:  # 51 s of backoff in all
            patient[transport] = client.generate("patient", resolution=4,
                                                 on_progress=(lambda n: None) if transport == "grpc" else None)

    waiters = [start(retrying, t) for t in ("http", "grpc")]
    for t in blockers + waiters:
        t.join(300)
    assert {t: len(r.tokens) for t, r in patient.items()} == {"http": LONG.num_tokens, "grpc": LONG.num_tokens}
    assert metrics(server)["cube3d_requests_dropped_total/v1/refused_busy"] - refused_before >= 2


def post_as(server, data: bytes, headers: dict, timeout: float = 120) -> tuple[int, dict, dict]:
    """post(), with request headers (the gateway's), and the answer's headers too."""
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/cube3d/infer", data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, json.loads(reply.read()), dict(reply.headers)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), dict(err.headers)


BATCH = {"x-cube3d-band": "batch", "x-cube3d-tenant": "nightly"}
INTERACTIVE = {"x-cube3d-band": "interactive", "x-cube3d-tenant": "editor"}


def test_a_full_queue_sheds_the_batch_band_for_an_interactive_request_with_429(server, expected_tokens):
    """The gateway's band header reaches the engine's queue through the predict model: an
    interactive request to a full queue takes a batch request's place, which is answered 429
    with Retry-After (over REST; RESOURCE_EXHAUSTED over gRPC), and is served itself."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    wait_for(lambda: idle(server))
    shed_before = metrics(server).get("cube3d_requests_dropped_total/v1/shed", 0)
    answers = {}
    batch = [start(lambda i: answers.__setitem__(i, post_as(server, body(f"batch {i}", seed=i), BATCH)), i)
             for i in range(MAX_OBJECTS + MAX_QUEUE)]
    wait_for(lambda: metrics(server).get("cube3d_requests_waiting/v1", 0) == MAX_QUEUE)
    urgent = start(lambda: answers.__setitem__("urgent", post_as(server, body("urgent"), INTERACTIVE)))
    wait_for(lambda: [i for i, (code, _, _) in answers.items() if code == 429], timeout=30)
    # A batch request to a queue that an interactive one holds is refused as shed, over gRPC too.
    client = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException) as err:
        client.infer("cube3d", grpc_inputs("late batch"), headers=BATCH)
    client.close()
    assert err.value.status() == "StatusCode.RESOURCE_EXHAUSTED", err.value
    assert "higher band than batch" in err.value.message()
    for t in (*batch, urgent):
        t.join(300)
    shed = [i for i, (code, _, _) in answers.items() if code == 429]
    assert len(shed) == 1 and shed[0] != "urgent", {i: a[:2] for i, a in answers.items()}
    code, reply, headers = answers[shed[0]]
    assert reply["error"].startswith("unavailable: shed: ") and "interactive before batch" in reply["error"]
    assert headers.get("Retry-After") == "1"
    for i, (code, reply, _) in answers.items():
        if i not in shed:
            assert code == 200, reply
            prompt, seed = ("urgent", 0) if i == "urgent" else (f"batch {i}", i)
            assert {o["name"]: o["data"] for o in reply["outputs"]}["SHAPE_TOKENS"] == expected_tokens(prompt, seed)
    assert metrics(server)["cube3d_requests_dropped_total/v1/shed"] - shed_before == 2


def test_a_band_that_is_not_one_is_a_400_naming_the_header_and_the_bands(server):
    code, reply, _ = post_as(server, body("x"), {"x-cube3d-band": "urgent"})
    assert code == 400 and reply["error"] == (
        "x-cube3d-band: must be one of interactive, standard, batch, got 'urgent'"), reply
    data = json.loads(body("x"))
    data["parameters"] = {"x-cube3d-band": "interactive"}
    code, reply = post(server, json.dumps(data).encode())
    assert code == 400 and "set by the gateway" in reply["error"], reply


# -- deadlines and clients that go away -----------------------------------------------------------

def test_a_deadline_that_passes_while_waiting_fails_with_503_and_takes_no_slot(server):
    wait_for(lambda: idle(server))
    tokens_before = metrics(server)["cube3d_tokens_generated_total/v1"]
    blocker = start(post, server, body("blocker"))
    wait_for(lambda: in_flight(server) == 1)
    code, reply = post(server, body("in a hurry", timeout_us=300_000))
    assert code == 503 and reply["error"].startswith("unavailable: deadline exceeded"), reply
    blocker.join(300)
    after = metrics(server)
    assert after["cube3d_tokens_generated_total/v1"] - tokens_before == LONG.num_tokens  # the blocker's only
    assert after["cube3d_requests_dropped_total/v1/expired"] >= 1


def test_a_waiting_request_whose_client_went_away_never_takes_a_slot(server):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    wait_for(lambda: idle(server))
    before = metrics(server)
    blocker = start(post, server, body("blocker"))
    wait_for(lambda: in_flight(server) == 1)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException):  # the client gives up while its request waits
        client.infer("cube3d", grpc_inputs("gone while waiting"), client_timeout=0.3)
    client.close()
    blocker.join(300)
    wait_for(lambda: idle(server))
    after = metrics(server)
    assert after["cube3d_tokens_generated_total/v1"] - before["cube3d_tokens_generated_total/v1"] == LONG.num_tokens
    assert after["cube3d_requests_dropped_total/v1/cancelled"] - before.get(
        "cube3d_requests_dropped_total/v1/cancelled", 0) == 1


def _rest_disconnect(server):
    """Triton 2.51's HTTP frontend does not see a client close its connection while the request
    runs (triton-inference-server/server#7077: the paused request's socket is not read), so a
    REST client's slot is freed by its deadline: the v2 `timeout` parameter, which the project's
    client always sends."""
    with socket.create_connection(("127.0.0.1", server.http_port)) as sock:
        data = body("gone mid-generation", timeout_us=1_000_000)
        sock.sendall(b"POST /v2/models/cube3d/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        wait_for(lambda: in_flight(server) == 1)


def _grpc_disconnect(server):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(server.grpc_url)
    ended = []
    call = client.async_infer("cube3d", grpc_inputs("gone mid-generation"),
                              callback=lambda result, error: ended.append(error))
    wait_for(lambda: in_flight(server) == 1)  # decoding: the client goes away mid-generation
    call.cancel()
    wait_for(lambda: ended)
    assert isinstance(ended[0], InferenceServerException) and "CANCELLED" in str(ended[0].status()), ended
    client.close()


def _stream_disconnect(server):
    import tritonclient.grpc as grpcclient

    progress = []
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: progress.append(result))
    client.async_stream_infer("cube3d_stream", grpc_inputs("gone mid-generation", stream=True))
    wait_for(lambda: len(progress) >= 50)
    client.stop_stream(cancel_requests=True)
    client.close()


@pytest.mark.parametrize("disconnect", [_rest_disconnect, _grpc_disconnect, _stream_disconnect],
                         ids=["rest-with-deadline", "grpc", "stream"])
def test_a_client_that_goes_away_mid_generation_frees_its_slot(server, disconnect):
    wait_for(lambda: idle(server))
    tokens_at_start = metrics(server)["cube3d_tokens_generated_total/v1"]
    disconnect(server)
    wait_for(lambda: in_flight(server) == 0)
    settled = metrics(server)["cube3d_tokens_generated_total/v1"]
    time.sleep(0.5)
    assert metrics(server)["cube3d_tokens_generated_total/v1"] == settled, "the engine kept decoding"
    assert settled - tokens_at_start < LONG.num_tokens


# -- bad requests beside good ones ----------------------------------------------------------------

def test_bad_requests_beside_good_ones_lose_nothing(server, expected_tokens):
    wait_for(lambda: idle(server))
    results = {}
    bad = {"TOP_P": ("FP32", 7.0), "RESOLUTION": ("INT32", 99), "SEED": ("INT64", -1)}

    def good(i):
        results[i] = post(server, body(f"burst {i}", seed=i))

    def send_bad(name):
        request = json.loads(body("bad"))
        dtype, value = bad[name]
        request["inputs"] = [i for i in request["inputs"] if i["name"] != name]
        request["inputs"].append({"name": name, "shape": [1], "datatype": dtype, "data": [value]})
        results[name] = post(server, json.dumps(request).encode())

    threads = [start(good, i) for i in range(2)] + [start(send_bad, n) for n in bad]
    for t in threads:
        t.join(300)
    for name in bad:
        code, reply = results[name]
        assert code == 400 and reply["error"].startswith(f"{name}:") and "must be" in reply["error"], reply
    for i in range(2):
        code, reply = results[i]
        assert code == 200
        assert {o["name"]: o["data"] for o in reply["outputs"]}["SHAPE_TOKENS"] == expected_tokens(f"burst {i}", i)


# -- a model unloaded while requests wait ---------------------------------------------------------

def test_unloading_the_engine_finishes_running_and_waiting_requests_then_refuses_clearly(server, expected_tokens):
    """Triton drains a decoupled model before it unloads it: what was accepted is served."""
    import tritonclient.http as httpclient

    wait_for(lambda: idle(server))
    triton = tritonserver_pid(server)
    [unloaded_engine] = engine_stubs(server)
    results = {}
    threads = [start(lambda i: results.__setitem__(i, post(server, body(f"burst {i}", seed=i))), i) for i in range(3)]
    wait_for(lambda: metrics(server).get("cube3d_requests_waiting/v1", 0) == 2)
    admin = httpclient.InferenceServerClient(server.http_url)
    log_at_unload = len(server.log_path.read_bytes())
    admin.unload_model("cube3d_stream", headers=server.admin_headers)
    try:
        for t in threads:
            t.join(120)
        for i, (code, reply) in results.items():
            assert code == 200, reply
            assert {o["name"]: o["data"] for o in reply["outputs"]}["SHAPE_TOKENS"] == expected_tokens(f"burst {i}", i)
        # While unloading and once unloaded: 503 naming the version (the predict model asks
        # whether its engine is loaded before it reads the forward's error).
        code, reply = post(server, body("while unloaded"))
        assert code == 503 and "cube3d_stream version 1 is not loaded" in reply["error"], (code, reply)
    finally:  # the module's other tests need the engine back, whatever failed above
        admin.load_model("cube3d_stream", headers=server.admin_headers)
    assert admin.is_model_ready("cube3d_stream")
    admin.close()
    assert post(server, body("after the reload"))[0] == 200
    assert tritonserver_pid(server) == triton  # an unload is no fault: the supervisor left it alone
    # The unloaded engine's process ends, and its memory with it (a stuck exit is ended within
    # 2 x triton_engine.EXIT_GRACE_S of finalize).
    deadline = time.monotonic() + 90
    while unloaded_engine in engine_stubs(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert unloaded_engine not in engine_stubs(server), (
        f"the unloaded engine's process {unloaded_engine} still runs 90 s after its reload: "
        f"{describe_process(unloaded_engine)}\n{log_lines(server, 'cube3d_stream', 'engine', 'Timeout', 'Thread', 'File')}")
    # its finalize ran (which arms the timers that end a stuck exit) and said how long it took
    assert logged_since(server, log_at_unload, "cube3d engine of version 1 stopped in")


# -- the engine's process dies --------------------------------------------------------------------

def kill_engine_stub(server) -> None:
    [pid] = engine_stubs(server)
    os.kill(pid, signal.SIGKILL)


def readiness(server) -> int | None:
    """The readiness endpoint's answer: its HTTP status, 0 for a connection refused or reset, None
    for no answer within 10 s (a slow answer on a loaded machine says nothing about readiness)."""
    try:
        with urllib.request.urlopen(f"http://{server.http_url}/v2/health/ready", timeout=10) as reply:
            return reply.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError) as exc:
        return None if isinstance(getattr(exc, "reason", exc), TimeoutError) else 0


def ready(server) -> bool:
    return readiness(server) == 200


def unready(server) -> bool:
    """The server said it is not ready (what KServe's probe acts on), not merely answered slowly."""
    return readiness(server) not in (200, None)


def post_or_disconnected(server, data: bytes) -> tuple[int | str, dict]:
    """post(), with a connection the server closed without an answer as ("disconnected", {})."""
    try:
        return post(server, data)
    except (ConnectionError, urllib.error.URLError) as exc:
        return "disconnected", {"error": repr(exc)}


TRITON_CRASHED, TRITON_UP = "tritonserver ended by itself", ") is up"  # the supervisor's log lines
TRITON_ABORTED = "boost::interprocess::lock_exception"  # what tritonserver prints as it aborts


def logged_since(server, offset: int, line: str) -> bool:
    return line.encode() in server.log_path.read_bytes()[offset:]


@pytest.mark.parametrize("when", ["mid-generation", "between requests"])
def test_a_killed_engine_process_fails_its_requests_clearly_and_the_server_comes_back(server, when):
    """Two endings, both Triton's own: usually the predict model's watchdog answers the forwards
    503 and the supervisor restarts tritonserver; when the stub dies holding a shared-memory mutex,
    tritonserver itself aborts (boost lock_exception, server/supervisor.py) and its connections
    close unanswered: the REST front end then answers 503. Either way every request ends at once,
    and the server comes back."""
    wait_for(lambda: ready(server) and idle(server), timeout=120)
    first_pid = tritonserver_pid(server)
    results = {}
    threads = []
    if when == "mid-generation":
        threads = [start(lambda i: results.__setitem__(i, (post_or_disconnected(server, body(f"doomed {i}")),
                                                           time.monotonic())), i)
                   for i in range(2)]
        wait_for(lambda: in_flight(server) == 1)
    log_before = len(server.log_path.read_bytes())
    kill_engine_stub(server)
    killed = time.monotonic()
    wait_for(lambda: unready(server), timeout=5)  # KServe stops routing here
    for t in threads:
        t.join(60)
    assert len(results) == len(threads)
    for (code, reply), answered in results.values():
        # REST clients always get an answer: the predict model's, or the front end's when
        # tritonserver itself went down (the connection to it closed unanswered).
        assert code == 503, reply
        if "engine process of cube3d_stream version 1 is gone" not in reply["error"]:
            assert reply["error"].startswith("unavailable: tritonserver is not answering"), reply
            # the supervisor saw it end, or it printed its abort while the supervisor, seeing the
            # dead stub first, stopped it
            wait_for(lambda: logged_since(server, log_before, TRITON_CRASHED)
                     or logged_since(server, log_before, TRITON_ABORTED), timeout=10)
        assert answered - killed < 10  # at once, not when some timeout ends
    wait_for(lambda: ready(server), timeout=120)  # the supervisor started tritonserver again
    assert tritonserver_pid(server) != first_pid
    code, reply = post(server, body("alive again"))
    assert code == 200, reply


def test_a_request_to_a_dead_stub_is_answered_unavailable_which_clients_retry(repo, tmp_path):
    """Triton answers a request for a model whose stub died with an INTERNAL error ("Stub process
    ... is not healthy"); the server is about to restart it (the supervisor, or the kubelet), so
    the front ends answer 503 / UNAVAILABLE "unavailable: ...", which the project's client retries.
    Here nothing restarts it (--on-fault none), so every request meets the dead stub."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    with LocalTriton(repo, free_port(), free_port(), free_port(), log_path=tmp_path / "tritonserver.log") as server:
        stubs = {model: pid for pid, (model, _) in python_stubs(tritonserver_pid(server)).items()}
        os.kill(stubs["cube3d"], signal.SIGKILL)
        os.kill(stubs["cube3d_stream"], signal.SIGKILL)
        wait_for(lambda: not set(python_stubs(tritonserver_pid(server))) & set(stubs.values()))

        code, reply = post(server, body("a dead predict model"))
        assert code == 503 and reply["error"].startswith("unavailable: the process of model instance 'cube3d_0_0' "
                                                         "died"), (code, reply)
        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            with pytest.raises(InferenceServerException) as err:
                client.infer("cube3d", grpc_inputs("a dead predict model"))
            assert err.value.status() == "StatusCode.UNAVAILABLE" and "'cube3d_0_0' died" in err.value.message()
            # the stream's errors come as responses, not a status: their message says it
            answers = []
            client.start_stream(callback=lambda result, error: answers.append(error))
            client.async_stream_infer("cube3d_stream", grpc_inputs("a dead engine", stream=True))
            wait_for(lambda: answers, timeout=30)
            client.stop_stream()
        finally:
            client.close()
        assert answers[0] is not None and answers[0].message().startswith(
            "unavailable: the process of model instance 'cube3d_stream_0_0' died"), answers
        # what the project's client does with it: retries, then gives up with the server's words
        with Cube3DClient(server.http_url, retries=1, backoff=0.1) as project_client:
            with pytest.raises(Exception, match="unavailable: the process of model instance"):
                project_client.generate("retried", resolution=4)
        server.kill()  # a stop would wait for the dead stubs' timeouts (tens of seconds), for nothing


@pytest.mark.parametrize("stuck", ["in Python", "past the interpreter"])
def test_an_engine_process_stuck_on_its_way_out_ends(stuck):
    """What the engine's finalize arms: a stub whose exit waits forever (here on a thread that
    never ends, which the interpreter joins at exit) would keep an unloaded version's memory. In
    Python, faulthandler writes the stacks and ends it; where faulthandler no longer runs (its
    timer cancelled here, as the interpreter's teardown cancels it), SIGALRM ends it later."""
    code = ("import faulthandler, threading, time\n"
            "from cubeserve.serving.stubs import end_this_process_after\n"
            "threading.Thread(target=time.sleep, args=(3600,), name='never-ends').start()\n"
            "end_this_process_after(1.0)\n")
    if stuck == "past the interpreter":
        code += "faulthandler.cancel_dump_traceback_later()\n"
    started = time.monotonic()
    ended = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert time.monotonic() - started < 30
    if stuck == "in Python":
        assert ended.returncode == 1, ended
        assert "Timeout (0:00:01)!" in ended.stderr and "threading.py" in ended.stderr, ended.stderr
    else:
        assert ended.returncode == -signal.SIGALRM, ended


@pytest.mark.parametrize("on_fault", ["restart", "exit"])
def test_a_crashed_tritonserver_is_started_again_or_the_container_exits(repo, tmp_path, on_fault):
    """tritonserver aborting by itself after it started (as it does when a stub dies holding a
    shared-memory mutex) is a fault like a dead stub: restarted locally, an exit in a container.
    The crashed server's shared memory (which Triton removes only in its own shutdown) does not
    stay behind in /dev/shm."""
    from cubeserve.serving.stubs import python_stubs, shm_regions
    from cubeserve.server.supervisor import FAULT_EXIT_CODE

    triton = LocalTriton(repo, free_port(), free_port(), free_port(), log_path=tmp_path / "log", supervised=True,
                         fault_grace=2, on_fault=on_fault)
    with triton:
        first = tritonserver_pid(triton)
        wait_for(lambda: logged_since(triton, 0, TRITON_UP), timeout=10)  # before: a failed start, not restarted
        regions = shm_regions(python_stubs(first))
        assert len(regions) == 2 and all(Path("/dev/shm", r).exists() for r in regions)
        time.sleep(2)  # the supervisor has seen the stubs
        os.kill(first, signal.SIGABRT)
        if on_fault == "exit":
            assert triton.process.wait(60) == FAULT_EXIT_CODE
            assert not [r for r in regions if Path("/dev/shm", r).exists()]
            return
        wait_for(lambda: ready(triton) and tritonserver_pid(triton) != first, timeout=120)
        assert "signal 6" in triton.log_path.read_text(errors="replace")
        assert not [r for r in regions if Path("/dev/shm", r).exists()]
        code, reply = post(triton, body("after the crash"))
        assert code == 200, reply


def test_the_shared_memory_of_a_killed_server_is_removed_by_the_next_start(repo, tmp_path):
    """kill -9 of every process of a server at once (a container killed whole: its grace period
    over, an out-of-memory kill of the group): nothing runs to remove the python backend's
    regions, which in a pod stay in its memory-backed /dev/shm across container restarts and
    count against its memory. The next start removes those that no process maps."""
    from cubeserve.serving.stubs import python_stubs, shm_regions

    with LocalTriton(repo, free_port(), free_port(), free_port(), log_path=tmp_path / "first.log",
                     supervised=True) as first:
        tree = process_tree(first.process.pid)
        regions = [Path("/dev/shm", r) for r in shm_regions(python_stubs(tritonserver_pid(first)))]
        assert len(regions) == 2
        first.kill()
        wait_for(lambda: all(_gone(pid) for pid in tree), timeout=60)
    left = [r for r in regions if r.exists()]
    assert left, "the killed server's regions were removed by something else: this test shows nothing"
    for region in left:  # as if the restart came a while later (regions younger than 60 s are kept)
        os.utime(region, (time.time() - 120, time.time() - 120))
    with LocalTriton(repo, free_port(), free_port(), free_port(), log_path=tmp_path / "second.log",
                     supervised=True) as second:
        assert not [r for r in left if r.exists()]
        # The same clean-up runs at every server's start, so a server of a parallel test worker
        # starting in between may have removed some or all of them (aged above, they are fair
        # game), and this one may remove others' too: what this log says must then be true of
        # itself: its count is the names it lists, and each of those is gone.
        # Broken clean-up fails the line above.
        said = re.search(r"removed (\d+) python backend shared-memory regions .*?: (.*)$",
                         second.log_path.read_text(), re.MULTILINE)
        if said:
            names = said.group(2).split(", ")
            assert int(said.group(1)) == len(names)
            assert not [n for n in names if Path("/dev/shm", n).exists()]
        assert all(r.exists() for r in map(Path, [f"/dev/shm/{n}" for n in shm_regions(
            python_stubs(tritonserver_pid(second)))]))  # its own are kept


def test_a_tritonserver_that_never_starts_is_not_started_again(tmp_path):
    """A start that fails before the endpoint answers (here: no model repository) fails the same
    way every time: the supervisor passes tritonserver's exit code on instead of looping."""
    import subprocess

    from cubeserve.server.local_triton import prepare_python_backend, tritonserver_home

    prepare_python_backend(tritonserver_home())
    triton = LocalTriton(tmp_path / "no-such-repository", free_port(), free_port(), free_port(), supervised=True)
    supervisor = subprocess.run(triton.command(), env=triton.environment(), capture_output=True, text=True,
                                timeout=120)
    assert supervisor.returncode not in (0, None), supervisor.stderr[-2000:]
    assert "starting tritonserver again" not in supervisor.stderr


def test_in_a_container_the_supervisor_exits_for_the_kubelet_to_restart(repo, tmp_path):
    """k8s/ runs `--on-fault exit` (cubeserve.deploy.server_command), with Triton's default model
    control: a dead stub stops the server and the container's process exits with
    FAULT_EXIT_CODE, so the kubelet restarts the container (restartPolicy Always)."""
    from cubeserve import deploy
    from cubeserve.server.supervisor import FAULT_EXIT_CODE

    assert deploy.server_command()[:len(deploy.SUPERVISOR)] == deploy.SUPERVISOR
    assert deploy.SUPERVISOR[:5] == [deploy.SUPERVISOR[0], "-m", "cubeserve.server.supervisor", "--on-fault", "exit"]
    triton = LocalTriton(repo, free_port(), free_port(), free_port(), log_path=tmp_path / "log", supervised=True,
                         fault_grace=2, on_fault="exit")
    with triton:
        kill_engine_stub(triton)
        wait_for(lambda: unready(triton), timeout=5)
        assert triton.process.wait(60) == FAULT_EXIT_CODE


def _gone(pid: int) -> bool:
    """Ended: no such process, or a zombie (its parent gone, nobody in this sandbox may reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_a_child_started_by_a_worker_thread_outlives_that_thread():
    """The parent-death signal follows the thread that forked: a server started from a worker
    thread (a fixture's pool, a Ray actor) would get SIGTERM when that thread ends, so there
    cubeserve/lifetime.py does not set it."""
    from cubeserve.lifetime import ends_with_this_process

    started = []
    worker = threading.Thread(target=lambda: started.append(
        subprocess.Popen(["sleep", "60"], preexec_fn=ends_with_this_process())))
    worker.start()
    worker.join()
    [child] = started
    try:
        time.sleep(0.5)
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_cubeserve_serve_runs_supervised_and_a_stop_ends_every_process(repo, tmp_path, stop):
    """`cubeserve serve` (`make serve`): tritonserver under the supervisor. SIGTERM to the command
    (a process manager, `kill`) passes down the tree; SIGKILL (no cleanup runs) reaches it too, by
    the parent-death signal (cubeserve/lifetime.py). No process is left behind, the port is free,
    and nothing on disk: neither the admin key's file nor the python backend's shared memory."""
    http = free_port()
    command = [str(Path(sys.executable).parent / "cubeserve"), "serve", "--model-repository", str(repo),
               "--http-port", str(http), "--grpc-port", str(free_port()), "--metrics-port", str(free_port())]
    serve = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = wait_for(lambda: (lambda out: out if out.startswith("tritonserver (") else None)(serve.stdout.readline()),
                        timeout=120)
        assert "supervisor pid" in line and "ready" in line
        tree = process_tree(serve.pid)
        names = [open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[:3] for pid in tree]
        assert any(b"cubeserve.server.supervisor" in n for args in names for n in args)
        assert any(args[0].endswith(b"tritonserver") for args in names)
        key_file = Path(re.search(r"with the key in (\S+);", line).group(1))
        assert key_file.stat().st_mode & 0o777 == 0o600 and len(key_file.read_text().strip()) >= 32
        # The stubs' shared-memory regions (their command lines name them).
        regions = {Path("/dev/shm") / arg.decode() for pid in tree for arg in Path(f"/proc/{pid}/cmdline").read_bytes()
                   .split(b"\0") if arg.startswith(b"triton_python_backend_shm_region")}
        assert regions and all(r.exists() for r in regions)
        serve.send_signal(stop)
        assert serve.wait(90) == (0 if stop == signal.SIGTERM else -signal.SIGKILL)
        wait_for(lambda: all(_gone(pid) for pid in tree), timeout=60)
        assert not key_file.exists()
        assert not [r for r in regions if r.exists()]
        with socket.socket() as s:  # nothing listens on the REST port
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", http))
    finally:
        if serve.poll() is None:
            serve.terminate()
            serve.wait(90)
