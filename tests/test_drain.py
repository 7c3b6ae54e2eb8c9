"""Stopping a pod without cutting generations, on the real tritonserver: the preStop hook of
k8s/components/raw-deployment (cubeserve.deploy.PRESTOP_COMMAND, serving/drain.py), then the
kubelet's SIGTERM to the container's process, cubeserve's supervisor (deploy.server_command).

Generations in flight when the drain starts (predict API over REST, the progress stream over
gRPC) must end with their meshes; requests sent after it started must be refused at once and
cleanly (HTTP 503 on new and on kept-alive connections, gRPC UNAVAILABLE), not taken, hung or
reset; and the server must exit promptly. The same checks run on a plain SIGTERM, as before the
fix, and find what goes wrong there (`PROBLEMS`): with an exit timeout shorter than the
generations (Triton's default is 30 s, generations may take the request timeout, 600 s) the
generations are cut; with a long one, Triton's own shutdown takes new work on gRPC connections.
(REST goes through the supervisor's front end, which answers 503 once tritonserver takes no new
connections: Triton's own resets and its new work on kept-alive connections no longer reach a
REST client.)

None of this depends on how fast the machine generates: the test holds the generations in flight
itself (`EngineHold`: the engine's process stopped, SIGSTOP, until the test lets it go on), so
they are in flight when the stop starts and, with the 2 s exit timeout, still unfinished when it
expires, however few seconds 2048 tokens take here; with the long one, an idle connection to
tritonserver's own port keeps its shutdown in the step that takes new gRPC work until the test
has sent its new requests, however soon the generations end.
"""

from __future__ import annotations

import dataclasses
import http.client
import io
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import trimesh

from cube3d_client import Cube3DClient
from cubeserve import deploy
from cubeserve.checkpoint import write_random_weights
from cubeserve.config import TINY
from cubeserve.serving.drain import IN_PROGRESS_METRIC, in_progress
from cubeserve.server.local_triton import LocalTriton, copy_model_repository, free_port
from cubeserve.serving.stubs import process_tree, python_stubs
from cubeserve.server.supervisor import DRAINED_GRACE_S
from serving_helpers import metrics, wait_until

# 2048 shape tokens on the tiny model (seconds on two cores): long enough for the test to find
# the three generations in flight together (then it holds them there, EngineHold), short enough
# to finish soon once let go.
LONG = dataclasses.replace(TINY, name="tiny-long",
                           tokenizer=dataclasses.replace(TINY.tokenizer, num_encoder_latents=2048))
IN_FLIGHT_HTTP, IN_FLIGHT_STREAM = 2, 1
# The supervisor's --drained-grace: a pod's (10 s) where a drained server must exit by itself
# (Triton's own shutdown of a drained, idle server takes about 2 s: it looks at its models once a
# second), a short one where the test waits for the supervisor's kill.
POD_DRAINED_GRACE = DRAINED_GRACE_S
DRAINED_GRACE = 2.0

# What each way of stopping gets wrong (the fix: nothing). A plain SIGTERM is Triton 2.51's own
# shutdown (serving/drain.py): requests on gRPC are still taken, and whatever runs when the exit
# timeout ends is cut; over REST the front end refuses new requests cleanly once tritonserver
# closes new connections. (problems it must show, problems it may show): with a 2 s exit
# timeout, whether a new request is still taken depends on how far the shutdown got on a loaded
# machine; the generations it cuts do not (the test holds them past it).
PROBLEMS = {
    "prestop-drain": (set(), set()),
    "sigterm-exit-timeout-2s": ({"in-flight cut"}, {"new work taken"}),
    "sigterm-exit-timeout-600s": ({"new work taken"}, set()),
}


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = copy_model_repository(tmp_path_factory.mktemp("model_repository"),
                                 {"max_objects": str(IN_FLIGHT_HTTP + IN_FLIGHT_STREAM), "max_queue": "4"})
    write_random_weights(LONG, root / "cube3d_stream" / "1" / "weights", seed=1)
    return root


# A request sent once the server is told to stop carries this deadline (the v2 `timeout`
# parameter, which the engine enforces): one that is taken ends after it with a 503 "deadline
# exceeded" instead of generating to the end and holding the server's shutdown.
NEW_REQUEST_DEADLINE_US = 3_000_000
ANSWER_WAIT_S = 15  # how long the test waits for any answer to a new request
SHUTTING_DOWN = "the server is shutting down"
IDLE_KILL = "still waits for clients' idle connections"  # the supervisor's line when it kills (supervisor.py)


class EngineHold:
    """The engine's process (the cube3d_stream stub, which runs every generation) stopped by the
    test with SIGSTOP, and let go with SIGCONT: while it is stopped no generation takes a step,
    sends a mesh or ends, so "in flight when the stop starts" and "longer than the exit timeout"
    hold by construction, whatever the machine's speed. The supervisor and the predict model
    take a stopped stub for a live one (they look for dead ones, serving/stubs.py); Triton's
    python backend does too until it hands the stub a request: one that does not take it within
    about a second is "not healthy", and killed. So the engine is held only while no new request
    is on its way to it."""

    def __init__(self, server):
        pids = [pid for pid, (model, _) in python_stubs(server.tritonserver_pid()).items()
                if model == deploy.STREAM_MODEL]
        assert len(pids) == 1, pids
        self.pid, self.held = pids[0], False

    def _stopped(self) -> bool:
        """Every thread of the engine's process has stopped (SIGSTOP takes effect asynchronously)."""
        try:
            states = [(task / "stat").read_text().rsplit(")", 1)[1].split()[0]
                      for task in Path(f"/proc/{self.pid}/task").iterdir()]
        except (OSError, IndexError):
            return False
        return all(state in ("T", "t") for state in states)

    def stop(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)
        self.held = True
        wait_until(self._stopped, 10, "the engine's process stopped")

    def stop_when(self, condition, timeout: float, what: str) -> None:
        """Stop the engine at a moment `condition` holds, as seen while it is stopped (so what it
        saw is what stays): look with the engine stopped, let it go on while it does not hold."""
        deadline = time.monotonic() + timeout
        while True:
            self.stop()
            if condition():
                return
            self.release()
            assert time.monotonic() < deadline, f"{what}: not within {timeout:g} s"
            time.sleep(0.05)

    def release(self) -> None:
        if self.held:
            self.held = False
            try:
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:  # killed meanwhile (the 2 s exit timeout's case)
                pass


def requests_in_progress(server, model: str) -> float:
    """The requests model `model` has accepted and not answered (its cube3d_requests_in_progress)."""
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    return sum(float(value) for labels, value in re.findall(rf"^{IN_PROGRESS_METRIC}\{{(.*)\}} ([0-9.e+-]+)$", text, re.M)
               if f'model="{model}"' in labels)


def triton_stopping(server) -> bool:
    """tritonserver has begun its own shutdown: its HTTP endpoint takes no new connections and
    waits for those open (Triton logs the count every second from then on)."""
    return b"HTTP service connections" in server.log_path.read_bytes()


def infer_body(prompt: str) -> bytes:
    return json.dumps({"inputs": [{"name": "PROMPT", "shape": [1], "datatype": "BYTES", "data": [prompt]},
                                  {"name": "RESOLUTION", "shape": [1], "datatype": "INT32", "data": [4]}],
                       "outputs": [{"name": "NUM_FACES"}],
                       "parameters": {"timeout": NEW_REQUEST_DEADLINE_US}}).encode()


def new_request(outcomes: dict, name: str, send) -> threading.Thread:
    """Run `send` (one request) in a thread; its outcome: "refused" (503 / UNAVAILABLE saying the
    server is shutting down), "taken" (answered, or ended by its own deadline, or no answer) or
    "reset" (the connection failed)."""
    def run():
        start = time.monotonic()
        try:
            outcomes[name] = (send(), time.monotonic() - start)
        except (ConnectionError, http.client.HTTPException, OSError) as exc:
            outcomes[name] = (("reset", repr(exc)), time.monotonic() - start)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def http_outcome(conn: http.client.HTTPConnection, prompt: str):
    conn.timeout = ANSWER_WAIT_S
    if conn.sock is not None:  # kept alive
        conn.sock.settimeout(ANSWER_WAIT_S)
    try:
        conn.request("POST", "/v2/models/cube3d/infer", body=infer_body(prompt))
        reply = conn.getresponse()
        text = reply.read().decode()
    except TimeoutError:
        return "taken", f"no answer within {ANSWER_WAIT_S} s"
    finally:
        conn.close()
    if reply.status == 503 and json.loads(text)["error"].startswith(f"unavailable: {SHUTTING_DOWN}"):
        return "refused", text
    return "taken", f"HTTP {reply.status}: {text[:200]}"  # 200, or 503 at its deadline


def grpc_outcome(server, stream: bool):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    prompt = grpcclient.InferInput("PROMPT", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([b"after the drain"], dtype=np.object_))
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        if not stream:
            client.infer("cube3d", [prompt], client_timeout=ANSWER_WAIT_S, timeout=NEW_REQUEST_DEADLINE_US)
            return "taken", "answered"
        answers = []
        client.start_stream(callback=lambda result, error: answers.append(error))
        client.async_stream_infer("cube3d_stream", [prompt], timeout=NEW_REQUEST_DEADLINE_US)
        deadline = time.monotonic() + ANSWER_WAIT_S
        while not answers and time.monotonic() < deadline:
            time.sleep(0.05)
        first = list(answers)
        client.stop_stream(cancel_requests=True)
        if not first:
            return "taken", f"no answer within {ANSWER_WAIT_S} s"
        error = first[0]
        if error is None or "deadline exceeded" in error.message():
            return "taken", "answered" if error is None else error.message()
        return ("refused" if SHUTTING_DOWN in error.message() else "reset"), error.message()
    except InferenceServerException as exc:
        if exc.status() == "StatusCode.UNAVAILABLE" and SHUTTING_DOWN in exc.message():
            return "refused", exc.message()
        if exc.status() == "StatusCode.DEADLINE_EXCEEDED" or "deadline exceeded" in exc.message():
            return "taken", exc.message()
        return "reset", f"{exc.status()}: {exc.message()}"
    finally:
        client.close()


@pytest.mark.parametrize("how", list(PROBLEMS))
def test_stopping_the_server_finishes_generations_in_flight_and_refuses_new_ones(repo, tmp_path, how):
    exit_timeout = {"sigterm-exit-timeout-2s": ["--exit-timeout-secs=2"]}.get(how, [])
    assert f"--exit-timeout-secs={deploy.EXIT_TIMEOUT_S}" in deploy.COMMON_FLAGS  # the rest run as in a pod
    server = LocalTriton(repo, free_port(), free_port(), free_port(), log_path=tmp_path / "tritonserver.log",
                         supervised=True, on_fault="exit", drained_grace=POD_DRAINED_GRACE,
                         extra_args=tuple(exit_timeout))
    server.start()
    problems: set[str] = set()
    hold = idle = None
    try:
        tree = process_tree(server.process.pid)
        hold = EngineHold(server)
        # A client that keeps its connection open (an ingress controller's pool does): opened now.
        kept_alive = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=10)
        kept_alive.request("GET", deploy.READY_PATH)
        assert kept_alive.getresponse().read() == b""

        results, errors = {}, {}

        def generate(i: int, protocol: str):
            url = server.http_url if protocol == "http" else server.grpc_url
            try:
                # The request timeout of a pod: on a busy machine a generation may take minutes.
                with Cube3DClient(url, protocol, retries=0, timeout=deploy.REQUEST_TIMEOUT_S) as client:
                    results[i] = client.generate(f"in flight {i}", seed=i, resolution=4,
                                                 on_progress=(lambda n: None) if protocol == "grpc" else None)
            except Exception as exc:  # noqa: BLE001 - a cut generation: recorded, judged below
                errors[i] = repr(exc)

        protocols = ["http"] * IN_FLIGHT_HTTP + ["grpc"] * IN_FLIGHT_STREAM
        flights = [threading.Thread(target=generate, args=(i, p), daemon=True) for i, p in enumerate(protocols)]
        for t in flights:
            t.start()
        # All of them in flight, and held there until the test lets them go on.
        hold.stop_when(lambda: metrics(server).get("cube3d_objects_in_flight/v1", 0) == len(protocols), 60,
                       "the generations did not start")

        # -- the pod is deleted: the preStop hook, or (before the fix) SIGTERM at once --------------
        stop_started = time.monotonic()
        if how == "prestop-drain":
            hook = [sys.executable, *deploy.drain_command(server.triton_http_port, server.metrics_port)[1:]]
            assert hook[1:] == [*deploy.PRESTOP_COMMAND[1:3],
                                *(a.replace(str(deploy.TRITON_HTTP_PORT), str(server.triton_http_port))
                                   .replace(str(deploy.METRICS_PORT), str(server.metrics_port))
                                  for a in deploy.PRESTOP_COMMAND[3:])]
            drain = subprocess.Popen(hook, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            ready, _, _ = select.select([drain.stdout], [], [], 60)  # bounded: the hook's first line
            assert ready, "the preStop hook printed nothing within 60 s"
            assert "refuses new requests" in drain.stdout.readline()  # the marker is written
        else:
            if how == "sigterm-exit-timeout-600s":
                # Triton's first step of a shutdown waits for every open HTTP connection: this one
                # stands for a generation over REST that is still running, however fast the
                # generations here end, until the test has sent its new requests.
                idle = http.client.HTTPConnection("127.0.0.1", server.triton_http_port, timeout=10)
                idle.request("GET", deploy.READY_PATH)
                assert idle.getresponse().read() == b""
            server.process.send_signal(signal.SIGTERM)
            # Triton has begun its shutdown: its HTTP endpoint takes no new connection, and waits
            # for those open (the held generations' at least).
            wait_until(lambda: triton_stopping(server), 30, "tritonserver's shutdown began")
        assert metrics(server)["cube3d_objects_in_flight/v1"] == len(protocols), "not in flight any more"
        # The new requests must find the engine running (EngineHold: Triton's python backend kills
        # a stub that does not take the request it hands it).
        hold.release()
        engine_requests = requests_in_progress(server, deploy.STREAM_MODEL)

        outcomes: dict = {}
        asking = [new_request(outcomes, "http new connection",
                              lambda: http_outcome(http.client.HTTPConnection("127.0.0.1", server.http_port),
                                                   "new connection")),
                  new_request(outcomes, "http kept-alive connection", lambda: http_outcome(kept_alive, "kept alive")),
                  new_request(outcomes, "grpc", lambda: grpc_outcome(server, stream=False)),
                  new_request(outcomes, "grpc stream", lambda: grpc_outcome(server, stream=True))]
        if how == "sigterm-exit-timeout-2s":
            # Held again once the engine has the two gRPC requests (Triton takes them before its
            # exit timeout ends), and from then on past that end: the exit timeout cuts the
            # generations, whatever the machine's speed. Between the two holds they ran only for
            # as long as two requests take to arrive: still in flight, as checked (held).
            wait_until(lambda: requests_in_progress(server, deploy.STREAM_MODEL) >= engine_requests + 2
                       or len(outcomes) == len(asking), 30, "the new gRPC requests reached the engine")
            hold.stop()
            assert metrics(server)["cube3d_objects_in_flight/v1"] == len(protocols), \
                "the generations ended before the test held them again"
        for t in asking:
            t.join(30)
        for name, ((outcome, detail), seconds) in outcomes.items():
            if outcome == "refused":  # at once, not at the end of some timeout
                assert seconds < NEW_REQUEST_DEADLINE_US / 1e6, f"{name}: refused, but only after {seconds:.1f} s"
            elif outcome == "reset":
                problems.add("new connection reset")
            else:
                problems.add("new work taken")
        assert len(outcomes) == 4, outcomes
        if how == "sigterm-exit-timeout-600s":
            idle.close()  # Triton's shutdown goes on

        log = server.log_path
        wait_until(lambda: not any(t.is_alive() for t in flights) or b"Exit timeout expired" in log.read_bytes(),
                   deploy.REQUEST_TIMEOUT_S, "the generations neither ended nor were cut", poll=0.1)
        if any(t.is_alive() for t in flights):
            # Triton gave up on them and exits (slowly: 2.51 then aborts in its exit path and
            # prints a stack trace); its stubs, which hold the clients' sockets, go with it.
            for pid in tree[1:]:
                if os.path.exists(f"/proc/{pid}"):
                    os.kill(pid, signal.SIGKILL)
        for t in flights:
            t.join(30)
        assert not any(t.is_alive() for t in flights), "a client still waits on a generation"
        for i, result in results.items():  # each mesh arrived whole
            mesh = trimesh.load(io.BytesIO(result.mesh), file_type="glb", force="mesh")
            assert len(mesh.faces) == result.num_faces > 0 and len(mesh.vertices) == result.num_vertices, i
            assert len(result.tokens) == LONG.num_tokens
        if errors or len(results) != len(protocols):
            problems.add("in-flight cut")

        if how == "prestop-drain":
            assert drain.wait(deploy.DRAIN_TIMEOUT_S) == 0, drain.stdout.read()
            assert "drained" in drain.stdout.read()
            assert in_progress(server.metrics_url) == 0 and len(results) == len(protocols)
            server.process.send_signal(signal.SIGTERM)  # the kubelet's, once the hook has returned
            killed_at = time.monotonic()
            assert server.process.wait(POD_DRAINED_GRACE + 30) == 0
            # Drained and idle: out within seconds, long before the exit timeout; by itself (the
            # kept-alive connection ends at the front end, so Triton's HTTP endpoint has none
            # open), not by the supervisor's kill (the next test).
            assert time.monotonic() - killed_at < POD_DRAINED_GRACE + 30
            assert IDLE_KILL.encode() not in server.log_path.read_bytes()
        else:
            kept_alive.close()
            server.process.wait(deploy.EXIT_TIMEOUT_S)
        assert time.monotonic() - stop_started < deploy.EXIT_TIMEOUT_S
        wait_until(lambda: not [pid for pid in tree if os.path.exists(f"/proc/{pid}")], 30, "processes left behind",
                   poll=0.1)
    finally:
        if hold is not None:
            hold.release()
        if idle is not None:
            idle.close()
        server.stop(timeout=30)
    must, may = PROBLEMS[how]
    assert must <= problems <= must | may, (how, problems, outcomes, errors)


def test_a_drained_server_held_by_an_idle_connection_is_stopped_after_the_grace(repo, tmp_path):
    """The supervisor's --drained-grace: tritonserver's HTTP endpoint waits for every open
    connection before it exits (up to the exit timeout, 600 s). A client of its own loopback port
    that keeps an idle connection open through the SIGTERM (the front end never does) would hold a
    drained pod that long: the supervisor kills the drained, idle server after the grace."""
    server = LocalTriton(repo, free_port(), free_port(), free_port(), log_path=tmp_path / "tritonserver.log",
                         supervised=True, on_fault="exit", drained_grace=DRAINED_GRACE)
    server.start()
    try:
        idle = http.client.HTTPConnection("127.0.0.1", server.triton_http_port, timeout=10)
        idle.request("GET", deploy.READY_PATH)
        assert idle.getresponse().read() == b""  # answered; the connection stays open, idle
        hook = [sys.executable, *deploy.drain_command(server.triton_http_port, server.metrics_port, settle=0.5,
                                                          scrape_interval=0)[1:]]
        assert subprocess.run(hook, capture_output=True, text=True, timeout=120).returncode == 0
        server.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        assert server.process.wait(DRAINED_GRACE + 30) == 0
        assert time.monotonic() - signalled < DRAINED_GRACE + 30 < deploy.EXIT_TIMEOUT_S
        assert IDLE_KILL.encode() in server.log_path.read_bytes(), "it exited, but not by the supervisor's kill"
        idle.close()
    finally:
        server.stop(timeout=30)



# -- the settle time: the drain's own loop, on a clock of the test's --------------------------------

class _Clock:
    """time as cubeserve.serving.drain uses it, advanced only by its sleeps."""

    def __init__(self):
        self.elapsed = 0.0

    def monotonic(self) -> float:
        return 1000.0 + self.elapsed

    def time(self) -> float:
        return 1.7e9 + self.elapsed

    def sleep(self, seconds: float) -> None:
        self.elapsed += seconds


def _drain_with_nothing_in_flight(monkeypatch, tmp_path, run, requests_at=()) -> tuple[int, list[float], _Clock]:
    """`run()` (a drain) against a server with no request in progress from the first look, whose
    counters show one more request at each look at or past each time in `requests_at` (a request
    refused or answered then): (its exit status, the clock at each look at the metrics, the clock)."""
    from cubeserve.serving import drain as drain_module

    clock, looks = _Clock(), []

    def metrics_text(url):
        looks.append(clock.elapsed)
        answered = sum(1 for t in requests_at if clock.elapsed >= t)
        return (f'{IN_PROGRESS_METRIC}{{model="cube3d",version="1"}} 0\n'
                f'cube3d_tenant_requests_total{{model="cube3d",tenant="team-a",outcome="ok"}} {answered}\n')

    monkeypatch.setattr(drain_module, "time", clock)
    monkeypatch.setattr(drain_module, "find_tritonserver", lambda port: 4242)
    monkeypatch.setattr(drain_module, "marker_path", lambda pid: tmp_path / f"marker-{pid}")
    monkeypatch.setattr(drain_module, "_metrics", metrics_text)
    status = run(drain_module)
    assert (tmp_path / "marker-4242").exists()  # new requests were refused from the start
    return status, looks, clock


def test_a_drain_with_nothing_in_flight_still_waits_the_settle_time(monkeypatch, tmp_path):
    """While the endpoints drop the pod (the settle time) new connections must still get a clean
    503 from a live server: the drain returns no sooner, though nothing was in flight, and at its
    first look past the settle time (no later)."""
    out = io.StringIO()
    status, looks, clock = _drain_with_nothing_in_flight(
        monkeypatch, tmp_path, lambda d: d.drain(8010, 8002, timeout=60, settle=2.0, poll=0.5, out=out))
    assert status == 0 and looks == [0.0, 0.5, 1.0, 1.5, 2.0] and clock.elapsed == 2.0
    assert "drained in 2.0 s" in out.getvalue()
    # The command line's --settle (without a Prometheus to wait for).
    status, looks, clock = _drain_with_nothing_in_flight(
        monkeypatch, tmp_path, lambda d: d.main(["--settle", "1", "--scrape-interval", "0"]))
    assert status == 0 and looks[-1] == clock.elapsed == 1.0


def test_a_drain_returns_only_after_a_scrape_of_the_last_counts(monkeypatch, tmp_path):
    """Prometheus scrapes every --scrape-interval: the drain returns that long (plus the margin)
    after the look that saw the counters' last change, and no sooner after its first look (a
    request answered just before the drain began is not scraped yet either), so that a scrape has
    the pod's final counts (tests/test_usage.py: the pod's last requests are billed)."""
    margin = deploy.DRAIN_SCRAPE_MARGIN_S
    # Nothing changes: one interval from the first look, past the settle time.
    status, looks, clock = _drain_with_nothing_in_flight(
        monkeypatch, tmp_path, lambda d: d.main(["--settle", "1", "--scrape-interval", "4"]))
    assert status == 0 and clock.elapsed == 4 + margin
    # Requests refused at 3 s and 7.2 s (seen at the look at 7.5 s): 7.5 + 4 + margin.
    status, looks, clock = _drain_with_nothing_in_flight(
        monkeypatch, tmp_path, lambda d: d.main(["--settle", "1", "--scrape-interval", "4"]), requests_at=(3, 7.2))
    assert status == 0 and clock.elapsed == 7.5 + 4 + margin
    # The preStop hook's defaults: the settle time, then the scrape interval of k8s/monitoring.
    status, looks, clock = _drain_with_nothing_in_flight(monkeypatch, tmp_path, lambda d: d.main([]))
    assert status == 0 and looks[-1] == clock.elapsed == max(deploy.DRAIN_SETTLE_S,
                                                            deploy.SCRAPE_INTERVAL_S + margin)
    assert deploy.PRESTOP_MAX_S >= deploy.DRAIN_TIMEOUT_S + deploy.SCRAPE_INTERVAL_S + margin
    # Bad input names the flag.
    with pytest.raises(SystemExit):
        _drain_with_nothing_in_flight(monkeypatch, tmp_path, lambda d: d.main(["--scrape-interval", "-1"]))
