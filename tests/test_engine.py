"""The cached engine reproduces the uncached reference forward, batches exactly, samples
reproducibly, and handles the reference's single-block quirk both ways."""

import pytest
import torch

from cubeserve.engine import GenerationRequest as Req

PROMPTS = ["a red chair", "a round table with four legs", ""]


@pytest.mark.parametrize("config", ["tiny", "tiny-bbox"])
@pytest.mark.parametrize("guidance", [0.0, 3.0])
def test_cached_decode_equals_uncached_forward_in_causal_mode(make_engine, config, guidance):
    engine = make_engine(config, "causal")
    bbox = (1.0, 2.0, 0.5) if config == "tiny-bbox" else None
    reqs = [Req(p, guidance_scale=guidance, bbox=bbox if i == 0 else None) for i, p in enumerate(PROMPTS)]
    tokens, logits = engine.generate_tokens(reqs, return_logits=True)
    ref_tokens, ref_logits = engine.generate_tokens_uncached(reqs, return_logits=True)
    assert torch.equal(tokens, ref_tokens)
    assert (logits - ref_logits).abs().max().item() < 1e-4


def test_bbox_changes_the_condition(make_engine):
    engine = make_engine("tiny-bbox", "causal")
    a = engine.generate_tokens([Req("a chair", bbox=(1, 1, 1))], return_logits=True)[1]
    b = engine.generate_tokens([Req("a chair", bbox=(1, 3, 1))], return_logits=True)[1]
    assert (a - b).abs().max().item() > 1e-3


@pytest.mark.parametrize("guidance", [0.0, 3.0])
def test_reference_mode_equals_independent_bos_only_computation(make_engine, guidance):
    """The cached reference mode against the full forward over whole sequences, whose single
    block gives every position BOS's value (what the reference's cached decode ends up with)."""
    engine = make_engine("tiny", "reference")
    reqs = [Req(p, guidance_scale=guidance) for p in PROMPTS]
    tokens, logits = engine.generate_tokens(reqs, return_logits=True)
    b, n = tokens.shape
    gpt = engine.gpt
    cond = torch.cat([engine.condition([r.prompt for r in reqs], [None] * b),
                      engine.condition([""] * b, [None] * b)])
    seq = torch.cat([torch.full((b, 1), gpt.cfg.bos_id), tokens[:, :-1]], dim=1).repeat(2, 1)
    full = gpt.forward_uncached(gpt.embed_tokens(seq), cond, "reference")[..., : gpt.cfg.shape_model_vocab_size]
    g = guidance * (n - torch.arange(n)) / n
    expected = (1 + g)[None, :, None] * full[:b] - g[None, :, None] * full[b:]
    assert (logits - expected).abs().max().item() < 1e-4
    assert torch.equal(tokens, expected.argmax(-1))


def test_reference_and_causal_modes_differ(make_engine):
    reqs = [Req("a red chair")]
    ref = make_engine("tiny", "reference").generate_tokens(reqs, return_logits=True)[1]
    causal = make_engine("tiny", "causal").generate_tokens(reqs, return_logits=True)[1]
    assert torch.allclose(ref[:, 0], causal[:, 0], atol=1e-5)  # BOS step: same attention
    assert (ref - causal).abs().max().item() > 1e-3


def test_batch_equals_one_by_one(make_engine):
    engine = make_engine("tiny", "reference")
    reqs = [Req("a red chair"), Req("a lamp", top_p=0.9, seed=7), Req("", guidance_scale=0.0),
            Req("a boat", temperature=0.7, seed=3)]
    batched = engine.generate_tokens(reqs)
    for i, r in enumerate(reqs):
        assert torch.equal(engine.generate_tokens([r])[0], batched[i])


def test_prompts_change_tokens(make_engine):
    engine = make_engine("tiny", "reference")
    tokens = engine.generate_tokens([Req("a red chair"), Req("a sailing boat")])
    assert not torch.equal(tokens[0], tokens[1])


def test_same_seed_same_tokens_different_seeds_differ(make_engine):
    engine = make_engine("tiny", "reference")
    a = engine.generate_tokens([Req("a lamp", top_p=0.95, seed=1)])
    b = engine.generate_tokens([Req("a lamp", top_p=0.95, seed=1)])
    c = engine.generate_tokens([Req("a lamp", top_p=0.95, seed=2)])
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_tiny_top_p_or_cold_temperature_is_greedy(make_engine):
    engine = make_engine("tiny", "reference")
    greedy = engine.generate_tokens([Req("a lamp")])
    assert torch.equal(engine.generate_tokens([Req("a lamp", top_p=1e-6, seed=5)]), greedy)
    assert torch.equal(engine.generate_tokens([Req("a lamp", temperature=1e-4, seed=5)]), greedy)


def test_prompt_longer_than_77_clip_tokens_is_truncated(make_engine):
    engine = make_engine("tiny", "reference")
    base = "a tall chair with " * 10
    assert engine.text.token_count(base) > 77
    a = engine.generate_tokens([Req(base)])
    b = engine.generate_tokens([Req(base + " and more words that fall past the end")])
    assert torch.equal(a, b)


def test_empty_prompt_is_the_unconditional_prompt(make_engine):
    engine = make_engine("tiny", "reference")
    # With guidance the empty prompt's cond and uncond rows are equal: guidance is a no-op.
    assert torch.equal(engine.generate_tokens([Req("", guidance_scale=3.0)]),
                       engine.generate_tokens([Req("", guidance_scale=0.0)]))


def test_requests_joining_mid_generation_get_their_own_tokens(make_engine, run_steps):
    """Continuous batching: rows at different positions, a free slot inside the batch range."""
    engine = make_engine("tiny", "causal")
    a, b, c = Req("a red chair"), Req("a lamp", top_p=0.9, seed=3), Req("a boat", guidance_scale=1.0)
    alone = {r.prompt: engine.generate_tokens([r])[0] for r in (a, b, c)}
    pool = engine.decode_runner(max_objects=3)
    done = {}

    def step(times):
        run_steps(pool, times, done)

    assert pool.admit([a]) == [0]
    step(5)
    assert pool.admit([b, c]) == [1, 2]
    step(3)
    pool.release(1)  # b leaves (cancelled): a hole in the middle of the running range
    step(4)
    assert pool.admit([b]) == [1]  # b again, from BOS, next to a and c at other positions
    step(3 * engine.cfg.num_tokens)
    assert not pool.busy_slots
    assert torch.equal(done[0], alone[a.prompt])
    assert torch.equal(done[1], alone[b.prompt])
    assert torch.equal(done[2], alone[c.prompt])


@pytest.mark.parametrize("mode", ["reference", "causal"])
def test_the_captured_step_padded_bucketed_and_masked_gives_the_eager_tokens(make_engine, mode, run_steps):
    """What a CUDA graph replays (slots padded to a bucket, attention over a cache-length
    bucket with masks, all sampling kernels), run eagerly: same tokens as the trimmed step,
    with requests joining mid-generation and a free slot inside the range."""
    engine = make_engine("tiny", mode)
    reqs = [Req("a red chair"), Req("a lamp", top_p=0.9, seed=3), Req("a boat", guidance_scale=1.0)]
    alone = [engine.generate_tokens([r])[0] for r in reqs]
    pool = engine.decode_runner(max_objects=8, graph_buckets=(1, 2, 4, 8), length_buckets=4, capture=False)
    done = {}

    def step(times):
        run_steps(pool, times, done)

    pool.admit(reqs[:1])
    step(9)
    pool.admit(reqs[1:])
    step(3)
    pool.release(1)  # a hole inside the range
    pool.admit(reqs[1:2])
    step(3 * engine.cfg.num_tokens)
    for slot, expected in enumerate(alone):
        assert torch.equal(done[slot], expected)


@pytest.mark.parametrize("runner", ["eager", "bucketed", "window 4"])
def test_a_paused_slot_stays_where_it_is_and_resumes_to_its_own_tokens(make_engine, runner, run_steps):
    """A higher band decoding alone (engine/scheduler.py priority_slots): paused slots neither
    advance nor change, whether computed beside the stepped ones (slot 0 paused under slot 1) or
    left out of the step (slot 2 above them), and end with the tokens they get unpaused: greedy
    and seeded sampling, in the one-token step, the padded graph step and window decoding."""
    engine = make_engine("tiny", "causal")
    reqs = [Req("a lamp", top_p=0.9, seed=3), Req("a red chair"), Req("a boat", top_p=0.8, seed=5)]
    alone = [engine.generate_tokens([r])[0] for r in reqs]
    pool = {"eager": lambda: engine.decode_runner(max_objects=3, window=1),
            "bucketed": lambda: engine.decode_runner(max_objects=3, graph_buckets=(1, 2), capture=False, window=1),
            "window 4": lambda: engine.decode_runner(max_objects=3, window=4)}[runner]()
    done = {}
    assert pool.admit(reqs) == [0, 1, 2]
    run_steps(pool, 3, done)
    before = list(pool.generated), pool.tokens.clone(), pool.x.clone()
    pool.pause(frozenset({0, 2}))
    run_steps(pool, 4, done)
    assert pool.generated[0] == before[0][0] and pool.generated[2] == before[0][2]
    assert pool.generated[1] > before[0][1]
    for s in (0, 2):
        assert torch.equal(pool.tokens[s], before[1][s]) and torch.equal(pool.x[2 * s: 2 * s + 2], before[2][2 * s: 2 * s + 2])
    pool.pause(frozenset())
    run_steps(pool, 3 * engine.cfg.num_tokens, done)
    assert not pool.busy_slots
    for slot, expected in enumerate(alone):
        assert torch.equal(done[slot], expected), slot
