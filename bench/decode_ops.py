"""Kernels per decode step: the ATen ops of one `DecodeRunner.compute` (what a CUDA graph of the
step captures), counted on the CPU with a TorchDispatchMode. No GPU needed.

    python -m bench.decode_ops [--config v0.1] [--width 192] [--full-width] [--top 15]

The runner is built as `Engine` builds it: Linear weights cast to the compute dtype, condition
projections in fp32, then the fast paths. `gpu` is the build a CUDA engine makes (`fast_paths.apply`
off the CPU: fused projections, frozen q/k norm weights, F.linear); `cpu` adds the CPU streaming
products. The step is the
captured one: `compute(k, live, uniform=False)`, every row masked.

The count of a step does not depend on the width (every op runs once per layer whatever its
size), so by default the config's layer structure (layers, heads, vocabulary, tokens) runs at a
narrow width; `--full-width` builds the real shapes (several GB of random weights) to check that.
Ops that only make a view (`is_view`: no data moves) are counted apart: on a GPU they launch no
kernel. The GPU time these ops cost is not measured here.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cubeserve.config import ModelConfig, get_config
from cubeserve.engine import fast_paths
from cubeserve.engine.cache import prefill_condition
from cubeserve.engine.runner import DecodeRunner
from cubeserve.model.gpt import DualStreamGPT
from cubeserve.model.layers import cast_linears
from cubeserve.requests import GenerationRequest

# Ops of `sampling.counter_uniform`'s hash that nothing else in a step runs: a greedy-only step
# must run none of them.
HASH_OPS = ("aten.bitwise_xor", "aten.bitwise_and", "aten.__rshift__", "aten.__lshift__",
            "aten.bitwise_right_shift", "aten.bitwise_left_shift")


class OpCounter(TorchDispatchMode):
    """Counts every ATen op dispatched inside it, by name (`aten.mm`), views apart."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.views: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # A step runs in inference mode, where composite ops (linear, layer_norm, to, SDPA...)
        # reach this mode whole: run their decomposition under it, so that what is counted
        # is what runs (a `to` to the same dtype is nothing, SDPA is its mask conversion and
        # its fused kernel).
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        name = str(func.overloadpacket)
        (self.views if func.is_view else self.ops)[name] += 1
        return func(*args, **kwargs)

    @property
    def kernels(self) -> int:
        """Ops that are not views: on a GPU, each is a kernel (or a host-side decision)."""
        return sum(self.ops.values())

    @property
    def total(self) -> int:
        return self.kernels + sum(self.views.values())


def narrow(cfg: ModelConfig, width: int) -> ModelConfig:
    """`cfg`'s layer structure (layers, heads, vocabulary, tokens) at model width `width`."""
    return dataclasses.replace(cfg, gpt=dataclasses.replace(cfg.gpt, n_embd=width, text_model_embed_dim=32))


def build_runner(cfg: ModelConfig, dtype: torch.dtype, objects: int = 2, build: str = "gpu",
                 single_block_mode: str = "reference", seed: int = 0) -> DecodeRunner:
    """A CPU `DecodeRunner` on random weights, built as `Engine` builds one; `build="gpu"`
    leaves out the CPU-only streaming products (what a CUDA engine runs)."""
    torch.manual_seed(seed)
    gpt = DualStreamGPT(cfg.gpt).eval()
    keep_fp32 = tuple(m for m in (gpt.text_proj, gpt.shape_proj, getattr(gpt, "bbox_proj", None)) if m is not None)
    cast_linears(gpt, dtype, skip=keep_fp32)
    fast_paths.apply(gpt, streaming=build == "cpu")
    generator = torch.Generator().manual_seed(seed)

    def condition(prompts, boxes):  # stands in for CLIP + text_proj: only shapes matter here
        return torch.randn(len(prompts), cfg.cond_len, cfg.gpt.n_embd, generator=generator)

    uncond_kv = prefill_condition(gpt, condition([""], [None]), dtype)
    return DecodeRunner(cfg, gpt, condition, uncond_kv, objects, torch.device("cpu"), dtype, single_block_mode,
                        graph_buckets=(objects,), capture=False)


def count_step(runner: DecodeRunner, any_sampling: bool, live: int | None = None) -> OpCounter:
    """The ops of one captured-shape step over every slot (after one warm-up step: lazy tables)."""
    k = runner.max_objects
    if runner.busy_slots:
        for s in runner.busy_slots:
            runner.release(s)
    runner.admit([GenerationRequest(f"object {i}", seed=i, temperature=0.8 if any_sampling else None)
                  for i in range(k)])
    live = live or runner.length_buckets[0]
    runner.compute(k, live, uniform=False, any_sampling=any_sampling)
    counter = OpCounter()
    with counter:
        runner.compute(k, live, uniform=False, any_sampling=any_sampling)
    return counter


def report(counter: OpCounter, top: int) -> list[str]:
    lines = [f"  {counter.kernels} ops that are not views (+ {counter.total - counter.kernels} views = "
             f"{counter.total})"]
    for name, n in counter.ops.most_common(top):
        lines.append(f"    {n:5d}  {name}")
    views = ", ".join(f"{name} {n}" for name, n in counter.views.most_common(6))
    lines.append(f"    views: {views}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="v0.1")
    parser.add_argument("--width", type=int, default=192, help="model width (ignored with --full-width)")
    parser.add_argument("--full-width", action="store_true", help="the config's real shapes (GBs of weights)")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--builds", default="gpu", help="gpu (what CUDA captures), cpu, or gpu,cpu")
    parser.add_argument("--mode", default="reference", choices=["reference", "causal"])
    parser.add_argument("--objects", type=int, default=2)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    cfg = get_config(args.config)
    if not args.full_width:
        cfg = narrow(cfg, args.width)
    g = cfg.gpt
    print(f"config {args.config}: {g.n_layer} dual + {g.n_single_layer} single layers, {g.n_head} heads, "
          f"width {g.n_embd}, {g.shape_model_vocab_size} codes; single blocks in {args.mode} mode; "
          f"{args.objects} objects ({2 * args.objects} rows), compute(uniform=False)")
    summary = []
    for build in args.builds.split(","):
        for dtype_name in args.dtypes.split(","):
            runner = build_runner(cfg, getattr(torch, dtype_name), args.objects, build, args.mode)
            for any_sampling in (True, False):
                counter = count_step(runner, any_sampling)
                title = f"{build} build, {dtype_name}, any_sampling={any_sampling}"
                print(f"\n{title}:")
                print("\n".join(report(counter, args.top)))
                hashed = sum(counter.ops[name] for name in HASH_OPS)
                summary.append(f"| {build} | {dtype_name} | {any_sampling} | {counter.kernels} | "
                               f"{counter.total} | {hashed} |")
            del runner
    print("\n| build | dtype | any_sampling | ops (not views) | ops with views | noise-hash ops |")
    print("|---|---|---|---|---|---|")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
