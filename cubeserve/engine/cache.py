"""The static KV cache of the dual-stream decoder.

Dual layer l keeps one buffer pair [rows, heads, S + N, head_dim]: the condition keys and
values at slots 0..S-1 (written once per request at prefill) and shape position p at slot
S + p. Keys are stored after RoPE, so nothing is re-rotated per step (condition tokens sit at
position 0, where RoPE is the identity). Single layers keep [rows, heads, N, head_dim] in
`causal` mode; in `reference` mode the query only ever sees slot 0 (BOS), so they keep the
BOS value alone.

The model's blocks reach the cache through `cubeserve.model.gpt.Keys`: `ConditionPrefill` keeps
the condition stream's keys and values, `CacheStep` is one decode step's view of the cache,
`WindowStep` one window forward's (several positions per row, `engine/window.py`).
"""

from __future__ import annotations

import torch

from cubeserve.config import ModelConfig
from cubeserve.model.gpt import DualStreamGPT


class ConditionPrefill:
    """`Keys` of the condition stream run alone: causal among the condition tokens; keeps
    every dual layer's keys and values, [B, H, S, hd] in `dtype` (`kv`)."""

    single_block_mode = "causal"  # unused: prefill runs no single block
    rot = None
    single_mask = None

    def __init__(self, cond_len: int, dtype: torch.dtype, device):
        self.dtype = dtype
        self.mask = torch.ones(cond_len, cond_len, dtype=torch.bool, device=device).tril()
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    def dual(self, layer, k, v):
        self.kv.append((k.to(self.dtype), v.to(self.dtype)))
        return self.kv[-1]

    def dual_mask(self, cond_queries, shape_queries):
        return self.mask


@torch.no_grad()
def prefill_condition(gpt: DualStreamGPT, cond: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Condition keys/values of every dual layer, [B, H, S, hd] each, in `dtype`: they depend
    on the prompt alone (condition tokens never see shape tokens)."""
    keys = ConditionPrefill(cond.shape[1], dtype, cond.device)
    gpt.prefill(cond, keys)
    return keys.kv


# Row stride of an additive mask, in elements: the memory-efficient attention kernel pads (a copy
# in every layer) a mask whose rows do not start at such a multiple; xformers' bias rule.
MASK_ALIGNMENT = 16


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """allowed [R, L] or [R, T, L] (bool; T queries per row) -> [R, 1, T, L] in `dtype`, 0 where
    allowed and -inf elsewhere: a view of an [R, 1, T, L'] buffer, L' = L rounded up to
    MASK_ALIGNMENT."""
    rows, length = allowed.shape[0], allowed.shape[-1]
    queries = allowed.shape[1] if allowed.dim() == 3 else 1
    padded = -(-length // MASK_ALIGNMENT) * MASK_ALIGNMENT
    mask = torch.full((rows, 1, queries, padded), float("-inf"), dtype=dtype, device=allowed.device)[..., :length]
    return mask.masked_fill_(allowed.view(rows, 1, queries, length), 0.0)


class CacheStep:
    """`Keys` of one decode step for cache rows 0..R-1, one new token per row at `positions`.

    `live` (host int) = 1 + the largest position: attention reads only the first S + live
    slots. With `uniform` (every row at position live - 1, which the host knows) no mask is
    needed, writes are plain slices, and in reference mode past position 0 the single
    blocks' output is the cached BOS value alone.
    """

    def __init__(self, cache: "KVCache", n_rows: int, positions: torch.Tensor, rot: torch.Tensor,
                 live: int, uniform: bool):
        s = cache.cond_len
        self.cache, self.n_rows, self.positions, self.live, self.uniform = cache, n_rows, positions, live, uniform
        self.single_block_mode = cache.single_block_mode
        self.rot = rot
        self.mask = self.single_mask = None
        if uniform:
            self.dual_slot, self.single_slot = s + live - 1, live - 1
        else:
            # Additive masks, built once a step: SDPA would convert a boolean one in every layer.
            slots = torch.arange(s + live, device=positions.device)
            self.mask = additive_mask(slots[None, :] <= (s + positions)[:, None], cache.dtype)
            if self.single_block_mode == "causal":
                self.single_mask = additive_mask(slots[None, :live] <= positions[:, None], cache.dtype)
            row_ids = torch.arange(n_rows, device=positions.device)
            self.dual_slot = (row_ids, slice(None), s + positions)
            self.single_slot = (row_ids, slice(None), positions)

    def _write(self, cache: torch.Tensor, slot, value: torch.Tensor) -> None:
        """Store value [R, H, 1, hd] at each row's slot: one slice for all rows when uniform."""
        if self.uniform:
            cache[:, :, slot] = value[:, :, 0]
        else:
            cache[slot] = value[:, :, 0].to(cache.dtype)

    def dual(self, layer, k, v):
        end = self.cache.cond_len + self.live
        kc, vc = self.cache.dual_k[layer][: self.n_rows], self.cache.dual_v[layer][: self.n_rows]
        self._write(kc, self.dual_slot, k)
        self._write(vc, self.dual_slot, v)
        return kc[:, :, :end], vc[:, :, :end]

    def dual_mask(self, cond_queries, shape_queries):
        return self.mask

    def single(self, layer, k, v):
        kc, vc = self.cache.single_k[layer][: self.n_rows], self.cache.single_v[layer][: self.n_rows]
        self._write(kc, self.single_slot, k)
        self._write(vc, self.single_slot, v)
        return kc[:, :, : self.live], vc[:, :, : self.live]

    def bos_value(self, layer):
        # Past position 0 on every row (the host knows when) the cache holds it.
        return self.cache.single_v[layer][: self.n_rows] if self.uniform and self.live > 1 else None

    def keep_bos_value(self, layer, v):
        # Computed for every row and selected (no host sync): a row at position 0 keeps its own.
        vcache = self.cache.single_v[layer][: self.n_rows]
        y = torch.where((self.positions == 0)[:, None, None, None], v.to(vcache.dtype), vcache)
        vcache.copy_(y)
        return y


class WindowStep:
    """`Keys` of one window forward (`engine/window.py`): T tokens per cache row 0..R-1, row r's
    at `positions` [R, T] (consecutive). Every token's keys and values are written before
    attention and query t sees the slots up to its own position: a rejected guess's entry is
    overwritten by the next window, which starts there, before any query may read it.

    `live` (host int) = 1 + the largest position of a row whose results are kept; `at_bos` (host
    bool): some such row's window starts at BOS (reference mode computes its BOS value then)."""

    def __init__(self, cache: "KVCache", n_rows: int, positions: torch.Tensor, rot: torch.Tensor, live: int,
                 at_bos: bool = True):
        s = cache.cond_len
        self.cache, self.n_rows, self.positions, self.live, self.at_bos = cache, n_rows, positions, live, at_bos
        self.single_block_mode = cache.single_block_mode
        self.rot = rot
        slots = torch.arange(s + live, device=positions.device)
        self.mask = additive_mask(slots <= (s + positions)[..., None], cache.dtype)
        self.single_mask = (additive_mask(slots[:live] <= positions[..., None], cache.dtype)
                            if self.single_block_mode == "causal" else None)

    def _write(self, cache: torch.Tensor, slots: torch.Tensor, value: torch.Tensor) -> None:
        """Store value [R, H, T, hd] at each row's slots [R, T]."""
        _, h, _, hd = value.shape
        cache.scatter_(2, slots[:, None, :, None].expand(-1, h, -1, hd), value.to(cache.dtype))

    def dual(self, layer, k, v):
        s, end = self.cache.cond_len, self.cache.cond_len + self.live
        kc, vc = self.cache.dual_k[layer][: self.n_rows], self.cache.dual_v[layer][: self.n_rows]
        self._write(kc, s + self.positions, k)
        self._write(vc, s + self.positions, v)
        return kc[:, :, :end], vc[:, :, :end]

    def dual_mask(self, cond_queries, shape_queries):
        return self.mask

    def single(self, layer, k, v):
        kc, vc = self.cache.single_k[layer][: self.n_rows], self.cache.single_v[layer][: self.n_rows]
        self._write(kc, self.positions, k)
        self._write(vc, self.positions, v)
        return kc[:, :, : self.live], vc[:, :, : self.live]

    def bos_value(self, layer):
        # Reference mode: every query sees BOS alone, whose value the cache holds past BOS.
        if self.at_bos:
            return None
        return self.cache.single_v[layer][: self.n_rows].expand(-1, -1, self.positions.shape[1], -1)

    def keep_bos_value(self, layer, v):
        # A row whose window starts at 0 holds BOS: its value is computed and kept.
        vcache = self.cache.single_v[layer][: self.n_rows]
        first = (self.positions[:, 0] == 0)[:, None, None, None]
        vcache.copy_(torch.where(first, v[:, :, :1].to(vcache.dtype), vcache))
        return vcache.expand(-1, -1, v.shape[2], -1)


class KVCache:
    def __init__(self, cfg: ModelConfig, rows: int, device, dtype: torch.dtype, single_block_mode: str,
                 window: int = 1):
        """`window`: tokens per row a forward may write (`WindowStep`); a window starting at the
        last position N - 1 writes up to N + window - 2, so the shape slots are N + window - 1."""
        g = cfg.gpt
        self.cond_len = cfg.cond_len
        self.num_tokens = cfg.num_tokens
        self.rows = rows
        self.dtype = dtype
        self.single_block_mode = single_block_mode
        shape_slots = cfg.num_tokens + window - 1
        dual_shape = (rows, g.n_head, cfg.cond_len + shape_slots, g.head_dim)
        self.dual_k = [torch.zeros(dual_shape, device=device, dtype=dtype) for _ in range(g.n_layer)]
        self.dual_v = [torch.zeros(dual_shape, device=device, dtype=dtype) for _ in range(g.n_layer)]
        single_slots = shape_slots if single_block_mode == "causal" else 1
        single_shape = (rows, g.n_head, single_slots, g.head_dim)
        self.single_k = ([torch.zeros(single_shape, device=device, dtype=dtype) for _ in range(g.n_single_layer)]
                         if single_block_mode == "causal" else [])
        self.single_v = [torch.zeros(single_shape, device=device, dtype=dtype) for _ in range(g.n_single_layer)]

    def step(self, n_rows: int, positions: torch.Tensor, rot: torch.Tensor, live: int, uniform: bool) -> CacheStep:
        return CacheStep(self, n_rows, positions, rot, live, uniform)

    def window(self, n_rows: int, positions: torch.Tensor, rot: torch.Tensor, live: int,
               at_bos: bool = True) -> WindowStep:
        return WindowStep(self, n_rows, positions, rot, live, at_bos)

    def set_condition(self, rows: slice, cond_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Write prefilled condition keys/values [n, H, S, hd] (or broadcastable) into `rows`."""
        s = self.cond_len
        for layer, (k, v) in enumerate(cond_kv):
            self.dual_k[layer][rows, :, :s] = k
            self.dual_v[layer][rows, :, :s] = v

    def read_bytes(self, rows: int, live: int) -> int:
        """Bytes that a decode step of `rows` rows, all at position live - 1, reads from the
        cache: each dual layer's keys and values over S + live slots, each single layer's over
        `live` slots (causal) or its BOS value (reference)."""
        def size(t: torch.Tensor, slots: int) -> int:
            return rows * t.shape[1] * slots * t.shape[3] * t.element_size()

        dual = sum(size(t, self.cond_len + live) for t in self.dual_k + self.dual_v)
        if self.single_block_mode == "causal":
            return dual + sum(size(t, live) for t in self.single_k + self.single_v)
        return dual + sum(size(t, 1) for t in self.single_v)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.dual_k + self.dual_v + self.single_k + self.single_v)
