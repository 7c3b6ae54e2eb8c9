"""`make load`: a load and soak test of the local Triton server with the shipped demo model.

N client threads (one client object per thread: tritonclient's HTTP client is not thread-safe)
send known greedy requests for a while over REST predict, gRPC predict and the gRPC stream, and
every result is checked against tokens computed in process beforehand. A refusal that says to
retry (busy: HTTP 503 / gRPC UNAVAILABLE) is counted and retried here, so it is not lost;
anything else that fails is lost. The server's resident memory (its whole process tree) is
sampled during the run to catch leaks.

    python -m bench.load --clients 64 --duration 600 [--transports rest,grpc,grpc-stream]
                         [--max-objects 8] [--max-queue N] [--resolution 4]
                         [--max-rss-growth-mb 64] [--json out.json] [--no-markdown]

`--transports rest,grpc` sends everything through the predict model `cube3d`, which forwards each
request to `cube3d_stream` over BLS, as KServe's predict clients do (tests/test_soak.py).

Exits non-zero when a request was lost or wrong, or when the server's memory leaks: it grew more
than half the bound over the run's second half (a leak grows with every request; what the
allocators and caches settle into as the mix of batch sizes and lengths comes round levels off
within the first few thousand requests: BENCHMARKS.md, "Load and soak"), or more than twice the
bound over the whole run.
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import os
import random
import re
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np

# The known requests: prompts worded like the demo model's training prompts (cubeserve/demo/
# shapes.py), greedy, so that every answer has exactly one right token sequence.
PROMPTS = ("a small ball", "a tall thin cylinder", "a round coffee table", "a high-backed chair",
           "a big fat donut", "a large cube", "a small tall mug", "a flat disc", "a tall pointy cone",
           "a capsule lying on its side", "a little crate", "a big thin ring")
TRANSPORTS = ("rest", "grpc", "grpc-stream")
TRANSPORT_NAMES = {"rest": "REST predict", "grpc": "gRPC predict", "grpc-stream": "the gRPC stream"}
RSS_SAMPLE_S = 10.0
MESH_CHECK_EVERY = 8  # parse one mesh in 8 per client (and its first): parsing costs client CPU
KEEP_MESSAGES = 5
BACKOFF_S, MAX_BACKOFF_S = 0.05, 1.0
GIVE_UP_S = 300.0  # a request still refused (or unanswered) after this long is lost


# -- the server's memory ------------------------------------------------------------------------

def process_label(pid: int) -> str:
    """A server process's role, for telling which one's memory grew: a python backend stub by its
    model ("stub cube3d_engine"), a Python process by its module ("cubeserve.server.front"), else
    the executable's name ("tritonserver")."""
    from cubeserve.serving.stubs import STUB_EXECUTABLE

    try:
        args = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return f"pid {pid}"
    if not args:
        return f"pid {pid}"
    if args[0].endswith(STUB_EXECUTABLE) and len(args) > 1:
        return f"stub {Path(args[1]).parent.parent.name}"  # <repository>/<model>/<version>/model.py
    if "-m" in args[:-1]:
        return args[args.index("-m") + 1]
    return Path(args[0]).name


def tree_rss_mb(pid: int) -> dict[str, float]:
    """{process label: VmRSS in MiB} over the process tree (labels made unique by a count). Pages
    shared between the processes (Triton's shared-memory tensors) count once per process."""
    from cubeserve.serving.stubs import process_tree

    out: dict[str, float] = {}
    for p in process_tree(pid):
        try:
            kb = next(int(line.split()[1]) for line in Path(f"/proc/{p}/status").read_text().splitlines()
                      if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue
        label = base = process_label(p)
        n = 1
        while label in out:
            n += 1
            label = f"{base} #{n}"
        out[label] = kb / 1024
    return out


class RssSampler(threading.Thread):
    """Samples the server tree's RSS, per process, every RSS_SAMPLE_S seconds until stopped; the
    first sample is taken at once, the last when stopped."""

    def __init__(self, pid: int):
        super().__init__(name="rss-sampler", daemon=True)
        self.pid, self.samples, self.processes = pid, [], 0
        self._stop_event = threading.Event()

    def sample(self) -> None:
        by_process = tree_rss_mb(self.pid)
        self.processes = len(by_process)
        self.samples.append((time.monotonic(), by_process))

    def run(self) -> None:
        self.sample()
        while not self._stop_event.wait(RSS_SAMPLE_S):
            self.sample()

    def finish(self) -> None:
        self._stop_event.set()
        self.join()
        self.sample()


# -- the model repository and the expected answers ----------------------------------------------

# Every result is compared token for token with the in-process engine, so both decode in float32:
# in bfloat16 (the default on CPUs with AMX) a row decoded beside others and alone part at
# near-ties ('a round coffee table' did, on a Sapphire Rapids Xeon, with or without the front
# ends). What is measured here is the transports and the queue, not a dtype.
DTYPE = "float32"


def make_repository(root: Path, max_objects: int | None, max_queue: int | None) -> Path:
    from cubeserve.server.local_triton import copy_model_repository, ensure_demo_weights

    parameters = {k: v for k, v in (("max_objects", max_objects), ("max_queue", max_queue), ("dtype", DTYPE))
                  if v is not None}
    repo = copy_model_repository(root / "models", parameters)
    ensure_demo_weights(repo)
    return repo


def known_requests(repo: Path, resolution: int) -> list[dict]:
    """The requests and their tokens, generated in process one at a time with the same weights."""
    import torch

    from cubeserve.deploy import STREAM_MODEL
    from cubeserve.engine import Engine, GenerationRequest

    # One OpenMP thread: a team of several stalls at every barrier when another process holds a
    # core (12 requests: 0.8 s on one thread, 8 s on two, on 2 busy cores; same tokens).
    engine = Engine.from_dir(repo / STREAM_MODEL / "1" / "weights", cpu_threads=1, dtype=DTYPE)
    out = []
    with torch.inference_mode():
        for i, prompt in enumerate(PROMPTS):
            fields = dict(prompt=prompt, seed=i, resolution=resolution)
            tokens = engine.generate_tokens([GenerationRequest(**fields)])[0].tolist()
            out.append({**fields, "tokens": tokens})
    return out


# -- the clients --------------------------------------------------------------------------------

class Stats:
    """Counts from every client thread (under one lock: the updates are tiny)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.latencies = defaultdict(list)  # transport -> seconds of each completed request
        self.count = Counter()  # (transport, outcome) -> n; outcome: completed | wrong | lost | refused
        self.messages = defaultdict(list)  # outcome -> the first few messages
        self.refusal_kinds = Counter()  # the refusals' messages up to their first ":" after the prefix

    def add(self, transport: str, outcome: str, message: str | None = None, latency: float | None = None):
        with self.lock:
            self.count[transport, outcome] += 1
            if latency is not None:
                self.latencies[transport].append(latency)
            if outcome == "refused":
                # "unavailable: the server is busy: 72 requests ..." -> "the server is busy"
                self.refusal_kinds[(message.split(":", 2) + [""])[1].strip() or message] += 1
            elif message and len(self.messages[outcome]) < KEEP_MESSAGES:
                self.messages[outcome].append(f"{transport}: {message}")

    def total(self, outcome: str) -> int:
        return sum(n for (_, o), n in self.count.items() if o == outcome)


def refusal(exc: Exception) -> str | None:
    """The message of a refusal from the server that says to retry later (503 / UNAVAILABLE),
    else None. Told by the server's own "unavailable:" prefix (cubeserve.serving.protocol), not
    by the status alone: gRPC also says UNAVAILABLE when the server cannot be reached (lost, not
    refused), and tritonclient drops the status of errors on a gRPC stream."""
    from cube3d_client import ServerError
    from cubeserve.serving.protocol import error_kind

    if isinstance(exc, ServerError) and error_kind(str(exc)) == "unavailable":
        return str(exc)
    return None


def send(clients: dict, transport: str, request: dict, check_mesh: bool, stats: Stats, rng: random.Random) -> None:
    """One request until it completes (retrying refusals); records its outcome."""
    import trimesh

    client = clients["http" if transport == "rest" else "grpc"]
    progress: list[int] = []
    kwargs = {"on_progress": progress.append} if transport == "grpc-stream" else {}
    start = time.perf_counter()
    delay = BACKOFF_S
    while True:
        progress.clear()
        try:
            result = client.generate(request["prompt"], seed=request["seed"], resolution=request["resolution"],
                                     **kwargs)
            break
        except Exception as exc:  # noqa: BLE001 - every failure is counted, none ends the run
            message = refusal(exc)
            if message is None or time.perf_counter() - start > GIVE_UP_S:
                stats.add(transport, "lost", f"{type(exc).__name__}: {exc}")
                return
            stats.add(transport, "refused", message)
            time.sleep(delay * rng.uniform(0.5, 1.5))  # jitter: refused clients do not return in step
            delay = min(2 * delay, MAX_BACKOFF_S)
    latency = time.perf_counter() - start
    tokens = np.asarray(result.tokens).tolist()
    if tokens != request["tokens"]:
        stats.add(transport, "wrong", f"{request['prompt']!r}: tokens differ from the in-process run")
        return
    if kwargs and progress != list(range(1, len(tokens) + 1)):  # one report per decode step, in order
        stats.add(transport, "wrong", f"{request['prompt']!r}: progress {progress[:8]}... is not 1..{len(tokens)}")
        return
    try:
        if not result.mesh or result.num_faces <= 0:
            raise ValueError(f"an empty mesh ({result.num_faces} faces, {len(result.mesh)} bytes)")
        if check_mesh:
            mesh = trimesh.load(io.BytesIO(result.mesh), file_type="glb", force="mesh")
            if len(mesh.faces) != result.num_faces:
                raise ValueError(f"the GLB has {len(mesh.faces)} faces, NUM_FACES says {result.num_faces}")
    except Exception as exc:  # noqa: BLE001
        stats.add(transport, "lost", f"{request['prompt']!r}: {exc}")
        return
    stats.add(transport, "completed", latency=latency)


def client_loop(index: int, server, requests: list[dict], end: float, stats: Stats,
                iterations: int | None = None, transports: tuple[str, ...] = TRANSPORTS) -> None:
    """One simulated user until `end` (or for `iterations` requests): requests and transports
    picked from (index, iteration), so a run is the same sequence of calls every time and every
    client soon uses every transport."""
    from cube3d_client import Cube3DClient

    # retries=0: the client's own retries would hide the refusals this test counts.
    clients = {"http": Cube3DClient(server.http_url, "http", retries=0, timeout=GIVE_UP_S),
               "grpc": Cube3DClient(server.grpc_url, "grpc", retries=0, timeout=GIVE_UP_S)}
    rng = random.Random(index)
    try:
        iteration = 0
        while (time.monotonic() < end and iteration != iterations
               and server.process.poll() is None):  # stop if the server died
            request = requests[(7 * index + iteration) % len(requests)]
            transport = transports[(index + iteration) % len(transports)]
            send(clients, transport, request, iteration % MESH_CHECK_EVERY == 0, stats, rng)
            iteration += 1
    finally:
        for c in clients.values():
            c.close()


def run_clients(n: int, server, requests: list[dict], end: float, stats: Stats, iterations: int | None = None,
                transports: tuple[str, ...] = TRANSPORTS):
    threads = [threading.Thread(target=client_loop, args=(i, server, requests, end, stats, iterations, transports),
                                name=f"load-client-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# -- the run ------------------------------------------------------------------------------------

def run_load(clients: int = 64, duration: float = 600.0, max_objects: int | None = None,
             max_queue: int | None = None, resolution: int = 4, max_rss_growth_mb: float = 64.0,
             log_path: str | Path | None = None, write_markdown: bool = True, warm_up: bool = True,
             transports: tuple[str, ...] = TRANSPORTS) -> dict:
    """Run the load test; returns its figures (see `failures` for the verdict). `warm_up=False`
    skips the warm-up round (short tests: the memory baseline then includes the ramp-up).
    `transports`: some of TRANSPORTS, taken in turn by each client."""
    unknown = set(transports) - set(TRANSPORTS)
    if unknown or not transports:
        raise ValueError(f"transports: {sorted(unknown) or 'none given'}; allowed: {', '.join(TRANSPORTS)}")
    import torch

    from bench.common import hardware
    from cubeserve.server.local_triton import SERVER_LOGS_ENV, LocalTriton, free_port
    from cubeserve.serving.stubs import kill_leftover_stubs, stub_processes

    with tempfile.TemporaryDirectory(prefix="cube3d-load-") as tmp:
        repo = make_repository(Path(tmp), max_objects, max_queue)
        requests = known_requests(repo, resolution)
        if log_path is None and not os.environ.get(SERVER_LOGS_ENV):
            log_path = Path(tmp) / "tritonserver.log"
        # else the test suite's folder of server logs keeps it, for its stub-crash count
        # As in a container (the supervisor's --on-fault exit): a python backend stub that dies ends
        # the server, and the run with it, so a crash is a failure, never requests hung on a dead stub.
        server = LocalTriton(repo, free_port(), free_port(), free_port(), log_path=log_path, supervised=True,
                             on_fault="exit", fault_grace=1.0).start()
        stubs = stub_processes(server.tritonserver_pid())  # to reap them if tritonserver dies (stop() then does not)
        sampler = RssSampler(server.process.pid)
        try:
            # Warm-up: one request from every client at once, counted apart and checked like the
            # rest, so that the memory baseline is taken with the server's pools (forwarding
            # threads, connections, buffers) already at the size this many clients need.
            warm = Stats()
            run_clients(clients if warm_up else 0, server, requests, float("inf"), warm, iterations=1,
                        transports=transports)
            sampler.start()
            stats = Stats()
            start = time.monotonic()
            run_clients(clients, server, requests, start + duration, stats, transports=transports)
            elapsed = time.monotonic() - start
            sampler.finish()
            server_exit = server.process.poll()  # None: still running, as it should be
        finally:
            server.stop()
            kill_leftover_stubs(stubs)
        log = server.log_path.read_text(errors="replace")
        engine_line = re.search(r"(\d+) objects in flight, max_queue (\d+)", log)

    def percentiles(values: list[float]) -> dict:
        values = np.array(values or [float("nan")])
        p50, p95, p99 = np.percentile(values, [50, 95, 99])
        return {"p50": round(float(p50), 3), "p95": round(float(p95), 3), "p99": round(float(p99), 3),
                "max": round(float(values.max()), 3)}

    rss = [sum(by_process.values()) for _, by_process in sampler.samples]
    first, last = sampler.samples[0][1], sampler.samples[-1][1]
    figures = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "hardware": hardware(torch.device("cpu")),
        "clients": clients, "duration_s": duration, "elapsed_s": round(elapsed, 1), "resolution": resolution,
        # what the engine reported at start-up (the config's values, or its defaults)
        "max_objects": int(engine_line.group(1)) if engine_line else max_objects,
        "max_queue": int(engine_line.group(2)) if engine_line else max_queue,
        "known_requests": len(requests),
        "completed": stats.total("completed"), "lost": stats.total("lost") + warm.total("lost"),
        "wrong": stats.total("wrong") + warm.total("wrong"), "refused": stats.total("refused"),
        "refusals_by_kind": dict(stats.refusal_kinds),
        "messages": {k: (warm.messages[k] + stats.messages[k])[:KEEP_MESSAGES]
                     for k in sorted(set(warm.messages) | set(stats.messages))},
        "latency_s": percentiles([x for values in stats.latencies.values() for x in values]),
        "objects_per_s": round(stats.total("completed") / elapsed, 2),
        "transports": {t: {**{o: stats.count[t, o] for o in ("completed", "refused", "lost", "wrong")},
                           "latency_s": percentiles(stats.latencies[t])} for t in transports},
        "server_processes": sampler.processes,
        "server_exit_code": server_exit,
        "server_log_tail": log.splitlines()[-15:] if server_exit is not None else [],
        "rss_mb": {"start": round(rss[0], 1), "end": round(rss[-1], 1), "growth": round(rss[-1] - rss[0], 1),
                   "second_half_growth": round(rss[-1] - rss[len(rss) // 2], 1),
                   "max": round(max(rss), 1), "samples": [round(mb, 1) for mb in rss],
                   "sample_interval_s": RSS_SAMPLE_S, "max_growth_bound": max_rss_growth_mb,
                   # each process's start and end, to tell which one grew
                   "by_process": {label: [round(first.get(label, 0.0), 1), round(last.get(label, 0.0), 1)]
                                  for label in sorted(set(first) | set(last))}},
    }
    if write_markdown:
        from bench.__main__ import update_markdown

        update_markdown("load", markdown_lines(figures))
    return figures


def failures(figures: dict) -> list[str]:
    out = []
    if figures["server_exit_code"] is not None:
        out.append(f"the server exited during the run (code {figures['server_exit_code']})")
    if figures["lost"]:
        out.append(f"{figures['lost']} request(s) lost")
    if figures["wrong"]:
        out.append(f"{figures['wrong']} request(s) answered wrongly")
    rss = figures["rss_mb"]
    bound = rss["max_growth_bound"]
    grew = sorted(((end - start, label) for label, (start, end) in rss["by_process"].items()), reverse=True)
    most = f"; most in {grew[0][1]} ({grew[0][0]:+.1f} MiB)" if grew else ""
    if rss["second_half_growth"] > bound / 2:
        out.append(f"server RSS still growing: {rss['second_half_growth']:+.1f} MiB over the run's second half "
                   f"(bound {bound / 2:.0f} MiB){most}")
    if rss["growth"] > 2 * bound:
        out.append(f"server RSS grew {rss['growth']:.1f} MiB over the run (bound {2 * bound:.0f} MiB){most}")
    if not figures["completed"]:
        out.append("no request completed")
    return out


def summary_lines(figures: dict) -> list[str]:
    f, lat, rss = figures, figures["latency_s"], figures["rss_mb"]
    lines = [
        f"load: {f['clients']} clients for {f['duration_s']:g} s (ran {f['elapsed_s']:g} s, the last requests included), "
        f"max_objects {f['max_objects']}, max_queue {f['max_queue']}, resolution {f['resolution']}, "
        f"{f['known_requests']} known greedy requests, on {f['hardware']}",
        f"completed {f['completed']}, lost {f['lost']}, wrong {f['wrong']}, "
        f"refused {f['refused']} (503/UNAVAILABLE, retried: {f['refusals_by_kind'] or 'none'})",
        f"latency (first try to result, refusals included) p50 {lat['p50']:.3f} s, p95 {lat['p95']:.3f} s, "
        f"p99 {lat['p99']:.3f} s, max {lat['max']:.3f} s; {f['objects_per_s']:.2f} objects/s",
        *(f"  {t}: {c['completed']} done, {c['refused']} refused, {c['lost']} lost, {c['wrong']} wrong; "
          f"p50 {c['latency_s']['p50']:.3f} s, p95 {c['latency_s']['p95']:.3f} s" for t, c in f["transports"].items()),
        f"server RSS ({f['server_processes']} processes, VmRSS summed): {rss['start']:.1f} MiB after warm-up, "
        f"{rss['end']:.1f} MiB at the end, growth {rss['growth']:+.1f} MiB (bound {2 * rss['max_growth_bound']:.0f} MiB), "
        f"{rss['second_half_growth']:+.1f} MiB over the second half (bound {rss['max_growth_bound'] / 2:.0f} MiB); "
        f"max {rss['max']:.1f}; samples every {rss['sample_interval_s']:.0f} s: {rss['samples']}",
        "  by process (MiB, start -> end): " + ", ".join(
            f"{label} {start:.0f} -> {end:.0f}" for label, (start, end) in rss["by_process"].items()),
    ]
    for outcome, messages in f["messages"].items():
        lines += [f"first {outcome} messages:"] + [f"  {m}" for m in messages]
    if f["server_log_tail"]:
        lines += [f"the server exited (code {f['server_exit_code']}); its log ends:"] + [
            f"  {line}" for line in f["server_log_tail"]]
    return lines


def _listed(words: list[str]) -> str:
    return " and ".join(filter(None, [", ".join(words[:-1]), words[-1]]))


def markdown_lines(figures: dict) -> list[str]:
    f, lat, rss = figures, figures["latency_s"], figures["rss_mb"]
    per = ", ".join(f"{t} {c['completed']}" for t, c in f["transports"].items())
    return [
        "## Load and soak (`make load`)",
        "",
        f"Measured {f['date']} on {f['hardware']}: the local Triton server with the demo model, "
        f"{f['clients']} client threads for {f['duration_s']:g} s over {_listed([TRANSPORT_NAMES[t] for t in f['transports']])}, "
        f"{f['known_requests']} known greedy requests at resolution {f['resolution']}, every result "
        f"checked against the in-process tokens; max_objects {f['max_objects']}, max_queue {f['max_queue']}. "
        "Refused = busy answers (503 / UNAVAILABLE) retried by the client; latency counts from the first try.",
        "",
        "| completed | lost | wrong | refused | p50 | p95 | p99 | objects/s | server RSS start → end |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {f['completed']} ({per}) | {f['lost']} | {f['wrong']} | {f['refused']} | {lat['p50']:.2f} s | "
        f"{lat['p95']:.2f} s | {lat['p99']:.2f} s | {f['objects_per_s']:.2f} | {rss['start']:.0f} → "
        f"{rss['end']:.0f} MiB ({rss['growth']:+.1f}) |",
        "",
        "Verdict: " + ("; ".join(failures(f)) or "nothing lost or wrong")
        + f" (memory bounds: {rss['max_growth_bound'] / 2:.0f} MiB of growth over the second half, "
          f"{2 * rss['max_growth_bound']:.0f} MiB over the run).",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=64, help="concurrent client threads")
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load (running requests finish)")
    parser.add_argument("--transports", default=",".join(TRANSPORTS),
                        help=f"comma-separated, taken in turn by each client (default: {','.join(TRANSPORTS)}); "
                             "rest and grpc go through the predict model cube3d")
    parser.add_argument("--max-objects", type=int, help="cube3d_stream max_objects (default: as shipped)")
    parser.add_argument("--max-queue", type=int, help="cube3d_stream max_queue (default: as shipped)")
    parser.add_argument("--resolution", type=int, default=4, help="geometry resolution of every request")
    parser.add_argument("--max-rss-growth-mb", type=float, default=64.0,
                        help="fail when the server's RSS grows more than half this over the run's second half, "
                             "or more than twice this over the run")
    parser.add_argument("--log", help="tritonserver log file (default: in the temporary model repository)")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--no-markdown", action="store_true", help="do not write BENCHMARKS.md's load section")
    args = parser.parse_args(argv)
    try:
        transports = tuple(t.strip() for t in args.transports.split(",") if t.strip())
        figures = run_load(args.clients, args.duration, args.max_objects, args.max_queue, args.resolution,
                           args.max_rss_growth_mb, log_path=args.log, write_markdown=not args.no_markdown,
                           transports=transports)
    except ValueError as exc:
        parser.error(str(exc))
    print("\n".join(summary_lines(figures)))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    problems = failures(figures)
    print("FAILED: " + "; ".join(problems) if problems else "OK: nothing lost or wrong, memory within the bound")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
