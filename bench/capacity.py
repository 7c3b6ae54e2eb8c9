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

The knee is the largest N whose p99 stays within the SLO: by default SLO_FACTOR times the p99 of
one client alone (queueing may at most double the tail: a request waits for about one other's
time), or --slo-seconds.
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
    """Calls `sample()` (-> {gauge: value}) every SAMPLE_S seconds until stopped."""

    def __init__(self, sample):
        super().__init__(name="gauge-sampler", daemon=True)
        self.sample, self.samples, self.stop_event = sample, [], threading.Event()

    def run(self) -> None:
        while not self.stop_event.wait(SAMPLE_S):
            try:
                self.samples.append(self.sample())
            except OSError:
                pass


class ServerTarget:
    """A local Triton server (the serving path, as a replica runs it): REST clients, the gauges
    from its metrics port."""

    def __init__(self, server, resolution: int):
        self.server, self.resolution = server, resolution

    def client(self):
        from cube3d_client import Cube3DClient

        client = Cube3DClient(self.server.http_url, "http", retries=0, timeout=600)
        return lambda prompt, seed: client.generate(prompt, seed=seed, resolution=self.resolution), client.close

    def sample(self) -> dict[str, float]:
        return gauges(self.server.metrics_url)


class EngineTarget:
    """The engine's own scheduler in this process (where no tritonserver is installed, as on the
    GPU check's machine): the same requests without the transport, the gauges from the scheduler."""

    def __init__(self, scheduler, resolution: int):
        self.scheduler, self.resolution = scheduler, resolution

    def client(self):
        from cubeserve.engine import GenerationRequest

        def send(prompt, seed):
            return self.scheduler.generate(GenerationRequest(prompt=prompt, seed=seed, resolution=self.resolution))
        return send, lambda: None

    def sample(self) -> dict[str, float]:
        stats = self.scheduler.stats.snapshot()
        return {"cube3d_requests_in_progress": float(self.scheduler.outstanding),
                "cube3d_objects_in_flight": float(stats["in_flight"]), "cube3d_requests_waiting": float(stats["waiting"])}


def run_step(target, clients: int, seconds: float) -> dict:
    """`clients` closed-loop clients for `seconds`; requests that started before the end are
    waited for and counted."""
    latencies, refused, failed, lock = [], [0], [], threading.Lock()
    end = time.monotonic() + seconds

    def client_loop(index: int) -> None:
        send, close = target.client()
        i = 0
        try:
            while time.monotonic() < end:
                t0 = time.perf_counter()
                try:
                    send(PROMPTS[(index + i) % len(PROMPTS)], index * 1000 + i)
                    with lock:
                        latencies.append(time.perf_counter() - t0)
                except Exception as exc:  # noqa: BLE001 - counted, the step goes on
                    with lock:
                        if getattr(exc, "retryable", False) or type(exc).__name__ == "Unavailable":
                            refused[0] += 1
                        else:
                            failed.append(f"{type(exc).__name__}: {exc}")
                    time.sleep(0.1)
                i += 1
        finally:
            close()

    sampler = Sampler(target.sample)
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


def ramp(target, steps: tuple[int, ...], seconds: float, slo_seconds: float | None) -> tuple[list[dict], float]:
    run_step(target, 2, min(seconds, 5.0))  # warm-up: first-request costs
    alone = run_step(target, 1, seconds)
    slo = slo_seconds or SLO_FACTOR * alone["p99_s"]
    results = [alone]
    print(f"capacity: 1 client: p50 {alone['p50_s']:.3f} s, p99 {alone['p99_s']:.3f} s, SLO p99 <= {slo:.3f} s",
          flush=True)
    for n in steps:
        if n == 1:
            continue
        step = run_step(target, n, seconds)
        results.append(step)
        print(f"capacity: {n} clients: {step['objects_per_second']:.2f} objects/s, "
              f"p50 {step['p50_s']:.3f} s, p99 {step['p99_s']:.3f} s, in progress {step['in_progress']:.1f}, "
              f"in flight {step['in_flight']:.1f}, waiting {step['waiting']:.1f}, refused {step['refused']}, "
              f"failed {step['failed']}", flush=True)
    return results, slo


def run(steps: tuple[int, ...] = DEFAULT_STEPS, seconds: float = 20.0, resolution: int = 8,
        slo_seconds: float | None = None, parameters: dict | None = None, engine_config: str | None = None) -> dict:
    """One replica's ramp: a local server with the demo model, or with `engine_config` (a preset,
    e.g. "v0.1", random weights) the engine's scheduler in process."""
    import torch

    from bench.common import hardware

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if engine_config:
        from bench.engine_speed import build_engine
        from cubeserve.engine.engine import default_dtype
        from cubeserve.engine.scheduler import Scheduler

        dtype = getattr(torch, default_dtype(device)[0])
        engine = build_engine(engine_config, device, dtype)
        max_objects = int((parameters or {}).get("max_objects") or 8)
        with Scheduler(engine, max_objects=max_objects) as scheduler:  # started and stopped
            results, slo = ramp(EngineTarget(scheduler, resolution), steps, seconds, slo_seconds)
            limits = (scheduler.runner.max_objects, scheduler.max_queue)
        model, dtype_name, path = f"{engine_config} (random weights)", str(dtype).removeprefix("torch."), "in process"
    else:
        from cubeserve.server.local_triton import LocalTriton, copy_model_repository, ensure_demo_weights, free_port

        with tempfile.TemporaryDirectory(prefix="cube3d-capacity-") as tmp:
            repo = copy_model_repository(Path(tmp) / "models", parameters or {})
            ensure_demo_weights(repo)
            log_path = Path(tmp) / "server.log"
            server = LocalTriton(repo, free_port(), free_port(), free_port(), log_path=log_path).start()
            try:
                results, slo = ramp(ServerTarget(server, resolution), steps, seconds, slo_seconds)
                log = log_path.read_text(errors="replace")
            finally:
                server.stop()
        engine_line = re.search(r"(\d+) objects in flight, max_queue (\d+)", log)
        dtype_line = re.search(r"cube3d engine ready: .* on \S+ \((\w+), weights", log)
        limits = (int(engine_line.group(1)), int(engine_line.group(2))) if engine_line else (None, None)
        model, dtype_name, path = "the demo model", dtype_line.group(1) if dtype_line else None, "REST"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "hardware": hardware(device),
        "torch": torch.__version__,
        "model": model,
        "path": path,
        "resolution": resolution,
        "seconds_per_step": seconds,
        "max_objects": limits[0],
        "max_queue": limits[1],
        "dtype": dtype_name,
        "slo_p99_s": slo,
        "slo_rule": f"{slo_seconds:g} s" if slo_seconds else f"{SLO_FACTOR:g} x the p99 of one client alone",
        "knee": knee(results, slo),
        "steps": results,
    }


def markdown_lines(f: dict) -> list[str]:
    where = ("one local server" if f["path"] == "REST" else "the engine's scheduler in process") + f" with {f['model']}"
    lines = [f"Measured {f['date']} on {f['hardware']}, torch {f['torch']}: {where} "
             f"({f['dtype']}, max_objects {f['max_objects']}, max_queue {f['max_queue']}), closed-loop {f['path']} clients, "
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
    config = "demo" if f["path"] == "REST" else f["model"].split()[0]
    return [Record("capacity", device, config, f"{s['clients']} clients", s["clients"],
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
    parser.add_argument("--slo-seconds", type=float, help=f"p99 bound (default {SLO_FACTOR:g} x the p99 of one client alone)")
    parser.add_argument("--engine", metavar="CONFIG",
                        help="the engine's scheduler in process with a preset's random weights (e.g. v0.1), "
                             "no server: for machines without tritonserver")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--no-markdown", action="store_true", help="leave BENCHMARKS.md and bench/results.json alone")
    args = parser.parse_args(argv)
    steps = tuple(sorted({int(s) for s in args.steps.split(",")} | {1}))
    figures = run(steps, args.seconds, args.resolution, args.slo_seconds, engine_config=args.engine)
    lines = markdown_lines(figures)
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    if not args.no_markdown:
        from bench.__main__ import update_markdown
        from bench.common import write_results

        write_results(records(figures), {"date": figures["date"], "hardware": figures["hardware"],
                                         "torch": figures["torch"]})
        if figures["path"] == "REST":
            section, heading = "capacity", "## Capacity of one replica (`python -m bench.capacity`)"
        else:  # the engine alone: a section per device and preset (the GPU check writes one)
            record = records(figures)[0]
            section, heading = f"capacity-{record.device}-{record.config}", f"### The engine alone: {figures['model']}"
        update_markdown(section, [heading, "", *lines])
    return 1 if any(s["failed"] for s in figures["steps"]) else 0


if __name__ == "__main__":
    sys.exit(main())
