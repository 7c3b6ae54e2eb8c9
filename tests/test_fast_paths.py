"""The engine's fast paths compute what the plain modules compute: fused projections, the CPU
weight-streaming product for any input layout, and the decode step's uniform-position path."""

import pytest
import torch
import torch.nn.functional as F

from cubeserve.checkpoint import init_random_models, load_models, parameter_counts, save_checkpoint
from cubeserve.config import V0_1, get_config
from cubeserve.engine import GenerationRequest as Req
from cubeserve.engine.fast_paths import FusedLinear, StreamingLinear, fuse, pack_weight, product, stream
from cubeserve.model.gpt import decode_modules
from cubeserve.model.layers import SwiGLU


@pytest.mark.parametrize("rows", [1, 2, 4, 16, 300])
@pytest.mark.parametrize("packed", [False, True], ids=["mkl", "onednn-packed"])
def test_product_equals_linear_for_any_rows_and_layout(rows, packed):
    """Both CPU paths (the packed one from 4 rows, `W @ x^T` below it or without a packed
    copy), any input layout, with and without bias, for 2-D and 3-D inputs."""
    torch.manual_seed(0)
    weight, bias = torch.randn(48, 32), torch.randn(48)
    copy = pack_weight(weight) if packed else None
    if packed:
        assert copy is not None  # the CPU build has oneDNN: the test must exercise it
    for x in (torch.randn(rows, 32), torch.randn(32, rows).T):
        for b in (bias, None):
            want = F.linear(x, weight, b)
            assert torch.allclose(product(weight, b, x, copy), want, atol=1e-5)
            assert torch.allclose(product(weight, b, x[:, None, :], copy)[:, 0], want, atol=1e-5)


def test_streaming_swap_packs_each_fused_group_once():
    torch.manual_seed(0)
    mlp = SwiGLU(16, 32)
    x = torch.randn(8, 16)
    before = mlp(x)
    everything = {id(m) for m in mlp.modules()}
    fuse(mlp, packed=everything)
    stream(mlp, packed=everything)
    assert mlp.gate_up.packed is not None and mlp.down_proj.packed is not None
    # The fused layers run as their group, so only the group holds a packed copy.
    assert mlp.gate_proj.packed is None and mlp.up_proj.packed is None
    assert torch.allclose(mlp(x), before, atol=1e-5)
    # Where there is no packed path (here: another dtype) nothing is packed.
    half = torch.nn.Linear(16, 16).to(torch.bfloat16)
    assert StreamingLinear(half, packed=True).packed is None


def test_engine_packs_the_decode_step_weights_only(make_engine):
    engine = make_engine("tiny", "reference")
    gpt = engine.gpt
    decode = {id(m) for root in decode_modules(gpt) for m in root.modules()}
    for m in gpt.modules():
        if isinstance(m, torch.nn.Linear) and id(m) not in decode:
            assert getattr(m, "packed", None) is None  # the condition stream runs once per prompt
    assert gpt.lm_head.packed is not None
    assert all(blk.post_1.mlp.gate_up.packed is not None for blk in gpt.transformer.dual_blocks)


def test_fused_linear_shares_memory_and_splits_outputs():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(8, 6, bias=False), torch.nn.Linear(8, 4)
    x = torch.randn(3, 8)
    expected = (a(x), b(x))
    fused = FusedLinear(a, b)
    assert a.bias is None and fused.bias[:6].eq(0).all()  # a missing bias is a zero block
    assert a.weight.data_ptr() == fused.weight.data_ptr()
    assert b.weight.data_ptr() == fused.weight[6:].data_ptr() and b.bias.data_ptr() == fused.bias[6:].data_ptr()
    for got, want in zip(fused(x), expected):
        assert torch.allclose(got, want, atol=1e-6)
    with torch.no_grad():  # loading into a layer (a view) updates the fused product
        b.weight.zero_()
    assert torch.equal(fused(x)[1], b.bias.detach().expand(3, 4))


def test_fusing_keeps_names_outputs_and_checkpoints(tmp_path):
    cfg = get_config("tiny")
    gpt, tok = init_random_models(cfg, seed=3)
    names = {k: tuple(v.shape) for k, v in gpt.state_dict().items()}
    torch.manual_seed(0)
    shape = torch.randn(2, 5, cfg.gpt.n_embd)
    cond = torch.randn(2, 7, cfg.gpt.n_embd)
    before = gpt.forward_uncached(shape, cond, "causal")
    fuse(gpt)
    assert {k: tuple(v.shape) for k, v in gpt.state_dict().items()} == names
    assert torch.allclose(gpt.forward_uncached(shape, cond, "causal"), before, atol=1e-5)
    # Fused parameters are views of one storage; the checkpoint writer still saves them.
    _, saved_gpt, _ = load_models(save_checkpoint(cfg, gpt, tok, tmp_path / "ckpt"), device="cpu")
    assert all(torch.equal(saved_gpt.state_dict()[k], v.float()) for k, v in gpt.state_dict().items())


def test_decode_parameters_count_only_what_a_step_reads():
    # The reference figure (every single-block tensor) and, in "reference" mode, without the
    # single block's q/k/v projections and q/k norms, which a step past BOS never reads.
    assert parameter_counts(V0_1)["decode_parameters"] == 931551744
    d = V0_1.gpt.n_embd
    unread = 3 * d * d + d + 2 * V0_1.gpt.head_dim
    assert parameter_counts(V0_1, "reference")["decode_parameters"] == 931551744 - unread


@pytest.mark.parametrize("mode", ["reference", "causal"])
def test_uniform_steps_equal_masked_steps(make_engine, mode):
    """Rows at one position take plain slice writes and no mask (and skip the single block's
    value in reference mode); the masked per-row path must give the same logits."""
    engine = make_engine("tiny", mode)
    reqs = [Req("a red chair"), Req("a lamp", guidance_scale=1.5)]
    pools = [engine.decode_runner(max_objects=2) for _ in range(2)]
    for pool in pools:
        pool.admit(reqs)
    for _ in range(12):
        k = 2
        live = pools[0].generated[0] + 1
        uniform = pools[0].compute(k, live, uniform=True, any_sampling=False)
        masked = pools[1].compute(k, live, uniform=False, any_sampling=False)
        assert torch.allclose(uniform, masked, atol=1e-5)
        for pool in pools:
            pool.generated = [g + 1 for g in pool.generated]
    assert torch.equal(pools[0].tokens, pools[1].tokens)


def test_bfloat16_engine_on_the_cpu_runs_the_gpu_dtype_path(tiny_weights, make_engine):
    """bfloat16 weights and cache, fp32 norms, RoPE and guidance (what CUDA runs), checked where
    no GPU is: the padded, masked step the CUDA graphs capture gives the eager step's tokens,
    and the first step's logits stay near float32's."""
    from cubeserve.engine import Engine

    engine = Engine.from_dir(tiny_weights, device="cpu", dtype="bfloat16")
    assert engine.gpt.lm_head.weight.dtype == torch.bfloat16
    assert engine.gpt.transformer.dual_blocks[0].attn.pre_x.project.weight.dtype == torch.bfloat16
    reqs = [Req("a red chair"), Req("a lamp", top_p=0.9, seed=3), Req("a boat", guidance_scale=1.0)]
    eager = engine.generate_tokens(reqs)
    pool = engine.decode_runner(max_objects=4, graph_buckets=(1, 2, 4), length_buckets=4, capture=False)
    pool.admit(reqs)
    for _ in range(engine.cfg.num_tokens):
        pool.step()
    assert torch.equal(pool.tokens[: len(reqs)], eager)

    first = engine.generate_tokens(reqs[:1], return_logits=True)[1][:, 0]
    reference = make_engine("tiny").generate_tokens(reqs[:1], return_logits=True)[1][:, 0]
    assert (first - reference).abs().max().item() < 0.05 * reference.abs().max().item()


@pytest.mark.parametrize("mode", ["reference", "causal"])
def test_cache_read_bytes_count_the_live_part(mode):
    """The benchmark's cache bytes: a step at the last position reads the whole cache of its
    rows; one at BOS reads the condition slots and one slot a layer."""
    from cubeserve.engine.cache import KVCache

    cfg = get_config("tiny")
    g = cfg.gpt
    cache = KVCache(cfg, rows=4, device="cpu", dtype=torch.float32, single_block_mode=mode)
    assert cache.read_bytes(4, cfg.num_tokens) == cache.nbytes()
    assert cache.read_bytes(2, cfg.num_tokens) == cache.nbytes() // 2
    per_slot = 2 * g.n_head * g.head_dim * 4  # keys and values of one row, float32
    single_slots = 1 if mode == "causal" else 1 / 2  # reference mode keeps the BOS value alone
    assert cache.read_bytes(1, 1) == per_slot * (g.n_layer * (cfg.cond_len + 1) + g.n_single_layer * single_slots)
