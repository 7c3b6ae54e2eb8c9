"""Building blocks shared by the GPT and the shape tokenizer.

Numerics follow the reference: norms run in fp32, Linear layers run in the dtype of their
weights (cast once, see `cast_linears`), attention in the compute dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def layer_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm without affine parameters, in fp32 (the reference stores no tensors for it)."""
    return F.layer_norm(x.float(), (x.shape[-1],), eps=eps)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim in fp32. `affine=False` still owns a (unused) weight where the
    reference checkpoint stores one, so that loading stays strict."""

    def __init__(self, dim: int, eps: float = 1e-5, affine: bool = True):
        super().__init__()
        self.eps = eps
        self.affine = affine
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.affine:
            out = out * self.weight.float()
        return out.type_as(x)


def rms_norm_noaffine(x: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


SMALL_BATCH_ROWS = 16  # decode-sized inputs: at most this many rows take the CPU GEMV path


def linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """Apply `layer` in the dtype of its weight (the input is cast, as autocast would).

    On the CPU, a decode step multiplies a few rows by each weight: F.linear then runs at a
    fraction of memory bandwidth (13-50 % measured for 2 rows), while W @ x^T streams the
    weight row by row at close to 100 %. Same product, another summation order.
    """
    w = layer.weight
    x = x.to(w.dtype)
    rows = x.numel() // x.shape[-1]
    if x.device.type == "cpu" and rows <= SMALL_BATCH_ROWS:
        x2 = x.reshape(rows, x.shape[-1])
        y = torch.mm(w, x2.T) if layer.bias is None else torch.addmm(layer.bias[:, None], w, x2.T)
        return y.T.reshape(*x.shape[:-1], w.shape[0])
    return F.linear(x, w, layer.bias)


class SwiGLU(nn.Module):
    """down(silu(gate(u)) * up(u)): the GPT's MLP."""

    def __init__(self, dim: int, hidden: int, bias: bool = True):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        return linear(self.down_proj, F.silu(linear(self.gate_proj, u)) * linear(self.up_proj, u))


class GeluMLP(nn.Module):
    """down(gelu(up(x))) with exact GELU: the tokenizer's MLP."""

    def __init__(self, dim: int, hidden: int, bias: bool = True):
        super().__init__()
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self.down_proj, F.gelu(linear(self.up_proj, x)))


def split_heads(x: torch.Tensor, n_head: int) -> torch.Tensor:
    """[B, T, H*hd] -> [B, H, T, hd]; head h owns features h*hd .. (h+1)*hd."""
    b, t, d = x.shape
    return x.view(b, t, n_head, d // n_head).transpose(1, 2)


def merge_heads(y: torch.Tensor) -> torch.Tensor:
    b, h, t, hd = y.shape
    return y.transpose(1, 2).reshape(b, t, h * hd)


def rope_tables(head_dim: int, max_positions: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_positions, head_dim/2] in fp32 for interleaved-pair RoPE."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32, device=device), inv_freq)
    return torch.cos(angles), torch.sin(angles)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (2i, 2i+1) of x [B, H, T, hd] in fp32.

    cos/sin are [T, hd/2] (shared positions) or [B, T, hd/2] (per-row positions).
    """
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    xf = x.float()
    x0, x1 = xf[..., 0::2], xf[..., 1::2]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    return out.type_as(x)


def attention(q, k, v, mask=None, is_causal: bool = False) -> torch.Tensor:
    """Scaled dot-product attention with the reference's 1/sqrt(head_dim) scale."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                          scale=1.0 / math.sqrt(q.shape[-1]))


def cast_linears(module: nn.Module, dtype: torch.dtype, skip: tuple[nn.Module, ...] = ()) -> None:
    """Cast every nn.Linear under `module` (weights and biases) to `dtype` once, instead of
    casting inside every step as the reference's autocast does. Norm weights, embeddings
    and the modules in `skip` keep their dtype."""
    skipped = {id(m) for s in skip for m in s.modules()}
    for m in module.modules():
        if isinstance(m, nn.Linear) and id(m) not in skipped:
            m.to(dtype)
