"""The decode runner: objects in flight as KV-cache slots that requests join and leave between
steps, one step's device work, and that step captured as CUDA graphs and replayed.

One slot is one object and owns two adjacent cache rows, 2s (conditional) and 2s + 1
(unconditional), so the rows of slots 0..k-1 are one contiguous range and guidance is a view.
Each row has its own position: a request admitted mid-generation starts at BOS while the
others go on (continuous batching). A step runs rows 0..2k-1, where k is one past the highest
busy slot; admission fills the lowest free slots so k stays small.

Everything a step needs lives in device tensors (inputs, positions, which slots are busy,
sampling parameters, tokens), so a step is a fixed sequence of kernels with no host sync. On
the CPU it runs eagerly and trims the work to what the host knows is live. With graph buckets
(CUDA) a step launches hundreds of small kernels whose launch cost exceeds the GPU time at small
batches: it is captured once per (slot bucket, cache-length bucket) at start-up and replayed,
one launch that never waits for the host. Batches are padded to the next slot bucket (padding
slots are free, so their results are discarded on the device), and attention reads only the
first S + L cache slots, L the next cache-length bucket above the longest live sequence. Each
bucket is captured twice: with sampling, and greedy-only (no noise hash, top-p sort) for steps in
which no row samples. All graphs share one memory pool: they never run concurrently.

On CUDA:
- the step's attention backends are pinned (DECODE_ATTENTION_BACKENDS): left to itself, PyTorch
  may route the masked one-query bfloat16 decode attention to cuDNN, which refuses some mask
  lengths instead of falling back, and the failure would surface in warm-up or capture;
- capture runs under the runner's device on a stream of its own, and every step under that
  device, so a runner on cuda:N (N > 0), e.g. a second Triton instance, captures and replays
  there and not on the thread's default device (cuda:0);
- the host keeps at most MAX_STEPS_IN_FLIGHT steps ahead of the GPU (CUDA events): progress and
  "finished" then lag the GPU by at most that, an admission's copies do not wait behind a long
  backlog, and step times come from the events, not from how long a launch took.

With a decode window T > 1 (`engine/window.py`, a version's `decode_window`) a step is one
forward of T positions per slot, and slots advance by what each accepted (1..T). It always
runs eagerly, never as graphs: the host reads the accepted counts after every forward (its
slots' progress decides the next forward's shape and which slots finish), a sync that a
replay running ahead of the host could not have, and it would multiply the captured buckets.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Callable

import collections
import contextlib

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from cubeserve.config import ModelConfig, check_decode_window
from cubeserve.engine import window as jacobi
from cubeserve.engine.cache import KVCache, prefill_condition
from cubeserve.engine.sampling import SamplingParams
from cubeserve.model.gpt import DualStreamGPT, SingleBlockMode
from cubeserve.requests import GenerationRequest

log = logging.getLogger(__name__)

CondKV = list[tuple[torch.Tensor, torch.Tensor]]  # per dual layer: condition keys, values [B, H, S, hd]
Condition = Callable[[list[str], list], torch.Tensor]  # prompts, boxes -> condition tokens [B, S, D]

# In this order of preference; cuDNN is left out (module docstring). Flash takes no mask, so
# masked steps get the memory-efficient kernel; the CPU has flash and math only and keeps them.
DECODE_ATTENTION_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
MAX_STEPS_IN_FLIGHT = 2


@dataclass
class StepOutput:
    finished: list[int]  # slots whose N tokens are complete (still holding their tokens)
    guided_logits: torch.Tensor | None  # [k, codes] of this step, when asked for (eager only)


class DecodeRunner:
    def __init__(self, cfg: ModelConfig, gpt: DualStreamGPT, condition: Condition, uncond_kv: CondKV,
                 max_objects: int, device: torch.device, dtype: torch.dtype, single_block_mode: SingleBlockMode,
                 graph_buckets: tuple[int, ...] | None = None, length_buckets: int = 4, capture: bool = True,
                 window: int = 1):
        """`condition`: CLIP and text_proj for admitted prompts; `uncond_kv`: the unconditional
        prefix's prefill, shared by every slot. `graph_buckets`: pad steps to these slot buckets
        and `length_buckets` cache lengths, captured as CUDA graphs; `capture=False` replays the
        very same bucketed, padded, masked step eagerly: what the graphs compute, runnable (and
        tested) on a machine without CUDA. `window` > 1: window decoding (module docstring), eager;
        graph buckets are then ignored."""
        self.window = check_decode_window(window)
        if window > 1 and graph_buckets is not None:
            log.info("decode window %d: decode steps run eagerly, without CUDA graphs", window)
            graph_buckets = None
        self.gpt = gpt
        self.condition = condition
        self.uncond_kv = uncond_kv
        self.dtype = dtype
        self.max_objects = max_objects
        self.num_tokens = n = cfg.num_tokens
        self.codes = cfg.gpt.shape_model_vocab_size
        rows = 2 * max_objects
        self.cache = KVCache(cfg, rows=rows, device=device, dtype=dtype, single_block_mode=single_block_mode,
                             window=window)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.x = torch.zeros(rows, cfg.gpt.n_embd, dtype=torch.float32, device=device)  # next inputs
        self.tokens = torch.zeros(max_objects, n, dtype=torch.int64, device=device)
        self.busy = torch.zeros(max_objects, dtype=torch.bool, device=device)  # stepped: admitted, not paused
        self.paused: frozenset[int] = frozenset()  # admitted slots the steps leave where they are
        # Window decoding: each slot's guesses for the tokens after its next input.
        self.guesses = torch.zeros(max_objects, window - 1, dtype=torch.int64, device=device)
        self.sampling = SamplingParams.of([GenerationRequest("")] * max_objects, device)
        # Host mirrors: tokens generated so far per slot (None = free) and who samples.
        self.generated: list[int | None] = [None] * max_objects
        self._samples: list[bool] = [False] * max_objects
        self.forwards = 0  # decode steps (forwards) run
        self.last_step_tokens = 0  # tokens the latest step added, over all slots
        with torch.no_grad():  # a BOS with grad would chain every admission into one autograd graph
            self._bos = gpt.embed_tokens(torch.tensor([cfg.gpt.bos_id], device=device))[0]
        self.slot_buckets: list[int] | None = None
        self.length_buckets: list[int] = []
        self.graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}  # (slots, length, any_sampling)
        self.capture_seconds = 0.0
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # for capture
        self._in_flight: collections.deque = collections.deque()  # end events of steps not yet waited for
        self.last_step_seconds: float | None = None  # device time of the latest step known to be done
        if graph_buckets is not None:
            self.slot_buckets = sorted({b for b in graph_buckets if b < max_objects} | {max_objects})
            self.length_buckets = sorted({math.ceil(n * (i + 1) / length_buckets) for i in range(length_buckets)})
            if capture:
                if device.type != "cuda":
                    raise ValueError("CUDA graphs need a CUDA device; the CPU runs the same step eagerly")
                self.capture_seconds = self._capture(device)

    # -- slots ----------------------------------------------------------------------------------

    @property
    def free_slots(self) -> list[int]:
        return [s for s, g in enumerate(self.generated) if g is None]

    @property
    def busy_slots(self) -> list[int]:
        return [s for s, g in enumerate(self.generated) if g is not None]

    @torch.no_grad()  # slot state must carry no autograd history: one chain per admission grows forever
    def admit(self, requests: list[GenerationRequest], slots: list[int] | None = None) -> list[int]:
        """Prefill `requests` (already validated) into `slots` (free ones; default: the lowest
        free slots); returns the slots."""
        free = self.free_slots
        if slots is None:
            if len(requests) > len(free):
                raise RuntimeError(f"{len(requests)} requests but only {len(free)} free slots")
            slots = free[: len(requests)]
        elif len(slots) != len(requests) or not set(slots) <= set(free) or len(set(slots)) != len(slots):
            raise RuntimeError(f"slots {slots} for {len(requests)} requests; free: {free}")
        with self._on_device():
            self._admit(slots, requests)
        return slots

    def _admit(self, slots: list[int], requests: list[GenerationRequest]) -> None:
        self.sampling.put(slots, SamplingParams.of(requests, self.x.device))
        cond = self.condition([r.prompt for r in requests], [r.normalized_bbox() for r in requests])
        cond_kv = prefill_condition(self.gpt, cond, self.dtype)
        for i, (s, r) in enumerate(zip(slots, requests)):
            self.cache.set_condition(slice(2 * s, 2 * s + 1), [(k[i: i + 1], v[i: i + 1]) for k, v in cond_kv])
            self.cache.set_condition(slice(2 * s + 1, 2 * s + 2), self.uncond_kv)
            self.positions[2 * s: 2 * s + 2] = 0
            self.x[2 * s: 2 * s + 2] = self._bos
            self.guesses[s] = 0  # any code: the first window accepts its first token alone
            self.busy[s] = s not in self.paused
            self.generated[s] = 0
            self._samples[s] = not r.greedy

    def release(self, slot: int) -> None:
        with self._on_device():  # a write on the steps' stream, in order with them
            self.busy[slot] = False
        self.generated[slot] = None
        self._samples[slot] = False

    def pause(self, slots: frozenset[int]) -> None:
        """From the next step on, the admitted slots in `slots` are left where they are (their
        tokens, cache and next input kept) and the others step: a higher priority band decodes
        alone (engine/scheduler.py). A slot computed beside stepped ones while paused (one below
        them) rewrites its own next cache entry with the same values and keeps its input."""
        slots = frozenset(slots)
        if slots == self.paused:
            return
        with self._on_device():
            for s in slots ^ self.paused:
                self.busy[s] = self.generated[s] is not None and s not in slots
        self.paused = slots

    # -- one step for every busy slot ------------------------------------------------------------

    # Inference mode rather than no_grad: tensors made here carry no version counters or view
    # tracking, which a step of hundreds of small ops feels (BENCHMARKS.md).
    @torch.inference_mode()
    def compute(self, k: int, live: int, uniform: bool, any_sampling: bool = True) -> torch.Tensor:
        """The device work of one step for slots 0..k-1, with no host synchronisation:
        decode, guidance, sampling, token write, next embeddings, positions. Free slots in the
        range compute garbage that is kept out of tokens and positions. Returns guided logits."""
        with sdpa_kernel(DECODE_ATTENTION_BACKENDS, set_priority=True):
            return self._compute(k, live, uniform, any_sampling)

    def _compute(self, k: int, live: int, uniform: bool, any_sampling: bool) -> torch.Tensor:
        rows = 2 * k
        positions = self.positions[:rows]
        step_keys = self.cache.step(rows, positions, self.gpt.rope(positions[:, None]), live, uniform)
        logits = self.gpt.decode(self.x[:rows], step_keys)
        pair = logits[:, : self.codes].view(k, 2, self.codes)
        step = self.positions[0:rows:2]
        guided, ids = self.sampling[:k].next_tokens(pair[:, 0], pair[:, 1], step, self.num_tokens, any_sampling)
        busy = self.busy[:k]
        slot_ids = torch.arange(k, device=ids.device)
        self.tokens[slot_ids, step] = torch.where(busy, ids, self.tokens[slot_ids, step])
        # Both rows of a slot take the token (views, not repeat_interleave: nothing to size); a
        # paused slot keeps its input.
        busy_rows = busy[:, None].expand(k, 2).reshape(rows)
        self.x[:rows] = torch.where(busy_rows[:, None], self.gpt.embed_tokens(ids[:, None].expand(k, 2).reshape(rows)),
                                    self.x[:rows])
        advance = busy & (step < self.num_tokens - 1)
        self.positions[:rows] += advance[:, None].expand(k, 2).reshape(rows).long()
        return guided

    @torch.no_grad()
    def step(self, return_logits: bool = False) -> StepOutput:
        if self.window > 1:
            if return_logits:
                raise ValueError("return_logits needs one token per step: a runner with window 1")
            return self._window_step()
        busy = [s for s in self.busy_slots if s not in self.paused]
        if not busy:
            return StepOutput([], None)
        k = busy[-1] + 1
        progress = [self.generated[s] for s in range(k)]
        live = max(g for g in progress if g is not None) + 1
        any_sampling = any(self._samples[:k])
        guided = None
        with self._on_device():
            begin = self._wait_for_backlog()
            started = time.perf_counter()
            if self.slot_buckets is not None and not return_logits:
                self._replay(k, live, any_sampling)
            else:
                uniform = all(g == progress[0] for g in progress)  # no free slot inside, same position
                guided = self.compute(k, live, uniform, any_sampling=any_sampling)
            self._step_launched(begin, started)
        self.forwards += 1
        self.last_step_tokens = len(busy)
        finished = []
        for s in busy:
            self.generated[s] += 1
            if self.generated[s] == self.num_tokens:
                finished.append(s)
        return StepOutput(finished, guided if return_logits else None)

    # -- window decoding (engine/window.py) --------------------------------------------------------

    def _window_step(self) -> StepOutput:
        n = self.num_tokens
        active = [s for s in self.busy_slots if self.generated[s] < n and s not in self.paused]
        if not active:
            return StepOutput([], None)
        k = active[-1] + 1
        live = max(self.generated[s] for s in active) + self.window
        with self._on_device():
            begin = self._wait_for_backlog()
            started = time.perf_counter()
            keep = torch.tensor([s in active for s in range(k)], device=self.device)
            at_bos = any(self.generated[s] == 0 for s in active)
            accepted = self.compute_window(k, live, keep, at_bos, any_sampling=any(self._samples[:k])).tolist()
            self._step_launched(begin, started)
        self.forwards += 1
        self.last_step_tokens = sum(accepted)
        finished = []
        for s in active:
            self.generated[s] += accepted[s]
            if self.generated[s] == n:
                finished.append(s)
        return StepOutput(finished, None)

    @torch.inference_mode()
    def compute_window(self, k: int, live: int, keep: torch.Tensor, at_bos: bool = True,
                       any_sampling: bool = True) -> torch.Tensor:
        """One window forward for slots 0..k-1, both guidance rows: a slot's known next input and
        its T - 1 guesses at its next T positions, a token chosen at each position as a one-token
        step would choose it there. The slots in `keep` [k] write the tokens sequential decoding
        also gives (`window.accepted`) and move past them, with new guesses. `at_bos`: some slot
        in `keep` starts at BOS (`cache.WindowStep`). Returns the tokens kept per slot [k] (0
        outside `keep`)."""
        with sdpa_kernel(DECODE_ATTENTION_BACKENDS, set_priority=True):
            t, rows, n, codes = self.window, 2 * k, self.num_tokens, self.codes
            positions = self.positions[:rows, None] + torch.arange(t, device=self.device)  # [rows, T]
            guesses = self.guesses[:k]
            # Both rows of a slot take the same inputs: its known next input, then its guesses.
            x = torch.cat([self.x[:rows, None], self.gpt.embed_tokens(guesses).repeat_interleave(2, dim=0)], dim=1)
            logits = self.gpt.decode(x, self.cache.window(rows, positions, self.gpt.rope(positions), live, at_bos))
            pair = logits[..., :codes].view(k, 2, t, codes)
            step = positions[0::2]  # [k, T]: each position's own guidance weight and noise
            sampling = self.sampling[torch.arange(k, device=self.device).repeat_interleave(t)]
            _, chosen = sampling.next_tokens(pair[:, 0].reshape(k * t, codes), pair[:, 1].reshape(k * t, codes),
                                             step.reshape(k * t), n, any_sampling)
            chosen = chosen.view(k, t)
            accepted = torch.where(keep, jacobi.accepted(guesses, chosen).clamp(max=n - step[:, 0]), 0)
            written = torch.arange(t, device=self.device) < accepted[:, None]  # [k, T]
            slot_ids = torch.arange(k, device=self.device)[:, None].expand(k, t)
            self.tokens[slot_ids[written], step[written]] = chosen[written]
            moved = accepted > 0
            last = chosen.gather(1, (accepted - 1).clamp(min=0)[:, None])[:, 0]
            self.x[:rows] = torch.where(moved.repeat_interleave(2)[:, None],
                                        self.gpt.embed_tokens(last).repeat_interleave(2, dim=0), self.x[:rows])
            # A finished slot stays at N - 1: a window from there still fits the cache.
            self.positions[:rows] = (self.positions[:rows] + accepted.repeat_interleave(2)).clamp(max=n - 1)
            self.guesses[:k] = torch.where(moved[:, None], jacobi.next_guesses(chosen, accepted), guesses)
            return accepted

    @torch.no_grad()
    def force(self, step: int, ids: torch.Tensor) -> None:
        """Teacher forcing, for measurements (`cubeserve.numerics`): the tokens the last step
        wrote at position `step` for slots 0..len(ids)-1 become `ids`, and so do the next
        inputs. Eager steps only, every slot admitted together (one position)."""
        k = len(ids)
        if self.slot_buckets is not None or any(g != step + 1 for g in self.generated[:k]):
            raise RuntimeError("force needs eager steps and slots 0..k-1 all past position `step`")
        with self._on_device():
            ids = ids.to(self.tokens.device)
            self.tokens[:k, step] = ids
            self.x[: 2 * k] = self.gpt.embed_tokens(ids[:, None].expand(k, 2).reshape(2 * k))

    def tokens_of(self, slot: int) -> torch.Tensor:
        """A finished slot's tokens, on the host (waits for its last step), before it is released."""
        with self._on_device():
            return self.tokens[slot].to("cpu", copy=True)

    # -- the device, and the steps in flight ------------------------------------------------------

    def _on_device(self):
        """Run under the runner's device (CUDA: a thread's current device is cuda:0 unless told),
        on that device's current stream, as the rest of the engine; nothing to do on the CPU."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _wait_for_backlog(self) -> torch.cuda.Event | None:
        """Before a step is launched: wait until fewer than MAX_STEPS_IN_FLIGHT are running (each
        step waited for gives its device time), and return the event the new step's time counts
        from: the end of the step before it while the GPU is still busy with it, else now."""
        while len(self._in_flight) >= MAX_STEPS_IN_FLIGHT:
            begin, end = self._in_flight.popleft()
            end.synchronize()
            self.last_step_seconds = begin.elapsed_time(end) / 1000
        if self.stream is None:
            return None
        if self._in_flight and not self._in_flight[-1][1].query():
            return self._in_flight[-1][1]
        begin = torch.cuda.Event(enable_timing=True)
        begin.record(torch.cuda.current_stream(self.device))
        return begin

    def _step_launched(self, begin: torch.cuda.Event | None, started: float) -> None:
        if self.stream is None:  # the CPU computed the step while the host waited
            self.last_step_seconds = time.perf_counter() - started
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record(torch.cuda.current_stream(self.device))
        self._in_flight.append((begin, end))

    # -- CUDA graphs ----------------------------------------------------------------------------

    def bucket(self, k: int, live: int) -> tuple[int, int]:
        return (next(b for b in self.slot_buckets if b >= k), next(n for n in self.length_buckets if n >= live))

    def _replay(self, k: int, live: int, any_sampling: bool) -> None:
        key = self.bucket(k, live)
        if self.graphs:
            self.graphs[(*key, any_sampling)].replay()
        else:
            self.compute(*key, uniform=False, any_sampling=any_sampling)

    def _capture(self, device: torch.device) -> float:
        if self.busy_slots:
            raise RuntimeError("capture before admitting requests: warm-up steps overwrite slot state")
        keys = [(k, length, any_sampling) for k in self.slot_buckets for length in self.length_buckets
                for any_sampling in (True, False)]
        start = time.perf_counter()
        with torch.cuda.device(device):
            # Warm up on a side stream (lazy initialisation, kernel selection, allocator), as
            # torch.cuda.graph requires, then capture on the runner's own stream (capture cannot
            # use the default stream). No slot is busy, so tokens and positions stay untouched.
            self.stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self.stream):
                for k, length, any_sampling in keys:
                    for _ in range(2):
                        self.compute(k, length, uniform=False, any_sampling=any_sampling)
            torch.cuda.synchronize(device)
            memory = torch.cuda.graph_pool_handle()
            for key in sorted(keys, reverse=True):  # largest first: the others fit in its memory
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=memory, stream=self.stream):
                    self.compute(key[0], key[1], uniform=False, any_sampling=key[2])
                self.graphs[key] = graph
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        log.info("captured %d decode graphs (slots %s x cache lengths %s, sampling and greedy-only) in %.1f s",
                 len(self.graphs), self.slot_buckets, self.length_buckets, seconds)
        return seconds
