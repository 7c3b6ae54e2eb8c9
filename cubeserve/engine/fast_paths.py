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
- Weight-only quantization (`quantization` "int8" or "int4"): the GPT's products but the
  condition projections (and, for int8, `lm_head`: `KEEP_LOGITS`) hold int8 weights per output
  channel or int4 weights in groups (`Int8Linear`, `Int4Linear`), multiplied by PyTorch's own
  kernels (`_weight_int8pack_mm`, tinygemm's `_weight_int4pack_mm[_for_cpu]`) on bf16 activations.
- fp8 (`quantization` "fp8"): e4m3 weights with a scale per output row and e4m3 activations
  with a scale per token (`Fp8Linear`): `torch._scaled_mm` on CUDA from compute capability 8.9,
  an emulation of the same numerics elsewhere (for measurement: no speed on the CPU).

Each variant but quantization is the same product in another summation order
(tests/test_fast_paths.py); quantization is held to the fp32 oracle by the numerics harness
(`cubeserve/numerics.py`, tests/test_quantization.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cubeserve.config import QUANTIZATIONS
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


# -- weight-only quantization ------------------------------------------------------------------

# The quantized kernels' activations: their float32 paths are 10-40x slower than bf16 on the CPU
# (measured at decode sizes), and tinygemm's CUDA kernel takes bf16 only.
ACTIVATION_DTYPE = torch.bfloat16
ACTIVATION_DTYPE_NAME = str(ACTIVATION_DTYPE).removeprefix("torch.")
INT4_GROUP_SIZES = (128, 64, 32)  # per layer, the largest that divides its inputs
INT4_ROWS = 16  # tinygemm packs outputs in tiles of 16 rows (CPU) or 8 (CUDA): pad to 16
# The quantizations that leave `lm_head` (the logits' own product) in the compute dtype. Its
# rounding lands on the logits undamped: on the trained demo model an int8 `lm_head` made half of
# float32+int8's KL from the float32 oracle (BENCHMARKS.md, "Numerics"), for 5 % of the GPT's
# weights there (under 3 % of those a v0.1 step reads). int4's and fp8's error is in the blocks:
# keeping their `lm_head` changed nothing measurable, so they take its bytes and speed.
KEEP_LOGITS = frozenset({"int8"})


def recipe(quantization: str) -> str:
    """What `quantization` does to the weights, in words: part of a quantized version's identity
    (pipeline/steps.py `served_digest`) and recorded with it (serving/repository.py
    `VERSION_SETTINGS`), so a server whose recipe differs refuses the version (`check_recipe`)
    instead of serving numerics nobody gated. Every choice that changes the numbers must show
    here (the condition projections are kept by the Engine): a change to how a kind rounds that
    leaves these words alone gets a new revision (`r1` -> `r2`)."""
    kept = "condition projections" + (", lm_head" if quantization in KEEP_LOGITS else "")
    return {
        "none": "",
        "int8": f"r1 int8 symmetric per output channel, {ACTIVATION_DTYPE_NAME} activations; kept: {kept}",
        "int4": f"r1 int4 asymmetric in groups of the first of {'/'.join(map(str, INT4_GROUP_SIZES))} dividing "
                f"the inputs, {ACTIVATION_DTYPE_NAME} activations; kept: {kept}",
        "fp8": f"r1 fp8 e4m3 symmetric per output row, activations per token; kept: {kept}",
    }[quantization]


def check_recipe(quantization: str, recorded: str | None) -> None:
    """ValueError when a version recorded with another recipe of `quantization` than this code's
    (an older or newer image): its numerics gate passed on other numbers. None or "": not recorded
    (a version packaged before recipes were, a repository written by hand), nothing to check."""
    if recorded and recorded != recipe(quantization):
        raise ValueError(f"quantization_recipe: this version was packaged with {quantization} as "
                         f"{recorded!r}; this server quantizes {quantization} as {recipe(quantization)!r}. "
                         f"Package the checkpoint again with this image (the pipeline gates it anew).")


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per output channel: weight ~ q * scale[:, None], q in [-127, 127] (int8)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def quantize_int4(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric in groups of `group` inputs, in tinygemm's convention: weight ~ (q - 8) *
    scale + zero, q in [0, 15] (int32 [N, K]); scales and zeros as [K / group, N, 2]."""
    n, k = weight.shape
    w = weight.detach().float().view(n, k // group, group)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round((w - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(n, k)
    return q, torch.stack([scale, lo + 8 * scale], dim=-1).transpose(0, 1).contiguous()


def int4_group_size(in_features: int) -> int:
    for group in INT4_GROUP_SIZES:
        if in_features % group == 0:
            return group
    raise ValueError(f"int4 quantization needs layers whose inputs are a multiple of {INT4_GROUP_SIZES[-1]}, "
                     f"got {in_features}")


class WeightOnlyLinear(nn.Module):
    """A product with quantized weights standing in for an nn.Linear or a `FusedLinear`
    (`sizes`: its outputs split as the group's layers). It returns the dtype the layer had
    (the engine's), takes any input dtype, and keeps no float copy of the weight."""

    weight = None  # `layers.linear` then leaves the input's dtype to the product

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int] | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.out_dtype = weight.dtype
        self.sizes = sizes
        self.register_buffer("bias", None if bias is None else bias.detach().to(weight.dtype).clone())

    def forward(self, x: torch.Tensor):
        *lead, k = x.shape
        y = self.matmul(x.reshape(-1, k).to(ACTIVATION_DTYPE)).to(self.out_dtype)
        if self.bias is not None:
            y = y + self.bias
        y = y.view(*lead, self.out_features)
        return y.split(self.sizes, dim=-1) if self.sizes else y

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Int8Linear(WeightOnlyLinear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int] | None = None):
        super().__init__(weight, bias, sizes)
        q, scale = quantize_int8(weight)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale.to(ACTIVATION_DTYPE))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scale)


class Int4Linear(WeightOnlyLinear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int] | None = None):
        super().__init__(weight, bias, sizes)
        n, k = weight.shape
        self.group = int4_group_size(k)
        rows = -(-n // INT4_ROWS) * INT4_ROWS  # padded with zero rows, cut off after the product
        padded = torch.cat([weight.detach(), weight.new_zeros(rows - n, k)]) if rows > n else weight
        q, scales_and_zeros = quantize_int4(padded, self.group)
        if weight.is_cpu:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
        else:  # two inputs a byte, the even one in the high nibble; tiles of 16 x inner_k_tiles inputs
            tiles = next(t for t in (8, 4, 2) if k % (16 * t) == 0)
            packed = torch.ops.aten._convert_weight_to_int4pack(((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8), tiles)
        self.register_buffer("qweight", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros.to(ACTIVATION_DTYPE))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cpu:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.qweight, self.group, self.scales_and_zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm(x, self.qweight, self.group, self.scales_and_zeros)
        return y[:, : self.out_features]


# -- fp8: e4m3 weights and activations, one float32 scale per row ----------------------------------

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
FP8_DIMS = 16  # _scaled_mm: the inputs (K) and outputs (N) a multiple of 16; padded with zeros at load
FP8_CAPABILITY = (8, 9)  # fp8 tensor cores: Ada, Hopper and later


def quantize_fp8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, symmetric: t ~ q * scale, q float8_e4m3fn [R, K], scale float32 [R, 1] (the row's
    absmax / 448, at least float32's smallest normal so that a zero row gives zeros, not NaN).
    The one quantizer of both the weights (at load) and the activations (every call): no host
    sync and no branch on values, so it captures into CUDA graphs."""
    t = t.detach().float()
    scale = (t.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    return (t / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_native(device: torch.device) -> bool:
    """Whether `device` multiplies e4m3 natively (`torch._scaled_mm`, rowwise scales)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_CAPABILITY


class Fp8Linear(WeightOnlyLinear):
    """fp8 rowwise W8A8: weights quantized once here (`quantize_fp8`, one scale per output row),
    activations per row (token) on every call; the product sums e4m3 x e4m3 in float32, scales
    by scale_a[m] * scale_b[n] and rounds to bf16.

    On a CUDA device of compute capability >= 8.9 that is `torch._scaled_mm` (rowwise: scale_a
    [M, 1], scale_b [1, N], float32; its first operand row-major, its second column-major, which
    the transposed view of the [N, K] weight is; K and N multiples of 16: the weight is padded
    with zero inputs and zero outputs at load, the activations with zero inputs per call, the
    extra outputs cut off). Everywhere else (the CPU, older GPUs) the same numerics are
    *emulated* -- the same quantization of both sides, the product of the e4m3 values in float32,
    the same scaling and bf16 rounding -- so the numerics harness measures on the CPU what the
    GPU computes. The emulation is for measurement, not a fast path: it converts the whole
    weight to float32 on every call; the CPU gets no speed from fp8."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int] | None = None):
        super().__init__(weight, bias, sizes)
        n, k = weight.shape
        self.native = fp8_native(weight.device)
        # Padding only where the kernel needs it: the emulation multiplies the layer as it is.
        rows, cols = (-(-n // FP8_DIMS) * FP8_DIMS, -(-k // FP8_DIMS) * FP8_DIMS) if self.native else (n, k)
        padded = F.pad(weight.detach(), (0, cols - k, 0, rows - n))  # zero rows: scale `tiny`, outputs 0
        q, scale = quantize_fp8(padded)
        self.pad_inputs = cols - k
        self.register_buffer("qweight", q)  # [N, K] row-major: .t() is the column-major [K, N]
        self.register_buffer("scale", scale.view(1, rows))  # scale_b, [1, N] contiguous

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.pad_inputs:
            x = F.pad(x, (0, self.pad_inputs))
        xq, scale_a = quantize_fp8(x)  # [M, K] contiguous (row-major), [M, 1]
        if self.native:
            y = torch._scaled_mm(xq, self.qweight.t(), scale_a=scale_a, scale_b=self.scale,
                                 out_dtype=torch.bfloat16)
        else:  # the emulation (see the class): e4m3 products are exact in float32
            y = (torch.mm(xq.float(), self.qweight.float().t()) * scale_a * self.scale).to(torch.bfloat16)
        return y[:, : self.out_features]


QUANTIZED = {"int8": Int8Linear, "int4": Int4Linear, "fp8": Fp8Linear}


class GroupMember(nn.Module):
    """One layer of a quantized fused group, for the code that calls that layer alone (a single
    block's value at BOS): the group's product, that layer's part. No second copy of weights."""

    weight = None

    def __init__(self, group: WeightOnlyLinear, index: int):
        super().__init__()
        self.group = (group,)  # a tuple: the group is its parent's module, not this one's
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group[0](x)[self.index]


def quantize(module: nn.Module, kind: str, keep: set[int] = frozenset()) -> None:
    """Every `FusedLinear` and nn.Linear under `module` but those whose id is in `keep` as the
    `kind` ("int8", "int4", "fp8") of `WeightOnlyLinear`; fuse first (a group is quantized as one
    product and its layers become `GroupMember`s of it)."""
    make = QUANTIZED[kind]
    members: dict[int, GroupMember] = {}

    def group(fused: FusedLinear) -> WeightOnlyLinear:
        q = make(fused.weight, fused.bias, sizes=fused.sizes)
        members.update({id(layer): GroupMember(q, i) for i, layer in enumerate(fused.layers)})
        return q

    with torch.no_grad():
        _swap(module, FusedLinear, group)
        for kind_ in (nn.Linear, StreamingLinear):
            _swap(module, kind_, lambda layer: layer if id(layer) in keep else
                  members.get(id(layer)) or make(layer.weight, layer.bias))


def weight_bytes(module: nn.Module) -> int:
    """Bytes of the weights `module` holds (parameters and buffers, each storage once): what
    quantization saves. oneDNN-packed copies (CPU float32) are not counted."""
    storages = {}
    for t in list(module.parameters()) + list(module.buffers()):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def apply(gpt: DualStreamGPT, *others: nn.Module, streaming: bool | None = None,
          quantization: str = "none", keep: tuple[nn.Module, ...] = ()) -> None:
    """The engine's speed variants, for models already on their device and in their dtype.

    `streaming` (default: on the CPU): the CPU's streaming products. The decode step's products
    from 4 rows (2 objects) up then run on oneDNN-packed copies of their weights: batching's
    speed, for a second copy of those weights. The condition stream runs once per prompt and is
    not packed; a fused group is packed once, as its one weight.

    `quantization` ("none", "int8", "int4", "fp8"): the GPT's weights as `WeightOnlyLinear`s, but the
    modules in `keep` (the engine keeps the condition projections in float32) and, for the
    quantizations in `KEEP_LOGITS`, `lm_head`; nothing is packed."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    if streaming is None:
        streaming = gpt.lm_head.weight.device.type == "cpu"
    quantized = quantization != "none"
    decode = ({id(m) for root in decode_modules(gpt) for m in root.modules()}
              if streaming and not quantized else set())
    fuse(gpt, packed=decode)
    _swap(gpt, QKNorm, FrozenQKNorm)
    if quantized:
        kept = (*keep, gpt.lm_head) if quantization in KEEP_LOGITS else keep
        quantize(gpt, quantization, keep={id(m) for k in kept for m in k.modules()})
    if streaming:
        stream(gpt, packed=decode)
        for module in others:
            stream(module)
