"""Decode speed and weight memory of the numerics modes (dtype, weight-only quantization), side
by side in one run on the same random weights; with --reference, the reference's own default
(bf16 autocast, its cached loop) on those weights too.

    python -m bench.quantization [--config mid] [--reference CUBE]

Every engine is built first; then rounds visit every (mode, objects in flight) in turn, so
a change of machine load falls on all of them alike. Decode steps only (no geometry):
time per token at 1 and 8 objects in flight, and objects per second of decoding at each.
Prints a Markdown table for BENCHMARKS.md, writes bench/results.json's "quantization" section.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench.common import Record, hardware, write_results
from bench.numerics import DEFAULT_MODES, ReferenceDecoder, parse_mode
from cubeserve.checkpoint import write_random_weights
from cubeserve.engine import fast_paths
from cubeserve.engine.engine import Engine
from cubeserve.requests import GenerationRequest


def packed_bytes(engine: Engine) -> int:
    """oneDNN-packed second copies of the decode weights (float32 on the CPU)."""
    total = 0
    for m in engine.gpt.modules():
        packed = getattr(m, "packed", None)
        if isinstance(packed, torch.Tensor):
            total += packed.numel() * packed.element_size()
    return total


def time_steps(runner, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        runner.step()
    return (time.perf_counter() - t0) / steps


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="mid")
    # fp8 is left out by default: off a GPU of compute capability 8.9 it is an emulation of the
    # kernel's numerics (fast_paths.Fp8Linear), slower than float32, whose speed means nothing.
    ap.add_argument("--modes", default=",".join(m for m in DEFAULT_MODES if not m.endswith("+fp8")))
    ap.add_argument("--flights", default="1,8")
    ap.add_argument("--steps", type=int, default=32, help="timed steps per visit")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--reference", type=Path, help="a checkout of github.com/Roblox/cube")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    flights = [int(f) for f in args.flights.split(",")]

    with tempfile.TemporaryDirectory() as tmp:
        weights = write_random_weights(args.config, Path(tmp) / args.config, seed=0)
        engines = {m: Engine.from_dir(weights, dtype=parse_mode(m)[0], quantization=parse_mode(m)[1],
                                      cpu_threads=args.threads) for m in modes}
        n = next(iter(engines.values())).cfg.num_tokens
        runners = {}
        for m, engine in engines.items():
            for k in flights:
                runner = engine.decode_runner(max_objects=k)
                runner.admit([GenerationRequest(f"benchmark object {i}") for i in range(k)])
                runner.step()  # the first step of a slot differs (BOS); warm
                runners[m, k] = runner
        times: dict[tuple[str, int], list[float]] = {key: [] for key in runners}
        for _ in range(args.rounds):
            for key, runner in runners.items():
                if n - runner.generated[0] <= args.steps:  # re-admit before the object ends
                    for s in runner.busy_slots:
                        runner.release(s)
                    runner.admit([GenerationRequest(f"benchmark object {i}") for i in range(key[1])])
                    runner.step()
                times[key].append(time_steps(runner, args.steps))
        reference_ms = None
        if args.reference:
            ref = ReferenceDecoder(args.reference, weights, next(iter(engines.values())).tokenizer)
            t0 = time.perf_counter()
            ref.tokens_and_logits([GenerationRequest("benchmark object 0")])
            reference_ms = (time.perf_counter() - t0) / n * 1e3

    device = hardware(torch.device("cpu"))
    threads = torch.get_num_threads()
    print(f"\nDecode speed and weight memory by numerics mode: `{args.config}` random weights, {n} tokens an "
          f"object, greedy, guidance 3; median of {args.rounds} rounds of {args.steps} steps; {threads} threads; "
          f"{device}\n")
    head = " | ".join(f"ms/token at {k}" for k in flights) + " | " + " | ".join(f"objects/s at {k}" for k in flights)
    print(f"| mode | {head} | GPT weights MB | + packed copies MB |")
    print("|---|" + "---|" * (2 * len(flights) + 2))
    records = []
    base = None
    for m, engine in engines.items():
        ms = [statistics.median(times[m, k]) * 1e3 for k in flights]
        ops = [k / (n * t / 1e3) for k, t in zip(flights, ms)]
        mb, packed = fast_paths.weight_bytes(engine.gpt) / 1e6, packed_bytes(engine) / 1e6
        base = base or ms[0]
        print(f"| {m} | " + " | ".join(f"{t:.2f}" for t in ms) + " | " + " | ".join(f"{o:.2f}" for o in ops)
              + f" | {mb:.1f} | {packed:.1f} |")
        for k, t, o in zip(flights, ms, ops):
            records.append(Record("quantization", device, args.config, m, k, ms_per_token=t, objects_per_second=o,
                                  extra={"gpt_weight_mb": mb, "packed_mb": packed, "threads": threads}))
    if reference_ms is not None:
        print(f"| reference default (bf16 autocast), 1 object | {reference_ms:.2f} | | | | | |")
        records.append(Record("quantization", device, args.config, "reference default (bf16 autocast)", 1,
                              ms_per_token=reference_ms, extra={"threads": threads}))
        for m in engines:
            print(f"  {m}: {reference_ms / statistics.median(times[m, flights[0]]) / 1e3:.2f}x the reference "
                  f"per token at {flights[0]} object", file=sys.stderr)
    write_results(records, {"by": "python -m bench.quantization"})


if __name__ == "__main__":
    main()
