"""bench/capacity.py: where the knee is, and a ramp through the engine in process (what the GPU
check runs) that counts every request and reads the scheduler's gauges."""

from bench import capacity


def step(clients, p99, failed=0):
    return {"clients": clients, "p99_s": p99, "failed": failed}


def test_the_knee_is_the_last_step_within_the_slo_before_the_first_miss():
    steps = [step(1, 0.5), step(2, 0.9), step(4, 1.5), step(8, 0.8)]
    assert capacity.knee(steps, 1.0) == 2  # 8 passing after 4 missed does not count
    assert capacity.knee([step(1, 0.5), step(2, 0.6, failed=1)], 1.0) == 1  # a failure ends it
    assert capacity.knee([step(1, 2.0)], 1.0) is None


def test_a_ramp_through_the_engine_in_process_counts_every_request():
    figures = capacity.run(steps=(1, 3), seconds=2.0, resolution=4, engine_config="tiny")
    assert [s["clients"] for s in figures["steps"]] == [1, 3]
    for s in figures["steps"]:
        assert s["completed"] > 0 and s["failed"] == 0 and s["refused"] == 0
        # closed loop: the scheduler holds about one request per client
        assert 0.5 * s["clients"] <= s["in_progress"] <= s["clients"] + 0.01
    assert figures["knee"] in (1, 3) and figures["path"] == "in process"
    assert figures["max_objects"] == 8 and figures["max_queue"] == 64
