"""The engine's batching loop, in its own thread: requests join the running batch between
decode steps, leave when their tokens are done (or when cancelled), and are turned into
meshes on a second thread so that decoding never waits for geometry: scikit-image's marching
cubes, which holds the GIL, runs in a child process (`mesh_worker`), and on CUDA the decode
thread's kernels go on a high-priority stream, the geometry thread's on a low-priority one.

    submit() -> Ticket (a Future of GenerationResult, with progress, cancel and a deadline);
               when max_queue requests already wait, one of them that counts for less (a lower
               band, a tenant over its share) gives way with `Shed`, or the newcomer is refused
               at once (`Shed`, or `Unavailable` when the queue is full of its equals)
    loop:  drop waiting requests whose client went away, whose deadline passed or that waited
           longer than max_wait_s
           admit waiting requests into free slots (one CLIP + prefill batch), by band and in
           turn between tenants (engine/admission.py)
           one decode step for every busy slot (with priority_slots: of the highest band among them)
           finished slots -> geometry thread (highest band first) -> ticket resolved

Priority slots (`priority_slots` R > 0): the lowest R slots take only the top band
(interactive), so one of its requests never waits for a lower band's object to finish; and while
objects of a higher band decode, those of lower bands pause (their cache and tokens kept: the
runner leaves them where they are) and no lower band is admitted, so a high band's step costs
what it costs alone: the reserved slots are the lowest, and a step computes slots 0..k-1. The
price: R slots idle while no interactive request comes, and lower bands stall for as long as a
higher band keeps decoding (strict priority, as llm-d's bands between each other).
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import itertools
import logging
import threading
import time
from concurrent.futures import CancelledError, Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Callable

import torch

from cubeserve.engine.admission import WaitingQueue
from cubeserve.engine.engine import Engine, GenerationResult, Timings
from cubeserve.engine.mesh_worker import MeshWorker
from cubeserve.engine.runner import DecodeRunner
from cubeserve.engine.threads import release_openmp_workers, set_thread_openmp_threads
from cubeserve.requests import BANDS, DEFAULT_BAND, GenerationRequest, Shed, Unavailable, band_rank

log = logging.getLogger(__name__)

# How often the decode thread looks through the waiting queue for requests to drop (asking
# whether a client went away can be an IPC round trip, so not on every step).
SWEEP_INTERVAL_S = 0.25
# CUDA stream priorities (lower is more urgent; 0, the default streams', is the least): a step's
# kernels are scheduled ahead of the occupancy queries and marching cubes queued beside them.
DECODE_STREAM_PRIORITY = -1
GEOMETRY_STREAM_PRIORITY = 0
# The slot buckets whose decode steps are captured as CUDA graphs (the runner adds max_objects);
# the batch pipeline's decode actors capture the same (cubeserve/batch/stages.py).
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# The longest a request waits for a slot before it is shed (429: retry later): a queue bounded in
# time as well as in length, so that a low band under a steady high-band load hears "later" in
# a minute rather than at its deadline.
MAX_WAIT_S = 60.0


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
        self.waiting = 0  # requests waiting for a slot
        self.refused_busy = 0  # refused at submit: max_queue requests of its equals were waiting
        self.shed = 0  # gave way to a higher band or a tenant under its share, or waited too long
        self.expired = 0  # deadline passed before the result
        self.cancelled = 0  # the client went away or cancelled

    def on_step(self, objects: int, seconds: float) -> None:
        with self.lock:
            self.steps += 1
            self.tokens_generated += objects
            self.step_seconds += seconds
            self.in_flight = objects
            self.max_in_flight = max(self.max_in_flight, objects)

    def on_window_tokens(self, tokens: int) -> None:
        """Tokens a window step (decode_window > 1) made beyond `on_step`'s one per object."""
        with self.lock:
            self.tokens_generated += tokens

    def on_admit(self, queue_seconds: float) -> None:
        with self.lock:
            self.queue_seconds += queue_seconds

    def on_in_flight(self, objects: int) -> None:
        with self.lock:
            self.in_flight = objects

    def on_complete(self) -> None:
        with self.lock:
            self.objects_completed += 1

    def on_waiting(self, waiting: int) -> None:
        with self.lock:
            self.waiting = waiting

    def on_dropped(self, reason: str) -> None:
        """reason: "refused_busy" | "shed" | "expired" | "cancelled"."""
        with self.lock:
            setattr(self, reason, getattr(self, reason) + 1)

    def snapshot(self) -> dict:
        with self.lock:
            return {k: v for k, v in vars(self).items() if k != "lock"}


@dataclass(eq=False)
class Ticket:
    request: GenerationRequest
    on_progress: Callable[[int], None] | None = None
    client_gone: Callable[[], bool] | None = None  # polled between steps; True cancels
    deadline: float | None = None  # time.perf_counter() after which the result is no use
    band: int = BANDS.index(DEFAULT_BAND)  # rank in requests.BANDS, 0 first (engine/admission.py)
    tenant: str = ""  # whose turn it is among the band's waiting requests
    future: Future = field(default_factory=Future)
    submitted: float = field(default_factory=time.perf_counter)
    admitting: float | None = None  # its admission (CLIP and prefill) began
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

    def fail(self, exc: BaseException) -> None:
        """End the ticket with `exc` unless it has ended already (stop() may race the loop)."""
        try:
            self.future.set_exception(exc)
        except InvalidStateError:
            pass

    @property
    def expired(self) -> bool:
        return self.deadline is not None and time.perf_counter() > self.deadline

    def result(self, timeout: float | None = None) -> GenerationResult:
        return self.future.result(timeout)


def _refusal(why: str, ticket: Ticket) -> str:
    """Why a newcomer to a full queue is refused with Shed (WaitingQueue.make_room's reason)."""
    if why == "higher band":
        return f"requests of a higher band than {BANDS[ticket.band]} hold the queue"
    return f"tenant {ticket.tenant or '(none)'} has more requests waiting than the others of band {BANDS[ticket.band]}"


class Scheduler:
    def __init__(self, engine: Engine, max_objects: int = 8, stats: EngineStats | None = None,
                 graphs: bool | None = None, graph_buckets: tuple[int, ...] = GRAPH_BUCKETS,
                 max_queue: int | None = None, mesh_process: bool = True,
                 max_wait_s: float | None = MAX_WAIT_S, priority_slots: int = 0):
        """`graphs`: capture the decode step as CUDA graphs at start-up (default: on CUDA).
        `mesh_process`: scikit-image's marching cubes in a child process (`mesh_worker`).
        `max_queue`: requests that may wait beyond the `max_objects` being worked on (for a slot,
        or for their mesh); past it a newcomer takes a place that counts for less, or is refused at
        once (engine/admission.py). Default 8 x max_objects. `max_wait_s`: the longest a request
        waits for a slot before it is shed (None: until its own deadline). `priority_slots`: the
        lowest slots kept for the top band, and higher bands decoding alone (module docstring)."""
        if max_objects < 1:
            raise ValueError(f"max_objects must be at least 1, got {max_objects}")
        if max_queue is None:
            max_queue = 8 * max_objects
        if max_queue < 0:
            raise ValueError(f"max_queue must be at least 0, got {max_queue}")
        if max_wait_s is not None and max_wait_s <= 0:
            raise ValueError(f"max_wait_s must be positive, got {max_wait_s}")
        if isinstance(priority_slots, bool) or not isinstance(priority_slots, int) or not 0 <= priority_slots < max_objects:
            raise ValueError(f"priority_slots must be an integer from 0 to max_objects - 1 ({max_objects - 1}), "
                             f"got {priority_slots!r}")
        self.priority_slots = priority_slots
        self.max_queue = max_queue
        self.max_wait_s = max_wait_s
        self.engine = engine
        if graphs is None:
            graphs = engine.device.type == "cuda"
        self.runner: DecodeRunner = engine.decode_runner(max_objects, graph_buckets=graph_buckets if graphs else None)
        self.stats = stats or EngineStats()
        self._waiting = WaitingQueue()
        self._slots: dict[int, Ticket] = {}
        self._outstanding = 0  # submitted and not yet resolved: waiting, decoding or in geometry
        self._last_sweep = 0.0
        self._cv = threading.Condition()
        # (band, order, ticket, tokens): the highest band's finished objects first, else in order
        self._geometry: list[tuple] = []
        self._geometry_order = itertools.count()
        self._geometry_cv = threading.Condition()
        self._mesh_worker = MeshWorker() if mesh_process else None  # its process starts on first use
        self._stopping = False
        self._decode_thread = threading.Thread(target=self._decode_loop, name="cubeserve-decode", daemon=True)
        self._geometry_thread = threading.Thread(target=self._geometry_loop, name="cubeserve-geometry", daemon=True)

    def start(self) -> "Scheduler":
        # The decode thread should own the process's only OpenMP team (see engine/threads.py):
        # the thread that built the engine and the runner hands its workers back.
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
        if self._mesh_worker is not None and not self._geometry_thread.is_alive():
            self._mesh_worker.close()
        with self._geometry_cv:
            unfinished = list(self._waiting) + list(self._slots.values()) + [job[2] for job in self._geometry]
        for ticket in unfinished:
            ticket.fail(Unavailable("the engine stopped (model unloaded or server shutting down) "
                                    "before this request finished"))

    def __enter__(self) -> "Scheduler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def submit(self, request: GenerationRequest, on_progress: Callable[[int], None] | None = None,
               client_gone: Callable[[], bool] | None = None, timeout: float | None = None,
               band: str | None = None, tenant: str = "") -> Ticket:
        """Validate (raising InvalidRequest at once) and queue a request. When the queue is full,
        raises Shed or Unavailable at once, or sheds a waiting request that counts for less
        (engine/admission.py). `on_progress(tokens)` is called on the decode thread after each
        step; `client_gone()` is polled there too. `timeout` (seconds from now): past it the
        request is dropped, waiting or decoding, and fails with Unavailable. `band` (one of
        requests.BANDS, default "standard") and `tenant` decide its turn for a slot."""
        self.engine.validate([request])
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        ticket = Ticket(request, on_progress, client_gone, band=band_rank(band), tenant=tenant or "")
        if timeout is not None:
            ticket.deadline = ticket.submitted + timeout
        victim = None
        with self._cv:
            if self._stopping:
                raise Unavailable("the engine is stopping (model unloaded or server shutting down)")
            if self._outstanding >= self.runner.max_objects + self.max_queue:
                victim, why = self._waiting.make_room(ticket.band, ticket.tenant)
                if victim is None:
                    full = (f"{self._outstanding} requests in progress or waiting (max_objects "
                            f"{self.runner.max_objects} + max_queue {self.max_queue})")
                    if why == "no capacity":
                        self.stats.on_dropped("refused_busy")
                        raise Unavailable(f"the server is busy: {full}; retry later or elsewhere")
                    self.stats.on_dropped("shed")
                    raise Shed(f"the server is busy ({full}) and {_refusal(why, ticket)}; retry later")
            self._outstanding += 1
            self._waiting.push(ticket)
            self.stats.on_waiting(len(self._waiting))
            self._cv.notify()
        ticket.future.add_done_callback(self._resolved)
        if victim is not None:  # outside the lock: its answer goes out from its done callbacks
            self.stats.on_dropped("shed")
            victim.fail(Shed(f"the server is busy and this request gave way in the queue: {why} "
                             f"(its band {BANDS[victim.band]}); retry later"))
        return ticket

    def _resolved(self, future: Future) -> None:
        with self._cv:
            self._outstanding -= 1

    @property
    def outstanding(self) -> int:
        """Requests submitted and not yet resolved."""
        with self._cv:
            return self._outstanding

    def generate(self, request: GenerationRequest, timeout: float | None = None) -> GenerationResult:
        return self.submit(request).result(timeout)

    # -- the decode thread ----------------------------------------------------------------------

    def _drop(self, ticket: Ticket) -> bool:
        """End a ticket whose client went away or whose deadline passed; True if it was."""
        if ticket.cancelled:
            self.stats.on_dropped("cancelled")
            ticket.fail(CancelledError())
            return True
        if ticket.expired:
            self.stats.on_dropped("expired")
            waited = time.perf_counter() - ticket.submitted
            ticket.fail(Unavailable(
                f"deadline exceeded: the request's timeout of {ticket.deadline - ticket.submitted:.3g} s "
                f"passed after {waited:.3g} s (queue and generation); retry later or allow more time"))
            return True
        return False

    def _waited_too_long(self, ticket: Ticket, now: float) -> bool:
        """Shed a request that waited for a slot longer than max_wait_s; True if it was."""
        if self.max_wait_s is None or now - ticket.submitted <= self.max_wait_s:
            return False
        self.stats.on_dropped("shed")
        ticket.fail(Shed(f"waited {now - ticket.submitted:.3g} s for a slot, longer than this server's queue "
                         f"allows ({self.max_wait_s:g} s; band {BANDS[ticket.band]}); retry later"))
        return True

    def _sweep_waiting(self) -> None:
        """Drop waiting requests that nobody will take (client gone, deadline passed) or that
        waited too long, so that they neither hold a place in the queue nor take a slot."""
        now = time.perf_counter()
        if now - self._last_sweep < SWEEP_INTERVAL_S:
            return
        self._last_sweep = now
        with self._cv:
            waiting = list(self._waiting)
        # Outside the lock: asking whether a client went away can be an IPC round trip.
        dropped = {id(t) for t in waiting if self._drop(t) or self._waited_too_long(t, now)}
        if dropped:
            with self._cv:
                self._waiting.remove_if(lambda t: id(t) in dropped)
                self.stats.on_waiting(len(self._waiting))

    def _admit(self) -> None:
        with self._cv:
            while not self._stopping and not self._waiting and not self._slots:
                self._cv.wait()
        self._sweep_waiting()
        with self._cv:
            free = self.runner.free_slots
            kept = [s for s in free if s < self.priority_slots]  # for the top band only
            shared = [s for s in free if s >= self.priority_slots]
            # With priority slots, nothing below the highest band decoding (rank `top`, 0 the
            # first) is admitted: its CLIP and prefill would slow that band's steps, and it
            # would only pause.
            top = min((t.band for t in self._slots.values()), default=len(BANDS)) if self.priority_slots else len(BANDS)
            batch, slots = [], []
            while (head := self._waiting.peek()) is not None and head.band <= top:
                pool = (kept or shared) if head.band == 0 else shared
                if not pool:
                    break
                ticket = self._waiting.pop()
                if not self._drop(ticket):
                    batch.append(ticket)
                    slots.append(pool.pop(0))
                    if self.priority_slots:
                        top = min(top, ticket.band)
            self.stats.on_waiting(len(self._waiting))
        if not batch:
            return
        admitting = time.perf_counter()
        try:
            slots = self.runner.admit([t.request for t in batch], slots)
        except Exception as exc:  # e.g. out of memory in CLIP or prefill: fail these, keep serving
            log.exception("admission failed")
            for t in batch:
                t.future.set_exception(exc)
            return
        now = time.perf_counter()
        for slot, ticket in zip(slots, batch):
            ticket.admitting, ticket.admitted = admitting, now
            self._slots[slot] = ticket
            self.stats.on_admit(now - ticket.submitted)

    def _drop_cancelled(self) -> None:
        dropped = False
        for slot, ticket in list(self._slots.items()):
            if self._drop(ticket):
                self.runner.release(slot)
                del self._slots[slot]
                dropped = True
        if dropped:
            self.stats.on_in_flight(len(self._slots))

    def _stream(self, priority: int):
        """On CUDA, run this thread's kernels on a new stream of `priority`, ordered after what
        the engine's device has queued so far (weights, graphs, the runner's buffers); nothing
        elsewhere."""
        device = self.engine.device
        if device.type != "cuda":
            return contextlib.nullcontext()
        stream = torch.cuda.Stream(device, priority=priority)
        stream.wait_stream(torch.cuda.current_stream(device))
        return torch.cuda.stream(stream)

    def _decode_loop(self) -> None:
        with self._stream(DECODE_STREAM_PRIORITY):
            self._decode_steps()

    def _decode_steps(self) -> None:
        while True:
            self._admit()
            if self._stopping:
                return
            self._drop_cancelled()
            if not self._slots:
                continue
            in_flight = len(self._slots)
            if self.priority_slots:
                top = min(t.band for t in self._slots.values())
                self.runner.pause(frozenset(s for s, t in self._slots.items() if t.band > top))
            try:
                out = self.runner.step()
            except Exception as exc:  # fail the objects in flight, keep the loop alive
                log.exception("decode step failed")
                for slot, ticket in list(self._slots.items()):
                    self.runner.release(slot)
                    ticket.future.set_exception(exc)
                self._slots.clear()
                continue
            # The device time of the latest step known to be done (on CUDA, one launched earlier).
            self.stats.on_step(in_flight, self.runner.last_step_seconds or 0.0)
            if self.runner.last_step_tokens > in_flight:
                self.stats.on_window_tokens(self.runner.last_step_tokens - in_flight)
            for slot, ticket in self._slots.items():
                if ticket.on_progress is not None:
                    try:
                        ticket.on_progress(self.runner.generated[slot])
                    except Exception:  # a caller's callback must not stop the batch
                        log.exception("progress callback failed")
            for slot in out.finished:
                ticket = self._slots.pop(slot)
                ticket.decoded = time.perf_counter()
                tokens = self.runner.tokens_of(slot)  # on the host: geometry runs on a stream of its own
                self.runner.release(slot)
                with self._geometry_cv:
                    heapq.heappush(self._geometry, (ticket.band, next(self._geometry_order), ticket, tokens))
                    self._geometry_cv.notify()
            self.stats.on_in_flight(len(self._slots))

    # -- the geometry thread --------------------------------------------------------------------

    def _geometry_loop(self) -> None:
        with self._stream(GEOMETRY_STREAM_PRIORITY):
            self._geometry_jobs()

    def _geometry_jobs(self) -> None:
        n = self.engine.cfg.num_tokens
        cpu_threads = torch.get_num_threads()
        while True:
            with self._geometry_cv:
                while not self._geometry and not self._stopping:
                    self._geometry_cv.wait()
                if not self._geometry:
                    return
                _, _, ticket, tokens = heapq.heappop(self._geometry)
            if self._drop(ticket):
                continue
            try:
                # While objects decode, a second OpenMP team would slow every step (see
                # engine/threads.py): one thread then; all of them, released after, otherwise.
                decoding = bool(self._slots or self._waiting)
                set_thread_openmp_threads(1 if decoding else cpu_threads)
                t0 = time.perf_counter()
                mesh = self.engine.tokens_to_meshes(tokens[None], [ticket.request.resolution],
                                                    mesh_worker=self._mesh_worker)[0]
                t1 = time.perf_counter()
                if not decoding:
                    release_openmp_workers()
                result = GenerationResult(ticket.request, tokens.tolist(), mesh, Timings(
                    queue_s=ticket.admitted - ticket.submitted, tokens_s=ticket.decoded - ticket.admitted,
                    steps=n, geometry_s=t1 - t0, total_s=t1 - ticket.submitted,
                    prefill_s=ticket.admitted - ticket.admitting))
                self.stats.on_complete()
                ticket.future.set_result(result)
            except Exception as exc:
                log.exception("geometry failed")
                ticket.future.set_exception(exc)
