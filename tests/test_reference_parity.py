"""Parity with Roblox's reference code itself: on the tiny test weights, cube-serve generates
the very token sequences that the reference's `Engine.run_gpt` generated (greedy, fp32), in
both single-block behaviours, with and without guidance, with and without a bounding box.

The tokens are facts in tests/data/reference/tokens.json, written by regenerate.py beside it
from a named commit of github.com/Roblox/cube (which is never copied here). The weights are
the session fixtures (and tiny-vq-norm, tiny's with the VQ norm weight changed as
regenerate.py changes it); their sha256 is checked first, so that a change of the weights (or
of how they are made) is reported as that, not as a disagreement of the code.
"""

import hashlib
import json
import shutil
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from cubeserve.config import get_config
from cubeserve.engine import Engine
from cubeserve.engine import GenerationRequest as Req

FACTS = json.loads((Path(__file__).parent / "data" / "reference" / "tokens.json").read_text())
CASES = FACTS["cases"]
GROUPS = sorted({(c["weights"], c["single_block_mode"]) for c in CASES})
REGENERATE = ("if the change of weights is intended, regenerate the tokens with "
              "tests/data/reference/regenerate.py (it says how)")
VQ_NORM = "bottleneck.block.norm.weight"


@pytest.fixture(scope="module")
def weights(tiny_weights, tiny_bbox_weights, tmp_path_factory):
    """name -> weights directory, as regenerate.py's WEIGHTS."""
    from safetensors.torch import load_file, save_file

    vq_norm = tmp_path_factory.mktemp("tiny_vq_norm") / "w"
    shutil.copytree(tiny_weights, vq_norm)
    path = vq_norm / "shape_tokenizer.safetensors"
    state = {k: v.clone() for k, v in load_file(str(path)).items()}
    state[VQ_NORM] = torch.linspace(0.5, 1.5, state[VQ_NORM].numel())  # as regenerate.vq_norm_variant
    path.unlink()
    save_file(state, str(path), metadata={"format": "pt"})
    return {"tiny": tiny_weights, "tiny-bbox": tiny_bbox_weights, "tiny-vq-norm": vq_norm}


@pytest.fixture(scope="module")
def engine_for(weights, make_engine):
    """engine_for(weights name, mode): the session's engines for the fixtures, fp32."""
    built = {}

    def get(name: str, mode: str) -> Engine:
        if name in ("tiny", "tiny-bbox"):
            return make_engine(name, mode)
        if (name, mode) not in built:
            built[(name, mode)] = Engine.from_dir(weights[name], device="cpu", dtype="float32",
                                                  single_block_mode=mode)
        return built[(name, mode)]

    return get


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


def _check_weights(weights, name: str) -> None:
    facts = FACTS["weights"][name]
    for file, digest in facts["sha256"].items():
        got = hashlib.sha256((weights[name] / file).read_bytes()).hexdigest()
        assert got == digest, (
            f"{name} {file}: these weights are not those the reference generated its tokens on "
            f"({facts['config']}, seed {facts['seed']}, variant {facts['variant']}, made with torch "
            f"{FACTS['environment']['torch']}, transformers {FACTS['environment']['transformers']}); "
            f"{REGENERATE}")


def test_the_facts_cover_every_mode():
    ref = FACTS["reference"]
    assert ref["repository"] == "https://github.com/Roblox/cube" and len(ref["commit"]) == 40
    seen = {(c["weights"], c["single_block_mode"], c["guidance_scale"] > 0, c["bbox"] is not None) for c in CASES}
    for name in ("tiny", "tiny-bbox", "tiny-vq-norm"):
        for mode in ("reference", "causal"):
            for guided in (True, False):
                assert (name, mode, guided, False) in seen
                if name == "tiny-bbox":
                    assert (name, mode, guided, True) in seen
    # The modes are the reference's cached decode (BOS-only single block) and its uncached forward.
    assert all(c["use_kv_cache"] == (c["single_block_mode"] == "reference") for c in CASES)


@pytest.mark.parametrize("name", sorted(FACTS["weights"]))
def test_the_weights_are_those_the_reference_ran_on(weights, name):
    _check_weights(weights, name)


@pytest.mark.parametrize("path", ["cached", "uncached"])
@pytest.mark.parametrize("name,mode", GROUPS)
def test_the_engine_generates_the_reference_tokens(weights, engine_for, name, mode, path):
    """Every case of a weights set and mode in one batch (mixed prompts, boxes and guidance),
    through the cached engine and through the uncached forward."""
    _check_weights(weights, name)
    cases = [c for c in CASES if (c["weights"], c["single_block_mode"]) == (name, mode)]
    engine = engine_for(name, mode)
    generate = engine.generate_tokens if path == "cached" else engine.generate_tokens_uncached
    problems = _mismatches(cases, generate([_request(c) for c in cases]))
    assert not problems, (f"{name}, single block {mode!r}, {path}: cube-serve disagrees with the reference "
                          f"(commit {FACTS['reference']['commit'][:12]}):\n" + "\n".join(problems))


def test_the_facts_tell_the_modes_the_boxes_and_the_vq_norm_apart():
    """Tokens that no mode, box or weight changed could not catch a mix-up of them."""
    by_mode, by_box, by_weights = defaultdict(dict), defaultdict(dict), defaultdict(dict)
    for c in CASES:
        assert len(c["tokens"]) == get_config(c["config"]).num_tokens
        key = (c["guidance_scale"], c["prompt"])
        by_mode[(c["weights"], str(c["bbox"])) + key][c["single_block_mode"]] = c["tokens"]
        by_box[(c["weights"], c["single_block_mode"]) + key][str(c["bbox"])] = c["tokens"]
        by_weights[(c["single_block_mode"], str(c["bbox"])) + key][c["weights"]] = c["tokens"]
    assert sum(t["reference"] != t["causal"] for t in by_mode.values()) >= 10
    assert any(len({tuple(t) for t in boxes.values()}) > 1 for boxes in by_box.values())
    assert all(t["tiny"] != t["tiny-vq-norm"] for t in by_weights.values() if "tiny-vq-norm" in t)
