"""The dual-stream decoder, with the reference's module and tensor names: the one description
of its math.

Sequence: [cond_0 .. cond_{S-1}] ++ [BOS, t_0 .. t_{L-2}]. Blocks 0..n_layer-2 update both
streams; the last dual block updates the shape stream only; single blocks see the shape
stream only. Each block's forward attends through `Keys`: the uncached forward
(`FullSequence`: whole sequences, as the reference without a cache and as training) or the
engine's KV cache (`cubeserve.engine.cache`: condition prefill, then one token per step).
"""

from __future__ import annotations

from typing import Literal, Protocol

import torch
from torch import nn

from cubeserve.config import GPTConfig
from cubeserve.model.layers import (
    Parallel, RMSNorm, SwiGLU, apply_rope, attention, layer_norm, linear, merge_heads, rope_tables,
    split_heads,
)

SingleBlockMode = Literal["reference", "causal"]
SINGLE_BLOCK_MODES = ("reference", "causal")
MAX_POSITIONS = 4096  # RoPE table rows; shape sequences are at most 1025 long


class QKNorm(nn.Module):
    """Queries and keys of one product, per head RMS-normed with the q_norm / k_norm weights and
    rotated by RoPE: qk [B, T, 2D] (queries, then keys) -> q, k [B, H, T, hd].

    Queries and keys go through each op together: a decode step runs this on a few rows,
    where every op's fixed cost outweighs its arithmetic. Same formulas as `RMSNorm` and
    `apply_rope`, with the same cast to the product's dtype in between. The norms stay their
    parent's (the checkpoint names them there), held in a plain tuple as `Parallel` holds its
    layers; the engine swaps in a copy with the weights stacked once
    (`cubeserve.engine.fast_paths.FrozenQKNorm`).
    """

    def __init__(self, q_norm: RMSNorm, k_norm: RMSNorm, n_head: int):
        super().__init__()
        self.norms = (q_norm, k_norm)
        self.n_head = n_head
        self.eps = q_norm.eps

    def weight(self) -> torch.Tensor:
        """Both norms' weights [2, 1, hd] in fp32, to broadcast over [.., 2, H, hd]."""
        return torch.stack([norm.weight for norm in self.norms]).float()[:, None]

    def forward(self, qk: torch.Tensor, rot: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """rot: [T, hd/2] or [B, T, hd/2], or None."""
        # One contiguous fp32 copy: on the CPU qk is often a transposed view (`fast_paths.product`),
        # and reductions over a strided last dim are several times slower.
        x = qk.to(torch.float32, memory_format=torch.contiguous_format).unflatten(-1, (2, self.n_head, -1))
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)  # [B, T, 2, H, hd]
        x = (x * self.weight()).type_as(qk)
        if rot is not None:
            x = apply_rope(x, rot[..., None, None, :])
        q, k = x.unbind(2)
        return q.transpose(1, 2), k.transpose(1, 2)


class StreamProjection(nn.Module):
    """`attn.pre_x` / `attn.pre_c`: q, k, v of one stream, heads split, q/k RMS-normed and
    rotated by RoPE when given the rotations.

    The last dual block's condition stream has no query: it owns `c_k` (with bias) instead of
    `c_qk`.
    """

    def __init__(self, cfg: GPTConfig, with_query: bool = True):
        super().__init__()
        d, hd = cfg.n_embd, cfg.head_dim
        self.n_head = cfg.n_head
        self.with_query = with_query
        if with_query:
            self.c_qk = nn.Linear(d, 2 * d, bias=False)
            self.q_norm = RMSNorm(hd)
        else:
            self.c_k = nn.Linear(d, d, bias=True)
        self.k_norm = RMSNorm(hd)
        self.c_v = nn.Linear(d, d, bias=cfg.bias)
        self.project = Parallel(self.c_qk if with_query else self.c_k, self.c_v)
        if with_query:
            self.qk_norm = QKNorm(self.q_norm, self.k_norm, cfg.n_head)

    def forward(self, h: torch.Tensor, rot: torch.Tensor | None = None):
        """h: the normed stream [B, T, D] -> (q or None, k, v), each [B, H, T, hd].

        rot: RoPE rotations [T, hd/2] or [B, T, hd/2] (`DualStreamGPT.rope`), or None.
        """
        qk, v = self.project(h)
        if self.with_query:
            q, k = self.qk_norm(qk, rot)
        else:
            q, k = None, self.k_norm(split_heads(qk, self.n_head))
            if rot is not None:
                k = apply_rope(k, rot if rot.dim() == 2 else rot[:, None])
        return q, k, split_heads(v, self.n_head)


def residual_update(s: torch.Tensor, y: torch.Tensor, c_proj: nn.Linear, mlp: SwiGLU, eps: float) -> torch.Tensor:
    """What every block does after attention: s += c_proj(y); s += SwiGLU(LN(s))."""
    s = s + linear(c_proj, y)
    return s + mlp(layer_norm(s, eps))


class StreamUpdate(nn.Module):
    """`post_1` / `post_2`: one stream's `residual_update`."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.eps = cfg.eps
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.mlp = SwiGLU(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)

    def forward(self, s: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return residual_update(s, y, self.c_proj, self.mlp, self.eps)


class DualAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, cond_query: bool):
        super().__init__()
        self.pre_x = StreamProjection(cfg)
        self.pre_c = StreamProjection(cfg, with_query=cond_query)


class DualBlock(nn.Module):
    """Joint attention over [condition ; shape], then each stream's own update. The last dual
    block updates the shape stream only (its condition stream gives keys and values)."""

    def __init__(self, cfg: GPTConfig, last: bool):
        super().__init__()
        self.eps = cfg.eps
        self.last = last
        self.attn = DualAttention(cfg, cond_query=not last)
        self.post_1 = StreamUpdate(cfg)
        if not last:
            self.post_2 = StreamUpdate(cfg)

    def forward(self, x: torch.Tensor | None, c: torch.Tensor | None, keys: Keys,
                layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """x: the shape stream [B, L, D], or None (condition prefill); c: the condition stream
        [B, S, D], or None (a decode step: its keys and values are in the cache)."""
        queries, new_k, new_v = [], [], []
        cond_queries = c is not None and not self.last
        if c is not None:
            # Condition tokens all sit at RoPE position 0, where the rotation is the identity.
            qc, kc, vc = self.attn.pre_c(layer_norm(c, self.eps))
            queries += [qc] if cond_queries else []
            new_k.append(kc)
            new_v.append(vc)
        if x is not None:
            qx, kx, vx = self.attn.pre_x(layer_norm(x, self.eps), keys.rot)
            queries.append(qx)
            new_k.append(kx)
            new_v.append(vx)
        k, v = keys.dual(layer, _cat(new_k), _cat(new_v))
        if not queries:  # the last block at prefill: only its condition keys are needed
            return x, c
        y = attention(_cat(queries).to(k.dtype), k, v, mask=keys.dual_mask(cond_queries, x is not None))
        if cond_queries:
            c = self.post_2(c, merge_heads(y[:, :, : c.shape[1]]))
        if x is not None:
            x = self.post_1(x, merge_heads(y[:, :, y.shape[2] - x.shape[1]:]))
        return x, c


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate along the sequence dim; a single part is returned as it is (no copy: a
    decode step has only the shape stream's, and it runs hundreds of small ops)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


class SingleAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        d = cfg.n_embd
        self.n_head = cfg.n_head
        self.c_qk = nn.Linear(d, 2 * d, bias=False)
        self.c_v = nn.Linear(d, d, bias=cfg.bias)
        self.c_proj = nn.Linear(d, d, bias=cfg.bias)
        self.q_norm = RMSNorm(cfg.head_dim)
        self.k_norm = RMSNorm(cfg.head_dim)
        self.project = Parallel(self.c_qk, self.c_v)
        self.qk_norm = QKNorm(self.q_norm, self.k_norm, cfg.n_head)

    def value(self, h: torch.Tensor) -> torch.Tensor:
        return split_heads(linear(self.c_v, h), self.n_head)

    def qkv(self, h: torch.Tensor, rot: torch.Tensor | None = None):
        """As `StreamProjection.forward`."""
        qk, v = self.project(h)
        q, k = self.qk_norm(qk, rot)
        return q, k, split_heads(v, self.n_head)


class SingleBlock(nn.Module):
    """Self-attention over the shape stream alone, then its `residual_update`."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.eps = cfg.eps
        self.attn = SingleAttention(cfg)
        self.mlp = SwiGLU(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor, keys: Keys, layer: int) -> torch.Tensor:
        h = layer_norm(x, self.eps)
        if keys.single_block_mode == "reference":
            # The reference's cached decode lets every query see position 0 (BOS) alone: the
            # softmax over one key is 1, so attention returns BOS's value. A cache past
            # position 0 on every row holds it already; otherwise it is computed.
            y = keys.bos_value(layer)
            if y is None:
                y = keys.keep_bos_value(layer, self.attn.value(h))
        else:
            q, k, v = self.attn.qkv(h, keys.rot)
            k, v = keys.single(layer, k, v)
            y = attention(q.to(k.dtype), k, v, mask=keys.single_mask)
        return residual_update(x, merge_heads(y), self.attn.c_proj, self.mlp, self.eps)


class Keys(Protocol):
    """What the queries of one forward call attend to: the call's own keys (the uncached
    forward, `FullSequence`), or a cache that stores them and returns what it holds (the
    engine's condition prefill and decode steps, `cubeserve.engine.cache`).

    Keys are stored after RoPE, in the dtype attention runs in."""

    single_block_mode: SingleBlockMode
    rot: torch.Tensor | None  # RoPE rotations of the shape positions, [L, hd/2] or [B, L, hd/2]
    single_mask: torch.Tensor | None  # single blocks' mask (causal mode), None when none is needed

    def dual(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Take dual layer `layer`'s new keys/values [B, H, T, hd]; return all those the queries see."""

    def dual_mask(self, cond_queries: bool, shape_queries: bool) -> torch.Tensor | None:
        """The dual layers' mask for queries [condition ; shape] (those present)."""

    def single(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As `dual`, for single layer `layer` (causal mode)."""

    def bos_value(self, layer: int) -> torch.Tensor | None:
        """Reference mode: every row's BOS value of single layer `layer` when already known."""

    def keep_bos_value(self, layer: int, v: torch.Tensor) -> torch.Tensor:
        """Reference mode: the attention output of single layer `layer`, given its new values."""


class FullSequence:
    """`Keys` of the uncached forward: one joint attention over [cond ; shape] with the plain
    lower-triangular mask, as the reference's uncached mode; nothing is kept."""

    def __init__(self, cond_len: int, length: int, rot: torch.Tensor, dtype: torch.dtype,
                 single_block_mode: SingleBlockMode):
        dev = rot.device
        self.cond_len, self.length, self.dtype = cond_len, length, dtype
        self.single_block_mode = single_block_mode
        self.rot = rot
        self.joint_mask = torch.ones(cond_len + length, cond_len + length, dtype=torch.bool, device=dev).tril()
        self.single_mask = self.joint_mask[cond_len:, cond_len:]

    def dual(self, layer, k, v):
        return k.to(self.dtype), v.to(self.dtype)

    def dual_mask(self, cond_queries, shape_queries):
        first = 0 if cond_queries else self.cond_len
        last = self.cond_len + (self.length if shape_queries else 0)
        return self.joint_mask[first:last]

    single = dual

    def bos_value(self, layer):
        return None

    def keep_bos_value(self, layer, v):
        return v[:, :, :1].to(self.dtype).expand(-1, -1, self.length, -1)


class Transformer(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd, padding_idx=cfg.pad_id)
        self.dual_blocks = nn.ModuleList(
            DualBlock(cfg, last=(i == cfg.n_layer - 1)) for i in range(cfg.n_layer)
        )
        self.single_blocks = nn.ModuleList(SingleBlock(cfg) for _ in range(cfg.n_single_layer))

    def forward(self, x: torch.Tensor | None, c: torch.Tensor | None, keys: Keys) -> torch.Tensor | None:
        """The shape stream after every block (None when only the condition stream ran)."""
        for layer, block in enumerate(self.dual_blocks):
            x, c = block(x, c, keys, layer)
        if x is None:
            return None
        for layer, block in enumerate(self.single_blocks):
            x = block(x, keys, layer)
        return x


class DualStreamGPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.text_proj = nn.Linear(cfg.text_model_embed_dim, cfg.n_embd, bias=cfg.bias)
        self.shape_proj = nn.Linear(cfg.shape_model_embed_dim, cfg.n_embd, bias=cfg.bias)
        if cfg.use_bbox:
            self.bbox_proj = nn.Linear(3, cfg.n_embd, bias=cfg.bias)
        self.transformer = Transformer(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self._rope_cache: dict = {}

    def rope(self, positions: torch.Tensor) -> torch.Tensor:
        """RoPE rotations (complex64, `apply_rope`) gathered at integer `positions` (any shape)."""
        key = positions.device
        if key not in self._rope_cache:
            self._rope_cache[key] = rope_tables(
                self.cfg.head_dim, MAX_POSITIONS, self.cfg.rope_theta, positions.device)
        return self._rope_cache[key][positions]

    def condition(self, text_hidden: torch.Tensor, bbox: torch.Tensor | None = None) -> torch.Tensor:
        """Condition tokens [B, S, D] in fp32: text_proj(CLIP hidden states) (+ bbox token)."""
        cond = linear(self.text_proj, text_hidden.float()).float()
        if self.cfg.use_bbox:
            if bbox is None:
                bbox = torch.zeros(cond.shape[0], 3, device=cond.device)
            box = linear(self.bbox_proj, bbox.float()).float()
            cond = torch.cat([cond, box[:, None, :]], dim=1)
        return cond

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        return self.transformer.wte(ids).float()

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self.lm_head, layer_norm(x, self.cfg.eps)).float()

    @torch.no_grad()
    def set_codebook_embeddings(self, codebook: torch.Tensor) -> None:
        """Overwrite wte rows 0..codes-1 with shape_proj(normalised codebook), as the reference
        does after loading."""
        emb = linear(self.shape_proj, codebook.float()).float()
        self.transformer.wte.weight[: emb.shape[0]] = emb.to(self.transformer.wte.weight.dtype)

    # -- the three ways to run the blocks: whole sequences, condition prefill, cached steps ----

    @torch.no_grad()
    def forward_uncached(self, *args, **kwargs) -> torch.Tensor:
        """The reference's uncached mode: `forward` (same arguments) without gradients."""
        return self.forward(*args, **kwargs)

    def forward(
        self,
        shape_embeds: torch.Tensor,
        cond: torch.Tensor,
        single_block_mode: SingleBlockMode = "causal",
        compute_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Logits [B, L, vocab] for every shape position, recomputing everything (also the
        training forward: teacher forcing over a whole sequence).

        `single_block_mode="reference"` gives the single block what the reference's cached
        decode ends up with (every query sees position 0 only).
        """
        x = shape_embeds.float()
        keys = FullSequence(cond.shape[1], x.shape[1], self.rope(torch.arange(x.shape[1], device=x.device)),
                            compute_dtype or self.lm_head.weight.dtype, single_block_mode)
        return self.logits(self.transformer(x, cond.float(), keys))

    def prefill(self, cond: torch.Tensor, cache: Keys) -> None:
        """Run the condition stream alone (it never sees shape tokens), leaving every dual
        layer's condition keys and values in `cache`."""
        self.transformer(None, cond.float(), cache)

    def decode(self, x: torch.Tensor, cache: Keys) -> torch.Tensor:
        """One shape token per row: x [R, D] (fp32 embeddings) -> logits [R, vocab], attending
        to what `cache` holds (the condition keys, the row's earlier tokens). x [R, T, D]: T
        consecutive tokens per row (a window, `cubeserve.engine.window`) -> logits [R, T, vocab]."""
        if x.dim() == 3:
            return self.logits(self.transformer(x.float(), None, cache))
        return self.logits(self.transformer(x.float()[:, None, :], None, cache))[:, 0]


def decode_modules(gpt: DualStreamGPT) -> list[nn.Module]:
    """The modules a decode step reads: the shape stream of every dual block, the single
    blocks and lm_head (the condition stream runs once at prefill, wte is a row lookup)."""
    modules = [m for blk in gpt.transformer.dual_blocks for m in (blk.attn.pre_x, blk.post_1)]
    return modules + list(gpt.transformer.single_blocks) + [gpt.lm_head]


def decode_parameter_count(gpt: DualStreamGPT, single_block_mode: SingleBlockMode = "causal") -> int:
    """Parameters one decode step reads (`decode_modules`).

    In "reference" mode a single block's attention output is BOS's value, kept in the cache:
    past position 0 its q/k/v projections are not read, so they are not counted (the
    benchmark's bandwidth figures count only what a step reads).
    """
    count = sum(p.numel() for m in decode_modules(gpt) for p in m.parameters())
    if single_block_mode == "reference":
        count -= sum(p.numel() for blk in gpt.transformer.single_blocks
                     for m in (blk.attn.c_qk, blk.attn.c_v, blk.attn.q_norm, blk.attn.k_norm) for p in m.parameters())
    return count
