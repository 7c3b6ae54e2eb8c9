"""Capacity of one replica: what the autoscaling targets in k8s/ come from (docs/deploy/autoscaling.md).

One server (the shipped engine parameters: max_objects, max_queue, the device's default dtype) and
a closed loop of N clients, N stepped up (1, 2, 4, ... by default): each client sends a request,
waits for its answer and sends the next at once, so N is the replica's concurrency, the signal
the InferenceServices scale on: Knative's `concurrency` metric counts the requests a pod holds,
and the KEDA query (cubeserve.deploy.keda_query) sums the engine's cube3d_requests_in_progress,
the requests accepted and not yet answered (waiting, decoding or in geometry). Per step:
objects/s, p50/p99 latency, and the means of that gauge, of the objects in the decode batch
(cube3d_objects_in_flight) and of those waiting for a slot (cube3d_requests_waiting), sampled
from the server's metrics while the step runs; refusals.

The knee is the largest N whose p99 stays within the SLO: by default SLO_FACTOR times the median
latency of one request alone (a request may wait for about one other's time), or --slo-seconds.
Past the knee, more concurrency buys little throughput and costs latency: that is where a new
replica should take the load, so the knee is the scaling target.

    python -m bench.capacity [--steps 1,2,4,6,8,12,16,24] [--seconds 20] [--resolution 8]
                             [--slo-seconds S] [--json out.json] [--no-markdown]

On a GPU machine bench/gpu_check.sh runs it (the same script; the demo model is tiny, so on a GPU
it measures the serving path, not a full checkpoint's decode).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from bench.common import Record

DEFAULT_STEPS = (1, 2, 3, 4, 6, 8, 12, 16, 24)
SLO_FACTOR = 2.0
# gauge -> the model whose series are summed (None: every model's)
GAUGES = {"cube3d_requests_in_progress": "cube3d_stream", "cube3d_objects_in_flight": None,
          "cube3d_requests_waiting": None}
SAMPLE_S = 0.25
PROMPTS = ("a small ball", "a round coffee table", "a high-backed chair", "a big fat donut", "a large cube",
           "a tall pointy cone")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def gauges(metrics_url: str) -> dict[str, float]:
    """The sum over series of each gauge in GAUGES, from the server's Prometheus text."""
    text = urllib.request.urlopen(metrics_url, timeout=5).read().decode()
    out = dict.fromkeys(GAUGES, 0.0)
    for line in text.splitlines():
        m = re.match(r"(\w+)\{(.*)\} ([0-9.e+-]+)$", line)
        if m and m.group(1) in out and GAUGES[m.group(1)] in (None, dict(re.findall(r'(\w+)="([^"]*)"', m.group(2))).get("model")):
            out[m.group(1)] += float(m.group(3))
    return out


class Sampler(threading.Thread):
    def __init__(self, metrics_url: str):
        super().__init__(name="gauge-sampler", daemon=True)
        self.url, self.samples, self.stop_event = metrics_url, [], threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(SAMPLE_S):
            try:
                self.samples.append(gauges(self.url))
            except OSError:
                pass


def run_step(server, clients: int, seconds: float, resolution: int) -> dict:
    """`clients` closed-loop clients for `seconds`; requests that started before the end are
    waited for and counted."""
    from cube3d_client import Cube3DClient

    latencies, refused, failed, lock = [], [0], [], threading.Lock()
    end = time.monotonic() + seconds

    def client_loop(index: int) -> None:
        client = Cube3DClient(server.http_url, "http", retries=0, timeout=600)
        i = 0
        try:
            while time.monotonic() < end:
                t0 = time.perf_counter()
                try:
                    client.generate(PROMPTS[(index + i) % len(PROMPTS)], seed=index * 1000 + i, resolution=resolution)
                    with lock:
                        latencies.append(time.perf_counter() - t0)
                except Exception as exc:  # noqa: BLE001 - counted, the step goes on
                    with lock:
                        if getattr(exc, "retryable", False):
                            refused[0] += 1
                        else:
                            failed.append(f"{type(exc).__name__}: {exc}")
                    time.sleep(0.1)
                i += 1
        finally:
            client.close()

    sampler = Sampler(server.metrics_url)
    threads = [threading.Thread(target=client_loop, args=(i,), name=f"capacity-{i}") for i in range(clients)]
    started = time.perf_counter()
    sampler.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    sampler.stop_event.set()
    sampler.join()
    samples = sampler.samples or [dict.fromkeys(GAUGES, 0.0)]
    return {
        "clients": clients,
        "completed": len(latencies),
        "refused": refused[0],
        "failed": len(failed),
        "failures": failed[:3],
        "seconds": round(elapsed, 2),
        "objects_per_second": len(latencies) / elapsed,
        "p50_s": statistics.median(latencies) if latencies else None,
        "p99_s": percentile(latencies, 0.99) if latencies else None,
        "in_progress": statistics.fmean(s["cube3d_requests_in_progress"] for s in samples),
        "in_flight": statistics.fmean(s["cube3d_objects_in_flight"] for s in samples),
        "waiting": statistics.fmean(s["cube3d_requests_waiting"] for s in samples),
    }


def knee(steps: list[dict], slo_s: float) -> int | None:
    """The largest concurrency whose p99 is within the SLO, counting only the steps before the
    first one that misses it (a later step that happens to pass does not move the knee past a
    failing one)."""
    best = None
    for step in steps:
        if step["p99_s"] is None or step["p99_s"] > slo_s or step["failed"]:
            break
        best = step["clients"]
    return best


def run(steps: tuple[int, ...] = DEFAULT_STEPS, seconds: float = 20.0, resolution: int = 8,
        slo_seconds: float | None = None, parameters: dict | None = None) -> dict:
    import torch

    from bench.common import hardware
    from cubeserve.serving.local_triton import LocalTriton, copy_model_repository, ensure_demo_weights, free_port

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory(prefix="cube3d-capacity-") as tmp:
        repo = copy_model_repository(Path(tmp) / "models", parameters or {})
        ensure_demo_weights(repo)
        log_path = Path(tmp) / "server.log"
        server = LocalTriton(repo, free_port(), free_port(), free_port(), log_path=log_path).start()
        try:
            run_step(server, 2, min(seconds, 5.0), resolution)  # warm-up: first-request costs
            alone = run_step(server, 1, seconds, resolution)
            slo = slo_seconds or SLO_FACTOR * alone["p50_s"]
            results = [alone]
            print(f"capacity: 1 client: p50 {alone['p50_s']:.3f} s, SLO p99 <= {slo:.3f} s", flush=True)
            for n in steps:
                if n == 1:
                    continue
                step = run_step(server, n, seconds, resolution)
                results.append(step)
                print(f"capacity: {n} clients: {step['objects_per_second']:.2f} objects/s, "
                      f"p50 {step['p50_s']:.3f} s, p99 {step['p99_s']:.3f} s, in progress {step['in_progress']:.1f}, "
                      f"in flight {step['in_flight']:.1f}, "
                      f"waiting {step['waiting']:.1f}, refused {step['refused']}, failed {step['failed']}", flush=True)
            log = log_path.read_text(errors="replace")
        finally:
            server.stop()
    engine_line = re.search(r"(\d+) objects in flight, max_queue (\d+)", log)
    dtype_line = re.search(r"dtype[ =:]+(\w+)", log)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "hardware": hardware(device),
        "torch": torch.__version__,
        "resolution": resolution,
        "seconds_per_step": seconds,
        "max_objects": int(engine_line.group(1)) if engine_line else None,
        "max_queue": int(engine_line.group(2)) if engine_line else None,
        "dtype": dtype_line.group(1) if dtype_line else None,
        "slo_p99_s": slo,
        "slo_rule": f"{slo_seconds:g} s" if slo_seconds else f"{SLO_FACTOR:g} x the median of one request alone",
        "knee": knee(results, slo),
        "steps": results,
    }


def markdown_lines(f: dict) -> list[str]:
    lines = [f"Measured {f['date']} on {f['hardware']}, torch {f['torch']}: one local server with the demo model "
             f"(max_objects {f['max_objects']}, max_queue {f['max_queue']}), closed-loop REST clients, "
             f"{f['seconds_per_step']:g} s per step, resolution {f['resolution']}. SLO: p99 <= {f['slo_p99_s']:.2f} s "
             f"({f['slo_rule']}).", "",
             "| clients | objects/s | p50 s | p99 s | in progress | in flight | waiting | refused | failed |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in f["steps"]:
        mark = " (knee)" if s["clients"] == f["knee"] else ""
        lines.append(f"| {s['clients']}{mark} | {s['objects_per_second']:.2f} | {s['p50_s']:.3f} | {s['p99_s']:.3f} | "
                     f"{s['in_progress']:.1f} | {s['in_flight']:.1f} | {s['waiting']:.1f} | {s['refused']} | {s['failed']} |")
    lines += ["", f"Knee (the scaling target for this hardware): {f['knee']} concurrent requests per replica."]
    return lines


def records(f: dict) -> list[Record]:
    device = "cuda" if "(CPU)" not in f["hardware"] else "cpu"
    return [Record("capacity", device, "demo", f"{s['clients']} clients", s["clients"],
                   objects_per_second=s["objects_per_second"],
                   extra={k: s[k] for k in ("p50_s", "p99_s", "in_progress", "in_flight", "waiting", "refused", "failed")}
                   | {"knee": f["knee"], "slo_p99_s": f["slo_p99_s"], "resolution": f["resolution"]})
            for s in f["steps"]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", default=",".join(map(str, DEFAULT_STEPS)),
                        help="client counts, comma-separated (default %(default)s)")
    parser.add_argument("--seconds", type=float, default=20.0, help="seconds per step (default %(default)s)")
    parser.add_argument("--resolution", type=int, default=8, help="marching-cubes resolution (default %(default)s)")
    parser.add_argument("--slo-seconds", type=float, help=f"p99 bound (default {SLO_FACTOR:g} x one request alone)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--no-markdown", action="store_true", help="leave BENCHMARKS.md and bench/results.json alone")
    args = parser.parse_args(argv)
    steps = tuple(sorted({int(s) for s in args.steps.split(",")} | {1}))
    figures = run(steps, args.seconds, args.resolution, args.slo_seconds)
    lines = markdown_lines(figures)
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    if not args.no_markdown:
        from bench.__main__ import update_markdown
        from bench.common import write_results

        write_results(records(figures), {"date": figures["date"], "hardware": figures["hardware"],
                                         "torch": figures["torch"]})
        update_markdown("capacity", ["## Capacity of one replica (`python -m bench.capacity`)", "", *lines])
    return 1 if any(s["failed"] for s in figures["steps"]) else 0


if __name__ == "__main__":
    sys.exit(main())
