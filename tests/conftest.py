"""Shared fixtures: tiny random checkpoints written once per session, engines built once, the
documentation site built once."""

from __future__ import annotations

import os

# The suite's processes (pytest, the Triton servers and Ray workers it starts, which inherit
# this) share two cores. libgomp's default wait policy spins threads at every barrier; when
# another process holds the other core, each parallel region of small ops then waits out a
# scheduler slice (docs/development.md, has the measured cost). Passive
# waiting only costs timing, which no test asserts. It must be set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Parallel workers (pytest-xdist: `make test` runs two): each picks its servers' ports in a range
# of its own, below the kernel's ephemeral ports (cubeserve.server.local_triton.free_port).
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")
if _WORKER.startswith("gw") and _WORKER[2:].isdigit():
    _low = 10000 + 2000 * int(_WORKER[2:])
    os.environ.setdefault("CUBESERVE_PORT_RANGE", f"{_low}-{_low + 1999}")

import pytest  # noqa: E402

from cubeserve.checkpoint import write_random_weights  # noqa: E402
from cubeserve.engine import Engine  # noqa: E402


# The test files that take longest, longest first (`make test`'s --durations, on 2 cores): run
# first, so that with two workers (--dist loadfile hands out files in collection order) neither
# ends the run alone on a long one. Only the order changes; a file not named keeps its place.
SLOW_FIRST = ("test_pipeline.py", "test_image.py", "test_faults.py", "test_experiments.py", "test_batch.py",
              "test_security.py", "test_demo_model.py", "test_drain.py", "test_quantization.py", "test_gateway.py")


# CUBESERVE_TEST_ORDER=reverse: every test file's tests, and the files of each rank, in reverse
# (the slowest still first): a second order, to find a test that passes only after another.
ORDER_ENV = "CUBESERVE_TEST_ORDER"


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    way = {"": 1, "reverse": -1}.get(os.environ.get(ORDER_ENV, ""))
    if way is None:
        raise pytest.UsageError(f"${ORDER_ENV} must be empty or 'reverse', got {os.environ[ORDER_ENV]!r}")
    order = {item: i for i, item in enumerate(items)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), way * order[item]))


@pytest.fixture(scope="session")
def built_site(tmp_path_factory):
    """The documentation site built once per session as `make docs` builds it (`mkdocs build
    --strict`: any warning fails), into a temporary folder: tests/test_docs.py reads it,
    tests/test_site_render.py opens every page in Chromium."""
    import subprocess
    import sys
    from pathlib import Path

    site = tmp_path_factory.mktemp("site")
    quiet = {"NO_MKDOCS_2_WARNING": "1", "DISABLE_MKDOCS_2_WARNING": "true"}  # a banner, not the site's warning
    result = subprocess.run([str(Path(sys.executable).parent / "mkdocs"), "build", "--strict", "-d", str(site)],
                            cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True,
                            env={**os.environ, **quiet}, timeout=300)
    if result.returncode != 0:
        pytest.fail(f"mkdocs build --strict failed:\n{result.stdout}{result.stderr}", pytrace=False)
    return site


@pytest.fixture(scope="session")
def tiny_weights(tmp_path_factory):
    return write_random_weights("tiny", tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="session")
def tiny_bbox_weights(tmp_path_factory):
    return write_random_weights("tiny-bbox", tmp_path_factory.mktemp("tiny_bbox"), seed=1)


_engines: dict = {}


@pytest.fixture(scope="session")
def make_engine(tiny_weights, tiny_bbox_weights):
    """engine(config="tiny"|"tiny-bbox", mode="reference"|"causal"), cached for the session."""

    def make(config: str = "tiny", mode: str = "reference"):
        key = (config, mode)
        if key not in _engines:
            weights = tiny_weights if config == "tiny" else tiny_bbox_weights
            _engines[key] = Engine.from_dir(weights, device="cpu", dtype="float32", single_block_mode=mode)
        return _engines[key]

    return make


@pytest.fixture
def run_steps():
    """run_steps(pool, n, done): n decode steps; each finished slot's tokens go to done[slot]
    and the slot is released, as the scheduler does."""

    def run(pool, n: int, done: dict) -> None:
        for _ in range(n):
            for slot in pool.step().finished:
                done[slot] = pool.tokens[slot].clone()
                pool.release(slot)

    return run


@pytest.fixture(scope="session")
def float32_shortfall(make_engine):
    """float32_shortfall(request, tokens, config="tiny", mode="reference"): how far, at worst,
    `tokens` fall short of float32 greedy decoding. The float32 engine is fed the tokens
    (teacher forcing: one full forward over BOS + tokens[:-1], with the uncond rows) and, at
    every step, the best guided logit minus the chosen token's is taken; the largest of those
    is returned (0.0 for float32's own greedy tokens).

    For a lower-precision or batched path, whose greedy tokens may part from float32's at a
    near-tie and then follow another but equally valid course, this is what holds: every token
    is (nearly) the best one given what came before. A token from a wrong row, cache slot or
    condition falls far short."""

    def shortfall(request, tokens, config: str = "tiny", mode: str = "reference") -> float:
        import torch

        engine = make_engine(config, mode)
        gpt, n = engine.gpt, len(tokens)
        codes = gpt.cfg.shape_model_vocab_size
        cond = torch.cat([engine.condition([request.prompt], [request.normalized_bbox()]),
                          engine.condition([""], [None])])
        seq = torch.tensor([[gpt.cfg.bos_id] + list(tokens[:-1])]).repeat(2, 1)
        with torch.no_grad():
            logits = gpt.forward_uncached(gpt.embed_tokens(seq), cond, mode, compute_dtype=torch.float32)
        logits = logits[..., :codes].float()
        g = request.guidance_scale * (n - torch.arange(n)) / n
        guided = (1 + g)[:, None] * logits[0] - g[:, None] * logits[1]
        chosen = guided.gather(1, torch.tensor(list(tokens))[:, None]).squeeze(1)
        return (guided.max(1).values - chosen).max().item()

    # What bfloat16 greedy decoding stays within on the tiny weights (measured: 0.004 at most on
    # the CPU; a token stream from another prompt falls short by 0.25 and more).
    shortfall.bfloat16_bound = 0.05
    return shortfall


# -- python backend stub crashes over the whole run: counted, and none allowed (tests/stub_crashes.py)

import stub_crashes  # noqa: E402


def pytest_configure(config):
    stub_crashes.configure(config)


def pytest_sessionfinish(session):
    stub_crashes.finish(session)


def pytest_terminal_summary(terminalreporter):
    stub_crashes.summary(terminalreporter)
