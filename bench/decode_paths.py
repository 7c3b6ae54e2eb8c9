"""Time per token of the engine's two decode paths, side by side in one process.

    generate_tokens   `Engine.generate_tokens` (what `cubeserve generate` runs), on the calling thread
    scheduler         `Scheduler.generate` (what the server runs), on the scheduler's decode thread

Both step a `DecodeRunner`; the figure is the decoding time of one object over its number of
tokens (for generate_tokens the whole call: runner, CLIP and prefill included, under 1 % here;
for the scheduler the ticket's admitted -> decoded time). The paths take turns for a few rounds at
each OpenMP thread count asked for, so a shared machine's drift reaches them all alike.

    python -m bench.decode_paths [--config tiny-long] [--threads 1,2] [--rounds 4] [--no-markdown]

Writes BENCHMARKS.md's `decode-paths` section.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time

import torch

from bench.common import hardware


def config(name: str):
    from cubeserve.config import TINY, get_config

    if name == "tiny-long":  # the tiny model with 1024 shape tokens (tests/test_faults.py)
        return dataclasses.replace(TINY, name="tiny-long",
                                   tokenizer=dataclasses.replace(TINY.tokenizer, num_encoder_latents=1024))
    return get_config(name)


def run(config_name: str = "tiny-long", thread_counts=(1, 2), rounds: int = 4) -> tuple[dict, list[str]]:
    from cubeserve.checkpoint import write_random_weights
    from cubeserve.engine import Engine, GenerationRequest
    from cubeserve.engine.scheduler import Scheduler

    load0 = os.getloadavg()[0]  # before anything of this run starts: other users' work
    cfg = config(config_name)
    weights = tempfile.mkdtemp(prefix="bench-decode-paths-")
    write_random_weights(cfg, weights, seed=1)
    engine = Engine.from_dir(weights, config=cfg)
    n = cfg.num_tokens
    request = GenerationRequest("a chair", seed=0, resolution=4)
    results: dict[tuple[str, int], list[float]] = {}
    reference = engine.generate_tokens([request])[0].tolist()  # warm-up, and the tokens both must make
    for _ in range(rounds):
        for threads in thread_counts:
            torch.set_num_threads(threads)  # process-wide: the scheduler's new threads take it too
            t0 = time.perf_counter()
            tokens = engine.generate_tokens([request])[0].tolist()
            results.setdefault(("generate_tokens", threads), []).append((time.perf_counter() - t0) / n)
            assert tokens == reference
            with Scheduler(engine, max_objects=1, mesh_process=False) as scheduler:
                result = scheduler.generate(request)
            results.setdefault(("scheduler", threads), []).append(result.stages.time_per_token_s)
            assert result.tokens == reference
            print(f"{threads} thread(s): generate_tokens {results['generate_tokens', threads][-1] * 1e3:.2f}, "
                  f"scheduler {results['scheduler', threads][-1] * 1e3:.2f} ms per token", flush=True)
    torch.set_num_threads(engine.cpu_threads.threads)
    figures = {f"{path} {threads}": [round(s * 1e3, 3) for s in v] for (path, threads), v in results.items()}
    lines = [
        f"`python -m bench.decode_paths --config {config_name} --threads {','.join(map(str, thread_counts))} "
        f"--rounds {rounds}` on {hardware(torch.device('cpu'))}, torch {torch.__version__}: {n} tokens, "
        f"1 object, greedy; ms per token, the median of {rounds} rounds (min-max). The machine's 1-minute "
        f"load average when the run began (other users' work): {load0:.1f}.",
        "",
        "| path | OpenMP threads | ms per token | min-max |",
        "|---|---|---|---|",
    ]
    for (path, threads), v in results.items():
        ms = [s * 1e3 for s in v]
        lines.append(f"| {path} | {threads} | {statistics.median(ms):.2f} | {min(ms):.2f}-{max(ms):.2f} |")
    return figures, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="tiny-long", help="tiny-long, or a preset (tiny, mid, ...)")
    parser.add_argument("--threads", default="1,2", help="OpenMP thread counts to compare, comma-separated")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--no-markdown", action="store_true", help="do not write BENCHMARKS.md")
    args = parser.parse_args()
    _, lines = run(args.config, tuple(int(t) for t in args.threads.split(",")), args.rounds)
    if not args.no_markdown:
        from bench.__main__ import update_markdown

        update_markdown("decode-paths", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
