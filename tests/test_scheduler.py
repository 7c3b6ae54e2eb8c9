"""The engine's batching thread: concurrent requests share steps, join mid-flight, cancel."""

import json
import threading
import time
from concurrent.futures import CancelledError

import pytest

from cubeserve.engine import GenerationRequest as Req
from cubeserve.engine import InvalidRequest
from cubeserve.engine.scheduler import Scheduler
from guards import cannot_run


def test_concurrent_requests_are_batched_and_each_gets_its_own_result(make_engine):
    engine = make_engine("tiny")
    reqs = [Req(f"object number {i}", seed=i, top_p=0.9 if i % 2 else None, resolution=4) for i in range(8)]
    with Scheduler(engine, max_objects=8) as sched:
        tickets = [sched.submit(r) for r in reqs]
        results = [t.result(timeout=120) for t in tickets]
        stats = sched.stats.snapshot()
    assert stats["max_in_flight"] > 1
    # On average at least two objects a step (the Triton test's bar): 8 requests submitted at
    # once share nearly every step; one by one would take 8 x N steps.
    assert stats["tokens_generated"] == 8 * engine.cfg.num_tokens
    assert stats["steps"] < stats["tokens_generated"] / 2, f"{stats['steps']} steps: not batched"
    for r, res in zip(reqs, results):
        assert res.tokens == engine.generate_tokens([r])[0].tolist()
        assert not res.mesh.empty
        assert res.timings["total_s"] >= res.timings["tokens_s"] > 0
        # The server sends these as JSON and its readers take them by key.
        assert json.loads(json.dumps(res.timings)).keys() == {
            "queue_s", "prefill_s", "tokens_s", "time_per_token_s", "geometry_s", "total_s"}
        assert res.timings["queue_s"] >= res.timings["prefill_s"] > 0  # the admission ends the wait
        assert res.timings["time_per_token_s"] == res.timings["tokens_s"] / engine.cfg.num_tokens


def test_requests_waiting_when_the_loop_starts_share_every_step(make_engine):
    """Queued before the decode thread runs, all are admitted in one batch: N steps for all."""
    engine = make_engine("tiny")
    sched = Scheduler(engine, max_objects=4)
    tickets = [sched.submit(Req(f"object {i}", resolution=4)) for i in range(4)]
    with sched:
        for t in tickets:
            t.result(timeout=120)
        stats = sched.stats.snapshot()
    assert stats["steps"] == engine.cfg.num_tokens and stats["max_in_flight"] == 4
    assert stats["tokens_generated"] == 4 * engine.cfg.num_tokens


def test_more_requests_than_slots_queue_and_join_mid_generation(make_engine):
    engine = make_engine("tiny")
    reqs = [Req(f"thing {i}", resolution=4) for i in range(5)]
    with Scheduler(engine, max_objects=2) as sched:
        tickets = [sched.submit(r) for r in reqs]
        results = [t.result(timeout=120) for t in tickets]
        stats = sched.stats.snapshot()
    assert stats["max_in_flight"] == 2
    for r, res in zip(reqs, results):
        assert res.tokens == engine.generate_tokens([r])[0].tolist()


BF16_PROMPTS = ["a red chair", "a lamp", "a boat", "a mug", "a wooden table", "a sports car", "a dragon", ""]


def test_bfloat16_scheduler_tokens_are_float32_greedy_choices(tiny_weights, make_engine, float32_shortfall):
    """bfloat16 tokens may part from float32's at a near-tie; what must hold is that every one
    is float32's best choice given the tokens before it (tests/test_cuda.py checks the same
    with CUDA graphs)."""
    from cubeserve.engine import Engine

    engine = Engine.from_dir(tiny_weights, device="cpu", dtype="bfloat16")
    reqs = [Req(p, resolution=4, guidance_scale=0.0 if i % 4 == 3 else 3.0) for i, p in enumerate(BF16_PROMPTS)]
    with Scheduler(engine, max_objects=8) as sched:
        results = [t.result(timeout=120) for t in [sched.submit(r) for r in reqs]]
    fp32 = make_engine("tiny").generate_tokens(reqs).tolist()
    for r, res, own in zip(reqs, results, fp32):
        assert float32_shortfall(r, own) < 1e-5  # float32's own greedy tokens fall short by nothing
        assert float32_shortfall(r, res.tokens) < float32_shortfall.bfloat16_bound, r.prompt
    # The measure tells a mix-up: another request's tokens fall far short.
    assert min(float32_shortfall(reqs[0], res.tokens) for res in results[1:]) > 2 * float32_shortfall.bfloat16_bound


def test_progress_arrives_in_order(make_engine):
    engine = make_engine("tiny")
    seen = []
    with Scheduler(engine) as sched:
        sched.submit(Req("a chair", resolution=4), on_progress=seen.append).result(timeout=60)
    assert seen == list(range(1, engine.cfg.num_tokens + 1))


def test_cancelled_request_leaves_the_batch_and_others_finish(make_engine):
    engine = make_engine("tiny")
    started = threading.Event()
    with Scheduler(engine, max_objects=4) as sched:
        slow = sched.submit(Req("cancel me", resolution=4), on_progress=lambda n: (started.set(), time.sleep(0.01)))
        other = sched.submit(Req("keep me", resolution=4))
        assert started.wait(30)
        slow.cancel()
        with pytest.raises(CancelledError):
            slow.result(timeout=60)
        assert other.result(timeout=60).tokens == engine.generate_tokens([Req("keep me")])[0].tolist()
        time.sleep(0.2)
        assert not sched.runner.busy_slots
        tokens_after_cancel = sched.stats.snapshot()["tokens_generated"]
    assert tokens_after_cancel < 2 * engine.cfg.num_tokens  # the cancelled one stopped early


def test_invalid_request_is_refused_at_submit(make_engine):
    with Scheduler(make_engine("tiny")) as sched:
        with pytest.raises(InvalidRequest, match="temperature"):
            sched.submit(Req("x", temperature=0))
        assert sched.generate(Req("still serving", resolution=4), timeout=60).tokens


def test_one_openmp_team_geometry_thread_single_threaded_others_untouched():
    """The geometry thread runs its kernels on one thread (no second worker pool to slow the
    decode thread's team); the setting is per thread, and kernels stay correct after the
    calling thread hands its workers back."""
    import torch

    from cubeserve.engine import threads

    if threads._openmp() is None:
        cannot_run("no OpenMP runtime in this PyTorch build")
    before = torch.get_num_threads()
    seen = []

    def geometry_like():
        threads.set_thread_openmp_threads(1)
        seen.append(torch.get_num_threads())

    t = threading.Thread(target=geometry_like)
    t.start()
    t.join()
    assert seen == [1] and torch.get_num_threads() == before
    assert threads.release_openmp_workers()
    x = torch.arange(1 << 22, dtype=torch.float64)
    assert torch.get_num_threads() == before and x.sum().item() == (1 << 22) * ((1 << 22) - 1) / 2


def test_slot_state_carries_no_autograd_history(make_engine):
    """An admission with grad enabled chained every slot's inputs into one autograd graph that
    grew for as long as the server lived."""
    pool = make_engine("tiny").decode_runner(max_objects=2)
    for _ in range(3):
        slot = pool.admit([Req("a chair")])[0]
        pool.release(slot)
    assert pool.x.grad_fn is None and not pool.x.requires_grad
    assert all(not t.requires_grad for t in (pool._bos, pool.sampling.scale, pool.positions))


def test_past_max_queue_requests_are_refused_at_once_and_taken_again_later(make_engine):
    from cubeserve.engine import Unavailable

    engine = make_engine("tiny")
    with Scheduler(engine, max_objects=1, max_queue=1) as sched:
        first, second = sched.submit(Req("one", resolution=4)), sched.submit(Req("two", resolution=4))
        with pytest.raises(Unavailable, match=r"^unavailable: the server is busy: 2 requests .* max_queue 1"):
            sched.submit(Req("three", resolution=4))
        assert first.result(timeout=60).tokens and second.result(timeout=60).tokens
        assert sched.generate(Req("three", resolution=4), timeout=60).tokens  # room again
        assert sched.stats.snapshot()["refused_busy"] == 1 and sched.outstanding == 0


def test_a_deadline_passing_in_the_queue_fails_the_request_without_a_slot(make_engine):
    from cubeserve.engine import Unavailable

    engine = make_engine("tiny")
    with Scheduler(engine, max_objects=1) as sched:
        blocker = sched.submit(Req("blocker", resolution=4), on_progress=lambda n: time.sleep(0.005))
        hurried = sched.submit(Req("hurried", resolution=4), timeout=0.05)
        with pytest.raises(Unavailable, match="deadline exceeded"):
            hurried.result(timeout=60)
        assert blocker.result(timeout=60).tokens
        stats = sched.stats.snapshot()
    assert stats["expired"] == 1 and stats["tokens_generated"] == engine.cfg.num_tokens
    with pytest.raises(ValueError, match="timeout"):
        Scheduler(engine).submit(Req("x"), timeout=0)


def test_stopping_fails_waiting_requests_as_unavailable(make_engine):
    from cubeserve.engine import Unavailable

    sched = Scheduler(make_engine("tiny"), max_objects=1).start()
    running = sched.submit(Req("running", resolution=4), on_progress=lambda n: time.sleep(0.01))
    waiting = sched.submit(Req("waiting", resolution=4))
    sched.stop()
    for ticket in (running, waiting):
        with pytest.raises(Unavailable, match="engine stopped"):
            ticket.result(timeout=5)
    with pytest.raises(Unavailable, match="stopping"):
        sched.submit(Req("late"))


# -- priority bands and tenants (engine/admission.py) -----------------------------------------


def _admission_order(sched, tickets: dict) -> list[str]:
    """The names of `tickets` in the order they got a slot (all must finish)."""
    for t in tickets.values():
        t.result(timeout=120)
    return sorted(tickets, key=lambda name: tickets[name].admitted)


def test_a_free_slot_goes_to_the_higher_band_first_and_to_tenants_in_turn(make_engine):
    """One slot; everything is queued before the loop starts, lowest band first and one tenant's
    burst before the others: slots go interactive, standard, batch, and inside a band the
    tenants take turns (a's burst does not hold b back)."""
    sched = Scheduler(make_engine("tiny"), max_objects=1, max_queue=16)
    tickets = {}
    for i in range(2):
        tickets[f"batch-{i}"] = sched.submit(Req(f"batch {i}", resolution=4), band="batch", tenant="c")
    for i in range(3):
        tickets[f"a-{i}"] = sched.submit(Req(f"a {i}", resolution=4), tenant="a")
    for i in range(2):
        tickets[f"b-{i}"] = sched.submit(Req(f"b {i}", resolution=4), tenant="b")
    tickets["interactive"] = sched.submit(Req("interactive", resolution=4), band="interactive", tenant="c")
    with sched:
        order = _admission_order(sched, tickets)
    assert order == ["interactive", "a-0", "b-0", "a-1", "b-1", "a-2", "batch-0", "batch-1"]


def test_a_full_queue_sheds_the_lower_band_and_the_tenant_over_its_share(make_engine):
    from cubeserve.engine import Unavailable
    from cubeserve.requests import Shed

    sched = Scheduler(make_engine("tiny"), max_objects=1, max_queue=2)  # 3 outstanding at most
    batch = [sched.submit(Req(f"batch {i}", resolution=4), band="batch", tenant="a") for i in range(3)]
    # Full: an interactive newcomer takes the newest batch request's place, which gives way (429).
    urgent = sched.submit(Req("urgent", resolution=4), band="interactive", tenant="b")
    with pytest.raises(Shed, match=r"^unavailable: shed: .*interactive before batch \(its band batch\)"):
        batch[2].result(timeout=5)
    # A batch newcomer to a queue of higher bands is refused as shed, not as "no capacity".
    with pytest.raises(Shed, match="higher band than batch"):
        sched.submit(Req("late batch", resolution=4), band="batch", tenant="a")
    with sched:
        for t in (*batch[:2], urgent):
            t.result(timeout=120)
    assert sched.stats.snapshot()["shed"] == 2

    # One band: tenant a's burst fills the queue; b's newcomer takes the place of a's newest,
    # a's next newcomer is refused (over its share), and a queue of equals is "no capacity" (503).
    sched = Scheduler(make_engine("tiny"), max_objects=1, max_queue=2)
    burst = [sched.submit(Req(f"a {i}", resolution=4), tenant="a") for i in range(3)]
    b = sched.submit(Req("b", resolution=4), tenant="b")
    with pytest.raises(Shed, match="over its share"):
        burst[2].result(timeout=5)
    with pytest.raises(Shed, match="tenant a has more requests waiting"):
        sched.submit(Req("a again", resolution=4), tenant="a")
    c = sched.submit(Req("c", resolution=4), tenant="c")  # a 2, b 1: c takes a's newest
    with pytest.raises(Shed):
        burst[1].result(timeout=5)
    with pytest.raises(Unavailable, match=r"^unavailable: the server is busy") as refused:
        sched.submit(Req("d", resolution=4), tenant="d")  # a, b and c one each: no capacity
    assert not isinstance(refused.value, Shed)
    with sched:
        for t in (burst[0], b, c):
            t.result(timeout=120)


def test_a_request_waiting_longer_than_max_wait_is_shed(make_engine):
    from cubeserve.requests import Shed

    sched = Scheduler(make_engine("tiny"), max_objects=1, max_wait_s=0.2)
    stale = sched.submit(Req("stale", resolution=4))
    time.sleep(0.3)
    fresh = sched.submit(Req("fresh", resolution=4))
    with sched:
        with pytest.raises(Shed, match=r"waited .* longer than this server's queue allows \(0.2 s"):
            stale.result(timeout=5)
        assert fresh.result(timeout=120).tokens
    assert sched.stats.snapshot()["shed"] == 1


def test_an_unknown_band_is_refused_naming_the_allowed_ones(make_engine):
    sched = Scheduler(make_engine("tiny"), max_objects=1)
    with pytest.raises(InvalidRequest, match=r"^band: must be one of interactive, standard, batch, got 'urgent'"):
        sched.submit(Req("x", resolution=4), band="urgent")


def test_priority_slots_an_interactive_request_decodes_alone_while_batch_objects_pause(make_engine):
    """max_objects 3, priority_slots 1: two batch objects decode in the shared slots; an
    interactive one arriving mid-way takes the kept slot at once, and while it decodes the batch
    objects do not advance (their progress holds still from its admission to its last token),
    then they resume; every object gets its sequential tokens."""
    engine = make_engine("tiny")
    progress: dict[str, list] = {"batch-0": [], "batch-1": []}

    def watch(name):
        return lambda generated: progress[name].append((time.perf_counter(), generated))

    reqs = {"batch-0": Req("batch 0", resolution=4, top_p=0.9, seed=1), "batch-1": Req("batch 1", resolution=4),
            "live": Req("live", resolution=4, top_p=0.9, seed=2)}
    with Scheduler(engine, max_objects=3, priority_slots=1) as sched:
        tickets = {name: sched.submit(reqs[name], on_progress=watch(name), band="batch") for name in ("batch-0", "batch-1")}
        deadline = time.monotonic() + 60
        while not progress["batch-1"] or progress["batch-1"][-1][1] < 3:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert sched.runner.generated[0] is None  # the kept slot stays free for the top band
        tickets["live"] = sched.submit(reqs["live"], band="interactive")
        results = {name: t.result(timeout=120) for name, t in tickets.items()}
    live = tickets["live"]
    for name in ("batch-0", "batch-1"):
        during = {g for t, g in progress[name] if live.admitted < t < live.decoded}
        assert len(during) <= 1, f"{name} advanced while the interactive object decoded: {sorted(during)}"
        assert results[name].timings["total_s"] > results["live"].timings["total_s"]
    for name, r in reqs.items():
        assert results[name].tokens == engine.generate_tokens([r])[0].tolist(), name


def test_priority_slots_are_kept_for_the_top_band(make_engine):
    """Standard requests never take a kept slot: two of them on max_objects 2 with one slot kept
    decode one at a time."""
    with Scheduler(make_engine("tiny"), max_objects=2, priority_slots=1) as sched:
        tickets = [sched.submit(Req(f"standard {i}", resolution=4)) for i in range(2)]
        for t in tickets:
            t.result(timeout=120)
        assert sched.stats.snapshot()["max_in_flight"] == 1


@pytest.mark.parametrize("value", [-1, 2, 1.5, True, "1x"])  # "1x": config.pbtxt text that is no integer
def test_priority_slots_out_of_range_is_refused_naming_the_range(make_engine, value):
    with pytest.raises(ValueError, match=r"^priority_slots must be an integer from 0 to max_objects - 1 \(1\), got"):
        Scheduler(make_engine("tiny"), max_objects=2, priority_slots=value)
