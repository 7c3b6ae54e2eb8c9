"""The dual-stream decoder, with the reference's module and tensor names.

Sequence: [cond_0 .. cond_{S-1}] ++ [BOS, t_0 .. t_{L-2}]. Blocks 0..n_layer-2 update both
streams; the last dual block updates the shape stream only; single blocks see the shape
stream only. `forward_uncached` is the plain full forward the reference runs without a
cache; the cached prefill/decode steps live in `cubeserve.engine.decode` and reuse the
per-stream pieces defined here.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from cubeserve.config import GPTConfig
from cubeserve.model.layers import (
    FusedLinear, RMSNorm, SwiGLU, apply_linears, apply_rope, attention, layer_norm, linear,
    merge_heads, rope_tables, split_heads,
)

SingleBlockMode = Literal["reference", "causal"]
SINGLE_BLOCK_MODES = ("reference", "causal")
MAX_POSITIONS = 4096  # RoPE table rows; shape sequences are at most 1025 long


def normed_query_key(qk: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm, n_head: int,
                     rot: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """qk [B, T, 2D] (queries, then keys) -> q, k [B, H, T, hd]: every head RMS-normed with the
    q_norm / k_norm weights, then rotated by `rot` ([T, hd/2] or [B, T, hd/2]) when given.

    Queries and keys go through each op together: a decode step runs this on a few rows,
    where every op's fixed cost outweighs its arithmetic. Same formulas as `RMSNorm` and
    `apply_rope`, with the same cast to the product's dtype in between.
    """
    # Contiguous first: on the CPU qk is often a transposed view (`product`), and reductions
    # over a strided last dim are several times slower.
    x = qk.float().contiguous().unflatten(-1, (2, n_head, -1))  # [B, T, 2, H, hd]
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + q_norm.eps)
    x = (x * torch.stack((q_norm.weight, k_norm.weight)).float()[:, None]).type_as(qk)
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
        self.fused_qkv: FusedLinear | None = None

    def fuse(self) -> None:
        self.fused_qkv = FusedLinear(self.c_qk if self.with_query else self.c_k, self.c_v)

    def forward(self, h: torch.Tensor, rot: torch.Tensor | None = None):
        """h: the normed stream [B, T, D] -> (q or None, k, v), each [B, H, T, hd].

        rot: RoPE rotations [T, hd/2] or [B, T, hd/2] (`DualStreamGPT.rope`), or None.
        """
        qk, v = apply_linears((self.c_qk if self.with_query else self.c_k, self.c_v), self.fused_qkv, h)
        if self.with_query:
            q, k = normed_query_key(qk, self.q_norm, self.k_norm, self.n_head, rot)
        else:
            q, k = None, self.k_norm(split_heads(qk, self.n_head))
            if rot is not None:
                k = apply_rope(k, rot if rot.dim() == 2 else rot[:, None])
        return q, k, split_heads(v, self.n_head)


class StreamUpdate(nn.Module):
    """`post_1` / `post_2`: s += c_proj(y); s += SwiGLU(LN(s))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.eps = cfg.eps
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.mlp = SwiGLU(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)

    def forward(self, s: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        s = s + linear(self.c_proj, y)
        return s + self.mlp(layer_norm(s, self.eps))


class DualAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, cond_query: bool):
        super().__init__()
        self.pre_x = StreamProjection(cfg)
        self.pre_c = StreamProjection(cfg, with_query=cond_query)


class DualBlock(nn.Module):
    def __init__(self, cfg: GPTConfig, last: bool):
        super().__init__()
        self.last = last
        self.attn = DualAttention(cfg, cond_query=not last)
        self.post_1 = StreamUpdate(cfg)
        if not last:
            self.post_2 = StreamUpdate(cfg)


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
        self.fused_qkv: FusedLinear | None = None

    def fuse(self) -> None:
        self.fused_qkv = FusedLinear(self.c_qk, self.c_v)

    def value(self, h: torch.Tensor) -> torch.Tensor:
        return split_heads(linear(self.c_v, h), self.n_head)

    def qkv(self, h: torch.Tensor, rot: torch.Tensor | None = None):
        """As `StreamProjection.forward`."""
        qk, v = apply_linears((self.c_qk, self.c_v), self.fused_qkv, h)
        q, k = normed_query_key(qk, self.q_norm, self.k_norm, self.n_head, rot)
        return q, k, split_heads(v, self.n_head)


class SingleBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.eps = cfg.eps
        self.attn = SingleAttention(cfg)
        self.mlp = SwiGLU(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)

    def update(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Residual updates after attention: x += c_proj(y); x += SwiGLU(LN(x))."""
        x = x + linear(self.attn.c_proj, y)
        return x + self.mlp(layer_norm(x, self.eps))


class Transformer(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd, padding_idx=cfg.pad_id)
        self.dual_blocks = nn.ModuleList(
            DualBlock(cfg, last=(i == cfg.n_layer - 1)) for i in range(cfg.n_layer)
        )
        self.single_blocks = nn.ModuleList(SingleBlock(cfg) for _ in range(cfg.n_single_layer))


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

    # -- pieces shared by the uncached forward and the cached engine --------------------------

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

    # -- the uncached reference forward ---------------------------------------------------------

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

        One joint attention over [cond ; shape] with the plain lower-triangular mask, as the
        reference's uncached mode. `single_block_mode="reference"` gives the single block the
        mask the reference's cached decode ends up with (every query sees slot 0 only).
        """
        cfg = self.cfg
        dt = compute_dtype or self.lm_head.weight.dtype
        x, c = shape_embeds.float(), cond.float()
        s, L = c.shape[1], x.shape[1]
        dev = x.device
        rot_x = self.rope(torch.arange(L, device=dev))
        rot_c = self.rope(torch.zeros(s, dtype=torch.long, device=dev))
        joint_mask = torch.ones(s + L, s + L, dtype=torch.bool, device=dev).tril()

        for block in self.transformer.dual_blocks:
            qx, kx, vx = block.attn.pre_x(layer_norm(x, cfg.eps), rot_x)
            qc, kc, vc = block.attn.pre_c(layer_norm(c, cfg.eps), rot_c)
            k = torch.cat([kc, kx], dim=2).to(dt)
            v = torch.cat([vc, vx], dim=2).to(dt)
            if block.last:
                y = attention(qx.to(dt), k, v, mask=joint_mask[s:])
                x = block.post_1(x, merge_heads(y))
            else:
                q = torch.cat([qc, qx], dim=2).to(dt)
                y = attention(q, k, v, mask=joint_mask)
                c = block.post_2(c, merge_heads(y[:, :, :s]))
                x = block.post_1(x, merge_heads(y[:, :, s:]))

        if single_block_mode == "causal":
            single_mask = torch.ones(L, L, dtype=torch.bool, device=dev).tril()
        else:
            single_mask = torch.zeros(L, L, dtype=torch.bool, device=dev)
            single_mask[:, 0] = True
        for block in self.transformer.single_blocks:
            q, k, v = block.attn.qkv(layer_norm(x, cfg.eps), rot_x)
            y = attention(q.to(dt), k.to(dt), v.to(dt), mask=single_mask)
            x = block.update(x, merge_heads(y))
        return self.logits(x)


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
