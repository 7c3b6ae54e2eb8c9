"""The cached computation: condition prefill once per prompt, then one shape token per step.

These functions reuse the GPT's per-stream modules (`cubeserve.model.gpt`) and differ from
`DualStreamGPT.forward_uncached` only in what they keep: the condition stream never runs
again after prefill, and each step computes one token per row against the cache.
"""

from __future__ import annotations

import torch

from cubeserve.engine.cache import KVCache
from cubeserve.model.gpt import DualStreamGPT
from cubeserve.model.layers import apply_rope, attention, layer_norm, merge_heads


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
    attention reads only the first S + live cache slots. With `uniform` (every row at the same
    position) no mask is needed.
    """
    cfg = gpt.cfg
    eps = cfg.eps
    s = cache.cond_len
    n_rows = x.shape[0]
    row_ids = torch.arange(n_rows, device=x.device)
    dtype = cache.dual_k[0].dtype
    x = x.float()[:, None, :]  # [R, 1, D]
    cos, sin = gpt.rope(positions[:, None])  # [R, 1, hd/2]
    slots = torch.arange(s + live, device=x.device)
    dual_mask = None if uniform else (slots[None, :] <= (s + positions)[:, None])[:, None, None, :]

    for layer, block in enumerate(gpt.transformer.dual_blocks):
        q, k, v = block.attn.pre_x(layer_norm(x, eps))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        kc, vc = cache.dual_k[layer][:n_rows], cache.dual_v[layer][:n_rows]
        kc[row_ids, :, s + positions] = k[:, :, 0].to(dtype)
        vc[row_ids, :, s + positions] = v[:, :, 0].to(dtype)
        y = attention(q.to(dtype), kc[:, :, : s + live], vc[:, :, : s + live], mask=dual_mask)
        x = block.post_1(x, merge_heads(y))

    for layer, block in enumerate(gpt.transformer.single_blocks):
        h = layer_norm(x, eps)
        vcache = cache.single_v[layer][:n_rows]
        if cache.single_block_mode == "reference":
            # The reference's cached decode lets every query see slot 0 only (BOS), so the
            # attention output is BOS's value: kept from the row's position-0 step. Computing
            # v for every row and selecting avoids a host sync (one D x D product).
            v_bos = torch.where((positions == 0)[:, None, None, None], block.attn.value(h).to(dtype), vcache)
            vcache.copy_(v_bos)
            y = v_bos
        else:
            q, k, v = block.attn.qkv(h)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            kc = cache.single_k[layer][:n_rows]
            kc[row_ids, :, positions] = k[:, :, 0].to(dtype)
            vcache[row_ids, :, positions] = v[:, :, 0].to(dtype)
            mask = None if uniform else (slots[None, :live] <= positions[:, None])[:, None, None, :]
            y = attention(q.to(dtype), kc[:, :, :live], vcache[:, :, :live], mask=mask)
        x = block.update(x, merge_heads(y.to(dtype)))
    return gpt.logits(x)[:, 0]

