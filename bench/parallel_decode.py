"""Parallel token generation by window (Jacobi) decoding (`cubeserve/engine/window.py`) against
one token per forward, side by side in one run: greedy, float32, on the CPU (or a GPU).

    python -m bench.parallel_decode [--prompts 50] [--windows 1,4,8,16,32] [--threads 1] [--quick] [--no-markdown]
    python -m bench.parallel_decode --device cuda --configs demo,v0.1 --prompts 4 --windows 1,4,16 --flights 1
    python -m bench.parallel_decode --cost-only --configs v0.1 --windows 1,4,16 --threads 2

Configs: the trained demo model (models/demo) and the tiny configs with random weights (tiny,
tiny-bbox). Prompts are the demo data's (`demo.shapes.sample_shapes`), decoded one object at a
time and in groups of 8 admitted together; every group runs every window in turn (window 1 is
one token per forward), so a change of the machine's load falls on all of them alike. Per
window: tokens accepted per forward, forwards per group, the share of objects whose tokens are
identical to sequential decoding (one object at a time), the time of one forward (the median
over groups: a shared machine's descheduling makes outliers), and decode wall clock per object
(admission to the last token; the mean: objects differ widely in forwards) with its ratio to
window 1. One OpenMP thread by default: these models' ops are too
small for a second, and on a shared machine a team of two waits at every barrier for a
descheduled thread (BENCHMARKS.md, `bench.decode_paths`). Writes bench/results.json (section
"parallel_decode") and BENCHMARKS.md's `parallel-decode` section (`parallel-decode-gpu` on CUDA).

On CUDA (bench/gpu_check.sh) window 1 replays the decode graphs as the server does and wider
windows run eagerly (`window_check.measure`). The full shapes (v0.1, v0.5) get random weights
built on the device, on the CPU too (their acceptance means nothing: what counts there is a
forward's time against its window), the demo model its own. `--cost-only` times forwards at
the first positions instead of whole objects (minutes a window at v0.1's size on a CPU) and
writes the `parallel-decode-full` section on the CPU.
"""

from __future__ import annotations

import os

# As tests/conftest.py: threads that spin at OpenMP barriers cost a scheduler slice each on a
# shared machine. Read when libgomp loads, so before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import datetime
import tempfile
from pathlib import Path

import torch

from bench.common import Record, hardware, write_results

DEMO_MODEL = Path(__file__).resolve().parents[1] / "models" / "demo"
FLIGHTS = (1, 8)
CONFIGS = ("demo", "tiny", "tiny-bbox")
FULL_SHAPES = ("v0.1", "v0.5")  # random weights built in memory: their cost, not their acceptance


def engine_of(config: str, tmp: str, threads: int, device: torch.device, dtype: str):
    from cubeserve.checkpoint import write_random_weights
    from cubeserve.engine import Engine

    if config in FULL_SHAPES or (config != "demo" and device.type == "cuda"):  # not written out
        from bench.engine_speed import build_engine

        return build_engine(config, device, getattr(torch, dtype), cpu_threads=threads if device.type == "cpu" else None)
    weights = DEMO_MODEL if config == "demo" else write_random_weights(config, Path(tmp) / config, seed=0)
    return Engine.from_dir(weights, device=str(device), dtype=dtype, cpu_threads=threads)


def run(config: str, prompts: list[str], windows: tuple[int, ...], threads: int = 1,
        flights: tuple[int, ...] = FLIGHTS, device: torch.device = torch.device("cpu"),
        dtype: str = "float32") -> tuple[list[Record], list[str]]:
    """Every window at every number of objects in flight (`cubeserve.engine.window_check.measure`:
    prompts decoded in groups of that many, admitted together, which finish at the forward of
    their slowest), compared with sequential decoding."""
    from cubeserve.engine import GenerationRequest
    from cubeserve.engine.window_check import measure

    with tempfile.TemporaryDirectory() as tmp:
        engine = engine_of(config, tmp, threads, device, dtype)
    n = engine.cfg.num_tokens
    requests = [GenerationRequest(p) for p in prompts]
    # Sequential decoding, one object at a time: the tokens every window must give.
    sequential = torch.cat([engine.generate_tokens([r]) for r in requests])
    records, rows = [], []
    for flight in flights:
        for f in measure(engine, requests, windows, flight, reference=sequential):
            wall = f.wall_s_per_object
            records.append(Record("parallel_decode", hardware(device), config, f"window {f.window}",
                                  flight, ms_per_token=wall / n * 1e3, objects_per_second=1 / wall,
                                  extra={"tokens_per_forward": f.tokens_per_forward,
                                         "forwards_per_group": f.forwards_per_group,
                                         "identical_share": f.identical_share, "wall_s_per_object": wall,
                                         "threads": threads, "dtype": dtype, "wall_vs_window_1": f.wall_vs_window_1,
                                         "objects": f.objects, "tokens": n, "forward_s_median": f.forward_s_median}))
            rows.append(f"| {config} | {flight} | {f.window} | {f.tokens_per_forward:.2f} | {f.forwards_per_group:.1f} "
                        f"({min(f.forwards)}-{max(f.forwards)}) | {f.identical}/{f.objects} | "
                        f"{f.forward_s_median * 1e3:.2f} | {wall * 1e3:.1f} | {f.speedup:.2f}x |")
            print(rows[-1], flush=True)
    return records, rows


def forward_cost(config: str, windows: tuple[int, ...], steps: int, rounds: int, threads: int,
                 device: torch.device, dtype: str) -> tuple[list[Record], list[str]]:
    """What one forward costs at each window, not what it accepts: one object admitted, two
    forwards untimed, then `steps` timed, the rows taking turns for `rounds` rounds (the
    median). For the full shapes, whose whole objects take minutes a window on a CPU and whose
    random weights make acceptance meaningless. Break-even: the tokens per forward a window must
    keep to beat one token per forward, its forward's time over window 1's. On the CPU a row "1,
    packed" runs one token per forward with its 2 rows on the packed weights
    (`fast_paths.PACKED_MIN_ROWS` 2 instead of 4), which the windows' 4 rows and more always take."""
    import contextlib
    import statistics
    import time

    from cubeserve.engine import GenerationRequest, fast_paths

    @contextlib.contextmanager
    def packed_from(rows: int):
        kept, fast_paths.PACKED_MIN_ROWS = fast_paths.PACKED_MIN_ROWS, rows
        try:
            yield
        finally:
            fast_paths.PACKED_MIN_ROWS = kept

    with tempfile.TemporaryDirectory() as tmp:
        engine = engine_of(config, tmp, threads, device, dtype)
    rows_of = [(str(w), w, fast_paths.PACKED_MIN_ROWS) for w in windows]
    if device.type == "cpu":
        rows_of.insert(1, ("1, packed", 1, 2))
    runners = {w: engine.decode_runner(max_objects=1, window=w) for w in windows}
    request = [GenerationRequest("a chair")]
    seconds = {label: [] for label, _, _ in rows_of}
    for r in range(rounds):
        for label, w, packed in rows_of[r % len(rows_of):] + rows_of[:r % len(rows_of)]:
            runner = runners[w]
            with packed_from(packed):
                slot = runner.admit(request)[0]
                for _ in range(2):
                    runner.step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                started, forwards = time.perf_counter(), runner.forwards
                for _ in range(steps):
                    runner.step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                seconds[label].append((time.perf_counter() - started) / (runner.forwards - forwards))
                runner.release(slot)
    base = statistics.median(seconds["1"])
    records, rows = [], []
    for label, _, _ in rows_of:
        median = statistics.median(seconds[label])
        records.append(Record("parallel_decode_cost", hardware(device), config, f"window {label}", 1,
                              extra={"forward_s_median": median, "forward_s": seconds[label], "steps": steps,
                                     "threads": threads, "dtype": dtype, "break_even_tokens_per_forward": median / base}))
        rows.append(f"| {config} | {label} | {median * 1e3:.1f} | {min(seconds[label]) * 1e3:.1f} | "
                    f"{max(seconds[label]) * 1e3:.1f} | {median / base:.2f} |")
        print(rows[-1], flush=True)
    return records, rows

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=50, help="objects per config (default 50)")
    parser.add_argument("--windows", default="1,4,8,16,32", help="decode windows, comma-separated; 1 comes first")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="demo, tiny, tiny-bbox (or any preset)")
    parser.add_argument("--threads", type=int, default=1, help="OpenMP threads (default 1)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="the weights' and activations' type (default float32: bfloat16's rounding can "
                             "break a tie differently at another window width)")
    parser.add_argument("--flights", default=",".join(map(str, FLIGHTS)), help="objects in flight, comma-separated")
    parser.add_argument("--quick", action="store_true", help="8 prompts per config (a smoke run)")
    parser.add_argument("--cost-only", action="store_true",
                        help="time forwards, not whole objects: for the full shapes (v0.1, v0.5) on a CPU")
    parser.add_argument("--steps", type=int, default=8, help="timed forwards a round with --cost-only")
    parser.add_argument("--rounds", type=int, default=3, help="rounds with --cost-only")
    parser.add_argument("--no-markdown", action="store_true", help="do not write BENCHMARKS.md or results.json")
    args = parser.parse_args()
    from cubeserve.engine.window_check import default_prompts, windows_of

    if args.cost_only:
        return cost_only(args)

    count = 8 if args.quick else args.prompts
    prompts = default_prompts(count)
    windows = windows_of(int(w) for w in args.windows.split(","))
    flights = tuple(int(f) for f in args.flights.split(","))
    device = torch.device(args.device)
    machine = hardware(device)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    load = os.getloadavg()[0]  # before anything of this run starts: other users' work
    print(f"# {machine}, torch {torch.__version__}, {args.dtype}, {args.threads} threads, {count} prompts, "
          f"load {load:.1f}", flush=True)
    records, rows = [], []
    for config in args.configs.split(","):
        r, lines = run(config, prompts, windows, args.threads, flights, device, args.dtype)
        records += r
        rows += lines
    cuda = device.type == "cuda"
    command = " ".join(["python -m bench.parallel_decode", "--quick" if args.quick else f"--prompts {count}",
                        *(f"--{k} {v}" for k, v in (("device", args.device), ("dtype", args.dtype),
                                                    ("configs", args.configs), ("windows", args.windows),
                                                    ("flights", args.flights)) if v != parser.get_default(k))])
    grouped = " or ".join(f"in groups of {f} admitted together" for f in flights if f > 1)
    lines = [
        f"`{command}`, measured {when} on {machine}, torch {torch.__version__}, "
        + ("window 1 replaying the decode graphs, wider windows eager" if cuda else f"{args.threads} OpenMP thread(s)")
        + f", the machine's 1-minute load average {load:.1f} when the run began (other users' work): {args.dtype}, "
        f"greedy, guidance 3, {count} prompts of the demo data per config, decoded one at a time (in flight 1)"
        + (f" or {grouped} (a group takes the forwards of its slowest object)" if grouped else "")
        + "; every group runs every window in turn. Tokens per forward: an object's tokens over the forwards it "
        "takes part in, over all objects; forwards per group: mean (min-max); identical: objects whose tokens "
        "equal sequential decoding's, one object at a time; ms per forward: a group's forwards (admission "
        "excluded) over their number, the median over groups; wall: decode time (admission, CLIP and prefill "
        "included, to the last token) of all groups over all objects; speed-up: window 1's wall over this "
        "window's, same config and objects in flight.",
        "",
        "| config | in flight | window | tokens per forward | forwards per group | identical to sequential | "
        "ms per forward | wall ms per object | speed-up vs window 1 |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    print("\n".join(lines))
    if not args.no_markdown:
        from bench.__main__ import update_markdown

        write_results(records, {"date": when, "hardware": machine, "torch": torch.__version__})
        update_markdown("parallel-decode-gpu" if cuda else "parallel-decode", lines)


def cost_only(args) -> None:
    """`--cost-only`: each config's forward_cost table; BENCHMARKS.md's `parallel-decode-full`."""
    from cubeserve.engine.window_check import windows_of

    windows = windows_of(int(w) for w in args.windows.split(","))
    device = torch.device(args.device)
    machine = hardware(device)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    load = os.getloadavg()[0]
    records, rows = [], []
    for config in args.configs.split(","):
        r, lines = forward_cost(config, windows, args.steps, args.rounds, args.threads, device, args.dtype)
        records += r
        rows += lines
    lines = [
        f"`python -m bench.parallel_decode --cost-only --configs {args.configs} --windows {args.windows} "
        f"--threads {args.threads} --steps {args.steps} --rounds {args.rounds}`, measured {when} on {machine}, "
        f"torch {torch.__version__}, {args.dtype}, {args.threads} OpenMP thread(s), the machine's 1-minute load "
        f"average {load:.1f} when the run began: one object (guidance on: 2 rows a position), random weights, "
        f"{args.steps} forwards timed after 2 untimed at the first positions, the windows taking turns for "
        f"{args.rounds} rounds. Break-even: the tokens a window's forward must keep on average to beat one token "
        "per forward (its forward's time over window 1's).",
        "",
        "| config | window | ms per forward (median) | min | max | break-even tokens per forward |",
        "|---|---|---|---|---|---|",
        *rows,
    ]
    print("\n".join(lines))
    if not args.no_markdown and device.type == "cpu":
        from bench.__main__ import update_markdown

        write_results(records, {"date": when, "hardware": machine, "torch": torch.__version__})
        update_markdown("parallel-decode-full", lines)


if __name__ == "__main__":
    main()
