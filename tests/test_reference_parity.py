"""Parity with Roblox's reference code itself: on the tiny test weights, cube-serve generates
the very token sequences that the reference's `Engine.run_gpt` generated (greedy, fp32), in
both single-block behaviours, with and without guidance, with and without a bounding box.

The tokens are facts in tests/data/reference/tokens.json, written by regenerate.py beside it
from a named commit of github.com/Roblox/cube (which is never copied here). The weights are
the session fixtures; their sha256 is checked first, so that a change of the weights (or of
how they are made) is reported as that, not as a disagreement of the code.
"""

import hashlib
import json
from collections import defaultdict
from pathlib import Path

import pytest

from cubeserve.config import get_config
from cubeserve.engine import GenerationRequest as Req

FACTS = json.loads((Path(__file__).parent / "data" / "reference" / "tokens.json").read_text())
CASES = FACTS["cases"]
GROUPS = sorted({(c["config"], c["single_block_mode"]) for c in CASES})
REGENERATE = ("if the change of weights is intended, regenerate the tokens with "
              "tests/data/reference/regenerate.py (it says how)")


@pytest.fixture(scope="module")
def weights(tiny_weights, tiny_bbox_weights):
    return {"tiny": tiny_weights, "tiny-bbox": tiny_bbox_weights}


def _request(case) -> Req:
    return Req(case["prompt"], guidance_scale=case["guidance_scale"],
               bbox=tuple(case["bbox"]) if case["bbox"] else None)


def _mismatches(cases, tokens) -> list[str]:
    out = []
    for case, got in zip(cases, tokens.tolist()):
        if got != case["tokens"]:
            first = next(i for i, (a, b) in enumerate(zip(got, case["tokens"])) if a != b)
            out.append(f"guidance {case['guidance_scale']} bbox {case['bbox']} prompt {case['prompt']!r}: "
                       f"first differs at token {first}: reference {case['tokens'][first:first + 8]}, "
                       f"cube-serve {got[first:first + 8]}")
    return out


def test_the_facts_cover_every_mode():
    ref = FACTS["reference"]
    assert ref["repository"] == "https://github.com/Roblox/cube" and len(ref["commit"]) == 40
    seen = {(c["config"], c["single_block_mode"], c["guidance_scale"] > 0, c["bbox"] is not None) for c in CASES}
    for config in ("tiny", "tiny-bbox"):
        for mode in ("reference", "causal"):
            for guided in (True, False):
                assert (config, mode, guided, False) in seen
                if config == "tiny-bbox":
                    assert (config, mode, guided, True) in seen
    # The modes are the reference's cached decode (BOS-only single block) and its uncached forward.
    assert all(c["use_kv_cache"] == (c["single_block_mode"] == "reference") for c in CASES)


@pytest.mark.parametrize("config", ["tiny", "tiny-bbox"])
def test_the_weights_are_those_the_reference_ran_on(weights, config):
    facts = FACTS["weights"][config]
    for name, digest in facts["sha256"].items():
        got = hashlib.sha256((weights[config] / name).read_bytes()).hexdigest()
        assert got == digest, (
            f"{config} {name}: the fixture's weights are not those the reference generated its tokens "
            f"on (seed {facts['seed']}, made with torch {FACTS['environment']['torch']}, transformers "
            f"{FACTS['environment']['transformers']}); {REGENERATE}")


@pytest.mark.parametrize("config,mode", GROUPS)
def test_cached_engine_generates_the_reference_tokens(make_engine, weights, config, mode):
    """Every case of a config and mode in one batch: mixed prompts, boxes and guidance."""
    test_the_weights_are_those_the_reference_ran_on(weights, config)
    cases = [c for c in CASES if (c["config"], c["single_block_mode"]) == (config, mode)]
    tokens = make_engine(config, mode).generate_tokens([_request(c) for c in cases])
    problems = _mismatches(cases, tokens)
    assert not problems, (f"{config}, single block {mode!r}: cube-serve disagrees with the reference "
                          f"(commit {FACTS['reference']['commit'][:12]}):\n" + "\n".join(problems))


@pytest.mark.parametrize("config,mode", GROUPS)
def test_uncached_forward_generates_the_reference_tokens(make_engine, weights, config, mode):
    test_the_weights_are_those_the_reference_ran_on(weights, config)
    cases = [c for c in CASES if (c["config"], c["single_block_mode"]) == (config, mode)]
    tokens = make_engine(config, mode).generate_tokens_uncached([_request(c) for c in cases])
    problems = _mismatches(cases, tokens)
    assert not problems, (f"{config}, single block {mode!r}, uncached: cube-serve disagrees with the reference "
                          f"(commit {FACTS['reference']['commit'][:12]}):\n" + "\n".join(problems))


def test_the_facts_tell_the_modes_and_the_boxes_apart():
    """Tokens that no mode or box changed could not catch a mix-up of them."""
    by_mode, by_box = defaultdict(dict), defaultdict(dict)
    for c in CASES:
        by_mode[(c["config"], c["guidance_scale"], c["prompt"], str(c["bbox"]))][c["single_block_mode"]] = c["tokens"]
        by_box[(c["config"], c["single_block_mode"], c["guidance_scale"], c["prompt"])][str(c["bbox"])] = c["tokens"]
        assert len(c["tokens"]) == get_config(c["config"]).num_tokens
    assert sum(t["reference"] != t["causal"] for t in by_mode.values()) >= 10
    assert any(len({tuple(t) for t in boxes.values()}) > 1 for boxes in by_box.values())
