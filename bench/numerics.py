"""How closely each numerics mode decodes like the float32 oracle (`cubeserve.numerics`), and,
with --reference, how closely the reference's own default numerics (bf16 autocast, bf16 KV
cache) do on the same weights and prompts: the bar a mode must meet.

    python -m bench.numerics --weights models/demo [--reference CUBE]
    python -m bench.numerics --config mid --seed 0 --prompts 8 [--reference CUBE]

A mode is `<dtype>` or `<dtype>+<quantization>`: float32, bfloat16, bfloat16+int8, float32+int4...
fp8 off a GPU of compute capability 8.9 is the emulation of the GPU kernel's numerics
(`fast_paths.Fp8Linear`): the same figures the GPU computes, measured on the CPU.
CUBE is a checkout of github.com/Roblox/cube (research code under its own licence, never
copied into this project), imported from where it lies, as tests/data/reference/regenerate.py
does; run it where the reference's few extra packages import (omegaconf, accelerate).
Prints a Markdown table for BENCHMARKS.md and writes bench/results.json's "numerics" section.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

from bench.common import Record, hardware, write_results
from cubeserve import numerics
from cubeserve.checkpoint import CLIP_DIR, GPT_FILE, TOKENIZER_FILE, write_random_weights
from cubeserve.config import read_yaml, to_yaml_dict
from cubeserve.engine.engine import DTYPES, Engine

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODES = ("float32", "bfloat16", "float32+int8", "bfloat16+int8", "bfloat16+int4", "bfloat16+fp8")


def parse_mode(mode: str) -> tuple[str, str]:
    dtype, _, quantization = mode.partition("+")
    if dtype not in DTYPES:
        raise SystemExit(f"mode {mode!r}: the dtype must be one of {sorted(DTYPES)}")
    return dtype, quantization or "none"


class ReferenceDecoder:
    """The reference's `Engine.run_gpt` with its default numerics, greedy; teacher forcing and
    the logits through its `process_logits` (the one function that sees the guided logits and
    picks the token). Its tokens become objects through the oracle's float32 tokenizer: the
    reference decodes shapes outside its autocast."""

    def __init__(self, checkout: Path, weights_dir: Path, tokenizer):
        import yaml

        regenerate = _load_module(REPO / "tests/data/reference/regenerate.py", "regenerate")
        sys.path.insert(0, str(checkout.resolve()))
        for name in ("warp", "skimage"):
            regenerate._stub_missing(name)
        import cube3d.inference.engine as ref_engine

        self.module = ref_engine
        ref_yaml = to_yaml_dict(read_yaml(weights_dir / "config.yaml"))
        ref_yaml.pop("name")
        ref_yaml["text_model_pretrained_model_name_or_path"] = str(weights_dir / CLIP_DIR)
        self.tmp = tempfile.TemporaryDirectory()
        config = Path(self.tmp.name) / "reference.yaml"
        config.write_text(yaml.safe_dump(ref_yaml, sort_keys=False))
        self.engine = ref_engine.Engine(str(config), str(weights_dir / GPT_FILE), str(weights_dir / TOKENIZER_FILE),
                                        device=torch.device("cpu"))
        self.tokenizer = tokenizer

    def tokens_and_logits(self, requests, force=None):
        guidance = {r.guidance_scale for r in requests}
        if len(guidance) != 1 or any(r.bbox is not None for r in requests):
            raise ValueError("the reference runs one guidance scale per batch and no boxes here")
        seen = []
        self.picked_at = []  # when each token was picked: the decode steps' times, for bench.quantization

        def process_logits(logits, top_p=None):
            i = len(seen)
            self.picked_at.append(time.perf_counter())
            seen.append(logits.float().clone())
            return force[:, i: i + 1].clone() if force is not None else logits.argmax(dim=-1, keepdim=True)

        original = self.module.process_logits
        self.module.process_logits = process_logits
        try:
            ids = self.engine.run_gpt([r.prompt for r in requests], use_kv_cache=True,
                                      guidance_scale=guidance.pop(), top_p=None)
        finally:
            self.module.process_logits = original
        return ids.cpu(), torch.stack(seen, dim=1)


def _load_module(path: Path, name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--weights", type=Path, help="a checkpoint directory (e.g. models/demo)")
    src.add_argument("--config", help="random weights of this preset (e.g. mid): mechanics, not margins")
    ap.add_argument("--seed", type=int, default=0, help="of the random weights")
    ap.add_argument("--modes", default=",".join(DEFAULT_MODES), help="none, with --reference: the reference's row alone")
    ap.add_argument("--prompts", type=int, default=len(numerics.PROMPTS), help="how many of the prompt set")
    ap.add_argument("--guidance", type=float, default=3.0)
    ap.add_argument("--resolution", type=int, default=numerics.RESOLUTION)
    ap.add_argument("--reference", type=Path, help="a checkout of github.com/Roblox/cube: adds its default numerics")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads (default: the engine's choice)")
    ap.add_argument("--json", type=Path, help="also write every per-prompt score here")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        weights = args.weights or write_random_weights(args.config, Path(tmp) / args.config, seed=args.seed)
        label = str(args.weights) if args.weights else f"{args.config} (random, seed {args.seed})"
        requests = numerics.requests_for(numerics.PROMPTS[: args.prompts], args.guidance)
        t0 = time.perf_counter()
        oracle_engine = Engine.from_dir(weights, dtype="float32", cpu_threads=args.threads)
        oracle = numerics.Oracle.of(numerics.EngineDecoder(oracle_engine), requests, args.resolution)
        print(f"oracle (float32): {len(requests)} prompts x {oracle.tokens.shape[1]} tokens in "
              f"{time.perf_counter() - t0:.0f} s", file=sys.stderr)
        # Only the oracle's tokenizer lives on: at v0.1 size a float32 GPT with its packed copies
        # is 11 GB, and each mode's engine loads beside it.
        tokenizer = oracle.tokenizer
        del oracle_engine
        # The reference first: a missing package there fails before the long part.
        ref = ReferenceDecoder(args.reference, Path(weights), tokenizer) if args.reference else None
        reports = []
        for mode in [m for m in args.modes.split(",") if m and m != "none"]:
            dtype, quantization = parse_mode(mode)
            engine = Engine.from_dir(weights, dtype=dtype, quantization=quantization, cpu_threads=args.threads)
            reports.append(numerics.compare(oracle, numerics.EngineDecoder(engine), mode))
            del engine
            print(json.dumps(reports[-1].summary()), file=sys.stderr)
        if ref is not None:
            reports.append(numerics.compare(oracle, ref, "reference default (bf16 autocast)"))
            print(json.dumps(reports[-1].summary()), file=sys.stderr)

    device = hardware(torch.device("cpu"))
    print(f"\nNumerics against the float32 oracle: {label}, {len(requests)} prompts, greedy, guidance "
          f"{args.guidance}, objects at resolution {args.resolution}; {device}\n")
    print("| mode | teacher-forced agreement | by quarter | KL (nats/token) | first divergence (median) "
          "| identical | volume IoU | Chamfer |")
    print("|---|---|---|---|---|---|---|---|")
    for r in reports:
        quarters = " / ".join(f"{q:.3f}" for q in r.agreement_by_quarter)
        print(f"| {r.mode} | {r.agreement:.4f} | {quarters} | {r.kl:.2e} | {r.first_divergence_median:.0f} of {r.tokens} "
              f"| {r.identical}/{len(r.prompts)} | {r.iou:.4f} | {r.chamfer:.4f} |")
    write_results([Record(f"numerics: {label}", device, label, r.mode, 1, extra=r.summary()) for r in reports],
                  {"by": "python -m bench.numerics"})
    if args.json:
        args.json.write_text(json.dumps([r.to_dict() for r in reports], indent=1) + "\n")


if __name__ == "__main__":
    main()
