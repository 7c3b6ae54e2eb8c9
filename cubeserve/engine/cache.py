"""The static KV cache of the dual-stream decoder.

Dual layer l keeps one buffer pair [rows, heads, S + N, head_dim]: the condition keys and
values at slots 0..S-1 (written once per request at prefill) and shape position p at slot
S + p. Keys are stored after RoPE, so nothing is re-rotated per step (condition tokens sit at
position 0, where RoPE is the identity). Single layers keep [rows, heads, N, head_dim] in
`causal` mode; in `reference` mode the query only ever sees slot 0 (BOS), so they keep the
BOS value alone.
"""

from __future__ import annotations

import torch

from cubeserve.config import ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, rows: int, device, dtype: torch.dtype, single_block_mode: str):
        g = cfg.gpt
        self.cond_len = cfg.cond_len
        self.num_tokens = cfg.num_tokens
        self.rows = rows
        self.single_block_mode = single_block_mode
        dual_shape = (rows, g.n_head, cfg.cond_len + cfg.num_tokens, g.head_dim)
        self.dual_k = [torch.zeros(dual_shape, device=device, dtype=dtype) for _ in range(g.n_layer)]
        self.dual_v = [torch.zeros(dual_shape, device=device, dtype=dtype) for _ in range(g.n_layer)]
        single_slots = cfg.num_tokens if single_block_mode == "causal" else 1
        single_shape = (rows, g.n_head, single_slots, g.head_dim)
        self.single_k = ([torch.zeros(single_shape, device=device, dtype=dtype) for _ in range(g.n_single_layer)]
                         if single_block_mode == "causal" else [])
        self.single_v = [torch.zeros(single_shape, device=device, dtype=dtype) for _ in range(g.n_single_layer)]

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
