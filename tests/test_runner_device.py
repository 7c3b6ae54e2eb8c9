"""The decode runner's device handling, on the CPU: which attention backends a step may use,
and, with a stand-in for torch.cuda (no GPU here; tests/test_cuda.py runs the real one), that
capture and replay happen under the runner's device and capture on a stream of its own, that a
greedy-only graph serves steps in which no row samples, and that the host keeps at most
MAX_STEPS_IN_FLIGHT steps ahead of the device, timing steps with events.

The stand-in follows torch.cuda's semantics where the runner relies on them (torch 2.13's
sources): a graph replays the work captured while it was recorded (torch/cuda/graphs.py:182,
`CUDAGraph.replay`), and `torch.cuda.graph` captures on the stream it is given, entering that
stream's context (graphs.py:365 and :437, `self.stream_ctx.__enter__()`); `torch.cuda.device`
and `torch.cuda.stream` set the thread's current device and stream for the block
(torch/cuda/__init__.py:642 `class device`, :756 `StreamContext`); an event completes when the
work recorded before it on its stream has run, `synchronize` waits for that (cudaEventSynchronize,
torch/cuda/streams.py:245) and `query` says whether it has (streams.py:225); here an event
completes when the test says so, or on `synchronize`."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from cubeserve.engine import GenerationRequest as Req
from cubeserve.engine import runner as runner_module
from cubeserve.engine.runner import DECODE_ATTENTION_BACKENDS, MAX_STEPS_IN_FLIGHT


def test_a_decode_step_never_uses_cudnn_attention_and_prefers_the_memory_efficient_kernel(make_engine, monkeypatch):
    seen = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((torch.backends.cuda.cudnn_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
                     torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled(),
                     torch._C._get_sdp_priority_order()[:3]))
        return real(*args, **kwargs)

    engine = make_engine("tiny", "causal")
    pool = engine.decode_runner(max_objects=2)
    pool.admit([Req("a lamp")])
    before = torch.backends.cuda.cudnn_sdp_enabled(), torch._C._get_sdp_priority_order()
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    pool.step()
    monkeypatch.undo()
    order = [int(b) for b in DECODE_ATTENTION_BACKENDS]
    assert DECODE_ATTENTION_BACKENDS[0] == SDPBackend.EFFICIENT_ATTENTION
    assert SDPBackend.CUDNN_ATTENTION not in DECODE_ATTENTION_BACKENDS
    assert seen and all(s == (False, True, True, True, order) for s in seen), seen[:3]
    assert (torch.backends.cuda.cudnn_sdp_enabled(), torch._C._get_sdp_priority_order()) == before  # restored


class FakeCuda:
    """The few torch.cuda calls the runner makes, with their semantics (module docstring)."""

    def __init__(self):
        self.current_device = torch.device("cuda", 0)  # a thread's default
        self.current_stream = "default"
        self.capturing = None  # the FakeGraph being captured
        self.captures, self.replays, self.computes = [], [], []
        self.events: list[FakeCuda.Event] = []
        self.synchronized = 0
        cuda = self

        class Stream:
            def __init__(self, device=None):
                self.device = device

            def wait_stream(self, other):
                pass

        class CUDAGraph:
            def __init__(self):
                self.work = []

            def replay(self):
                cuda.replays.append((cuda.current_device, cuda.current_stream))
                for fn in self.work:
                    fn()

        class Event:
            def __init__(self, enable_timing=False):
                self.done, self.recorded_at = False, None
                cuda.events.append(self)

            def record(self, stream=None):
                self.recorded_at = len(cuda.computes)

            def query(self):
                return self.done

            def synchronize(self):  # the work recorded before it, and so every earlier event, is done
                for event in cuda.events:
                    if event.recorded_at is not None and event.recorded_at <= self.recorded_at:
                        event.done = True
                cuda.synchronized += 1

            def elapsed_time(self, end):
                return 7.0  # milliseconds: a figure the host could not have measured itself

        self.Stream, self.CUDAGraph, self.Event = Stream, CUDAGraph, Event

    @contextlib.contextmanager
    def device(self, device):
        before, self.current_device = self.current_device, torch.device(device)
        try:
            yield
        finally:
            self.current_device = before

    @contextlib.contextmanager
    def stream(self, stream):
        before, self.current_stream = self.current_stream, stream
        try:
            yield
        finally:
            self.current_stream = before

    @contextlib.contextmanager
    def graph(self, graph, pool=None, stream=None):
        self.captures.append((self.current_device, stream))
        before, self.current_stream, self.capturing = self.current_stream, stream, graph
        try:
            yield
        finally:
            self.current_stream, self.capturing = before, None

    def current_stream_of(self, device=None):
        return self.current_stream

    def install(self, monkeypatch):
        for name in ("Stream", "CUDAGraph", "Event", "device", "stream", "graph"):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))
        monkeypatch.setattr(torch.cuda, "current_stream", self.current_stream_of)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())

    def record_compute(self, pool):
        """Wrap pool.compute: note where each call runs; inside a capture, the graph keeps it."""
        real = pool.compute

        def noted(k, live, uniform, any_sampling):
            self.computes.append((self.current_device, self.current_stream, k, live, any_sampling))
            return real(k, live, uniform, any_sampling)

        def compute(k, live, uniform, any_sampling=True):
            if self.capturing is not None:
                self.capturing.work.append(lambda: noted(k, live, uniform, any_sampling))
            return noted(k, live, uniform, any_sampling)

        pool.compute = compute


@pytest.fixture
def on_cuda_1(make_engine, monkeypatch):
    """A runner of graph buckets whose device is cuda:1 (its tensors stay on the CPU), captured
    under the stand-in."""
    engine = make_engine("tiny", "causal")
    pool = engine.decode_runner(max_objects=4, graph_buckets=(1, 2, 4), length_buckets=2, capture=False)
    cuda = FakeCuda()
    cuda.install(monkeypatch)
    cuda.record_compute(pool)
    pool.device = torch.device("cuda", 1)
    pool.stream = torch.cuda.Stream(pool.device)
    pool._capture(pool.device)
    return engine, pool, cuda


def test_graphs_are_captured_under_the_runners_device_on_its_own_stream(on_cuda_1):
    engine, pool, cuda = on_cuda_1
    assert sorted(pool.graphs) == sorted((k, n, s) for k in (1, 2, 4) for n in pool.length_buckets
                                         for s in (True, False))
    assert cuda.captures and all(c == (torch.device("cuda", 1), pool.stream) for c in cuda.captures)
    assert all(device == torch.device("cuda", 1) for device, *_ in cuda.computes)  # warm-up too
    assert cuda.current_device == torch.device("cuda", 0)  # the thread's own is left as it was


def test_replays_run_under_the_runners_device_and_greedy_steps_use_the_greedy_graph(on_cuda_1, run_steps):
    engine, pool, cuda = on_cuda_1
    greedy, sampled = Req("a red chair"), Req("a lamp", top_p=0.9, seed=3, temperature=0.8)
    expected = [engine.generate_tokens([r])[0] for r in (greedy, sampled)]
    cuda.computes.clear()
    done = {}
    pool.admit([greedy])
    run_steps(pool, 5, done)
    replayed_greedy = [c[-1] for c in cuda.computes]
    pool.admit([sampled])
    run_steps(pool, 2 * engine.cfg.num_tokens, done)
    assert replayed_greedy and not any(replayed_greedy)  # no row samples: the greedy-only graph
    assert any(c[-1] for c in cuda.computes)
    assert cuda.replays and all(device == torch.device("cuda", 1) for device, _ in cuda.replays)
    for slot, tokens in enumerate(expected):
        assert torch.equal(done[slot], tokens)


def test_the_host_keeps_at_most_two_steps_ahead_and_times_steps_with_events(on_cuda_1):
    engine, pool, cuda = on_cuda_1
    pool.admit([Req("a boat")])
    launched = len(cuda.computes)
    most_ahead = 0
    for i in range(10):
        pool.step()
        done = max([e.recorded_at for e in cuda.events if e.done], default=launched)
        most_ahead = max(most_ahead, len(cuda.computes) - max(done, launched))  # steps launched, not done
    assert MAX_STEPS_IN_FLIGHT == 2 and most_ahead == MAX_STEPS_IN_FLIGHT
    assert len(pool._in_flight) == MAX_STEPS_IN_FLIGHT and cuda.synchronized == 10 - MAX_STEPS_IN_FLIGHT
    assert pool.last_step_seconds == pytest.approx(0.007)  # from the events, not the host's clock


def test_on_the_cpu_a_step_is_timed_by_the_host_and_nothing_waits(make_engine):
    pool = make_engine("tiny", "causal").decode_runner(max_objects=2)
    pool.admit([Req("a mug")])
    pool.step()
    assert pool.stream is None and not pool._in_flight and pool.last_step_seconds > 0
    assert runner_module.MAX_STEPS_IN_FLIGHT == MAX_STEPS_IN_FLIGHT


def test_the_gpu_checks_preflight_runs_the_engines_own_step(capsys):
    """bench/gpu_check.sh runs the preflight first, on the GPU: here a dry run on the tiny shapes
    keeps it working (replay == eager, every attention call under the pinned backends)."""
    from bench import cuda_preflight

    assert cuda_preflight.main(["--config", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "replay == eager" in out and "attention under the pinned backends: OK" in out
    assert "preflight OK" in out
