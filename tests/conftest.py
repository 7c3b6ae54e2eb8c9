"""Shared fixtures: tiny random checkpoints written once per session, engines built once."""

from __future__ import annotations

import pytest

from cubeserve.checkpoint import write_random_weights
from cubeserve.engine import Engine


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
