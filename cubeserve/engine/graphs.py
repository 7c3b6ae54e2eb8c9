"""CUDA graphs of the whole decode step, one per (slot bucket, cache-length bucket).

A step (`SlotPool.compute`: 24 layers, guidance, sampling, token write, next embedding,
position update) launches hundreds of small kernels; at batch 1 their launch cost exceeds
the GPU time. Captured once at start-up and replayed, a step is one launch and never waits
for the host. Batches are padded to the next slot bucket (padding slots are free, so their
results are discarded on the device). Attention reads only the first S + L cache slots, L the
next cache-length bucket above the longest live sequence, so short sequences do not pay for
the whole cache. All graphs share one memory pool: they never run concurrently.
"""

from __future__ import annotations

import logging
import math
import time

import torch

log = logging.getLogger(__name__)


class DecodeGraphs:
    def __init__(self, pool, slot_buckets: tuple[int, ...], length_buckets: int, capture: bool = True):
        """`capture=False` replays the very same bucketed, padded, masked step eagerly: what the
        graphs compute, runnable (and tested) on a machine without CUDA."""
        if capture and pool.engine.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device; the CPU runs the same step eagerly")
        self.pool = pool
        n = pool.num_tokens
        self.slot_buckets = sorted({b for b in slot_buckets if b < pool.max_objects} | {pool.max_objects})
        self.length_buckets = sorted({math.ceil(n * (i + 1) / length_buckets) for i in range(length_buckets)})
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.capture_seconds = self._capture() if capture else 0.0

    def _capture(self) -> float:
        pool = self.pool
        if pool.busy_slots:
            raise RuntimeError("capture before admitting requests: warm-up steps overwrite slot state")
        device = pool.engine.device
        keys = [(k, length) for k in self.slot_buckets for length in self.length_buckets]
        start = time.perf_counter()
        # Warm up on a side stream (lazy initialisation, kernel selection, allocator), as
        # torch.cuda.graph requires. No slot is busy, so tokens and positions stay untouched.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for k, length in keys:
                for _ in range(2):
                    pool.compute(k, length, uniform=False)
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)
        memory = torch.cuda.graph_pool_handle()
        for k, length in sorted(keys, reverse=True):  # largest first: the others fit in its memory
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=memory):
                pool.compute(k, length, uniform=False)
            self.graphs[(k, length)] = graph
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        log.info("captured %d decode graphs (slots %s x cache lengths %s) in %.1f s",
                 len(self.graphs), self.slot_buckets, self.length_buckets, seconds)
        return seconds

    def bucket(self, k: int, live: int) -> tuple[int, int]:
        return (next(b for b in self.slot_buckets if b >= k), next(n for n in self.length_buckets if n >= live))

    def replay(self, k: int, live: int) -> None:
        key = self.bucket(k, live)
        if self.graphs:
            self.graphs[key].replay()
        else:
            self.pool.compute(*key, uniform=False)
