"""Decode speed and weight memory of the numerics modes (dtype, weight-only quantization), side
by side in one run on the same random weights; with --reference, the reference's own default
(bf16 autocast, its cached loop) on those weights too, one object, its steps after the first
token (the whole object's average goes to stderr and results.json).

    python -m bench.quantization [--config mid] [--reference CUBE] [--one-at-a-time]

Every engine is built first; then rounds visit every (mode, objects in flight) in turn, so
a change of machine load falls on all of them alike. Where the engines side by side do not fit
in memory (v0.1 size on a 24 GB machine), --one-at-a-time builds, times and frees each mode in
turn: still one run on one machine, but a change of load between modes is no longer shared.
Decode steps only (no geometry): time per token at 1 and 8 objects in flight, and objects per
second of decoding at each. Prints a Markdown table for BENCHMARKS.md, writes
bench/results.json's "quantization" section."""

from __future__ import annotations

import argparse
import gc
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


def time_modes(engines: dict[str, Engine], flights: list[int], rounds: int, steps: int):
    """Seconds per decode step of each (mode, objects in flight), a list of one per round (rounds
    visit every runner in turn); and each mode's first token of one object, seconds."""
    runners = {}
    for m, engine in engines.items():
        for k in flights:
            runner = engine.decode_runner(max_objects=k)
            runner.admit([GenerationRequest(f"benchmark object {i}") for i in range(k)])
            runner.step()  # the first step of a slot differs (BOS); warm
            runners[m, k] = runner
    n = next(iter(engines.values())).cfg.num_tokens
    times: dict[tuple[str, int], list[float]] = {key: [] for key in runners}
    for _ in range(rounds):
        for key, runner in runners.items():
            if n - runner.generated[0] <= steps:  # re-admit before the object ends
                for s in runner.busy_slots:
                    runner.release(s)
                runner.admit([GenerationRequest(f"benchmark object {i}") for i in range(key[1])])
                runner.step()
            times[key].append(time_steps(runner, steps))
    # An object's first token: its prompt encoded, admitted and the first step (its prefill).
    firsts: dict[str, list[float]] = {}
    for (m, k), runner in runners.items():
        if k != 1:
            continue
        for _ in range(3):
            for s in runner.busy_slots:
                runner.release(s)
            t0 = time.perf_counter()
            runner.admit([GenerationRequest("benchmark object 0")])
            runner.step()
            firsts.setdefault(m, []).append(time.perf_counter() - t0)
    return times, {m: statistics.median(f) for m, f in firsts.items()}


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
    ap.add_argument("--one-at-a-time", action="store_true",
                    help="build, time and free each mode in turn (when they do not fit in memory together)")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    flights = [int(f) for f in args.flights.split(",")]

    with tempfile.TemporaryDirectory() as tmp:
        weights = write_random_weights(args.config, Path(tmp) / args.config, seed=0)
        groups = [[m] for m in modes] if args.one_at_a_time else [modes]
        times: dict[tuple[str, int], list[float]] = {}
        firsts: dict[str, float] = {}
        memory: dict[str, tuple[float, float]] = {}
        tokenizer = None
        for group in groups:
            engines = {m: Engine.from_dir(weights, dtype=parse_mode(m)[0], quantization=parse_mode(m)[1],
                                          cpu_threads=args.threads) for m in group}
            group_times, group_firsts = time_modes(engines, flights, args.rounds, args.steps)
            times.update(group_times)
            firsts.update(group_firsts)
            for m, engine in engines.items():
                memory[m] = fast_paths.weight_bytes(engine.gpt) / 1e6, packed_bytes(engine) / 1e6
                n, tokenizer = engine.cfg.num_tokens, engine.tokenizer  # the tokenizer is kept for the reference
            del engines
            gc.collect()
        reference_ms = reference_step_ms = None
        if args.reference:
            ref = ReferenceDecoder(args.reference, weights, tokenizer)
            t0 = time.perf_counter()
            ref.tokens_and_logits([GenerationRequest("benchmark object 0")])
            reference_ms = (time.perf_counter() - t0) / n * 1e3
            # Its decode steps alone (after the first token: prompt and prefill excluded), as the
            # engines' rows are timed; its first step is a forward over the whole padded sequence.
            reference_step_ms = (ref.picked_at[-1] - ref.picked_at[0]) / (len(ref.picked_at) - 1) * 1e3

    device = hardware(torch.device("cpu"))
    threads = torch.get_num_threads()
    print(f"\nDecode speed and weight memory by numerics mode: `{args.config}` random weights, {n} tokens an "
          f"object, greedy, guidance 3; median of {args.rounds} rounds of {args.steps} steps; {threads} threads; "
          f"{device}\n")
    head = " | ".join(f"ms/token at {k}" for k in flights) + " | " + " | ".join(f"objects/s at {k}" for k in flights)
    print(f"| mode | {head} | GPT weights MB | + packed copies MB |")
    print("|---|" + "---|" * (2 * len(flights) + 2))
    records = []
    for m in modes:
        ms = [statistics.median(times[m, k]) * 1e3 for k in flights]
        ops = [k / (n * t / 1e3) for k, t in zip(flights, ms)]
        mb, packed = memory[m]
        print(f"| {m} | " + " | ".join(f"{t:.2f}" for t in ms) + " | " + " | ".join(f"{o:.3g}" for o in ops)
              + f" | {mb:.1f} | {packed:.1f} |")
        for k, t, o in zip(flights, ms, ops):
            records.append(Record("quantization", device, args.config, m, k, ms_per_token=t, objects_per_second=o,
                                  extra={"gpt_weight_mb": mb, "packed_mb": packed, "threads": threads,
                                         "one_at_a_time": args.one_at_a_time}))
    if reference_ms is not None:
        print(f"| reference default (bf16 autocast), 1 object | {reference_step_ms:.2f} | | | | | |")
        records.append(Record("quantization", device, args.config, "reference default (bf16 autocast)", 1,
                              ms_per_token=reference_step_ms,
                              extra={"threads": threads, "whole_object_ms_per_token": reference_ms}))
    # Over a whole object at one in flight (prompt, first token and n - 1 steps): how the
    # reference's own "per token" figures count, and where its first step (a forward over the
    # whole padded sequence) weighs.
    whole = {}
    if 1 in flights:
        print("\nOver a whole object at 1 object in flight (prompt and first token included), ms/token:\n")
        print("| mode | first token ms | ms/token over the object |" + (" x the reference |" if reference_ms else ""))
        print("|---|---|---|" + ("---|" if reference_ms else ""))
        for m in modes:
            whole[m] = (firsts[m] + (n - 1) * statistics.median(times[m, 1])) / n * 1e3
            ratio = f" {reference_ms / whole[m]:.2f}x |" if reference_ms else ""
            print(f"| {m} | {firsts[m] * 1e3:.1f} | {whole[m]:.2f} |{ratio}")
        if reference_ms:
            print(f"| reference default (bf16 autocast) | {(reference_ms * n - reference_step_ms * (n - 1)):.1f} "
                  f"| {reference_ms:.2f} | 1.00x |")
        for r in records:
            if r.mode in whole and r.objects_in_flight == 1:
                r.extra.update(first_token_ms=firsts[r.mode] * 1e3, whole_object_ms_per_token=whole[r.mode])
    if reference_ms is not None:
        for m in modes:
            print(f"  {m}: {reference_step_ms / statistics.median(times[m, flights[0]]) / 1e3:.2f}x the reference "
                  f"per decode step at {flights[0]} object", file=sys.stderr)
    write_results(records, {"by": "python -m bench.quantization"})


if __name__ == "__main__":
    main()
