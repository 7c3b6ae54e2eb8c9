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


# Decode-sized inputs (up to 128 objects with guidance) take the CPU weight-streaming path.
DECODE_ROWS = 256
# From this many rows a CPU product uses the weight's oneDNN-packed copy where it has one.
PACKED_MIN_ROWS = 4


def product(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor,
            packed: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T + bias in the dtype of the weight (the input is cast, as autocast would).

    On the CPU a decode step multiplies a few rows by each weight, where MKL's F.linear is
    slow. Two paths, measured on a 2-core AMD EPYC (`mid`'s weights, float32):
    - `packed` (`pack_weight`, oneDNN's blocked layout, made once) from PACKED_MIN_ROWS rows:
      oneDNN's kernels on that layout run few-row products near twice as fast as MKL's sgemm
      (MKL's own pre-packed sgemm did not help). The whole weight set: 8.4 vs 16.2 ms at 16
      rows (8 objects), 24 vs 36 ms at 64; ahead of F.linear at any size (lm_head at 300 rows:
      24 vs 41 ms).
    - `W @ x^T` below that (2 rows = 1 object with guidance: 5.0 vs 6.7 ms packed, F.linear
      13-50 % of bandwidth). It needs the rows contiguous: fed a column-major input (such as
      the transposed view it returns), MKL takes a slow path (the MLP's down projection ran 3x
      slower). So rows are made contiguous on the way in (a copy of a few rows, only where
      needed) and the result stays a transposed view.
    Each path is the same product in another summation order.
    """
    if x.dtype != weight.dtype:
        x = x.to(weight.dtype)
    *lead, k = x.shape
    rows = x.numel() // k
    if x.is_cpu and packed is not None and rows >= PACKED_MIN_ROWS:
        y = torch.ops.mkldnn._linear_pointwise(_contiguous_rows(x, rows, k), packed, bias, "none", [], "")
        return y.view(*lead, weight.shape[0])
    if x.is_cpu and rows <= DECODE_ROWS:
        x2 = _contiguous_rows(x, rows, k)
        y = torch.mm(weight, x2.T) if bias is None else torch.addmm(bias.unsqueeze(1), weight, x2.T)
        return y.T.view(*lead, weight.shape[0])
    return F.linear(x, weight, bias)


def _contiguous_rows(x: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    x2 = x.reshape(rows, k)
    return x2 if x2.is_contiguous() else x2.contiguous()


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed copy of a float32 CPU weight for `product`; None where there is no
    such path (another device or dtype, a build without oneDNN)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return None
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """Apply `layer` in the dtype of its weight (see `product`), with its packed copy if any."""
    return product(layer.weight, layer.bias, x, layer.__dict__.get("packed_weight"))


class FusedLinear:
    """Several nn.Linear layers that read the same input, applied as one product.

    One product streams the weights in one pass: on the CPU a few-row product of a few MB
    runs further below bandwidth than a larger one (thread start-up and prefetch ramp-up per
    call), and on the GPU it is one kernel instead of several. The layers' parameters become
    views of the concatenated weight and bias, so memory is not doubled and checkpoint names
    are untouched. Not an nn.Module (invisible to state_dict and .to()): fuse after the last
    move or cast, as `fuse_linears` does in the engine.
    """

    def __init__(self, *layers: nn.Linear):
        self.layers = layers
        self.sizes = [layer.out_features for layer in layers]
        self.packed_weight: torch.Tensor | None = None
        with torch.no_grad():
            self.weight = torch.cat([layer.weight for layer in layers])
            self.bias = None
            if any(layer.bias is not None for layer in layers):
                self.bias = torch.cat([layer.bias if layer.bias is not None else
                                       layer.weight.new_zeros(layer.out_features) for layer in layers])
        offset = 0
        for layer, n in zip(layers, self.sizes):
            layer.weight = nn.Parameter(self.weight[offset: offset + n], requires_grad=False)
            if layer.bias is not None:
                layer.bias = nn.Parameter(self.bias[offset: offset + n], requires_grad=False)
            offset += n

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return product(self.weight, self.bias, x, self.packed_weight).split(self.sizes, dim=-1)


def apply_linears(layers: tuple[nn.Linear, ...], fused: FusedLinear | None, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each layer applied to x: as one fused product where the layers have been fused."""
    return fused(x) if fused is not None else tuple(linear(layer, x) for layer in layers)


def fuse_linears(module: nn.Module) -> None:
    """Fuse the parallel projections of every submodule that has some (a `fuse` method)."""
    for m in module.modules():
        if hasattr(m, "fuse"):
            m.fuse()


def pack_linears(module: nn.Module) -> None:
    """Give the products under `module` packed copies of their weights (`pack_weight`; where
    there is none, nothing changes). A fused group is packed once, as its one weight.

    The copies are taken now: pack after the last load, move or cast, as the engine does.
    They double the packed weights' memory on the CPU.
    """
    groups = [v for m in module.modules() for v in vars(m).values() if isinstance(v, FusedLinear)]
    grouped = {id(layer) for group in groups for layer in group.layers}
    for group in groups:
        group.packed_weight = pack_weight(group.weight)
    for m in module.modules():
        if isinstance(m, nn.Linear) and id(m) not in grouped:
            m.packed_weight = pack_weight(m.weight)


class SwiGLU(nn.Module):
    """down(silu(gate(u)) * up(u)): the GPT's MLP."""

    def __init__(self, dim: int, hidden: int, bias: bool = True):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.fused_gate_up: FusedLinear | None = None

    def fuse(self) -> None:
        self.fused_gate_up = FusedLinear(self.gate_proj, self.up_proj)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        gate, up = apply_linears((self.gate_proj, self.up_proj), self.fused_gate_up, u)
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
