"""Preflight for the GPU check: does the engine's own decode step run, capture and replay on this
device, before minutes of benchmark depend on it? About 20 seconds on a GPU; a dry run on the CPU.

    python3 -m bench.cuda_preflight          (bench/gpu_check.sh runs it first)
    python3 -m bench.cuda_preflight --config tiny    (seconds: the test suite keeps it working)

By default the model has v0.1's widths, heads, condition length and token count but two dual layers and
one single layer, so its attention and sampling shapes are the real ones and it builds in
seconds. Checks, each printed as OK or FAIL (exit status 1 on any FAIL):
1. graphs: a runner with graph buckets captures (sampling and greedy-only graphs) and its
   replays give the tokens of the same bucketed step run eagerly, greedy and sampled requests,
   one joining mid-generation;
2. attention: every scaled_dot_product_attention call of one decode step (taken from the step
   itself, so masks and layouts are the engine's) runs under the pinned backends
   (DECODE_ATTENTION_BACKENDS), and under each single backend it says which kernels accept those
   arguments, how far each is from the math backend in float32, and how long one call takes.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.common import sync
from cubeserve.checkpoint import init_random_models
from cubeserve.config import TINY, V0_1, ModelConfig
from cubeserve.engine import Engine, GenerationRequest
from cubeserve.engine.runner import DECODE_ATTENTION_BACKENDS
from cubeserve.model.text import TextEncoder, build_tiny_clip

CONFIGS = {"v0.1-shallow": dataclasses.replace(V0_1, name="v0.1-shallow",
                                               gpt=dataclasses.replace(V0_1.gpt, n_layer=3, n_single_layer=1)),
           "tiny": TINY}
BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH]


def engine_on(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> Engine:
    gpt, tokenizer = init_random_models(cfg, seed=0, device=device)
    clip = build_tiny_clip(tempfile.mkdtemp(prefix="preflight-clip-"), cfg.gpt.text_model_embed_dim, seed=0)
    return Engine(cfg, gpt, tokenizer, TextEncoder(clip, device), device=device, dtype=dtype)


def requests() -> list[GenerationRequest]:
    return [GenerationRequest("a red chair"), GenerationRequest("a lamp", top_p=0.9, temperature=0.8, seed=3),
            GenerationRequest("a boat", guidance_scale=1.0)]


def run_steps(runner, first: list[GenerationRequest], later: list[GenerationRequest], steps: int) -> torch.Tensor:
    runner.admit(first)
    for i in range(steps):
        if i == 5:
            runner.admit(later)
        runner.step()
    return runner.tokens_of(0), runner.tokens_of(1), runner.tokens_of(2)


def check_graphs(engine: Engine, cuda: bool) -> bool:
    """Captured replays equal the eager bucketed step (float32: bit for bit)."""
    t0 = time.perf_counter()
    graphed = engine.decode_runner(max_objects=8, graph_buckets=(1, 8), length_buckets=4, capture=cuda)
    capture_s = time.perf_counter() - t0
    eager = engine.decode_runner(max_objects=8, graph_buckets=(1, 8), length_buckets=4, capture=False)
    reqs, steps = requests(), min(40, engine.cfg.num_tokens - 1)
    got = run_steps(graphed, reqs[:1], reqs[1:], steps)
    want = run_steps(eager, reqs[:1], reqs[1:], steps)
    ok = all(torch.equal(a, b) for a, b in zip(got, want))
    print(f"graphs: {len(graphed.graphs)} captured in {capture_s:.1f} s; replay == eager over {steps} steps "
          f"(greedy, sampled, joining): {'OK' if ok else 'FAIL'}", flush=True)
    return ok


def attention_calls(engine: Engine) -> list[tuple]:
    """(q, k, v, mask, scale) of each attention call in one decode step at the longest bucket."""
    runner = engine.decode_runner(max_objects=8, graph_buckets=(8,), length_buckets=4, capture=False)
    runner.admit(requests())
    calls, real = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        calls.append((q.clone(), k.clone(), v.clone(), None if attn_mask is None else attn_mask.clone(), scale))
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kwargs)

    F.scaled_dot_product_attention = spy
    try:
        runner.compute(8, runner.length_buckets[-1], uniform=False)
    finally:
        F.scaled_dot_product_attention = real
    return calls


def time_call(fn, device: torch.device, repeat: int = 20) -> float:
    fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / repeat


def check_attention(engine: Engine, device: torch.device) -> bool:
    ok = True
    shapes = {}
    for q, k, v, mask, scale in attention_calls(engine):
        key = (tuple(q.shape), tuple(k.shape), None if mask is None else (tuple(mask.shape), str(mask.dtype)))
        shapes.setdefault(key, (q, k, v, mask, scale))
    for (q_shape, k_shape, mask_shape), (q, k, v, mask, scale) in shapes.items():
        def call(backends, q=q, k=k, v=v, mask=mask, scale=scale):
            with sdpa_kernel(backends, set_priority=True):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

        reference = call([SDPBackend.MATH]).float()
        row = [f"attention q{list(q_shape)} kv{list(k_shape)} mask {mask_shape}:"]
        for backends, label in [(DECODE_ATTENTION_BACKENDS, "pinned")] + [([b], b.name.lower()) for b in BACKENDS]:
            try:
                err = (call(backends).float() - reference).abs().max().item()
                seconds = time_call(lambda: call(backends), device)
                row.append(f"{label} {seconds * 1e6:.0f} us err {err:.1e}")
            except RuntimeError as exc:  # a backend that refuses these arguments
                if label == "pinned":
                    ok = False
                    row.append(f"pinned FAIL {str(exc).splitlines()[0][:120]}")
                else:
                    row.append(f"{label} refused")
        print(" ".join(row[:1]) + "\n    " + "; ".join(row[1:]), flush=True)
    print(f"attention under the pinned backends: {'OK' if ok else 'FAIL'}", flush=True)
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", choices=sorted(CONFIGS), default="v0.1-shallow")
    cfg = CONFIGS[parser.parse_args(argv).config]
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    print("torch", torch.__version__, "cuda", torch.version.cuda,
          torch.cuda.get_device_name(0) if cuda else "CPU (a dry run: nothing is captured)", flush=True)
    t0 = time.perf_counter()
    ok = check_graphs(engine_on(cfg, device, torch.float32), cuda)
    ok &= check_attention(engine_on(cfg, device, torch.bfloat16 if cuda else torch.float32), device)
    print(f"preflight {'OK' if ok else 'FAILED'} in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
