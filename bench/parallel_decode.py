"""Parallel token generation by window (Jacobi) decoding (`cubeserve/engine/window.py`) against
one token per forward, side by side in one run: greedy, float32, on the CPU.

    python -m bench.parallel_decode [--prompts 50] [--windows 1,4,8,16,32] [--threads 1] [--quick] [--no-markdown]

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
"parallel_decode") and BENCHMARKS.md's `parallel-decode` section.
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


def engine_of(config: str, tmp: str, threads: int):
    from cubeserve.checkpoint import write_random_weights
    from cubeserve.engine import Engine

    weights = DEMO_MODEL if config == "demo" else write_random_weights(config, Path(tmp) / config, seed=0)
    return Engine.from_dir(weights, device="cpu", dtype="float32", cpu_threads=threads)


def run(config: str, prompts: list[str], windows: tuple[int, ...], threads: int = 1,
        flights: tuple[int, ...] = FLIGHTS) -> tuple[list[Record], list[str]]:
    """Every window at every number of objects in flight (`cubeserve.engine.window_check.measure`:
    prompts decoded in groups of that many, admitted together, which finish at the forward of
    their slowest), compared with sequential decoding."""
    from cubeserve.engine import GenerationRequest
    from cubeserve.engine.window_check import measure

    with tempfile.TemporaryDirectory() as tmp:
        engine = engine_of(config, tmp, threads)
    n = engine.cfg.num_tokens
    requests = [GenerationRequest(p) for p in prompts]
    # Sequential decoding, one object at a time: the tokens every window must give.
    sequential = torch.cat([engine.generate_tokens([r]) for r in requests])
    records, rows = [], []
    for flight in flights:
        for f in measure(engine, requests, windows, flight, reference=sequential):
            wall = f.wall_s_per_object
            records.append(Record("parallel_decode", hardware(torch.device("cpu")), config, f"window {f.window}",
                                  flight, ms_per_token=wall / n * 1e3, objects_per_second=1 / wall,
                                  extra={"tokens_per_forward": f.tokens_per_forward,
                                         "forwards_per_group": f.forwards_per_group,
                                         "identical_share": f.identical_share, "wall_s_per_object": wall,
                                         "threads": threads, "wall_vs_window_1": f.wall_vs_window_1,
                                         "objects": f.objects, "tokens": n, "forward_s_median": f.forward_s_median}))
            rows.append(f"| {config} | {flight} | {f.window} | {f.tokens_per_forward:.2f} | {f.forwards_per_group:.1f} "
                        f"({min(f.forwards)}-{max(f.forwards)}) | {f.identical}/{f.objects} | "
                        f"{f.forward_s_median * 1e3:.2f} | {wall * 1e3:.1f} | {f.speedup:.2f}x |")
            print(rows[-1], flush=True)
    return records, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=50, help="objects per config (default 50)")
    parser.add_argument("--windows", default="1,4,8,16,32", help="decode windows, comma-separated; 1 comes first")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="demo, tiny, tiny-bbox (or any preset)")
    parser.add_argument("--threads", type=int, default=1, help="OpenMP threads (default 1)")
    parser.add_argument("--quick", action="store_true", help="8 prompts per config (a smoke run)")
    parser.add_argument("--no-markdown", action="store_true", help="do not write BENCHMARKS.md or results.json")
    args = parser.parse_args()
    from cubeserve.engine.window_check import default_prompts, windows_of

    count = 8 if args.quick else args.prompts
    prompts = default_prompts(count)
    windows = windows_of(int(w) for w in args.windows.split(","))
    cpu = hardware(torch.device("cpu"))
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    load = os.getloadavg()[0]  # before anything of this run starts: other users' work
    print(f"# {cpu}, torch {torch.__version__}, {args.threads} threads, {count} prompts, load {load:.1f}", flush=True)
    records, rows = [], []
    for config in args.configs.split(","):
        r, lines = run(config, prompts, windows, args.threads)
        records += r
        rows += lines
    lines = [
        f"`python -m bench.parallel_decode{' --quick' if args.quick else f' --prompts {count}'}`, measured {when} "
        f"on {cpu}, torch {torch.__version__}, {args.threads} OpenMP thread(s), the machine's 1-minute load "
        f"average {load:.1f} when the run began (other users' work): float32, greedy, guidance 3, "
        f"{count} prompts of the demo data per config, decoded one at a time (in flight 1) or in groups of 8 "
        f"admitted together (in flight 8: a group takes the forwards of its slowest object); every group runs "
        f"every window in turn. Tokens per forward: an object's tokens over the forwards it takes part in, over "
        f"all objects; forwards per group: mean (min-max); identical: objects whose tokens equal sequential "
        f"decoding's, one object at a time; ms per forward: a group's forwards (admission excluded) over their "
        f"number, the median over groups; wall: decode time (admission, CLIP and prefill included, to the last "
        f"token) of all groups over all objects; speed-up: window 1's wall over this "
        f"window's, same config and objects in flight.",
        "",
        "| config | in flight | window | tokens per forward | forwards per group | identical to sequential | "
        "ms per forward | wall ms per object | speed-up vs window 1 |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    print("\n".join(lines))
    if not args.no_markdown:
        from bench.__main__ import update_markdown

        write_results(records, {"date": when, "hardware": cpu, "torch": torch.__version__})
        update_markdown("parallel-decode", lines)


if __name__ == "__main__":
    main()
