"""The engine's speed variants of the model's products, as module swaps: the model files stay
plain PyTorch, and `apply` (called once by the Engine) is the one place they come in.

- Fusion (every device): each `Parallel` group (q/k with v, gate with up) becomes one
  `FusedLinear` product. One product streams the weights in one pass: on the CPU a few-row
  product of a few MB runs further below bandwidth than a larger one (thread start-up and
  prefetch ramp-up per call), and on the GPU it is one kernel instead of several.
- Frozen norm weights (every device): each `QKNorm` becomes a `FrozenQKNorm` that stacks its
  q/k norm weights once instead of in every layer of every step.
- Streaming products (CPU): every nn.Linear becomes a `StreamingLinear` that multiplies through
  `product`, and the decode step's weights get oneDNN-packed copies. A decode step multiplies a
  few rows by each weight, where MKL's F.linear is slow (BENCHMARKS.md, "What the CPU step
  is made of").

Each variant is the same product in another summation order (tests/test_fast_paths.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cubeserve.model.gpt import DualStreamGPT, QKNorm, decode_modules
from cubeserve.model.layers import Parallel

# Decode-sized inputs (up to 128 objects with guidance) take the CPU weight-streaming path.
DECODE_ROWS = 256
# From this many rows a CPU product uses the weight's oneDNN-packed copy where it has one.
PACKED_MIN_ROWS = 4


def product(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor,
            packed: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T + bias in the dtype of the weight (the input is cast, as autocast would).

    On the CPU: from PACKED_MIN_ROWS rows, oneDNN's kernels on the `packed` copy
    (`pack_weight`); below that (or without one), `W @ x^T`, which needs the rows contiguous:
    fed a column-major input (such as the transposed view it returns) MKL takes a slow path,
    so rows are made contiguous on the way in (a copy of a few rows, only where needed) and the
    result stays a transposed view. Larger inputs and other devices: F.linear.
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


class StreamingLinear(nn.Linear):
    """An nn.Linear (the same parameters) that multiplies through `product`, with a packed copy
    of its weight when asked for one (taken now: swap after the last load, move or cast)."""

    def __init__(self, layer: nn.Linear, packed: bool = False):
        nn.Module.__init__(self)
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.weight, self.bias = layer.weight, layer.bias
        self.packed = pack_weight(self.weight) if packed else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return product(self.weight, self.bias, x, self.packed)


class FusedLinear(Parallel):
    """A `Parallel` group as one product. The layers' parameters become views of the
    concatenated weight and bias, so memory is not doubled and checkpoint names are untouched.
    The concatenation is no parameter (invisible to state_dict and .to()): fuse after the last
    move or cast."""

    def __init__(self, *layers: nn.Linear, packed: bool = False):
        super().__init__(*layers)
        self.sizes = [layer.out_features for layer in layers]
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
        self.packed = pack_weight(self.weight) if packed else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return product(self.weight, self.bias, x, self.packed).split(self.sizes, dim=-1)


class FrozenQKNorm(QKNorm):
    """A `QKNorm` whose stacked weights are taken now, once (swap after the last load: a later
    load into the norms would not reach them)."""

    def __init__(self, norm: QKNorm):
        super().__init__(*norm.norms, n_head=norm.n_head)
        with torch.no_grad():
            self.stacked = norm.weight().clone()

    def weight(self) -> torch.Tensor:
        return self.stacked


def _swap(root: nn.Module, kind: type[nn.Module], make) -> None:
    """Replace every submodule of `kind` under `root` by make(module) (exact type: a swapped
    module is never swapped again)."""
    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is kind:
                setattr(parent, name, make(child))


def fuse(module: nn.Module, packed: set[int] = frozenset()) -> None:
    """Every `Parallel` group under `module` as one `FusedLinear` (packed where its id is in `packed`)."""
    _swap(module, Parallel, lambda group: FusedLinear(*group.layers, packed=id(group) in packed))


def stream(module: nn.Module, packed: set[int] = frozenset()) -> None:
    """Every nn.Linear under `module` as a `StreamingLinear` (packed where its id is in `packed`).
    A layer of a fused group runs as its group, so it gets no packed copy of its own. Fuse
    first: a `Parallel` group keeps the layers it was built with."""
    grouped = {id(layer) for m in module.modules() if isinstance(m, FusedLinear) for layer in m.layers}
    _swap(module, nn.Linear, lambda layer: StreamingLinear(layer, packed=id(layer) in packed - grouped))


def apply(gpt: DualStreamGPT, *others: nn.Module, streaming: bool | None = None) -> None:
    """The engine's speed variants, for models already on their device and in their dtype.

    `streaming` (default: on the CPU): the CPU's streaming products. The decode step's products
    from 4 rows (2 objects) up then run on oneDNN-packed copies of their weights: batching's
    speed, for a second copy of those weights. The condition stream runs once per prompt and is
    not packed; a fused group is packed once, as its one weight."""
    if streaming is None:
        streaming = gpt.lm_head.weight.device.type == "cpu"
    decode = {id(m) for root in decode_modules(gpt) for m in root.modules()} if streaming else set()
    fuse(gpt, packed=decode)
    _swap(gpt, QKNorm, FrozenQKNorm)
    if streaming:
        stream(gpt, packed=decode)
        for module in others:
            stream(module)
