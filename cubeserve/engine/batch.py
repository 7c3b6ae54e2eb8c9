"""Objects in flight: a pool of KV-cache slots that requests join and leave between steps.

One slot is one object and owns two adjacent cache rows, 2s (conditional) and 2s + 1
(unconditional), so the rows of slots 0..k-1 are one contiguous range and guidance is a view.
Each row has its own position: a request admitted mid-generation starts at BOS while the
others go on (continuous batching). A step runs rows 0..2k-1, where k is one past the highest
busy slot; admission fills the lowest free slots so k stays small.

Everything a step needs lives in device tensors (inputs, positions, which slots are busy,
sampling parameters, tokens), so a step is a fixed sequence of kernels with no host sync: on
CUDA it is captured once per (slot bucket, cache-length bucket) as a CUDA graph
(`cubeserve.engine.graphs`) and replayed; on the CPU it runs eagerly and trims the work to
what the host knows is live.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from cubeserve.engine.cache import KVCache
from cubeserve.engine.requests import GenerationRequest
from cubeserve.engine.sampling import apply_guidance, guidance_weights, sample
from cubeserve.engine.step import decode_step, prefill_condition

log = logging.getLogger(__name__)


@dataclass
class StepOutput:
    finished: list[int]  # slots whose N tokens are complete (still holding their tokens)
    guided_logits: torch.Tensor | None  # [k, codes] of this step, when asked for (eager only)


class SlotPool:
    def __init__(self, engine, max_objects: int, graphs: bool = False,
                 graph_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64), length_buckets: int = 4):
        cfg = engine.cfg
        self.engine = engine
        self.max_objects = max_objects
        self.num_tokens = cfg.num_tokens
        self.codes = cfg.gpt.shape_model_vocab_size
        dev = engine.device
        rows = 2 * max_objects
        self.cache = KVCache(cfg, rows=rows, device=dev, dtype=engine.dtype,
                             single_block_mode=engine.single_block_mode)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.x = torch.zeros(rows, cfg.gpt.n_embd, dtype=torch.float32, device=dev)  # next inputs
        self.tokens = torch.zeros(max_objects, cfg.num_tokens, dtype=torch.int64, device=dev)
        self.busy = torch.zeros(max_objects, dtype=torch.bool, device=dev)
        self.scale = torch.zeros(max_objects, dtype=torch.float32, device=dev)
        self.greedy = torch.ones(max_objects, dtype=torch.bool, device=dev)
        self.temperature = torch.ones(max_objects, dtype=torch.float32, device=dev)
        self.top_p = torch.ones(max_objects, dtype=torch.float32, device=dev)
        self.seed = torch.zeros(max_objects, dtype=torch.int64, device=dev)
        # Host mirrors: tokens generated so far per slot (None = free) and who samples.
        self.generated: list[int | None] = [None] * max_objects
        self._samples: list[bool] = [False] * max_objects
        with torch.no_grad():  # a BOS with grad would chain every admission into one autograd graph
            self._bos = engine.gpt.embed_tokens(torch.tensor([cfg.gpt.bos_id], device=dev))[0]
        self.graphs = None
        if graphs:
            from cubeserve.engine.graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self, graph_buckets, length_buckets)

    # -- slots ----------------------------------------------------------------------------------

    @property
    def free_slots(self) -> list[int]:
        return [s for s, g in enumerate(self.generated) if g is None]

    @property
    def busy_slots(self) -> list[int]:
        return [s for s, g in enumerate(self.generated) if g is not None]

    @torch.no_grad()  # slot state must carry no autograd history: one chain per admission grows forever
    def admit(self, requests: list[GenerationRequest]) -> list[int]:
        """Prefill `requests` (already validated) into the lowest free slots; returns the slots."""
        free = self.free_slots
        if len(requests) > len(free):
            raise RuntimeError(f"{len(requests)} requests but only {len(free)} free slots")
        slots = free[: len(requests)]
        engine = self.engine
        cond = engine.condition([r.prompt for r in requests], [r.normalized_bbox() for r in requests])
        cond_kv = prefill_condition(engine.gpt, cond, engine.dtype)
        for i, (s, r) in enumerate(zip(slots, requests)):
            self.cache.set_condition(slice(2 * s, 2 * s + 1), [(k[i: i + 1], v[i: i + 1]) for k, v in cond_kv])
            self.cache.set_condition(slice(2 * s + 1, 2 * s + 2), engine.uncond_kv)
            self.positions[2 * s: 2 * s + 2] = 0
            self.x[2 * s: 2 * s + 2] = self._bos
            self.scale[s] = r.guidance_scale
            self.greedy[s] = r.greedy
            self.temperature[s] = r.temperature or 1.0
            self.top_p[s] = r.top_p if r.top_p is not None else 1.0
            self.seed[s] = r.seed
            self.busy[s] = True
            self.generated[s] = 0
            self._samples[s] = not r.greedy
        return slots

    def release(self, slot: int) -> None:
        self.busy[slot] = False
        self.generated[slot] = None
        self._samples[slot] = False

    # -- one step for every busy slot ------------------------------------------------------------

    # Inference mode rather than no_grad: tensors made here carry no version counters or view
    # tracking, which a step of ~600 small ops feels (4.5 % of a `mid` step at 1 object on a 2-core
    # AMD EPYC).
    @torch.inference_mode()
    def compute(self, k: int, live: int, uniform: bool, any_sampling: bool = True) -> torch.Tensor:
        """The device work of one step for slots 0..k-1, with no host synchronisation:
        decode, guidance, sampling, token write, next embeddings, positions. Free slots in the
        range compute garbage that is kept out of tokens and positions. Returns guided logits."""
        rows = 2 * k
        logits = decode_step(self.engine.gpt, self.cache, self.x[:rows], self.positions[:rows],
                             live=live, uniform=uniform)
        pair = logits[:, : self.codes].view(k, 2, self.codes)
        step = self.positions[0:rows:2]
        guided = apply_guidance(pair[:, 0], pair[:, 1], guidance_weights(self.scale[:k], step, self.num_tokens))
        ids = sample(guided, self.greedy[:k], self.temperature[:k], self.top_p[:k], self.seed[:k], step,
                     any_sampling=any_sampling)
        busy = self.busy[:k]
        slot_ids = torch.arange(k, device=ids.device)
        self.tokens[slot_ids, step] = torch.where(busy, ids, self.tokens[slot_ids, step])
        # Both rows of a slot take the token (views, not repeat_interleave: nothing to size).
        self.x[:rows] = self.engine.gpt.embed_tokens(ids[:, None].expand(k, 2).reshape(rows))
        advance = busy & (step < self.num_tokens - 1)
        self.positions[:rows] += advance[:, None].expand(k, 2).reshape(rows).long()
        return guided

    @torch.no_grad()
    def step(self, return_logits: bool = False) -> StepOutput:
        busy = self.busy_slots
        if not busy:
            return StepOutput([], None)
        k = busy[-1] + 1
        progress = [self.generated[s] for s in range(k)]
        live = max(g for g in progress if g is not None) + 1
        guided = None
        if self.graphs is not None and not return_logits:
            self.graphs.replay(k, live)
        else:
            uniform = all(g == progress[0] for g in progress)  # no free slot inside, same position
            guided = self.compute(k, live, uniform, any_sampling=any(self._samples[:k]))
        finished = []
        for s in busy:
            self.generated[s] += 1
            if self.generated[s] == self.num_tokens:
                finished.append(s)
        return StepOutput(finished, guided if return_logits else None)
