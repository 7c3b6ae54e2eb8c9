"""Decode speed, throughput, bandwidth use and geometry, measured side by side in one run.

On CUDA: the full v0.1 and v0.5 shapes with random weights (same cost as the real ones) in
bfloat16, captured graphs vs the plain eager cached loop vs the uncached forward. On the CPU:
the `mid` config (width 512, 6 dual layers, 16384 codes, 512 tokens) in float32.
"""

from __future__ import annotations

import gc
import resource
import statistics
import tempfile
import time

import torch

from bench.common import Record, sync, timed

CLIP_SEED = 0
MARCHING_CUBES_NAMES = {"skimage": "scikit-image, on the CPU", "warp": "NVIDIA Warp, on the GPU"}


def build_engine(config: str, device: torch.device, dtype: torch.dtype, cpu_threads: int | None = None):
    from cubeserve.checkpoint import init_random_models
    from cubeserve.config import get_config
    from cubeserve.engine import Engine
    from cubeserve.model.text import TextEncoder, build_tiny_clip

    cfg = get_config(config)
    gpt, tok = init_random_models(cfg, seed=0, device=device)
    clip_dir = build_tiny_clip(tempfile.mkdtemp(prefix="bench-clip-"), cfg.gpt.text_model_embed_dim, seed=CLIP_SEED)
    return Engine(cfg, gpt, tok, TextEncoder(clip_dir, device), device=device, dtype=dtype, cpu_threads=cpu_threads)


class ReadBandwidth:
    """Read bandwidth in GB/s: the best of a few full reductions over a buffer far larger than
    the caches (1 GiB on a GPU, 256 MiB on the CPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffer = torch.ones((1 << 30 if device.type == "cuda" else 1 << 28) // 4, device=device)

    def __call__(self, repeat: int = 3) -> float:
        return self.buffer.numel() * 4 / timed(self.buffer.sum, self.device, repeat=repeat) / 1e9


def time_steps(runner, steps: int, device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        runner.step()
    sync(device)
    return (time.perf_counter() - t0) / steps


def run(config: str, device: torch.device, dtype: torch.dtype, flights=(1, 8, 32), window: int | None = None,
        resolutions=(5, 6, 8), dense_max_resolution: int = 8) -> tuple[list[Record], list[str]]:
    from cubeserve.checkpoint import parameter_counts
    from cubeserve.config import get_config
    from cubeserve.engine import GenerationRequest
    from cubeserve.engine import geometry

    cfg = get_config(config)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    engine = build_engine(config, device, dtype)
    n = cfg.num_tokens
    window = min(window or n, n - 1)  # steps timed per row of the table, from position 1
    element = torch.finfo(dtype).bits // 8
    step_bytes = parameter_counts(cfg, engine.single_block_mode)["decode_parameters"] * element
    bandwidth = ReadBandwidth(device)
    dev_name = str(device)
    records, rows = [], []

    def requests(k):
        return [GenerationRequest(f"benchmark object {i}") for i in range(k)]

    # Every runner first (capture, admission, first token), then timed rounds that visit every
    # runner in turn, each visit right after a read-bandwidth measurement; round r covers the
    # same positions in every runner. On a shared machine the bandwidth left to us drifts (a
    # 2-core VM's read bandwidth measured anywhere from 29 to 58 GB/s within minutes): this
    # compares flights and modes under the same conditions and each step with the bandwidth
    # of its own moment.
    modes = [("graphs", True), ("eager cached", False)] if cuda else [("eager cached", False)]
    runners, setup = {}, {}
    for mode, graphs in modes:
        for k in flights:
            t0 = time.perf_counter()
            runner = engine.decode_runner(k, graph_buckets=(k,) if graphs else None, length_buckets=4)
            capture = time.perf_counter() - t0
            sync(device)
            t0 = time.perf_counter()
            runner.admit(requests(k))
            runner.step()
            sync(device)
            runners[(mode, k)] = runner
            setup[(mode, k)] = (capture if graphs else 0.0, time.perf_counter() - t0)
    rounds = 4
    steps = max(1, window // rounds)
    timed_rounds = {key: [] for key in runners}  # (seconds per step, read GB/s, cache bytes per step) per round
    for _ in range(rounds):
        for (mode, k), runner in runners.items():
            first = runner.generated[0] + 1  # live positions at the round's first step
            cache_bytes = statistics.mean(runner.cache.read_bytes(2 * k, live) for live in range(first, first + steps))
            gbps = bandwidth()
            timed_rounds[(mode, k)].append((time_steps(runner, steps, device), gbps, cache_bytes))
    del runners, runner

    results = {}
    for (mode, k), measured in timed_rounds.items():
        step = statistics.mean(t for t, _, _ in measured)  # rounds are equally long: the mean step
        gbps = statistics.mean(g for _, g, _ in measured)
        share = statistics.mean(step_bytes / t / 1e9 / g for t, g, _ in measured)
        cache_bytes = statistics.mean(c for _, _, c in measured)
        share_all = statistics.mean((step_bytes + c) / t / 1e9 / g for t, g, c in measured)
        capture, ttft = setup[(mode, k)]
        results[(mode, k)] = step
        records.append(Record("engine", dev_name, config, mode, k, ms_per_token=step * 1e3,
                              objects_per_second=k / (step * n), gb_per_second=step_bytes / step / 1e9,
                              extra={"time_to_first_token_s": ttft, "capture_s": capture,
                                     "read_bandwidth_gb_per_second": gbps, "bandwidth_share": share,
                                     "cache_bytes_per_step": cache_bytes, "bandwidth_share_with_cache": share_all,
                                     "steps_timed": steps * rounds}))
        rows.append(f"| {mode} | {k} | {step * 1e3:.2f} | {k / (step * n):.2f} | {ttft * 1e3:.0f} | "
                    f"{step_bytes / step / 1e9:.1f} | {cache_bytes / 1e6:.0f} | {gbps:.0f} | "
                    f"{100 * share:.0f} % | {100 * share_all:.0f} % |")

    def ratio(num, den):
        return results[num] / results[den]

    # The reference's uncached mode: the full forward over the prefix at every step (1 object).
    uncached_tokens = min(window, 64)
    req = requests(1)
    sync(device)
    t0 = time.perf_counter()
    cond = torch.cat([engine.condition([r.prompt for r in req], [None]), engine.condition([""], [None])])
    seq = torch.full((2, 1), cfg.gpt.bos_id, dtype=torch.int64, device=device)
    for _ in range(uncached_tokens):
        logits = engine.gpt.forward_uncached(engine.gpt.embed_tokens(seq), cond, engine.single_block_mode,
                                             compute_dtype=dtype)[:, -1]
        ids = logits[:1, : cfg.gpt.shape_model_vocab_size].argmax(-1)
        seq = torch.cat([seq, ids.repeat(2)[:, None]], dim=1)
    sync(device)
    uncached = (time.perf_counter() - t0) / uncached_tokens
    records.append(Record("engine", dev_name, config, "uncached forward", 1, ms_per_token=uncached * 1e3,
                          extra={"tokens_timed": uncached_tokens}))
    rows.append(f"| uncached forward (first {uncached_tokens} tokens) | 1 | {uncached * 1e3:.2f} | - | - | - | - | - | - | - |")

    # Geometry: dense grid vs coarse-to-fine, one object.
    tokens = engine.generate_tokens(req) if n <= 512 else torch.randint(0, cfg.tokenizer.num_codes, (1, n), device=device)
    latents = engine.tokenizer.decode_tokens(tokens.to(device))
    geo_rows = []
    for r in resolutions:
        fine = timed(lambda: geometry.occupancy_grid_coarse_to_fine(engine.tokenizer, latents, r), device)
        dense = timed(lambda: geometry.occupancy_grid(engine.tokenizer, latents, r), device) if r <= dense_max_resolution else None
        grid = geometry.occupancy_grid_coarse_to_fine(engine.tokenizer, latents, r)
        mc = timed(lambda: geometry.marching_cubes(grid, r), device)
        mc_backend = geometry.marching_cubes_backend(grid)
        records.append(Record("geometry", dev_name, config, f"resolution {r}", 1,
                              extra={"coarse_to_fine_s": fine, "dense_s": dense, "marching_cubes_s": mc,
                                     "marching_cubes_backend": mc_backend}))
        geo_rows.append(f"| {r} | {geometry.grid_size(r)}^3 | {'-' if dense is None else f'{dense:.3f}'} | "
                        f"{fine:.3f} | {mc:.3f} |")

    peak = (torch.cuda.max_memory_allocated(device) / 2**30 if cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
    if cuda:  # hand the caches' memory back before the next config builds its runners
        del engine, latents
        gc.collect()
        torch.cuda.empty_cache()
    main_mode = modes[0][0]
    ratio_lines = [f"uncached forward (its first {uncached_tokens} tokens) / eager cached at 1 object = "
                   f"{uncached / results[('eager cached', 1)]:.1f}x"]
    if cuda:
        ratio_lines.append(f"eager cached / graphs at 1 object = {ratio(('eager cached', 1), ('graphs', 1)):.1f}x")
    for k in flights[1:]:
        ratio_lines.append(f"objects/s at {k} vs 1 object in flight ({main_mode}) = "
                           f"{k * ratio((main_mode, 1), (main_mode, k)):.1f}x")
    lines = [
        f"Config `{config}` ({dtype}), {n} tokens per object, guidance on (2 rows per object). "
        f"One decode step reads {step_bytes / 1e9:.3f} GB of weights. Time per token = the mean decode "
        f"step over positions 1..{steps * rounds} ({'the whole object' if steps * rounds >= n - rounds else 'a window'}), "
        f"timed in {rounds} rounds of {steps} steps; every round visits every row of the table in "
        f"turn, each visit right after a read-bandwidth measurement (the best of 3 sums over a large "
        f"buffer), and the share is the mean over rounds of weight GB/s over that visit's read GB/s. "
        f"Attention's cache reads grow with the position: the cache column is the mean of the live "
        f"part a step reads (keys and values up to its position), and the last column counts "
        f"them with the weights. objects/s counts decoding only.",
        "",
        "| mode | objects in flight | ms per token | objects/s | time to first token (ms) | weight GB/s | "
        "cache MB a step | read GB/s (paired) | share of bandwidth (weights) | share (weights + cache) |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "Ratios in this run: "
        + "; ".join(ratio_lines) + ".",
        "",
        "Geometry, one object (seconds): occupancy on the dense grid vs coarse-to-fine (same mesh), and marching "
        f"cubes ({MARCHING_CUBES_NAMES[mc_backend]})"
        + (f"; the dense grid is timed up to resolution {dense_max_resolution}." if dense_max_resolution < max(resolutions) else "."),
        "",
        "| resolution | grid | dense | coarse-to-fine | marching cubes |",
        "|---|---|---|---|---|",
        *geo_rows,
        "",
        f"Peak memory: {peak:.2f} GiB ({'CUDA allocated' if cuda else 'process RSS'}; the runners of every row "
        f"above are alive at once).",
    ]
    return records, lines
