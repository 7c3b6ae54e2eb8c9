"""Window (Jacobi) decoding (cubeserve/engine/window.py): several positions per forward give the
tokens of one-token-at-a-time decoding, greedy and seeded sampling alike, on the tiny configs and
the trained demo model, with slots joining, leaving and finishing at different times; fewer
forwards than tokens where the guesses hold."""

import json

import pytest
import torch

from cubeserve.config import DECODE_WINDOWS, check_decode_window, decode_window_of
from cubeserve.engine import Engine
from cubeserve.engine import GenerationRequest as Req
from cubeserve.engine import window as jacobi
from cubeserve.engine.scheduler import Scheduler
from cubeserve.server.local_triton import DEMO_MODEL

REQUESTS = [Req("a red chair"), Req("a lamp", top_p=0.9, seed=3), Req("a boat", guidance_scale=1.0),
            Req("", temperature=0.8, seed=9), Req("a mug", guidance_scale=0.0)]
DEMO_PROMPTS = ["a sphere", "a cube", "a tall thin cylinder", "a tall pointy cone", "a thin ring", "a big hoop"]


def decode(runner, requests) -> torch.Tensor:
    """Admit `requests` together and step until every one has its N tokens."""
    runner.admit(requests)
    while any(g is not None and g < runner.num_tokens for g in runner.generated):
        runner.step()
    return runner.tokens[: len(requests)].clone()


# -- the acceptance rule ----------------------------------------------------------------------

def test_acceptance_keeps_the_first_token_and_each_next_while_the_guess_that_fed_it_matched():
    chosen = torch.tensor([[5, 6, 7, 8]] * 4)
    guesses = torch.tensor([[5, 6, 7],   # every guess right: the whole window
                            [5, 0, 7],   # tokens 0 and 1 (fed by 5 == 5); 0 != 6 stops there
                            [0, 6, 7],   # the first guess wrong: token 0 alone
                            [9, 9, 9]])  # nothing right
    assert jacobi.accepted(guesses, chosen).tolist() == [4, 2, 1, 1]
    # A window of one is sequential decoding: its token, nothing to verify.
    assert jacobi.accepted(torch.zeros(2, 0, dtype=torch.long), torch.tensor([[3], [4]])).tolist() == [1, 1]


def test_next_guesses_are_the_windows_own_later_choices_then_its_last_repeated():
    chosen = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    accepted = torch.tensor([1, 3, 4])
    assert jacobi.next_guesses(chosen, accepted).tolist() == [[6, 7, 8], [8, 8, 8], [8, 8, 8]]


# -- the same tokens as sequential decoding -------------------------------------------------------

@pytest.mark.parametrize("window", [1, 4, 16])
@pytest.mark.parametrize("config,mode", [("tiny", "reference"), ("tiny", "causal"), ("tiny-bbox", "reference"),
                                         ("tiny-bbox", "causal")])
def test_window_decoding_gives_the_sequential_tokens(make_engine, config, mode, window):
    """Greedy, top-p, temperature and no guidance in one batch; a window of 16 runs past the
    end of the sequence (N = 32 or 48) near the end."""
    engine = make_engine(config, mode)
    sequential = engine.generate_tokens(REQUESTS)
    runner = engine.decode_runner(max_objects=len(REQUESTS), window=window)
    assert torch.equal(decode(runner, REQUESTS), sequential)
    assert runner.forwards <= engine.cfg.num_tokens


@pytest.mark.parametrize("window", [4, 16])
@pytest.mark.parametrize("mode", ["reference", "causal"])
def test_slots_joining_leaving_and_finishing_at_different_times(make_engine, run_steps, mode, window):
    """Continuous batching with windows: slots at different positions advance by different
    amounts, a hole inside the range, a slot taken again from BOS after its object left (in
    reference mode its BOS value is computed beside slots that read theirs from the cache)."""
    engine = make_engine("tiny", mode)
    a, b, c = REQUESTS[:3]
    alone = {r.prompt: engine.generate_tokens([r])[0] for r in (a, b, c)}
    pool = engine.decode_runner(max_objects=3, window=window)
    done = {}
    assert pool.admit([a]) == [0]
    run_steps(pool, 2, done)
    assert pool.admit([b, c]) == [1, 2]
    run_steps(pool, 1, done)
    pool.release(1)  # b leaves (cancelled): a hole in the middle of the running range
    run_steps(pool, 1, done)
    assert pool.admit([b]) == [1]
    run_steps(pool, 3 * engine.cfg.num_tokens, done)
    assert not pool.busy_slots
    for slot, r in enumerate((a, b, c)):
        assert torch.equal(done[slot], alone[r.prompt])


@pytest.fixture(scope="module")
def demo_engine():
    return Engine.from_dir(DEMO_MODEL, device="cpu", dtype="float32")


@pytest.mark.parametrize("window", [1, 4, 16])
def test_the_demo_model_decodes_the_sequential_tokens_in_fewer_forwards(demo_engine, window):
    """The trained model's margins and its runs of repeated tokens: same tokens, one at a
    time or several prompts batched (finishing at different forwards)."""
    requests = [Req(p) for p in DEMO_PROMPTS]
    sequential = demo_engine.generate_tokens(requests)
    forwards = 0
    for i, r in enumerate(requests):
        runner = demo_engine.decode_runner(max_objects=1, window=window)
        assert torch.equal(decode(runner, [r])[0], sequential[i]), r.prompt
        forwards += runner.forwards
    n = demo_engine.cfg.num_tokens
    if window == 1:
        assert forwards == n * len(requests)
    else:  # measured: 1.7 tokens a forward at window 4, 2.7 at 16 (BENCHMARKS.md)
        assert forwards < 0.8 * n * len(requests)
    assert torch.equal(decode(demo_engine.decode_runner(max_objects=len(requests), window=window), requests),
                       sequential)


def test_accepting_one_guess_too_many_is_caught(make_engine, demo_engine, monkeypatch):
    """The identity checks above catch a verifier that keeps a token its guess did not earn."""
    real = jacobi.accepted
    monkeypatch.setattr(jacobi, "accepted", lambda g, c: (real(g, c) + 1).clamp(max=c.shape[1]))
    differ = 0
    demo_requests = [Req(p) for p in DEMO_PROMPTS]
    for engine, requests in ((make_engine("tiny", "reference"), REQUESTS), (demo_engine, demo_requests)):
        sequential = engine.generate_tokens(requests)  # one token per step: the patched rule is not used
        tokens = decode(engine.decode_runner(max_objects=len(requests), window=4), requests)
        differ += sum(not torch.equal(t, s) for t, s in zip(tokens, sequential))
    assert differ > 0, differ


def test_right_guesses_are_all_accepted_in_one_forward(make_engine):
    """Guesses set to the sequential tokens: each forward keeps its whole window."""
    engine = make_engine("tiny", "reference")
    n, window = engine.cfg.num_tokens, 8
    request = REQUESTS[1]  # top-p sampling: its noise is per position, so guesses verify alike
    sequential = engine.generate_tokens([request])[0]
    runner = engine.decode_runner(max_objects=1, window=window)
    runner.admit([request])
    while runner.generated[0] < n:
        p = runner.generated[0]
        runner.guesses[0] = torch.cat([sequential, sequential[-1:].repeat(window)])[p: p + window - 1]
        runner.step()
        assert runner.generated[0] == min(p + window, n) and runner.last_step_tokens == runner.generated[0] - p
    assert runner.forwards == n // window
    assert torch.equal(runner.tokens[0], sequential)


# -- the setting, the engine's paths ---------------------------------------------------------------

@pytest.mark.parametrize("bad", [0, 65, -1, "4", 4.0, True, None])
def test_the_decode_window_setting_is_checked_by_name_and_range(make_engine, tiny_weights, bad):
    with pytest.raises(ValueError, match=r"decode_window: must be an integer in 1\.\.64"):
        check_decode_window(bad)
    with pytest.raises(ValueError, match="decode_window"):
        decode_window_of({"decode_window": bad})
    with pytest.raises(ValueError, match="decode_window"):
        Engine.from_dir(tiny_weights, decode_window=bad)
    if bad is not None:  # None: the engine's own window
        with pytest.raises(ValueError, match="decode_window"):
            make_engine("tiny").decode_runner(max_objects=1, window=bad)
    assert decode_window_of({}) == 1 and decode_window_of({"quantization": "none", "decode_window": 8}) == 8
    assert DECODE_WINDOWS == range(1, 65)


def test_the_engine_and_the_scheduler_decode_with_the_engines_window(make_engine, monkeypatch):
    engine = make_engine("tiny", "reference")
    sequential = engine.generate_tokens(REQUESTS)
    with_logits = engine.generate_tokens(REQUESTS, return_logits=True)
    monkeypatch.setattr(engine, "decode_window", 4)
    progress = []
    assert torch.equal(engine.generate_tokens(REQUESTS, on_step=progress.append), sequential)
    assert progress[-1] == engine.cfg.num_tokens and progress == sorted(progress)
    # Guided logits and teacher forcing go one token per step (a window runner refuses them).
    tokens, logits = engine.generate_tokens(REQUESTS, return_logits=True)
    assert torch.equal(tokens, with_logits[0]) and torch.equal(logits, with_logits[1])
    with pytest.raises(ValueError, match="window 1"):
        runner = engine.decode_runner(max_objects=1)
        runner.admit(REQUESTS[:1])
        runner.step(return_logits=True)
    # Graph buckets are ignored: window steps run eagerly (capture would fail on the CPU).
    assert engine.decode_runner(max_objects=2, graph_buckets=(1, 2)).slot_buckets is None
    requests = [Req(r.prompt, seed=r.seed, top_p=r.top_p, temperature=r.temperature,
                    guidance_scale=r.guidance_scale, resolution=4) for r in REQUESTS]
    with Scheduler(engine, max_objects=2, mesh_process=False) as sched:
        results = [t.result(timeout=120) for t in [sched.submit(r) for r in requests]]
        stats = sched.stats.snapshot()
    assert [res.tokens for res in results] == sequential.tolist()
    assert stats["tokens_generated"] == len(requests) * engine.cfg.num_tokens


def test_a_version_packaged_with_a_window_serves_the_sequential_tokens_and_counts_them_all(tmp_path):
    """The setting as a server reads it: a version's version.json `decode_window` reaches its
    engine (serving/triton_engine.py), the tokens are the sequential ones, and the tokens counter
    counts every token a window step makes, not one a step."""
    from cube3d_client import Cube3DClient
    from cubeserve.server.local_triton import LocalTriton, copy_model_repository, ensure_demo_weights, free_port
    from cubeserve.serving.repository import VERSION_SETTINGS
    from serving_helpers import metrics

    repo = copy_model_repository(tmp_path / "repo", {"dtype": "float32"})
    weights = ensure_demo_weights(repo)
    (weights.parent / VERSION_SETTINGS).write_text(json.dumps({"decode_window": 8}))
    engine = Engine.from_dir(weights, dtype="float32")
    want = engine.generate_tokens([Req("a round table", seed=3)])[0].tolist()
    with LocalTriton(repo, free_port(), free_port(), free_port(), log_path=tmp_path / "log") as server:
        with Cube3DClient(server.http_url) as client:
            result = client.generate("a round table", seed=3, resolution=4)
        assert [int(t) for t in result.tokens] == want
        counted = metrics(server)
    assert counted["cube3d_tokens_generated_total/v1"] == len(want)
    # the window was in effect: fewer forwards (steps) than tokens
    assert counted["cube3d_decode_steps_total/v1"] < 0.8 * len(want), counted
