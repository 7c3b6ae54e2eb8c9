"""What a decode step launches: its ATen ops, counted on the CPU (`bench.decode_ops`), as the
CUDA graph of the step would capture them. On a GPU each op is a kernel of a few microseconds
whatever its size, so what runs once per layer is what a step costs at small batches.

Nothing that is the same in every layer may run in every layer: the norm weights are stacked
once (`fast_paths.FrozenQKNorm`), the attention mask is built once a step in the attention's
dtype (a boolean mask would be converted by SDPA in every layer), and a step in which no row
samples runs none of the counter-noise hash.
"""

import dataclasses

import pytest
import torch

from bench.decode_ops import HASH_OPS, build_runner, count_step
from cubeserve.config import get_config
from cubeserve.engine.cache import MASK_ALIGNMENT, additive_mask

# Built once per step, however many layers: a per-layer copy of any of these is a regression.
ONCE_A_STEP = ("aten.stack", "aten.scalar_tensor", "aten.where", "aten.clone", "aten.le", "aten.full")
# The ops one more dual layer adds in bfloat16 (the shape stream's norm, fused q/k/v product, q/k
# norm and RoPE with the reference's casts, cache writes, attention, c_proj, SwiGLU).
OPS_PER_DUAL_LAYER = 27


def counts(n_layer: int, mode: str, any_sampling: bool):
    tiny = get_config("tiny")
    cfg = dataclasses.replace(tiny, gpt=dataclasses.replace(tiny.gpt, n_layer=n_layer, n_single_layer=2))
    return count_step(build_runner(cfg, torch.bfloat16, objects=2, build="gpu", single_block_mode=mode),
                      any_sampling)


@pytest.mark.parametrize("mode", ["reference", "causal"])
@pytest.mark.parametrize("any_sampling", [True, False], ids=["sampling", "greedy-only"])
def test_a_dual_layer_adds_only_its_own_work_to_a_step(mode, any_sampling):
    three, four = counts(3, mode, any_sampling), counts(4, mode, any_sampling)
    assert four.kernels - three.kernels == OPS_PER_DUAL_LAYER
    for name in ONCE_A_STEP:
        assert four.ops[name] == three.ops[name], f"{name} runs in every layer"
    assert three.ops["aten.stack"] == 0 and three.ops["aten.scalar_tensor"] == 0


def test_a_greedy_only_step_runs_no_noise_hash():
    sampling, greedy = counts(3, "reference", True), counts(3, "reference", False)
    assert sum(sampling.ops[name] for name in HASH_OPS) > 50
    assert sum(greedy.ops[name] for name in HASH_OPS) <= 1  # the position bookkeeping's `&`
    assert greedy.ops["aten.sort"] == 0 and greedy.kernels < sampling.kernels - 100


@pytest.mark.parametrize("length", [5, 16, 205])
def test_the_additive_mask_is_the_boolean_one_in_the_attention_dtype_with_aligned_rows(length):
    allowed = torch.rand(3, length) < 0.5
    mask = additive_mask(allowed, torch.bfloat16)
    assert mask.shape == (3, 1, 1, length) and mask.dtype == torch.bfloat16
    assert all(stride % MASK_ALIGNMENT == 0 for stride in mask.stride()[:-1]) and mask.stride(-1) == 1
    assert torch.equal(mask[:, 0, 0] == 0, allowed)
    assert torch.isneginf(mask[:, 0, 0][~allowed]).all()
    # Attention under it is attention under the boolean mask.
    q, k, v = torch.randn(3, 2, 1, 8), torch.randn(3, 2, length, 8), torch.randn(3, 2, length, 8)
    allowed[:, 0] = True  # every row sees something
    expect = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None, None, :])
    got = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=additive_mask(allowed, torch.float32))
    torch.testing.assert_close(got, expect)
