"""`cubeserve rollout analyze`, the promotion gate.

* The decision as a pure function of the figures (no Prometheus).
* The queries against a real Prometheus (Debian's package, tests/prometheus_server.py) scraping a
  synthetic exporter that serves serving/metrics.py's series, names, labels and buckets, while
  "traffic" runs: a baseline, a healthy candidate, an erroring one, a slow one, a shadow.
"""

from __future__ import annotations

import io
import json
import math
import re
import time

import pytest

from cubeserve.rollout import analyze as a
from cubeserve.rollout.cli import main as rollout_main
from serving_helpers import wait_until
from cubeserve.serving import metrics as m
from cubeserve.server.local_triton import free_port
from prometheus_server import PrometheusServer


def figures(version="2", requests=100.0, errors=0.0, p95=1.0, tpot=0.01, empty=0.0, **kw) -> a.Figures:
    half = lambda x: None if x is None else x / 2  # noqa: E731
    f = a.Figures(version, requests=requests, error_rate=errors, p50_seconds=half(p95), p95_seconds=p95,
                  time_per_token_p50=half(tpot), time_per_token_p95=tpot, meshes=requests, empty_mesh_rate=empty,
                  not_watertight_rate=0.0)
    for k, v in kw.items():
        setattr(f, k, v)
    return f


# -- the decision -------------------------------------------------------------------------------

def test_a_candidate_like_its_baseline_passes_with_every_check_listed():
    result = a.decide(figures("2"), figures("1"), a.Thresholds())
    assert result.result == a.PASS and result.reasons == []
    assert {c.name for c in result.checks} == {"error_rate", "empty_mesh_rate", "error_rate_increase", "p95_ratio",
                                               "time_per_token_ratio"}
    assert all(c.passed for c in result.checks)


@pytest.mark.parametrize("candidate, failing, words", [
    (figures(errors=0.2), {"error_rate", "error_rate_increase"}, "error rate 0.2 > 0.05"),
    (figures(p95=2.0), {"p95_ratio"}, "p95 latency (s) 2 is 2.00x the baseline's 1 (limit 1.5x)"),
    (figures(tpot=0.03), {"time_per_token_ratio"}, "3.00x"),
    (figures(empty=0.5), {"empty_mesh_rate"}, "empty-mesh rate 0.5 > 0.05"),
])
def test_each_limit_fails_the_gate_naming_the_figure_and_limit(candidate, failing, words):
    result = a.decide(candidate, figures("1"), a.Thresholds())
    assert result.result == a.FAIL
    assert {c.name for c in result.checks if not c.passed} == failing
    assert any(words in r for r in result.reasons), result.reasons


def test_error_rate_relative_to_a_baseline_that_errs_too():
    t = a.Thresholds(max_error_rate=0.5, max_error_rate_increase=0.02)
    assert a.decide(figures(errors=0.11), figures("1", errors=0.10), t).result == a.PASS
    result = a.decide(figures(errors=0.15), figures("1", errors=0.10), t)
    assert result.result == a.FAIL and "above the baseline's 0.1" in result.reasons[0]


def test_too_few_requests_on_either_side_is_not_enough_data_even_with_failing_checks():
    t = a.Thresholds(min_requests=20)
    result = a.decide(figures(requests=19, errors=1.0), figures("1"), t)
    assert result.result == a.NOT_ENOUGH_DATA
    assert result.reasons == ["version 2 answered 19 requests in the window, fewer than min_requests 20"]
    assert not [c for c in result.checks if c.name == "error_rate"][0].passed  # the figures are still there
    assert a.decide(figures(), figures("1", requests=3), t).result == a.NOT_ENOUGH_DATA


def test_figures_that_cannot_be_computed_and_limits_that_are_off_are_not_checked():
    # No successful request: no latency; no baseline: no ratios; limits None: nothing.
    cand = figures(errors=0.0, p95=None, tpot=None)
    result = a.decide(cand, None, a.Thresholds())
    assert {c.name for c in result.checks} == {"error_rate", "empty_mesh_rate"} and result.result == a.PASS
    off = a.Thresholds(**{n: None for n in a.Thresholds.names() if n != "min_requests"})
    assert a.decide(figures(errors=1.0), figures("1"), off).checks == []


def test_shadow_agreement_is_checked_when_a_shadow_ran():
    t = a.Thresholds(min_shadow_agreement=0.95)
    assert "shadow_agreement" not in {c.name for c in a.decide(figures(), None, t).checks}
    result = a.decide(figures(shadow_agreement_mean=0.9), None, t)
    assert result.result == a.FAIL and result.reasons == ["shadow agreement 0.9 < 0.95"]


@pytest.mark.parametrize("field, value, allowed", [
    ("max_error_rate", 1.5, "[0, 1]"), ("max_p95_ratio", 0.5, "[1, 1000]"), ("min_requests", 0, "[1, 1e+09]"),
    ("min_requests", 2.5, "whole number"), ("max_empty_mesh_rate", float("nan"), "[0, 1]"),
    ("min_shadow_agreement", -0.1, "[0, 1]")])
def test_bad_thresholds_are_refused_naming_the_field_and_range(field, value, allowed):
    with pytest.raises(ValueError, match=rf"^{field}: must be .*{re.escape(allowed)}"):
        a.Thresholds(**{field: value})


@pytest.mark.parametrize("text, seconds", [("300", 300), ("30s", 30), ("5m", 300), ("1.5h", 5400), ("1d", 86400)])
def test_windows(text, seconds):
    assert a.parse_window(text) == seconds


@pytest.mark.parametrize("text", ["", "5 min", "-5m", "0s", "8d"])
def test_bad_windows_are_refused(text):
    with pytest.raises(ValueError, match=r"^window: must be"):
        a.parse_window(text)


def test_the_queries_use_the_metric_names_and_the_version_label():
    q = a.queries("7", "300s", 'namespace="models"')
    series = f'{m.REQUESTS}{{version="7",namespace="models"}}'
    assert q["outcomes"] == (f"sum by (outcome) (((increase({series}[300s]) and {series} offset 300s) "
                             f"or ({series} unless {series} offset 300s)))")
    assert f"{m.REQUEST_DURATION}_bucket|{m.SHADOW_DURATION}_bucket" in q["p95_seconds"]
    assert f'{m.SHADOW_AGREEMENT}_bucket{{version="7",le="0.999",namespace="models"}}' in q["agreement_below_identical"]


# -- against a real Prometheus ------------------------------------------------------------------

BASELINE, HEALTHY, ERRORING, SLOW, SHADOW, NEWBORN, ABSENT = "1", "2", "3", "4", "5", "6", "9"
NEWBORN_FROM = 50  # version 6's series appear with its first request, at this step, as a server's do
TRAFFIC_S = 6.0


class SyntheticServer:
    """The cube3d_* series of serving/metrics.py on 127.0.0.1 (prometheus_client), written as a
    server's would be: per request an outcome and a duration, per object the engine's series."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

        self.registry = CollectorRegistry()
        labels = ["model", "version", "arm"]
        self.requests = Counter(m.REQUESTS.removesuffix("_total"), "", labels + ["outcome"], registry=self.registry)
        self.duration = Histogram(m.REQUEST_DURATION, "", labels, buckets=m.DURATION_BUCKETS, registry=self.registry)
        self.tpot = Histogram(m.TIME_PER_OUTPUT_TOKEN, "", labels, buckets=m.TOKEN_BUCKETS, registry=self.registry)
        self.queue = Histogram(m.QUEUE_TIME, "", labels, buckets=m.QUEUE_BUCKETS, registry=self.registry)
        self.meshes = Counter(m.MESHES.removesuffix("_total"), "", labels + ["quality"], registry=self.registry)
        shadow_labels = ["model", "version", "baseline"]
        self.shadow_requests = Counter(m.SHADOW_REQUESTS.removesuffix("_total"), "", shadow_labels + ["outcome"],
                                       registry=self.registry)
        self.shadow_duration = Histogram(m.SHADOW_DURATION, "", shadow_labels, buckets=m.DURATION_BUCKETS,
                                         registry=self.registry)
        self.agreement = Histogram(m.SHADOW_AGREEMENT, "", shadow_labels + ["measure"],
                                   buckets=m.AGREEMENT_BUCKETS, registry=self.registry)
        self.port = free_port()
        self.server, self.thread = start_http_server(self.port, addr="127.0.0.1", registry=self.registry)
        self.target = f"127.0.0.1:{self.port}"

    def request(self, version: str, outcome: str, seconds: float, tpot: float, quality: str = m.MESH_OK,
                arm: str = "") -> None:
        self.requests.labels("cube3d", version, arm, outcome).inc()
        if outcome == m.OK:
            self.duration.labels("cube3d", version, arm).observe(seconds)
            self.tpot.labels("cube3d_stream", version, arm).observe(tpot)
            self.queue.labels("cube3d_stream", version, arm).observe(0.02)
            self.meshes.labels("cube3d_stream", version, arm, quality).inc()

    def shadow(self, version: str, baseline: str, agreement: float) -> None:
        self.shadow_requests.labels("cube3d", version, baseline, m.OK).inc()
        self.shadow_duration.labels("cube3d", version, baseline).observe(0.9)
        self.tpot.labels("cube3d_stream", version, m.SHADOW_ARM).observe(0.01)
        self.meshes.labels("cube3d_stream", version, m.SHADOW_ARM, m.MESH_OK).inc()
        self.agreement.labels("cube3d", version, baseline, m.AGREEMENT_TOKENS).observe(agreement)

    def zero(self) -> None:
        """Every series at 0 before the first scrape, as a server that starts: increase() then
        counts the first request too."""
        for v in (BASELINE, HEALTHY, ERRORING, SLOW):
            for outcome in m.OUTCOMES:
                self.requests.labels("cube3d", v, "", outcome)
            for h, model in ((self.duration, "cube3d"), (self.tpot, "cube3d_stream"), (self.queue, "cube3d_stream")):
                h.labels(model, v, "")
            for q in m.MESH_QUALITIES:
                self.meshes.labels("cube3d_stream", v, "", q)
        self.shadow_requests.labels("cube3d", SHADOW, BASELINE, m.OK)
        self.shadow_duration.labels("cube3d", SHADOW, BASELINE)
        self.tpot.labels("cube3d_stream", SHADOW, m.SHADOW_ARM)
        self.meshes.labels("cube3d_stream", SHADOW, m.SHADOW_ARM, m.MESH_OK)
        self.agreement.labels("cube3d", SHADOW, BASELINE, m.AGREEMENT_TOKENS)

    def traffic(self, seconds: float) -> int:
        """Requests every 20 ms for `seconds`: each step one to the baseline, the healthy, the
        erroring (1 in 3 fails, 1 in 6 is refused) and the slow candidate (4x the latency and
        time per token), and a shadow copy of the baseline's to version 5 (half identical,
        half at 0.8 agreement). Returns the number of steps."""
        steps, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            self.request(BASELINE, m.OK, 0.8, 0.010)
            self.request(HEALTHY, m.OK, 0.85, 0.011)
            bad = m.FAILED if steps % 3 == 0 else (m.UNAVAILABLE if steps % 6 == 1 else m.OK)
            self.request(ERRORING, bad, 0.8, 0.010)
            self.request(SLOW, m.OK, 3.2, 0.040)
            if steps % 10 == 0:
                self.request(BASELINE, m.INVALID, 0.0, 0.0)  # the caller's mistake: counts for nobody
                self.request(HEALTHY, m.INVALID, 0.0, 0.0)
            self.shadow(SHADOW, BASELINE, 1.0 if steps % 2 else 0.8)
            if steps >= NEWBORN_FROM:  # its first request fails, then every one succeeds
                self.request(NEWBORN, m.FAILED if steps == NEWBORN_FROM else m.OK, 0.8, 0.010)
            steps += 1
            time.sleep(0.02)
        return steps

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    exporter = SyntheticServer()
    exporter.zero()
    server = PrometheusServer(tmp_path_factory.mktemp("prometheus"), [exporter.target]).start()
    try:
        assert server.wait_for(f'{m.REQUESTS}{{version="{HEALTHY}"}}'), "Prometheus never scraped the exporter"
        client = a.PrometheusClient(server.url)
        steps = exporter.traffic(TRAFFIC_S)
        ended = time.time()
        wait_until(lambda: (client.latest_scrape() or 0) >= ended + 1, 120, "a scrape after the last request",
                   poll=0.2)
        yield server, client, steps
    finally:
        server.stop()
        exporter.stop()


WINDOW_S = 60.0  # covers the whole traffic run


def test_healthy_candidate_passes_with_its_figures(prometheus):
    _, client, steps = prometheus
    result = a.analyze(client, HEALTHY, BASELINE, WINDOW_S, a.Thresholds())
    assert result.result == a.PASS, result.report()
    c, b = result.candidate, result.baseline
    # increase() extrapolates at the window's edges: counts are close, not exact.
    assert c.requests == pytest.approx(steps, rel=0.1) and b.requests == pytest.approx(steps, rel=0.1)
    assert c.outcomes[m.INVALID] > 0 and c.error_rate == 0.0  # invalid requests count for nobody
    assert 0.5 < c.p50_seconds <= 1 and 0.5 < c.p95_seconds <= 1  # in the (0.5, 1] bucket
    assert 0.008 < c.time_per_token_p95 <= 0.016 and 0 < c.queue_p95_seconds <= 0.05
    assert c.meshes == pytest.approx(steps, rel=0.1) and c.empty_mesh_rate == 0.0
    assert c.shadow_agreement_mean is None  # no shadow of version 2


def test_erroring_candidate_fails_on_its_error_rate(prometheus):
    _, client, _ = prometheus
    result = a.analyze(client, ERRORING, BASELINE, WINDOW_S, a.Thresholds())
    assert result.result == a.FAIL
    assert result.candidate.error_rate == pytest.approx(0.5, abs=0.05)  # 1/3 failed + 1/6 unavailable
    assert result.candidate.outcomes[m.FAILED] > result.candidate.outcomes[m.UNAVAILABLE] > 0
    assert {c.name for c in result.checks if not c.passed} == {"error_rate", "error_rate_increase"}
    assert any(r.startswith("error rate 0.") and "> 0.05" in r for r in result.reasons)


def test_slow_candidate_fails_on_latency_and_time_per_token(prometheus):
    _, client, _ = prometheus
    result = a.analyze(client, SLOW, BASELINE, WINDOW_S, a.Thresholds())
    assert result.result == a.FAIL and result.candidate.error_rate == 0.0
    failed = {c.name: c for c in result.checks if not c.passed}
    assert set(failed) == {"p95_ratio", "time_per_token_ratio"}
    assert failed["p95_ratio"].value > 2 and failed["time_per_token_ratio"].value > 2


def test_shadow_figures(prometheus):
    _, client, steps = prometheus
    f = client.figures(SHADOW, WINDOW_S, client.latest_scrape())
    assert f.shadow_outcomes[m.OK] == pytest.approx(steps, rel=0.1) and f.requests == f.shadow_outcomes[m.OK]
    assert f.shadow_agreement_mean == pytest.approx(0.9, abs=0.02)
    assert f.shadow_identical_share == pytest.approx(0.5, abs=0.05)
    assert 0.5 < f.p95_seconds <= 1 and f.meshes > 0  # the shadow's own engine series (arm "shadow")
    strict = a.analyze(client, SHADOW, BASELINE, WINDOW_S, a.Thresholds(min_shadow_agreement=0.95))
    assert strict.result == a.FAIL and re.fullmatch(r"shadow agreement 0\.(9|8\d*) < 0\.95", strict.reasons[0])


def test_series_born_in_the_window_count_from_their_first_event(prometheus):
    """A counter that appears with value 1 and never grows is one event, not none (increase()
    alone would say 0: it takes the first sample as the start)."""
    _, client, steps = prometheus
    f = client.figures(NEWBORN, WINDOW_S, client.latest_scrape())
    assert f.outcomes[m.FAILED] == 1.0
    assert f.outcomes[m.OK] == pytest.approx(steps - NEWBORN_FROM - 1, rel=0.1)
    assert f.meshes == pytest.approx(steps - NEWBORN_FROM - 1, rel=0.1)


def test_a_version_without_traffic_is_not_enough_data(prometheus):
    _, client, _ = prometheus
    result = a.analyze(client, ABSENT, BASELINE, WINDOW_S, a.Thresholds())
    assert result.result == a.NOT_ENOUGH_DATA and result.candidate.requests == 0
    assert result.reasons == ["version 9 answered 0 requests in the window, fewer than min_requests 20"]
    # A window that ends before the traffic began holds no data for anyone.
    early = a.analyze(client, HEALTHY, BASELINE, 5.0, a.Thresholds(), at=time.time() - 3600)
    assert early.result == a.NOT_ENOUGH_DATA and len(early.reasons) == 2


def cli(*args) -> tuple[int, str]:
    import contextlib

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = rollout_main(["rollout", "analyze", *args])
    return code, out.getvalue()


def test_cli_exit_codes_and_output(prometheus, capsys):
    server, _, _ = prometheus
    base = ["--prometheus", server.url, "--baseline", BASELINE, "--window", "1m"]
    code, text = cli(*base, "--candidate", HEALTHY)
    assert code == 0 and text.startswith("pass: version 2 against 1 over 60 s") and "p95_seconds" in text
    code, text = cli(*base, "--candidate", SLOW, "--json")
    body = json.loads(text)
    assert code == 1 and body["result"] == "fail" and body["candidate"]["version"] == SLOW
    assert {c["name"] for c in body["checks"] if not c["passed"]} == {"p95_ratio", "time_per_token_ratio"}
    # Turning the failing checks off passes it.
    code, _ = cli(*base, "--candidate", SLOW, "--max-p95-ratio", "off", "--max-time-per-token-ratio", "off")
    assert code == 0
    assert cli(*base, "--candidate", ABSENT)[0] == 3
    assert cli(*base, "--candidate", HEALTHY, "--max-error-rate", "7")[0] == 2
    assert "max_error_rate: must be a number in [0, 1], got 7.0" in capsys.readouterr().err
    assert cli(*base, "--candidate", HEALTHY, "--window", "soon")[0] == 2
    assert cli("--prometheus", f"http://127.0.0.1:{free_port()}", "--candidate", HEALTHY)[0] == 1
    assert "cannot query Prometheus" in capsys.readouterr().err


def test_a_bad_query_reports_prometheus_own_error(prometheus):
    _, client, _ = prometheus
    with pytest.raises(a.PrometheusError, match="parse error"):
        client.query("sum(")
    assert not math.isnan(float(client.query("1 + 1")[0]["value"][1]))


# -- end to end: a real tritonserver with two candidates behind an experiment --------------------

def empty_mesh_checkpoint(source, out):
    """A copy of the checkpoint `source` whose occupancy head says "outside" everywhere: it
    loads, generates tokens at the usual speed and answers every request with an empty mesh."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from cubeserve.checkpoint import TOKENIZER_FILE

    shutil.copytree(source, out)
    tensors = load_file(str(out / TOKENIZER_FILE))
    tensors["occupancy_decoder.c_head.weight"] = torch.zeros_like(tensors["occupancy_decoder.c_head.weight"])
    tensors["occupancy_decoder.c_head.bias"] = torch.full_like(tensors["occupancy_decoder.c_head.bias"], -10.0)
    save_file(tensors, str(out / TOKENIZER_FILE), metadata={"format": "pt"})
    return out


E2E_BASELINE, E2E_HOLLOW, E2E_HEALTHY, E2E_CRASHED = 1, 2, 3, 4
E2E_TRAFFIC_S = 10.0
# About 20 for a 20 % arm: past min_requests 5 with room for the random split (at 60, one run
# in CI gave the arm 4).
E2E_REQUESTS = 100


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Versions 1 (the demo model), 2 (its empty-mesh copy), 3 (the demo model again) and 4 (the
    demo model, whose engine process is killed after the warm-up: every request to it fails) of
    one model store, loaded into a tritonserver through model control with an experiment
    splitting unpinned requests 30/20/30/20; a Prometheus scraping its metrics port; two clients
    sending traffic for E2E_TRAFFIC_S and until E2E_REQUESTS were sent."""
    import os
    import signal

    from cubeserve.serving.stubs import python_stubs
    from cubeserve.pipeline.serving import send_traffic, serve_versions
    from cubeserve.serving.experiment import Arm, Experiment
    from cubeserve.server.local_triton import DEMO_MODEL, LocalTriton
    from cubeserve.serving.repository import build_version_repository

    tmp = tmp_path_factory.mktemp("e2e")
    store = tmp / "store"
    hollow = empty_mesh_checkpoint(DEMO_MODEL, tmp / "hollow")
    versions = [E2E_BASELINE, E2E_HOLLOW, E2E_HEALTHY, E2E_CRASHED]
    for version, weights in zip(versions, (DEMO_MODEL, hollow, DEMO_MODEL, DEMO_MODEL)):
        build_version_repository(weights, version, store / str(version), "cpu")
    (tmp / "repository").mkdir()
    experiment = Experiment("gate", (Arm("control", E2E_BASELINE, 30), Arm("hollow", E2E_HOLLOW, 20),
                                     Arm("healthy", E2E_HEALTHY, 30), Arm("crashed", E2E_CRASHED, 20))).to_json()
    with LocalTriton(tmp / "repository", free_port(), free_port(), free_port(), log_path=tmp / "tritonserver.log",
                     extra_args=("--model-control-mode=explicit",)) as server:
        serve_versions(server.http_url, str(store), versions, experiment, admin_key=server.admin_key)
        with PrometheusServer(tmp / "prometheus", [f"127.0.0.1:{server.metrics_port}"]) as prometheus:
            client = a.PrometheusClient(prometheus.url)
            warm_up(server.http_url, ["control", "hollow", "healthy", "crashed"])
            [crashed] = [pid for pid, (model, v) in python_stubs(server.tritonserver_pid()).items()
                         if model == "cube3d_stream" and v == str(E2E_CRASHED)]
            os.kill(crashed, signal.SIGKILL)
            warmed = time.time()
            wait_until(lambda: (client.latest_scrape() or 0) >= warmed + 1, 120,  # the window starts after it
                       "a scrape after the warm-up", poll=0.2)
            started = time.time()
            counts = send_traffic(server.http_url, ["a small ball", "a tall thin cylinder", "a round coffee table"],
                                  E2E_TRAFFIC_S, clients=2, requests=E2E_REQUESTS)
            ended = time.time()
            wait_until(lambda: (client.latest_scrape() or 0) >= ended + 1, 120, "a scrape after the traffic", poll=0.2)
            yield client, counts, client.latest_scrape() - started


# The default ratios (1.5x) compare p95s of a few dozen requests; on this 2-core machine, shared
# by three engines and other jobs, a healthy copy's p95 varied by up to 2.5x from run to run.
E2E_LIMITS = a.Thresholds(min_requests=5, max_p95_ratio=3.0, max_time_per_token_ratio=3.0)


def warm_up(url: str, arms: list[str]) -> None:
    """Two requests pinned to each arm (with an experiment in force, the experiment routes every
    request, whatever version the URL names): an engine's first requests pay one-time costs
    (allocations, packed weights) that are no figure of the version."""
    from cube3d_client import Cube3DClient

    for arm in arms:
        with Cube3DClient(url, "http", arm=arm) as c:
            for seed in range(2):
                c.generate("a small ball", seed=seed, resolution=4)


def test_e2e_the_healthy_candidate_passes_from_the_servers_own_metrics(served):
    client, counts, window = served
    result = a.analyze(client, E2E_HEALTHY, E2E_BASELINE, window, E2E_LIMITS)
    crashed = client.figures(E2E_CRASHED, window, result.at)
    # the only failures were the crashed version's
    assert counts["sent"] >= E2E_REQUESTS and counts["failed"] == pytest.approx(crashed.requests, abs=2), counts
    assert result.result == a.PASS, result.report()
    c, b = result.candidate, result.baseline
    assert c.error_rate == 0.0 and c.empty_mesh_rate == 0.0 and c.p95_seconds > 0 and c.time_per_token_p95 > 0
    # Every request went to one of the three versions.
    total = sum(f.requests for f in (c, b, client.figures(E2E_HOLLOW, window, result.at), crashed))
    assert total == pytest.approx(counts["sent"], rel=0.25)


def test_e2e_the_empty_mesh_candidate_fails_with_its_figures(served):
    client, _, window = served
    result = a.analyze(client, E2E_HOLLOW, E2E_BASELINE, window, E2E_LIMITS)
    assert result.result == a.FAIL, result.report()
    assert result.candidate.empty_mesh_rate == 1.0 and result.baseline.empty_mesh_rate == 0.0
    assert any(r.startswith("empty-mesh rate 1 > 0.05") for r in result.reasons), result.reasons


def test_e2e_the_crashed_candidate_fails_on_its_error_rate(served):
    client, _, window = served
    result = a.analyze(client, E2E_CRASHED, E2E_BASELINE, window, E2E_LIMITS)
    assert result.result == a.FAIL, result.report()
    assert result.candidate.error_rate == 1.0 and result.baseline.error_rate == 0.0
    assert any(r.startswith("error rate 1") for r in result.reasons), result.reasons
