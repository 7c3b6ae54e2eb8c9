"""The batch pipeline (`cubeserve batch`, cubeserve/batch/) against the in-process engine's batched
loop, on the same rows and settings: the demo model (models/demo) on the CPU.

    engine loop   one process: `Engine.generate` over the rows, max_objects at a time (decode,
                  then occupancy and marching cubes), each mesh exported and written as the
                  pipeline writes it
    pipeline      `cubeserve.batch.run.run` on an embedded local Ray: decode actors, a geometry
                  actor, write tasks, the results table; Ray started by the run, as the CLI does

Objects/s over the whole run (for the pipeline from Ray's start to the last record, actors'
start-up included, Ray's own start-up not) and in the steady state (first to last record); Ray's
start-up; peak memory (the sum of the resident sets of this process and every process it started,
sampled every 0.2 s). Every run must write every mesh and record every row once.

    python -m bench.batch [--rows 200] [--resolution 5] [--actors 1,2] [--no-markdown]

Writes BENCHMARKS.md's `batch` section.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

from bench.common import hardware

PROMPTS = ["a round table", "a red chair", "a small boat", "a tall lamp", "a wooden stool", "a cup", "a bench",
           "a vase", "a bookshelf", "a sofa", "a bed", "a desk", "a bottle", "a car", "a tree", "a house",
           "a mug", "a chest", "a barrel", "a crate"]


class PeakMemory:
    """The largest sum of resident sets of this process and its descendants (Ray's workers)."""

    def __init__(self, every_s: float = 0.2):
        import psutil

        self.me, self.every_s, self.peak = psutil.Process(), every_s, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self):
        import psutil

        while not self.stop.is_set():
            total = 0
            for p in [self.me, *self.me.children(recursive=True)]:
                try:
                    total += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            self.stop.wait(self.every_s)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def write_prompts(path: Path, rows: int) -> str:
    path.write_text("".join(json.dumps({"prompt": PROMPTS[i % len(PROMPTS)], "seed": i}) + "\n"
                            for i in range(rows)))
    return str(path)


def engine_loop(prompts: str, out: Path, resolution: int, max_objects: int, threads: int | None = None) -> dict:
    from cubeserve import storage
    from cubeserve.batch import rows as rows_mod
    from cubeserve.engine import Engine
    from cubeserve.server.local_triton import DEMO_MODEL

    parsed = rows_mod.parse(rows_mod.read_records(prompts), rows_mod.Defaults(resolution=resolution))
    requests = [rows_mod.request_of(r.as_dict()) for r in parsed]
    with PeakMemory() as memory:
        engine = Engine.from_dir(DEMO_MODEL, device="cpu", cpu_threads=threads)
        t0 = time.perf_counter()
        for start in range(0, len(requests), max_objects):
            chunk = requests[start: start + max_objects]
            for row, result in zip(parsed[start: start + max_objects], engine.generate(chunk)):
                storage.write_bytes(str(out / f"{row.id}.glb"), result.mesh_bytes())
        seconds = time.perf_counter() - t0
    written = len(list(out.glob("*.glb")))
    assert written == len(requests), (written, len(requests))
    return {"seconds": seconds, "objects_per_s": written / seconds, "peak_gib": memory.peak / 2**30,
            "threads": engine.cpu_threads.threads}


def pipeline(prompts: str, out: Path, resolution: int, max_objects: int, decode_actors: int) -> dict:
    from cubeserve.batch import results, rows as rows_mod
    from cubeserve.batch.run import Settings, run
    from cubeserve.server.local_triton import DEMO_MODEL

    times = []
    settings = Settings(weights=str(DEMO_MODEL), out=str(out), device="cpu", decode_actors=decode_actors,
                        max_objects=max_objects, batch_size=2 * max_objects,
                        defaults=rows_mod.Defaults(resolution=resolution))
    with PeakMemory() as memory:
        summary = run(prompts, settings, progress=False, on_record=lambda r: times.append(time.perf_counter()))
    table = results.read(str(out))
    ids = table.column("id").to_pylist()
    assert summary.done == len(ids) == len(set(ids)) == len(list(out.glob("*.glb"))), summary.text()
    steady = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else None
    per_object = {k.removesuffix("_s"): v / summary.done for k, v in summary.stage_s.items()}
    return {"seconds": summary.seconds, "objects_per_s": summary.objects_per_s, "steady_objects_per_s": steady,
            "ray_start_s": summary.ray_start_s, "peak_gib": memory.peak / 2**30, "stage_s_per_object": per_object,
            "done": summary.done}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--resolution", type=int, default=5)
    parser.add_argument("--max-objects", type=int, default=8)
    parser.add_argument("--actors", default="1,2", help="decode actor counts to run")
    parser.add_argument("--engine-threads", default="2,1",
                        help="PyTorch threads of the engine loop's runs (the first is the baseline)")
    parser.add_argument("--no-markdown", action="store_true")
    args = parser.parse_args()
    import torch

    load0 = os.getloadavg()[0]
    tmp = Path(tempfile.mkdtemp(prefix="bench-batch-"))
    prompts = write_prompts(tmp / "prompts.jsonl", args.rows)
    figures = {}
    for t in (int(a) for a in args.engine_threads.split(",")):
        figures[f"engine loop, {t} thread{'s' if t > 1 else ''}"] = got = \
            engine_loop(prompts, _fresh(tmp / f"engine{t}"), args.resolution, args.max_objects, t)
        print("engine loop", got, flush=True)
    for n in (int(a) for a in args.actors.split(",")):
        figures[f"pipeline, {n} decode actor{'s' if n > 1 else ''}"] = got = \
            pipeline(prompts, _fresh(tmp / f"ray{n}"), args.resolution, args.max_objects, n)
        print(n, got, flush=True)
    base = next(iter(figures.values()))["objects_per_s"]
    lines = [
        f"`python -m bench.batch --rows {args.rows} --resolution {args.resolution} --actors {args.actors} "
        f"--engine-threads {args.engine_threads}` on "
        f"{hardware(torch.device('cpu'))}, torch {torch.__version__}, Ray {__import__('ray').__version__}: the demo "
        f"model, {args.rows} rows (20 prompts, seeds 0-{args.rows - 1}, greedy), resolution {args.resolution}, "
        f"{args.max_objects} objects in flight per engine, GLB files on the local disk. The machine's 1-minute "
        f"load average when the run began (other users' work): {load0:.1f}.",
        "",
        "| run | objects/s (whole run) | vs the first row | objects/s (steady) | Ray start-up s | run s | peak memory GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, f in figures.items():
        steady = f.get("steady_objects_per_s")
        lines.append(f"| {name} | {f['objects_per_s']:.2f} | {f['objects_per_s'] / base:.0%} | "
                     f"{'' if steady is None else f'{steady:.2f}'} | {f.get('ray_start_s', 0):.1f} | "
                     f"{f['seconds']:.1f} | {f['peak_gib']:.2f} |")
    for name, f in figures.items():
        if "stage_s_per_object" in f:
            stages = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in f["stage_s_per_object"].items())
            lines.append(f"\n{name}: per object, {stages} (decode: a row's admitted -> last token, its batch "
                         f"decoding beside it).")
    print("\n".join(lines))
    if not args.no_markdown:
        from bench.__main__ import update_markdown

        update_markdown("batch", lines)


def _fresh(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


if __name__ == "__main__":
    main()
