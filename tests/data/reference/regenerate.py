"""Regenerate `tokens.json`: the shape tokens that Roblox's own Cube 3D code generates on this
project's tiny test weights. tests/test_reference_parity.py checks cube-serve against them.

It lives next to the file it writes, so that the facts and the way they were made stay
together; it is not a test (pytest does not collect it) and it never runs in the suite.

The reference (https://github.com/Roblox/cube, research code under its own licence) is never
copied into this project: give the path of a checkout or an export of it. Run this in a
throwaway virtual environment, not the project's, with the reference's token-path needs and
the project's versions of torch and transformers (so that the tiny weights, CLIP included,
come out bit-identical to the test fixtures'; the file records their sha256 to prove it):

    python3 -m venv REFVENV                      # anywhere outside this repository
    REFVENV/bin/pip install "torch==<the project's>" "transformers==<the project's>" \\
        "numpy<2" safetensors pyyaml omegaconf tqdm accelerate
    git clone https://github.com/Roblox/cube CUBE
    REFVENV/bin/python tests/data/reference/regenerate.py CUBE [--commit HASH]

The reference's mesh extraction needs `warp-lang` and `scikit-image`; neither is on the token
path, so where they are not installed they are replaced by stubs that fail if called.

What runs is the reference's own `cube3d.inference.engine.Engine.run_gpt`, greedy
(top_p=None), on the reference's own modules loaded strictly from our safetensors files (the
checkpoint format is the reference's, no conversion), with a reference-format YAML config and
the tiny CLIP as its text model. One change: the reference runs the GPT under bf16 autocast
with a bf16 KV cache; here its `torch.autocast` is switched off and its cache dtype is fp32,
so that the tokens are the fp32 model's (exact enough to compare greedy tokens; bf16 flips
near-ties differently from one implementation to another).

Cases: the tiny and tiny-bbox configs (the seeds of tests/conftest.py's fixtures), both of
the reference's single-block behaviours (`use_kv_cache=True`: its cached decode, where the
single block attends only to BOS, cube-serve's "reference" mode; `use_kv_cache=False`: its
uncached full forward, causal in the single block, cube-serve's "causal" mode), guidance
3.0 and 0.0 (no classifier-free guidance), several prompts including the empty one, and for
tiny-bbox no box (a zero box token) and two boxes normalised as the reference's CLI does.
A third set, tiny-vq-norm, is tiny's weights with the VQ's RMSNorm weight not all ones
(`vq_norm_variant`): the reference multiplies by that weight although its norm is declared
without affine parameters.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import subprocess
import sys
import tempfile
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
OUT = HERE / "tokens.json"

# name -> (config, seed, variant); tiny and tiny-bbox as tests/conftest.py writes its fixtures
WEIGHTS = {"tiny": ("tiny", 0, None), "tiny-bbox": ("tiny-bbox", 1, None),
           "tiny-vq-norm": ("tiny", 0, "vq-norm")}
VQ_NORM = "bottleneck.block.norm.weight"
HASHED = ("shape_gpt.safetensors", "shape_tokenizer.safetensors", "clip/model.safetensors")
PROMPTS = ["a red chair", "a round table with four legs", ""]
BBOXES = {"tiny": [None], "tiny-bbox": [None, [1.0, 2.0, 0.5], [3.0, 1.0, 1.0]]}
GUIDANCE = [3.0, 0.0]
MODES = {"reference": True, "causal": False}  # cube-serve single_block_mode -> use_kv_cache


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def vq_norm_variant(weights_dir: Path) -> None:
    """The VQ's RMSNorm weight set to linspace(0.5, 1.5) instead of ones. The reference's
    RMSNorm(elementwise_affine=False) multiplies by its (frozen) weight all the same, in the
    codebook rows the GPT's wte takes and in the lookup. tests/test_reference_parity.py makes
    the same change; the sha256 check proves it."""
    import torch
    from safetensors.torch import load_file, save_file

    path = weights_dir / "shape_tokenizer.safetensors"
    state = {k: v.clone() for k, v in load_file(str(path)).items()}
    state[VQ_NORM] = torch.linspace(0.5, 1.5, state[VQ_NORM].numel())
    path.unlink()
    save_file(state, str(path), metadata={"format": "pt"})


def _stub_missing(name: str) -> None:
    """A module the reference imports for mesh extraction only: any use of it fails."""
    try:
        importlib.import_module(name)
        return
    except ImportError:
        pass

    class Missing(types.ModuleType):
        def __getattr__(self, attr):
            if attr.startswith("__"):
                raise AttributeError(attr)

            def unavailable(*_a, **_k):
                raise RuntimeError(f"{name}.{attr} is stubbed out (not on the token path)")
            return unavailable

    sys.modules[name] = Missing(name)


def _fp32(engine_module) -> None:
    """Switch the reference engine's bf16 autocast off and make its KV cache fp32."""
    import torch

    proxy = types.ModuleType("torch")
    proxy.__getattr__ = lambda attr: getattr(torch, attr)
    proxy.bfloat16 = torch.float32
    proxy.autocast = lambda device_type=None, dtype=None, enabled=True, **kw: torch.autocast(
        device_type, enabled=False)
    engine_module.torch = proxy


def reference_commit(path: Path, given: str | None) -> str:
    if given:
        return given
    try:
        return subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], check=True,
                              capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        sys.exit(f"{path} is not a git checkout: name the reference commit with --commit")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reference", type=Path, help="a checkout or export of github.com/Roblox/cube")
    ap.add_argument("--commit", help="the reference's commit (read with git when omitted)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    commit = reference_commit(args.reference, args.commit)

    import torch
    import transformers
    import yaml

    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(args.reference.resolve()))
    for name in ("warp", "skimage"):
        _stub_missing(name)
    import cube3d.inference.engine as ref_engine
    from cube3d.inference.utils import normalize_bbox

    from cubeserve.checkpoint import GPT_FILE, TOKENIZER_FILE, write_random_weights
    from cubeserve.config import get_config, to_yaml_dict

    _fp32(ref_engine)
    weights_facts, cases = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (config, seed, variant) in WEIGHTS.items():
            wdir = write_random_weights(config, Path(tmp) / name, seed=seed)
            if variant == "vq-norm":
                vq_norm_variant(wdir)
            weights_facts[name] = {"config": config, "seed": seed, "variant": variant,
                                   "sha256": {f: sha256(wdir / f) for f in HASHED}}
            # The reference's YAML layout; its dataclasses take every key cube-serve writes.
            ref_yaml = to_yaml_dict(get_config(config))
            ref_yaml.pop("name")
            ref_yaml["text_model_pretrained_model_name_or_path"] = str(wdir / "clip")
            (wdir / "reference.yaml").write_text(yaml.safe_dump(ref_yaml, sort_keys=False))
            engine = ref_engine.Engine(str(wdir / "reference.yaml"), str(wdir / GPT_FILE),
                                       str(wdir / TOKENIZER_FILE), device=torch.device("cpu"))
            assert engine.gpt_model.cfg.rope_theta == 10000, "rope_theta must come from the YAML"
            for mode, use_kv_cache in MODES.items():
                for guidance in GUIDANCE:
                    for bbox in BBOXES[config]:
                        for prompt in PROMPTS:
                            ids = engine.run_gpt([prompt], use_kv_cache=use_kv_cache, guidance_scale=guidance,
                                                 top_p=None,
                                                 bounding_box_xyz=normalize_bbox(tuple(bbox)) if bbox else None)
                            cases.append({"weights": name, "config": config, "single_block_mode": mode,
                                          "use_kv_cache": use_kv_cache, "guidance_scale": guidance,
                                          "prompt": prompt, "bbox": bbox, "tokens": ids[0].tolist()})
                            print(name, mode, guidance, bbox, repr(prompt), ids[0].tolist()[:8], "...")

    facts = {
        "what": "shape tokens generated by Roblox's reference code on cube-serve's tiny test weights; "
                "written by tests/data/reference/regenerate.py, checked by tests/test_reference_parity.py",
        "reference": {
            "repository": "https://github.com/Roblox/cube",
            "commit": commit,
            "ran": "cube3d.inference.engine.Engine.run_gpt(prompts=[prompt], use_kv_cache, guidance_scale, "
                   "top_p=None, bounding_box_xyz=normalize_bbox(bbox) or None)",
            "precision": "float32: the reference's bf16 autocast switched off, its KV cache in float32",
            "sampling": "greedy (argmax)",
        },
        "environment": {"python": sys.version.split()[0], "torch": torch.__version__,
                        "transformers": transformers.__version__},
        "weights": weights_facts,
        "cases": cases,
    }
    # One line per case: a diff shows which case changed.
    text = json.dumps({**facts, "cases": ["@"]}, indent=1)
    lines = ",\n  ".join(json.dumps(c) for c in cases)
    args.out.write_text(text.replace('"@"', " " + lines) + "\n")
    print(f"{len(cases)} cases -> {args.out}")


if __name__ == "__main__":
    main()
