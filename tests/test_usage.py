"""`cubeserve usage` stays exact when a server goes away: real servers (the demo model) metering
two tenants, a real Prometheus scraping them, and `cubeserve usage` compared with what the
clients received (requests by outcome, objects and shape tokens, per tenant and model).

Three ways a server goes away, each of which `cubeserve usage` once came back short from:
* killed (kill -9: a crash, an abrupt scale-down) after its series' first and only sample, the
  server having answered before Prometheus discovered it (a new pod serves as soon as it is
  ready; discovery and the first scrape come seconds later);
* drained (the preStop hook) and stopped after requests in its last scrape interval;
* a rollout: the old server drained and stopped, the new one serving before it is discovered.

The rollout's test (two servers) is marked `scale`: `make scale-test` runs it, `make test` the
other two.

The clients send the tenant and model headers the gateway sets (tests/test_gateway.py holds the
gateway to setting them); the servers count by those.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from cube3d_client import Cube3DClient
from cubeserve import deploy
from cubeserve.serving import metrics as names
from cubeserve.serving.experiment import MODEL_KEY, TENANT_KEY
from cubeserve.server.local_triton import (DEMO_MODEL, LocalTriton, copy_model_repository, ensure_demo_weights,
                                            free_port)
from prometheus_server import PrometheusServer
from serving_helpers import wait_until

TENANTS = ("team-a", "team-b")
MODEL = "cube3d"  # the gateway's name of the model (the `model` column)
# Prometheus's scrape interval: long enough that a kill right after a scrape comes before the
# next one. The drain's test needs more: its last requests, the drain and the stop (Triton's
# shutdown takes about 4 s, its metrics answering meanwhile) must all fall before the next scrape
# for a drain that does not wait for one to lose the last counts.
INTERVAL = 5.0
DRAIN_INTERVAL = 10.0


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    root = copy_model_repository(tmp_path_factory.mktemp("model_repository"))
    ensure_demo_weights(root, DEMO_MODEL)
    return root


@pytest.fixture
def servers(repository, tmp_path):
    """start() -> a new real server metering TENANTS; each is stopped (by its PID) at the end."""
    started = []

    def start() -> LocalTriton:
        server = LocalTriton(repository, free_port(), free_port(), free_port(),
                             log_path=tmp_path / f"tritonserver-{len(started)}.log",
                             env={names.TENANTS_ENV: ",".join(TENANTS), names.MODELS_ENV: MODEL})
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop(timeout=30)


class Clients:
    """Requests as the gateway forwards them, and what their clients received."""

    def __init__(self):
        self.received = collections.Counter()  # (tenant, outcome) -> requests; (tenant, column) -> amount

    def generate(self, server: LocalTriton, tenant: str, seed: int) -> None:
        with Cube3DClient(server.http_url, "http", retries=0) as client:
            client._headers = lambda: {TENANT_KEY: tenant, MODEL_KEY: MODEL}  # what the gateway sets
            result = client.generate(f"a chair {seed}", seed=seed, resolution=4)
        assert result.num_faces > 0
        self.received[tenant, names.OK] += 1
        self.received[tenant, "objects"] += 1
        self.received[tenant, "shape_tokens"] += len(result.tokens)

    def invalid(self, server: LocalTriton, tenant: str) -> None:
        body = {"inputs": [{"name": "PROMPT", "datatype": "BYTES", "shape": [1], "data": ["a chair"]},
                           {"name": "RESOLUTION", "datatype": "INT32", "shape": [1], "data": [99]}]}
        request = urllib.request.Request(f"http://{server.http_url}/v2/models/{deploy.PREDICT_MODEL}/infer",
                                         data=json.dumps(body).encode(), method="POST",
                                         headers={TENANT_KEY: tenant, MODEL_KEY: MODEL})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=60)
        assert refused.value.code == 400 and b"RESOLUTION" in refused.value.read()
        self.received[tenant, names.INVALID] += 1

    def expected(self) -> dict[tuple, int]:
        return {k: v for k, v in self.received.items() if v}


def billed(prometheus: PrometheusServer) -> dict[tuple, int]:
    """`cubeserve usage --csv` (the command), summed over versions as Clients.received counts."""
    out = subprocess.run([sys.executable, "-m", "cubeserve.cli", "usage", "--prometheus", prometheus.url,
                          "--since", "30m", "--csv"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    header, *lines = out.stdout.strip().splitlines()
    total = collections.Counter()
    for line in lines:
        row = dict(zip(header.split(","), line.split(",")))
        assert row["model"] == MODEL, out.stdout
        for column in (*names.OUTCOMES, "objects", "shape_tokens"):
            total[row["tenant"], column] += int(row[column])
    return {k: v for k, v in total.items() if v}


def target(server: LocalTriton) -> str:
    return f"127.0.0.1:{server.metrics_port}"


def samples(prometheus: PrometheusServer, server: LocalTriton, selector: str) -> int:
    """How many samples Prometheus has of the server's series `selector` (all of them, summed)."""
    result = prometheus.query(f'sum(count_over_time({selector[:-1]},instance="{target(server)}"}}[30m]))')
    return int(float(result[0]["value"][1])) if result else 0


def scraped(prometheus: PrometheusServer, server: LocalTriton) -> float:
    """When Prometheus last scraped the server successfully (0: never)."""
    result = prometheus.query(f'timestamp(up{{instance="{target(server)}"}} == 1)')
    return float(result[0]["value"][1]) if result else 0.0


def first_scrape(prometheus: PrometheusServer, server: LocalTriton) -> None:
    """Return just after Prometheus first scraped the server (discovery takes up to 5 s)."""
    wait_until(lambda: scraped(prometheus, server), 5 + 2 * prometheus.interval, "the first scrape", poll=0.1)


def drain_and_stop(server: LocalTriton, interval: float) -> None:
    """A pod's deletion: the preStop hook (with Prometheus's interval), then the kubelet's SIGTERM."""
    hook = [sys.executable, *deploy.drain_command(server.triton_http_port, server.metrics_port, settle=0,
                                                  scrape_interval=interval)[1:]]
    drained = subprocess.run(hook, capture_output=True, text=True, timeout=120)
    assert drained.returncode == 0, drained.stdout + drained.stderr
    server.stop(timeout=60)


def test_a_server_killed_after_one_sample_is_billed_in_full(servers, tmp_path):
    clients = Clients()
    server = servers()
    with PrometheusServer(tmp_path / "prometheus", [], interval=INTERVAL, discovered=True) as prometheus:
        # It serves before Prometheus finds it: its first scrape holds the requests, and the
        # invalid series are born at 1 in it.
        clients.generate(server, "team-a", 1)
        clients.invalid(server, "team-a")
        clients.invalid(server, "team-b")
        prometheus.discover([target(server)])
        first_scrape(prometheus, server)
        server.kill()  # every process of it, as a pod's kill
        invalid = f'{names.TENANT_REQUESTS}{{outcome="{names.INVALID}"}}'
        assert samples(prometheus, server, invalid) == 2  # one sample of each: the first and only
        assert billed(prometheus) == clients.expected()


def test_a_drained_server_is_billed_for_its_last_scrape_interval(servers, tmp_path):
    clients = Clients()
    server = servers()
    with PrometheusServer(tmp_path / "prometheus", [target(server)], interval=DRAIN_INTERVAL) as prometheus:
        first_scrape(prometheus, server)
        # Its requests, then the drain and the stop (Prometheus's targets keep it throughout, as
        # a terminating pod's), all before the next scrape.
        clients.generate(server, "team-a", 1)
        clients.generate(server, "team-b", 2)
        clients.invalid(server, "team-a")
        drain_and_stop(server, DRAIN_INTERVAL)
        assert billed(prometheus) == clients.expected()


@pytest.mark.scale  # two servers, about 40 s: `make scale-test`
def test_a_rollout_bills_the_old_server_and_the_new_one(servers, tmp_path):
    clients = Clients()
    old = servers()
    with PrometheusServer(tmp_path / "prometheus", [target(old)], interval=INTERVAL, discovered=True) as prometheus:
        first_scrape(prometheus, old)
        clients.generate(old, "team-a", 1)
        clients.invalid(old, "team-a")
        new = servers()  # the new version's pod: ready, and sent traffic before it is discovered
        clients.invalid(old, "team-b")
        clients.generate(new, "team-a", 2)
        clients.invalid(new, "team-a")
        clients.generate(new, "team-b", 3)
        drain_and_stop(old, INTERVAL)
        prometheus.discover([target(new)])  # the old pod is gone from discovery, the new one found
        first_scrape(prometheus, new)
        assert billed(prometheus) == clients.expected()
