"""How many points one query of the occupancy decoder takes on the CPU, side by side in one run.

`python -m bench.geometry_chunks [--configs tiny,v0.1] [--resolutions 5,7] [--rounds 5]`: a
shape tokenizer of each config's shape (random weights: the cost does not depend on them) turns
random latents into an occupancy grid (`geometry.occupancy_grid_coarse_to_fine`, as the engine
does) with the points split into chunks of each size in turn, round after round in one process
(glibc's thresholds set as the engine sets them, `engine/allocator.py`). Reported per chunk size:
the median and best time of a grid and the page faults it took; `geometry.chunk_points` is
the size the engine uses. Writes BENCHMARKS.md's `geometry-chunks` section and
bench/results.json unless told not to.
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import statistics
import time

import torch

from bench.common import Record, hardware, write_results
from cubeserve.config import PRESETS
from cubeserve.engine import geometry
from cubeserve.engine.allocator import keep_freed_memory
from cubeserve.model.tokenizer import ShapeTokenizer

BUDGETS_MIB = (8, 64)  # chunks whose MLP block is this many MiB, beside the engine's and the old fixed size


def sizes_for(width: int) -> dict[str, int]:
    """Chunk sizes to compare, by name: the engine's, the fixed 100,000 it replaced, and budgets."""
    row = 4 * 4 * width  # bytes of one point's row of the MLP's hidden block (fp32)
    sizes = {"chunk_points (engine)": geometry.chunk_points(width, "cpu"), "100,000 (before)": 100_000}
    sizes.update({f"{mib} MiB blocks": max(256, (mib << 20) // row) for mib in BUDGETS_MIB})
    return sizes


def run(config: str, resolution: int, rounds: int) -> tuple[list[Record], list[str]]:
    cfg = PRESETS[config].tokenizer
    torch.manual_seed(0)
    tokenizer = ShapeTokenizer(cfg).eval()
    latents = torch.randn(1, cfg.num_encoder_latents, cfg.width)
    sizes = sizes_for(cfg.width)
    seconds = {name: [] for name in sizes}
    faults = {name: [] for name in sizes}
    for chunk in sizes.values():  # a first grid of each, untimed: the allocator's first blocks
        geometry.occupancy_grid_coarse_to_fine(tokenizer, latents, resolution, chunk_size=chunk)
    for _ in range(rounds):
        for name, chunk in sizes.items():
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            started = time.perf_counter()
            geometry.occupancy_grid_coarse_to_fine(tokenizer, latents, resolution, chunk_size=chunk)
            seconds[name].append(time.perf_counter() - started)
            faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    base = statistics.median(seconds["100,000 (before)"])
    records, rows = [], []
    for name, chunk in sizes.items():
        median = statistics.median(seconds[name])
        records.append(Record("geometry-chunks", hardware(torch.device("cpu")), config, f"resolution {resolution}, {name}", 1,
                              extra={"chunk_points": chunk, "median_s": median, "best_s": min(seconds[name]),
                                     "page_faults": statistics.median(faults[name]), "rounds": rounds}))
        rows.append(f"| {config} (width {cfg.width}) | {resolution} | {name} | {chunk:,} | {median * 1e3:.1f} | "
                    f"{min(seconds[name]) * 1e3:.1f} | {statistics.median(faults[name]):,.0f} | "
                    f"{median / base:.2f}x |")
    return records, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="tiny,v0.1", help="presets whose tokenizer shape is measured")
    parser.add_argument("--resolutions", default="5,7", help="grid resolutions, comma-separated")
    parser.add_argument("--max-v01-resolution", type=int, default=5,
                        help="a v0.1-shaped grid past this is skipped (resolution 7 takes minutes a grid)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-markdown", action="store_true", help="do not write BENCHMARKS.md or results.json")
    args = parser.parse_args()
    keep_freed_memory()
    device = torch.device("cpu")
    machine = hardware(device)
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    load = os.getloadavg()[0]
    print(f"# {machine}, torch {torch.__version__}, {torch.get_num_threads()} threads, load {load:.1f}", flush=True)
    records, rows = [], []
    for config in args.configs.split(","):
        for resolution in (int(r) for r in args.resolutions.split(",")):
            if config.startswith("v0.") and resolution > args.max_v01_resolution:
                continue
            r, lines = run(config, resolution, args.rounds)
            records += r
            rows += lines
            print("\n".join(lines), flush=True)
    lines = [
        f"`python -m bench.geometry_chunks --rounds {args.rounds}`, measured {when} on {machine}, torch "
        f"{torch.__version__}, {torch.get_num_threads()} OpenMP threads, the machine's 1-minute load average "
        f"{load:.1f} when the run began: one grid (coarse-to-fine, as the engine does), random latents on a "
        f"random tokenizer of the config's shape, float32, the chunk sizes taking turns for {args.rounds} rounds.",
        "",
        "| tokenizer | resolution | chunk | points | median ms | best ms | page faults | vs 100,000 |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    print("\n".join(lines))
    if not args.no_markdown:
        from bench.__main__ import update_markdown

        write_results(records, {"date": when, "hardware": machine, "torch": torch.__version__})
        update_markdown("geometry-chunks", lines)


if __name__ == "__main__":
    main()
