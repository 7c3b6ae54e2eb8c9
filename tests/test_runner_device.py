"""The decode runner's device handling, on the CPU: which attention backends a step may use,
and, with a stand-in for torch.cuda (tests/fake_cuda.py; no GPU here, tests/test_cuda.py runs the
real one), what CUDA graphs, streams and events hold it to.

The stand-in follows torch.cuda's semantics where a runner can get them wrong (its docstring
gives them, with torch's sources): capture runs nothing, and a replay re-runs the captured aten
operations on the captured tensors, so a step reads only what the runner wrote into the buffers
the graphs captured (a buffer rebound after capture is stale, as on a GPU); a host
synchronisation while capturing, or capture on a default stream, is refused; work on one stream
is ordered after another's only by wait_stream or the host waiting (else StreamRace); events are
done when the device has done the work before them, by itself or because the host waited, and
time the graphs replayed between them. Its own tests come first, then the runner's: it is built
by its own constructor for cuda:1 (not the thread's default device), which captures; capture and
replay happen under that device, capture on a stream of its own into one memory pool, admission
and release reach the graphs through their buffers (tokens equal the eager engine's), a
greedy-only graph serves steps in which no row samples, and the host keeps at most
MAX_STEPS_IN_FLIGHT steps ahead of the device, timing steps with its events."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from cubeserve.engine import GenerationRequest as Req
from cubeserve.engine import runner as runner_module
from cubeserve.engine.runner import DECODE_ATTENTION_BACKENDS, MAX_STEPS_IN_FLIGHT, DecodeRunner
from fake_cuda import FakeCuda, StreamRace


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


# -- the stand-in for torch.cuda (tests/fake_cuda.py): what it holds a runner to ----------------

@pytest.fixture
def cuda(monkeypatch):
    with FakeCuda("cuda:0").installed(monkeypatch) as fake:
        yield fake


def test_a_graph_replays_its_captured_operations_on_the_captured_tensors_only(cuda):
    a, out = torch.ones(3), torch.zeros(3)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
        scale = 2.0 if out.shape[0] == 3 else 0.0  # host logic: settled at capture
        out.copy_(a * scale + 1)
        made = a * 10
    assert out.tolist() == [0.0] * 3  # capture runs nothing
    assert torch.isnan(made).all()  # and what it allocated is the graph's memory, not a result
    graph.replay()
    assert out.tolist() == [3.0] * 3
    a.fill_(5.0)  # written in place: the graph reads it
    graph.replay()
    assert out.tolist() == [11.0] * 3
    a = torch.full((3,), 7.0)  # a new tensor: the graph still reads the one it captured
    graph.replay()
    assert out.tolist() == [11.0] * 3


def test_what_a_gpu_refuses_the_stand_in_refuses(cuda):
    a = torch.ones(3)
    with pytest.raises(RuntimeError, match="non-default stream"):
        with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=torch.cuda.current_stream()):
            a * 2
    for sync in (lambda: a.sum().item(), lambda: bool(a.any()), lambda: a.nonzero()):  # the host waits
        with torch.inference_mode(), pytest.raises(RuntimeError, match="capturing"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                sync()
        with pytest.raises(RuntimeError, match="capturing"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                sync()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # under cuda:0, the thread's default device
        a.mul_(2)
    with torch.cuda.device(1), pytest.raises(RuntimeError, match="replayed under cuda:1"):
        graph.replay()
    timed, untimed = torch.cuda.Event(enable_timing=True), torch.cuda.Event()
    timed.record(), untimed.record()
    untimed.synchronize()
    with pytest.raises(RuntimeError, match="enable_timing"):
        timed.elapsed_time(untimed)


def test_only_wait_stream_or_the_host_waiting_orders_one_streams_work_after_anothers(cuda):
    x = torch.zeros(4)  # written on cuda:0's default stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side), pytest.raises(StreamRace, match="reads a tensor .* that <default stream"):
        x + 1
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        y = x + 1  # ordered after the write now
    with pytest.raises(StreamRace, match="reads a tensor .* that <stream"):
        y * 2  # the default stream reads what the side stream wrote
    on_side = torch.cuda.Event()
    on_side.record(side)
    on_side.synchronize()  # the host has waited for the side stream: what it launches next comes after
    assert (y * 2).tolist() == [2.0] * 4
    with torch.cuda.stream(side):
        x * 3  # a read on the side stream...
    with pytest.raises(StreamRace, match="writes a tensor .* that <stream .* read"):
        x.add_(1)  # ...then a write on the default stream that nothing orders after it


@pytest.mark.parametrize("behind", [None, 0])
def test_events_are_done_when_the_device_has_done_the_work_and_time_it(monkeypatch, behind):
    """behind=None: the device runs only when the host waits for it; 0: it keeps up by itself."""
    with FakeCuda("cuda:0", behind=behind).installed(monkeypatch) as cuda:
        a, out = torch.ones(3), torch.zeros(3)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out.copy_(a * 2)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        graph.replay()
        end.record()
        assert end.query() == (behind == 0) and cuda.blocked == 0
        if behind is None:
            with pytest.raises(RuntimeError, match="not ready"):
                begin.elapsed_time(end)
        end.synchronize()
        assert end.query() and cuda.blocked == (behind is None)
        assert begin.elapsed_time(end) == pytest.approx(2 * graph.device_ms) and graph.device_ms > 0


# -- the runner under the stand-in ---------------------------------------------------------------

CUDA_1 = torch.device("cuda", 1)
REQUESTS = {"greedy": Req("a red chair"), "sampled": Req("a lamp", top_p=0.9, seed=3, temperature=0.8),
            "boat": Req("a boat")}


@pytest.fixture(scope="session")
def alone(make_engine):
    """Each of REQUESTS decoded alone by the CPU engine, eagerly, before any stand-in is installed."""
    engine = make_engine("tiny", "causal")
    return {name: engine.generate_tokens([r])[0] for name, r in REQUESTS.items()}


def runner_on_cuda_1(engine, cls=DecodeRunner, **kwargs) -> DecodeRunner:
    """A runner for cuda:1 (not the thread's default device) with graph buckets, built by its own
    constructor, which captures: slot buckets 1 and 2, two cache-length buckets."""
    return cls(engine.cfg, engine.gpt, engine.condition, engine.uncond_kv, 2, CUDA_1, engine.dtype,
               engine.single_block_mode, graph_buckets=(1,), length_buckets=2, **kwargs)


@pytest.fixture
def on_cuda_1(make_engine, monkeypatch, request):
    """(engine, runner, stand-in): the runner built for cuda:1 under the stand-in, whose device
    lags as `request.param` says (default None: it runs only when the host waits for it)."""
    engine = make_engine("tiny", "causal")
    with FakeCuda(CUDA_1, behind=getattr(request, "param", None)).installed(monkeypatch) as cuda:
        yield engine, runner_on_cuda_1(engine), cuda


def test_the_constructor_captures_under_the_runners_device_on_its_own_stream_in_one_pool(on_cuda_1):
    """Its warm-up, capture and the race checks of the stand-in all passed on the way here."""
    engine, pool, cuda = on_cuda_1
    assert sorted(pool.graphs) == sorted((k, n, s) for k in (1, 2) for n in pool.length_buckets
                                         for s in (True, False))
    assert len(cuda.captures) == len(pool.graphs) and len({id(p) for *_, p in cuda.captures}) == 1
    assert all(device == CUDA_1 and stream is pool.stream and p is not None for device, stream, p in cuda.captures)
    assert all(g.device == CUDA_1 and g.ops for g in pool.graphs.values())
    assert pool.stream.device == CUDA_1 and not pool.stream.default
    assert pool.stream.launched > 0  # the warm-up ran there (a capture launches nothing)
    assert cuda.current_device == torch.device("cuda", 0) and cuda.current_stream(CUDA_1).default  # as before
    assert not pool.tokens.any() and not pool.positions.any()  # neither warm-up nor capture touched them


def test_replays_read_the_static_buffers_and_give_the_eager_tokens_greedy_steps_on_the_greedy_graph(
        alone, on_cuda_1, run_steps):
    """A greedy request decodes alone and leaves; a sampled one takes its slot, a greedy one
    joins mid-generation, the first of them leaves while the other goes on: admission and release
    reach the graphs only through the buffers they captured."""
    engine, pool, cuda = on_cuda_1
    n, done = engine.cfg.num_tokens, {}
    pool.admit([REQUESTS["greedy"]])
    run_steps(pool, n, done)
    first = done.pop(0)
    pool.admit([REQUESTS["sampled"]])  # into slot 0 again
    run_steps(pool, 5, done)
    pool.admit([REQUESTS["boat"]])  # slot 1
    run_steps(pool, 2 * n, done)
    key_of = {id(g): key for key, g in pool.graphs.items()}
    keys = [key_of[id(graph)] for _, _, graph, _ in cuda.replays]
    assert len(keys) == 2 * n + 5  # one launch per step with a busy slot; nothing else computed the steps
    assert [k for k, _, _ in keys] == [1] * (n + 5) + [2] * n  # slot buckets
    assert [s for *_, s in keys] == [False] * n + [True] * n + [False] * 5  # no row samples: greedy-only graph
    assert {length for _, length, _ in keys} == set(pool.length_buckets)
    assert all(device == CUDA_1 and stream is cuda.current_stream(CUDA_1) for device, stream, *_ in cuda.replays)
    assert torch.equal(first, alone["greedy"])
    assert torch.equal(done[0], alone["sampled"]) and torch.equal(done[1], alone["boat"])


class RebindsBusy(DecodeRunner):
    """A runner with the classic CUDA-graph bug: admission gives `busy` a new tensor (same
    values) instead of writing the captured one in place."""

    def _admit(self, slots, requests):
        self.busy = self.busy.clone()
        super()._admit(slots, requests)


def test_a_buffer_rebound_after_capture_is_a_stale_buffer_to_the_graphs(alone, make_engine, monkeypatch):
    """The stand-in catches what only a replay shows: run eagerly, RebindsBusy is right."""
    engine = make_engine("tiny", "causal")
    with FakeCuda(CUDA_1).installed(monkeypatch) as cuda:
        graphed = runner_on_cuda_1(engine, RebindsBusy)
        eager = runner_on_cuda_1(engine, RebindsBusy, capture=False)  # the same bucketed steps, not captured
        for pool in (graphed, eager):
            pool.admit([REQUESTS["boat"]])
            for _ in range(8):
                pool.step()
        assert len(cuda.replays) == 8
        assert torch.equal(eager.tokens_of(0)[:8], alone["boat"][:8])
        assert not graphed.tokens_of(0).any()  # the graphs read the old `busy`: no slot busy, no token kept


@pytest.mark.parametrize("on_cuda_1", [None, 0], indirect=True, ids=["device-behind", "device-keeps-up"])
def test_the_host_keeps_at_most_two_steps_ahead_and_times_steps_with_the_devices_events(alone, on_cuda_1):
    engine, pool, cuda = on_cuda_1
    keeps_up = cuda.behind == 0
    pool.admit([REQUESTS["boat"]])
    ahead = []
    for _ in range(10):
        pool.step()
        ahead.append(sum(stream.done < number for _, stream, _, number in cuda.replays))  # launched, not done
    assert MAX_STEPS_IN_FLIGHT == 2 and len(pool._in_flight) == MAX_STEPS_IN_FLIGHT
    if keeps_up:  # events are done by themselves: the host never waits
        assert ahead == [0] * 10 and cuda.blocked == 0
    else:  # the host runs ahead until two steps are in flight, then waits for the oldest
        assert ahead == [1] + [MAX_STEPS_IN_FLIGHT] * 9 and cuda.blocked == 10 - MAX_STEPS_IN_FLIGHT
    assert cuda.synchronized == 10 - MAX_STEPS_IN_FLIGHT
    step_graph = cuda.replays[10 - MAX_STEPS_IN_FLIGHT - 1][2]  # the latest step known to be done
    assert pool.last_step_seconds == pytest.approx(step_graph.device_ms / 1000)  # its device time alone
    tokens = pool.tokens_of(0)  # a copy to the host: waits for the slot's last step
    assert all(stream.done >= number for _, stream, _, number in cuda.replays)
    assert torch.equal(tokens[:10], alone["boat"][:10])


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


def test_the_gpu_check_fits_its_device_time_and_keeps_each_figure_made():
    """A lent GPU gives a session 15 minutes in all, start included, and the check runs with a
    limit of 420 s: its parts' own limits add up to at most 6 minutes (so that a rerun fits), and
    BENCHMARKS.md is copied to $OUT after each benchmark (a check cut off keeps what it made)."""
    import re
    from pathlib import Path

    script = (Path(__file__).resolve().parents[1] / "bench" / "gpu_check.sh").read_text()
    limits = [int(n) for n in re.findall(r"^timeout (\d+) ", script, flags=re.M)]
    assert len(limits) >= 5 and sum(limits) <= 360, limits
    benches = re.findall(r"^timeout \d+ python3 -m (bench\S*)", script, flags=re.M)
    for bench in benches:
        after = script[script.index(f"-m {bench}"):]
        assert re.search(r"^save$", after, flags=re.M), f"{bench}: its figures are not copied to $OUT after it"


def test_a_window_runner_steps_eagerly_on_its_device_and_captures_nothing(alone, make_engine, monkeypatch, run_steps):
    """Window decoding (decode_window > 1) ignores the graph buckets: its steps run eagerly under
    the runner's device, the host reading each forward's accepted counts, with the eager tokens."""
    engine = make_engine("tiny", "causal")
    with FakeCuda(CUDA_1).installed(monkeypatch) as cuda:
        pool = runner_on_cuda_1(engine, window=4)
        assert pool.slot_buckets is None and not pool.graphs and not cuda.captures
        done = {}
        pool.admit([REQUESTS["sampled"], REQUESTS["boat"]])
        run_steps(pool, engine.cfg.num_tokens, done)
        assert not cuda.replays and pool.forwards <= engine.cfg.num_tokens
    assert torch.equal(done[0], alone["sampled"]) and torch.equal(done[1], alone["boat"])
