"""The generation engine: prompts in, shape tokens and meshes out.

    text      CLIP -> text_proj (+ bbox token)              once per request
    prefill   condition K/V of every dual layer              once per request;
              the unconditional prefix                       once per engine, shared
    decode    one token per object per step, guidance rows [cond ; uncond] in one batch
              (or a window of positions per forward, `decode_window`: engine/window.py)
    shape     tokens -> latents -> occupancy grid -> marching cubes -> GLB/OBJ
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from cubeserve.checkpoint import CLIP_DIR, load_models
from cubeserve.config import ModelConfig, check_decode_window
from cubeserve.engine import fast_paths, geometry
from cubeserve.engine.allocator import keep_freed_memory
from cubeserve.engine.cache import prefill_condition
from cubeserve.engine.runner import DecodeRunner
from cubeserve.engine.sampling import SamplingParams
from cubeserve.engine.threads import CpuThreads, apply_cpu_threads, decide_cpu_threads
from cubeserve.model.gpt import SINGLE_BLOCK_MODES, DualStreamGPT
from cubeserve.model.layers import cast_linears
from cubeserve.model.text import TextEncoder
from cubeserve.model.tokenizer import ShapeTokenizer
from cubeserve.requests import GenerationRequest

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class Timings:
    """Seconds per stage of one generation. `Engine.generate` runs one batch with no queue;
    the scheduler also knows the wait for a slot and the total."""

    queue_s: float | None = None  # submitted -> admitted (scheduler), the admission included
    tokens_s: float  # decoding (with `Engine.generate`: the whole batch's)
    steps: int  # the object's tokens: one decode step each (fewer forwards with a decode window)
    geometry_s: float  # tokens -> mesh (with `Engine.generate`: the batch's share per object)
    total_s: float | None = None  # submitted -> mesh (scheduler)
    prefill_s: float | None = None  # the admission: CLIP and prefill of its batch, the end of queue_s (scheduler)

    @property
    def time_per_token_s(self) -> float:
        return self.tokens_s / self.steps

    def as_dict(self) -> dict[str, float]:
        """The stages known, as the JSON-able dict that readers take by key."""
        stages = {"queue_s": self.queue_s, "prefill_s": self.prefill_s, "tokens_s": self.tokens_s,
                  "time_per_token_s": self.time_per_token_s, "geometry_s": self.geometry_s, "total_s": self.total_s}
        return {k: v for k, v in stages.items() if v is not None}


@dataclass
class GenerationResult:
    request: GenerationRequest
    tokens: list[int]
    mesh: geometry.Mesh
    stages: Timings

    @property
    def timings(self) -> dict[str, float]:
        """`stages` as a dict (seconds by stage name), the form the server sends."""
        return self.stages.as_dict()

    def mesh_bytes(self) -> bytes:
        return self.mesh.export(self.request.format)


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def native_bf16_cpu() -> str | None:
    """The CPU's native bf16 multiply (AMX tiles, AVX-512 BF16), or None where it has none."""
    if torch.cpu._is_amx_tile_supported():
        return "AMX"
    if torch.cpu._is_avx512_bf16_supported():
        return "AVX-512 BF16"
    return None


def default_dtype(device: torch.device) -> tuple[str, str]:
    """The compute dtype where none is asked for, and why: bfloat16 on CUDA and on CPUs with AMX,
    float32 elsewhere. AVX-512 BF16 alone decoded slower in bfloat16 than in float32 (1.2x on
    an AMD EPYC: BENCHMARKS.md, "Numerics modes"); bf16's agreement with float32 is measured
    there too."""
    if device.type == "cuda":
        return "bfloat16", "CUDA"
    native = native_bf16_cpu()
    if native == "AMX":
        return "bfloat16", "the CPU multiplies bf16 in AMX tiles"
    if native:
        return "float32", f"the CPU has {native} but no AMX: bf16 decodes slower there"
    return "float32", "the CPU has no native bf16 multiply"


class Engine:
    """Holds the models of one checkpoint on one device and generates from requests."""

    def __init__(self, cfg: ModelConfig, gpt: DualStreamGPT, tokenizer: ShapeTokenizer, text: TextEncoder,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 single_block_mode: str = "reference", cpu_threads: int | None = None,
                 engines_sharing_cpu: int = 1, quantization: str = "none", decode_window: int = 1):
        """`decode_window`: positions per object one decode forward runs (window decoding,
        `engine/window.py`: the same tokens, fewer forwards where guesses hold); 1 is one token
        per forward. `quantization`: "none", or the GPT's weights as "int8" (per output channel) or "int4"
        (in groups), weight-only, or "fp8" (e4m3 weights and activations, per-row scales; an
        emulation off CUDA capability 8.9) (`fast_paths.quantize`); the condition projections,
        the shape tokenizer and, for int8, `lm_head` (`fast_paths.KEEP_LOGITS`) keep `dtype`.
        `cpu_threads`: PyTorch's intra-op threads (process-wide); None: $OMP_NUM_THREADS if
        set, else the CPUs the cgroup's quota and the affinity mask allow, divided among the
        `engines_sharing_cpu` engine processes that share them (`threads.decide_cpu_threads`)."""
        self.decode_window = check_decode_window(decode_window)
        self.cpu_threads: CpuThreads = decide_cpu_threads(cpu_threads, engines=engines_sharing_cpu)
        apply_cpu_threads(self.cpu_threads)
        log.info("engine: %s", self.cpu_threads.describe())
        if single_block_mode not in SINGLE_BLOCK_MODES:
            raise ValueError(f"single_block_mode must be one of {SINGLE_BLOCK_MODES}, got {single_block_mode!r}")
        if text.hidden_size != cfg.gpt.text_model_embed_dim:
            raise ValueError(
                f"the CLIP model has hidden size {text.hidden_size}, the GPT expects "
                f"text_model_embed_dim {cfg.gpt.text_model_embed_dim}")
        self.cfg = cfg
        self.device = torch.device(device)
        if self.device.type == "cpu":
            keep_freed_memory()  # the same page faults an object in every process (engine/allocator.py)
        self.dtype = dtype
        self.single_block_mode = single_block_mode
        self.quantization = quantization
        # The engine owns the models it is given: it moves them, casts their Linear weights to the
        # compute dtype once (the condition projections stay fp32, as the reference runs them
        # outside autocast; norms and embeddings stay fp32) and swaps in its fast paths.
        self.gpt = gpt.to(self.device)
        self.tokenizer = tokenizer.to(self.device)
        keep_fp32 = tuple(m for m in (gpt.text_proj, gpt.shape_proj, getattr(gpt, "bbox_proj", None)) if m is not None)
        cast_linears(self.gpt, dtype, skip=keep_fp32)
        cast_linears(self.tokenizer, dtype)
        fast_paths.apply(self.gpt, self.tokenizer, quantization=quantization, keep=keep_fp32)
        if quantization == "fp8" and not fast_paths.fp8_native(self.device):
            # Chosen on purpose for its numerics, not its speed: say so where nobody reads a docstring.
            log.warning("fp8 on %s is an emulation of the CUDA kernel's numerics (for measurement), slower than "
                        "float32; fp8 runs natively on CUDA devices of compute capability 8.9 or newer", self.device)
        self.text = text
        # The unconditional prefix: CLIP("") (+ a zero box), prefilled once and shared.
        self.uncond_kv = prefill_condition(self.gpt, self.condition([""], [None]), self.dtype)

    @classmethod
    def from_dir(cls, weights_dir: str | Path, device: str | torch.device | None = "cpu",
                 dtype: str | torch.dtype | None = None, single_block_mode: str = "reference",
                 config: ModelConfig | str | None = None, cpu_threads: int | None = None,
                 engines_sharing_cpu: int = 1, quantization: str = "none", decode_window: int = 1) -> "Engine":
        """`dtype` None: `default_dtype` for the device, decided here once and logged."""
        check_decode_window(decode_window)  # before anything loads
        device = resolve_device(device)
        if dtype is None:
            dtype, why = default_dtype(device)
            log.info("engine: compute dtype %s (%s)", dtype, why)
        if isinstance(dtype, str) and dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
        dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
        cfg, gpt, tok = load_models(weights_dir, config=config, device="cpu")
        text = TextEncoder(Path(weights_dir) / CLIP_DIR, device=device)
        return cls(cfg, gpt, tok, text, device=device, dtype=dtype, single_block_mode=single_block_mode,
                   cpu_threads=cpu_threads, engines_sharing_cpu=engines_sharing_cpu, quantization=quantization,
                   decode_window=decode_window)

    # -- stages ---------------------------------------------------------------------------------

    def condition(self, prompts: list[str], bboxes: list) -> torch.Tensor:
        hidden = self.text(prompts)
        box = None
        if self.cfg.gpt.use_bbox:
            box = torch.tensor([b if b is not None else (0.0, 0.0, 0.0) for b in bboxes],
                               dtype=torch.float32, device=self.device)
        return self.gpt.condition(hidden, box)

    def decode_runner(self, max_objects: int, graph_buckets: tuple[int, ...] | None = None,
                      length_buckets: int = 4, capture: bool = True, window: int | None = None) -> DecodeRunner:
        """Slots for `max_objects` objects in flight on this engine's models (`DecodeRunner`);
        `window` None: the engine's `decode_window`."""
        return DecodeRunner(self.cfg, self.gpt, self.condition, self.uncond_kv, max_objects, self.device,
                            self.dtype, self.single_block_mode, graph_buckets, length_buckets, capture,
                            window=self.decode_window if window is None else window)

    def validate(self, requests: list[GenerationRequest]) -> None:
        for r in requests:
            r.validate(uses_bbox=self.cfg.gpt.use_bbox)

    @torch.no_grad()
    def generate_tokens(self, requests: list[GenerationRequest],
                        on_step: Callable[[int], None] | None = None,
                        return_logits: bool = False, force: torch.Tensor | None = None):
        """Shape token ids [B, N] for a batch of requests, with the KV cache, all in one batch.

        With `return_logits`, also the guided fp32 logits [B, N, codes] of every step. With
        `force` [B, N] (teacher forcing, for measurements), each step's logits are computed
        after those tokens, which are also the ones returned. Both decode one token per step
        (no decode window). `on_step(tokens)`: after each step, the tokens every object has.
        """
        self.validate(requests)
        one_by_one = return_logits or force is not None
        runner = self.decode_runner(max_objects=len(requests), window=1 if one_by_one else None)
        runner.admit(requests)
        all_logits = []
        done = 0
        while done < self.cfg.num_tokens:
            out = runner.step(return_logits=return_logits)
            if return_logits:
                all_logits.append(out.guided_logits)
            if force is not None:
                runner.force(done, force[:, done])
            done = min(runner.generated)
            if on_step is not None:
                on_step(done)
        tokens = runner.tokens.clone()
        return (tokens, torch.stack(all_logits, dim=1)) if return_logits else tokens

    @torch.no_grad()
    def generate_tokens_uncached(self, requests: list[GenerationRequest], return_logits: bool = False):
        """The reference's uncached mode: the full forward over the whole prefix every step."""
        self.validate(requests)
        b, n = len(requests), self.cfg.num_tokens
        codes = self.cfg.gpt.shape_model_vocab_size
        cond = self.condition([r.prompt for r in requests], [r.normalized_bbox() for r in requests])
        uncond = self.condition([""] * b, [None] * b)
        cond_rows = torch.cat([cond, uncond], dim=0)
        dev = self.device
        sampling = SamplingParams.of(requests, dev)
        seq = torch.full((2 * b, 1), self.cfg.gpt.bos_id, dtype=torch.int64, device=dev)
        tokens, all_logits = [], []
        for step in range(n):
            logits = self.gpt.forward_uncached(self.gpt.embed_tokens(seq), cond_rows, self.single_block_mode,
                                               compute_dtype=self.dtype)[:, -1, :codes]
            steps = torch.full((b,), step, dtype=torch.int64, device=dev)
            guided, ids = sampling.next_tokens(logits[:b], logits[b:], steps, n)
            all_logits.append(guided)
            tokens.append(ids)
            seq = torch.cat([seq, ids.repeat(2)[:, None]], dim=1)
        tokens = torch.stack(tokens, dim=1)
        return (tokens, torch.stack(all_logits, dim=1)) if return_logits else tokens

    @torch.no_grad()
    def tokens_to_meshes(self, tokens: torch.Tensor, resolutions: list[int], coarse_to_fine: bool = True,
                         chunk_size: int | None = None,
                         mesh_worker: geometry.MeshWorker | None = None) -> list[geometry.Mesh]:
        """Meshes of token sequences [B, N]; coarse-to-fine occupancy unless told to go dense.
        `mesh_worker`: where scikit-image's marching cubes runs (`geometry.marching_cubes`)."""
        latents = self.tokenizer.decode_tokens(tokens.to(self.device))
        meshes = []
        for i, res in enumerate(resolutions):
            if coarse_to_fine:
                grid = geometry.occupancy_grid_coarse_to_fine(self.tokenizer, latents[i: i + 1], res,
                                                              chunk_size=chunk_size)
            else:
                grid = geometry.occupancy_grid(self.tokenizer, latents[i: i + 1], res, chunk_size)[0]
            meshes.append(geometry.marching_cubes(grid, res, worker=mesh_worker))
        return meshes

    def generate(self, requests: list[GenerationRequest],
                 on_step: Callable[[int], None] | None = None) -> list[GenerationResult]:
        """Prompts to meshes, with per-stage timings (seconds). Every request is validated
        (by generate_tokens) before any work starts."""
        t0 = time.perf_counter()
        tokens = self.generate_tokens(requests, on_step=on_step)
        self._sync()
        t1 = time.perf_counter()
        meshes = self.tokens_to_meshes(tokens, [r.resolution for r in requests])
        self._sync()
        t2 = time.perf_counter()
        n = self.cfg.num_tokens
        results = []
        for r, toks, mesh in zip(requests, tokens.tolist(), meshes):
            if mesh.empty:
                log.warning("prompt %r: %s", r.prompt, mesh.message)
            results.append(GenerationResult(r, toks, mesh, Timings(
                tokens_s=t1 - t0, steps=n, geometry_s=(t2 - t1) / len(requests))))
        return results

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
