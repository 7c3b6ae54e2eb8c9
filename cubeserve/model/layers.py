"""Building blocks shared by the GPT and the shape tokenizer.

Numerics follow the reference: norms run in fp32, Linear layers run in the dtype of their
weights (cast once, see `cast_linears`), attention in the compute dtype. Plain PyTorch: the
engine's speed variants of these modules are in `cubeserve.engine.fast_paths`.
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


def linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """Apply `layer` in the dtype of its weight: the input is cast, as autocast would. A layer
    whose weight is None (the engine's quantized swaps) takes any input dtype itself."""
    w = layer.weight
    return layer(x if w is None or x.dtype == w.dtype else x.to(w.dtype))


class Parallel(nn.Module):
    """Linear layers that read one input (q/k with v, gate with up), applied in turn.

    The layers stay their parent's (the checkpoint names them there): this holds them in a
    plain tuple, so it owns no parameters. It is the place where the engine swaps in one fused
    product (`cubeserve.engine.fast_paths.FusedLinear`)."""

    def __init__(self, *layers: nn.Linear):
        super().__init__()
        self.layers = layers

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(linear(layer, x) for layer in self.layers)


class SwiGLU(nn.Module):
    """down(silu(gate(u)) * up(u)): the GPT's MLP."""

    def __init__(self, dim: int, hidden: int, bias: bool = True):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.gate_up = Parallel(self.gate_proj, self.up_proj)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(u)
        return linear(self.down_proj, F.silu(gate) * up)


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


def rope_tables(head_dim: int, max_positions: int, theta: float, device=None) -> torch.Tensor:
    """Rotations exp(i * position * theta^(-2j/hd)) [max_positions, head_dim/2], complex64, for
    interleaved-pair RoPE."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32, device=device), inv_freq)
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (2i, 2i+1) of x [..., hd] in fp32: the pair as a complex
    number times the rotation (x0 cos - x1 sin, x0 sin + x1 cos), one kernel.

    rot: complex rotations (`rope_tables`) broadcastable to x's pairs [..., hd/2].
    """
    xf = x.float()
    if xf.stride(-1) != 1:
        xf = xf.contiguous()
    pairs = torch.view_as_complex(xf.unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rot).flatten(-2).type_as(x)


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
