"""Decode speed, throughput, bandwidth use and geometry, measured side by side in one run.

On CUDA: the full v0.1 and v0.5 shapes with random weights (same cost as the real ones) in
bfloat16, captured graphs vs the plain eager cached loop vs the uncached forward. On the CPU:
the `mid` config (width 512, 6 dual layers, 16384 codes, 512 tokens) in float32.
"""

from __future__ import annotations

import resource
import tempfile
import time

import torch

from bench.common import Record, sync, timed

CLIP_SEED = 0


def build_engine(config: str, device: torch.device, dtype: torch.dtype):
    from cubeserve.checkpoint import init_random_models
    from cubeserve.config import get_config
    from cubeserve.engine import Engine
    from cubeserve.model.text import TextEncoder, build_tiny_clip

    cfg = get_config(config)
    gpt, tok = init_random_models(cfg, seed=0, device=device)
    clip_dir = build_tiny_clip(tempfile.mkdtemp(prefix="bench-clip-"), cfg.gpt.text_model_embed_dim, seed=CLIP_SEED)
    return Engine(cfg, gpt, tok, TextEncoder(clip_dir, device), device=device, dtype=dtype)


def memory_bandwidth(device: torch.device) -> float:
    """Read bandwidth in GB/s: the best of several full reductions over a large buffer."""
    n = (1 << 30 if device.type == "cuda" else 1 << 28) // 4
    x = torch.ones(n, device=device)
    best = timed(x.sum, device, repeat=10)
    return n * 4 / best / 1e9


def time_steps(pool, steps: int) -> float:
    device = pool.engine.device
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        pool.step()
    sync(device)
    return (time.perf_counter() - t0) / steps


def run(config: str, device: torch.device, dtype: torch.dtype, flights=(1, 8, 32), window: int | None = None,
        resolutions=(5, 6, 8), dense_max_resolution: int = 8) -> tuple[list[Record], list[str]]:
    from cubeserve.checkpoint import parameter_counts
    from cubeserve.config import get_config
    from cubeserve.engine import GenerationRequest
    from cubeserve.engine import geometry
    from cubeserve.engine.batch import SlotPool

    cfg = get_config(config)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    engine = build_engine(config, device, dtype)
    n = cfg.num_tokens
    window = window or n  # steps timed per measurement
    element = torch.finfo(dtype).bits // 8
    step_bytes = parameter_counts(cfg)["decode_parameters"] * element
    bandwidth = memory_bandwidth(device)
    dev_name = str(device)
    records, rows = [], []

    def requests(k):
        return [GenerationRequest(f"benchmark object {i}") for i in range(k)]

    modes = [("graphs", True), ("eager cached", False)] if cuda else [("eager cached", False)]
    results = {}
    for mode, graphs in modes:
        for k in flights:
            t0 = time.perf_counter()
            pool = SlotPool(engine, k, graphs=graphs, graph_buckets=(k,), length_buckets=4)
            capture = time.perf_counter() - t0
            sync(device)
            t0 = time.perf_counter()
            pool.admit(requests(k))
            pool.step()
            sync(device)
            ttft = time.perf_counter() - t0
            step = time_steps(pool, min(window, n - 1))
            results[(mode, k)] = step
            rec = Record("engine", dev_name, config, mode, k, ms_per_token=step * 1e3,
                         objects_per_second=k / (step * n), gb_per_second=step_bytes / step / 1e9,
                         extra={"time_to_first_token_s": ttft, "capture_s": capture if graphs else 0.0,
                                "bandwidth_share": step_bytes / step / 1e9 / bandwidth, "steps_timed": min(window, n - 1)})
            records.append(rec)
            rows.append(f"| {mode} | {k} | {step * 1e3:.2f} | {k / (step * n):.2f} | {ttft * 1e3:.0f} | "
                        f"{step_bytes / step / 1e9:.1f} ({100 * step_bytes / step / 1e9 / bandwidth:.0f} %) |")
            del pool

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
    rows.append(f"| uncached forward (first {uncached_tokens} tokens) | 1 | {uncached * 1e3:.2f} | - | - | - |")

    # Geometry: dense grid vs coarse-to-fine, one object.
    tokens = engine.generate_tokens(req) if n <= 512 else torch.randint(0, cfg.tokenizer.num_codes, (1, n), device=device)
    latents = engine.tokenizer.decode_tokens(tokens.to(device))
    geo_rows = []
    for r in resolutions:
        fine = timed(lambda: geometry.occupancy_grid_coarse_to_fine(engine.tokenizer, latents, r), device)
        dense = timed(lambda: geometry.occupancy_grid(engine.tokenizer, latents, r), device) if r <= dense_max_resolution else None
        grid = geometry.occupancy_grid_coarse_to_fine(engine.tokenizer, latents, r)
        mc = timed(lambda: geometry.marching_cubes(grid, r), device)
        records.append(Record("geometry", dev_name, config, f"resolution {r}", 1,
                              extra={"coarse_to_fine_s": fine, "dense_s": dense, "marching_cubes_s": mc}))
        geo_rows.append(f"| {r} | {geometry.grid_size(r)}^3 | {dense if dense is None else f'{dense:.3f}'} | "
                        f"{fine:.3f} | {mc:.3f} |")

    peak = (torch.cuda.max_memory_allocated(device) / 2**30 if cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
    eager1 = results[("eager cached", 1)]
    lines = [
        f"Config `{config}` ({dtype}), {n} tokens per object, guidance on (2 rows per object). "
        f"One decode step reads {step_bytes / 1e9:.3f} GB of weights; measured read bandwidth "
        f"{bandwidth:.0f} GB/s. Time per token = one decode step (steps timed: {min(window, n - 1)}); "
        f"objects/s counts decoding only.",
        "",
        "| mode | objects in flight | ms per token | objects/s | time to first token (ms) | weight GB/s (share of bandwidth) |",
        "|---|---|---|---|---|---|",
        *rows,
        "",
        f"Ratios in this run: uncached forward / eager cached at 1 object = {uncached / eager1:.1f}x"
        + (f"; eager cached / graphs at 1 object = {eager1 / results[('graphs', 1)]:.1f}x" if cuda else "")
        + f"; objects/s at {max(flights)} vs 1 object in flight = "
        + f"{(max(flights) / results[(modes[0][0], max(flights))]) / (1 / results[(modes[0][0], 1)]):.1f}x.",
        "",
        "Geometry, one object (seconds): occupancy on the dense grid vs coarse-to-fine (same mesh), and marching cubes.",
        "",
        "| resolution | grid | dense | coarse-to-fine | marching cubes |",
        "|---|---|---|---|---|",
        *geo_rows,
        "",
        f"Peak memory: {peak:.2f} GiB ({'CUDA allocated' if cuda else 'process RSS'}).",
    ]
    return records, lines
