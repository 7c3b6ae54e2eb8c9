"""The engine's batching loop, in its own thread: requests join the running batch between
decode steps, leave when their tokens are done (or when cancelled), and are turned into
meshes on a second thread so that decoding never waits for geometry.

    submit() -> Ticket (a Future of GenerationResult, with progress and cancel)
    loop:  admit waiting requests into free slots (one CLIP + prefill batch)
           one decode step for every busy slot
           finished slots -> geometry thread -> ticket resolved
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import Callable

import torch

from cubeserve.engine.batch import SlotPool
from cubeserve.engine.engine import Engine, GenerationResult
from cubeserve.engine.requests import GenerationRequest
from cubeserve.engine.threads import release_openmp_workers, set_thread_openmp_threads

log = logging.getLogger(__name__)


class EngineStats:
    """What the loop reports; the Triton model mirrors these into Prometheus metrics."""

    def __init__(self):
        self.lock = threading.Lock()
        self.tokens_generated = 0
        self.objects_completed = 0
        self.steps = 0
        self.step_seconds = 0.0
        self.queue_seconds = 0.0
        self.in_flight = 0
        self.max_in_flight = 0

    def on_step(self, objects: int, seconds: float) -> None:
        with self.lock:
            self.steps += 1
            self.tokens_generated += objects
            self.step_seconds += seconds
            self.in_flight = objects
            self.max_in_flight = max(self.max_in_flight, objects)

    def on_admit(self, queue_seconds: float) -> None:
        with self.lock:
            self.queue_seconds += queue_seconds

    def on_in_flight(self, objects: int) -> None:
        with self.lock:
            self.in_flight = objects

    def on_complete(self) -> None:
        with self.lock:
            self.objects_completed += 1

    def snapshot(self) -> dict:
        with self.lock:
            return {k: v for k, v in vars(self).items() if k != "lock"}


@dataclass(eq=False)
class Ticket:
    request: GenerationRequest
    on_progress: Callable[[int], None] | None = None
    client_gone: Callable[[], bool] | None = None  # polled between steps; True cancels
    future: Future = field(default_factory=Future)
    submitted: float = field(default_factory=time.perf_counter)
    admitted: float | None = None
    decoded: float | None = None
    _cancel: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Leave the batch at the next step boundary; the future ends with CancelledError."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        if not self._cancel.is_set() and self.client_gone is not None and self.client_gone():
            self._cancel.set()
        return self._cancel.is_set()

    def result(self, timeout: float | None = None) -> GenerationResult:
        return self.future.result(timeout)


class Scheduler:
    def __init__(self, engine: Engine, max_objects: int = 8, stats: EngineStats | None = None,
                 graphs: bool | None = None, graph_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)):
        """`graphs`: capture the decode step as CUDA graphs at start-up (default: on CUDA)."""
        if max_objects < 1:
            raise ValueError(f"max_objects must be at least 1, got {max_objects}")
        self.engine = engine
        if graphs is None:
            graphs = engine.device.type == "cuda"
        self.pool = SlotPool(engine, max_objects, graphs=graphs, graph_buckets=graph_buckets)
        self.stats = stats or EngineStats()
        self._waiting: collections.deque[Ticket] = collections.deque()
        self._slots: dict[int, Ticket] = {}
        self._cv = threading.Condition()
        self._geometry: collections.deque = collections.deque()
        self._geometry_cv = threading.Condition()
        self._stopping = False
        self._decode_thread = threading.Thread(target=self._decode_loop, name="cubeserve-decode", daemon=True)
        self._geometry_thread = threading.Thread(target=self._geometry_loop, name="cubeserve-geometry", daemon=True)

    def start(self) -> "Scheduler":
        # The decode thread should own the process's only OpenMP team (see engine/threads.py):
        # the thread that built the engine and the pool hands its workers back.
        release_openmp_workers()
        self._decode_thread.start()
        self._geometry_thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        with self._geometry_cv:
            self._geometry_cv.notify_all()
        self._decode_thread.join(timeout)
        self._geometry_thread.join(timeout)
        for ticket in list(self._waiting) + list(self._slots.values()):
            if not ticket.future.done():
                ticket.future.set_exception(RuntimeError("the engine stopped before this request finished"))

    def __enter__(self) -> "Scheduler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def submit(self, request: GenerationRequest, on_progress: Callable[[int], None] | None = None,
               client_gone: Callable[[], bool] | None = None) -> Ticket:
        """Validate (raising InvalidRequest at once) and queue a request. `on_progress(tokens)`
        is called on the decode thread after each step; `client_gone()` is polled there too."""
        self.engine.validate([request])
        ticket = Ticket(request, on_progress, client_gone)
        with self._cv:
            if self._stopping:
                raise RuntimeError("the engine is stopping")
            self._waiting.append(ticket)
            self._cv.notify()
        return ticket

    def generate(self, request: GenerationRequest, timeout: float | None = None) -> GenerationResult:
        return self.submit(request).result(timeout)

    # -- the decode thread ----------------------------------------------------------------------

    def _admit(self) -> None:
        with self._cv:
            while not self._stopping and not self._waiting and not self._slots:
                self._cv.wait()
            free = len(self.pool.free_slots)
            batch = []
            while self._waiting and len(batch) < free:
                ticket = self._waiting.popleft()
                if ticket.cancelled:
                    ticket.future.set_exception(CancelledError())
                    continue
                batch.append(ticket)
        if not batch:
            return
        try:
            slots = self.pool.admit([t.request for t in batch])
        except Exception as exc:  # e.g. out of memory in CLIP or prefill: fail these, keep serving
            log.exception("admission failed")
            for t in batch:
                t.future.set_exception(exc)
            return
        now = time.perf_counter()
        for slot, ticket in zip(slots, batch):
            ticket.admitted = now
            self._slots[slot] = ticket
            self.stats.on_admit(now - ticket.submitted)

    def _drop_cancelled(self) -> None:
        dropped = False
        for slot, ticket in list(self._slots.items()):
            if ticket.cancelled:
                self.pool.release(slot)
                del self._slots[slot]
                ticket.future.set_exception(CancelledError())
                dropped = True
        if dropped:
            self.stats.on_in_flight(len(self._slots))

    def _decode_loop(self) -> None:
        while True:
            self._admit()
            if self._stopping:
                return
            self._drop_cancelled()
            if not self._slots:
                continue
            in_flight = len(self._slots)
            t0 = time.perf_counter()
            try:
                out = self.pool.step()
            except Exception as exc:  # fail the objects in flight, keep the loop alive
                log.exception("decode step failed")
                for slot, ticket in list(self._slots.items()):
                    self.pool.release(slot)
                    ticket.future.set_exception(exc)
                self._slots.clear()
                continue
            self.stats.on_step(in_flight, time.perf_counter() - t0)
            for slot, ticket in self._slots.items():
                if ticket.on_progress is not None:
                    try:
                        ticket.on_progress(self.pool.generated[slot])
                    except Exception:  # a caller's callback must not stop the batch
                        log.exception("progress callback failed")
            for slot in out.finished:
                ticket = self._slots.pop(slot)
                ticket.decoded = time.perf_counter()
                tokens = self.pool.tokens[slot].clone()
                self.pool.release(slot)
                with self._geometry_cv:
                    self._geometry.append((ticket, tokens))
                    self._geometry_cv.notify()
            self.stats.on_in_flight(len(self._slots))

    # -- the geometry thread --------------------------------------------------------------------

    def _geometry_loop(self) -> None:
        n = self.engine.cfg.num_tokens
        cpu_threads = torch.get_num_threads()
        while True:
            with self._geometry_cv:
                while not self._geometry and not self._stopping:
                    self._geometry_cv.wait()
                if not self._geometry:
                    return
                ticket, tokens = self._geometry.popleft()
            if ticket.cancelled:
                ticket.future.set_exception(CancelledError())
                continue
            try:
                # While objects decode, a second OpenMP team would slow every step (see
                # engine/threads.py): one thread then; all of them, released after, otherwise.
                decoding = bool(self._slots or self._waiting)
                set_thread_openmp_threads(1 if decoding else cpu_threads)
                t0 = time.perf_counter()
                mesh = self.engine.tokens_to_meshes(tokens[None], [ticket.request.resolution])[0]
                t1 = time.perf_counter()
                if not decoding:
                    release_openmp_workers()
                decode_s = ticket.decoded - ticket.admitted
                result = GenerationResult(ticket.request, tokens.tolist(), mesh, {
                    "queue_s": ticket.admitted - ticket.submitted,
                    "tokens_s": decode_s,
                    "time_per_token_s": decode_s / n,
                    "geometry_s": t1 - t0,
                    "total_s": t1 - ticket.submitted,
                })
                self.stats.on_complete()
                ticket.future.set_result(result)
            except Exception as exc:
                log.exception("geometry failed")
                ticket.future.set_exception(exc)
