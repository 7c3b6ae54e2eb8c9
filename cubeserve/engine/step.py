"""The cached computation: condition prefill once per prompt, then one shape token per step.

These functions reuse the GPT's per-stream modules (`cubeserve.model.gpt`) and differ from
`DualStreamGPT.forward_uncached` only in what they keep: the condition stream never runs
again after prefill, and each step computes one token per row against the cache.
"""

from __future__ import annotations

import torch

from cubeserve.engine.cache import KVCache
from cubeserve.model.gpt import DualStreamGPT
from cubeserve.model.layers import attention, layer_norm, merge_heads


@torch.no_grad()
def prefill_condition(gpt: DualStreamGPT, cond: torch.Tensor, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Condition keys/values of every dual layer, [B, H, S, hd] each, in `dtype`.

    Condition tokens attend causally among themselves and never see shape tokens, so these
    depend on the prompt alone. They all sit at RoPE position 0, where the rotation is the
    identity, so no rotation is applied.
    """
    eps = gpt.cfg.eps
    c = cond.float()
    out = []
    for block in gpt.transformer.dual_blocks:
        q, k, v = block.attn.pre_c(layer_norm(c, eps))
        k, v = k.to(dtype), v.to(dtype)
        out.append((k, v))
        if not block.last:
            y = attention(q.to(dtype), k, v, is_causal=True)
            c = block.post_2(c, merge_heads(y))
    return out


@torch.no_grad()
def decode_step(gpt: DualStreamGPT, cache: KVCache, x: torch.Tensor, positions: torch.Tensor,
                live: int, uniform: bool) -> torch.Tensor:
    """One shape token per row: x [R, D] (fp32 embeddings) at `positions` [R] -> logits [R, V].

    Runs cache rows 0..R-1. `live` (host int) = 1 + the largest position in the batch:
    attention reads only the first S + live cache slots. With `uniform` (every row at position
    live - 1, which the host knows) no mask is needed and cache writes are plain slices.
    """
    cfg = gpt.cfg
    eps = cfg.eps
    s = cache.cond_len
    n_rows = x.shape[0]
    dtype = cache.dual_k[0].dtype
    x = x.float()[:, None, :]  # [R, 1, D]
    rot = gpt.rope(positions[:, None])  # [R, 1, hd/2]
    if uniform:
        dual_mask, single_mask = None, None
        dual_slot, single_slot = s + live - 1, live - 1  # ints: writes are slices
    else:
        slots = torch.arange(s + live, device=x.device)
        dual_mask = (slots[None, :] <= (s + positions)[:, None])[:, None, None, :]
        single_mask = (slots[None, :live] <= positions[:, None])[:, None, None, :]
        row_ids = torch.arange(n_rows, device=x.device)
        dual_slot, single_slot = (row_ids, slice(None), s + positions), (row_ids, slice(None), positions)

    for layer, block in enumerate(gpt.transformer.dual_blocks):
        q, k, v = block.attn.pre_x(layer_norm(x, eps), rot)
        kc, vc = cache.dual_k[layer][:n_rows], cache.dual_v[layer][:n_rows]
        _write(kc, dual_slot, k, uniform)
        _write(vc, dual_slot, v, uniform)
        y = attention(q.to(dtype), kc[:, :, : s + live], vc[:, :, : s + live], mask=dual_mask)
        x = block.post_1(x, merge_heads(y))

    for layer, block in enumerate(gpt.transformer.single_blocks):
        h = layer_norm(x, eps)
        vcache = cache.single_v[layer][:n_rows]
        if cache.single_block_mode == "reference":
            # The reference's cached decode lets every query see slot 0 only (BOS), so the
            # attention output is BOS's value: kept from the row's position-0 step. Past
            # position 0 on every row (the host knows when) that is the cache alone; otherwise
            # v is computed for every row and selected, which avoids a host sync.
            if uniform and live > 1:
                y = vcache
            else:
                y = torch.where((positions == 0)[:, None, None, None], block.attn.value(h).to(dtype), vcache)
                vcache.copy_(y)
        else:
            q, k, v = block.attn.qkv(h, rot)
            kc = cache.single_k[layer][:n_rows]
            _write(kc, single_slot, k, uniform)
            _write(vcache, single_slot, v, uniform)
            y = attention(q.to(dtype), kc[:, :, :live], vcache[:, :, :live], mask=single_mask)
        x = block.update(x, merge_heads(y.to(dtype)))
    return gpt.logits(x)[:, 0]


def _write(cache: torch.Tensor, slot, value: torch.Tensor, uniform: bool) -> None:
    """Store value [R, H, 1, hd] at each row's slot: one slice for all rows when uniform."""
    if uniform:
        cache[:, :, slot] = value[:, :, 0]
    else:
        cache[slot] = value[:, :, 0].to(cache.dtype)
