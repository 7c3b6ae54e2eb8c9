"""bench.quantization's one-at-a-time mode (how the v0.1 rows fit in 24 GB) and the results file
keeping each config's records when another config of the same section is measured."""

from __future__ import annotations

import json

import pytest

from bench import common, quantization


@pytest.fixture
def results(tmp_path, monkeypatch):
    path = tmp_path / "results.json"
    monkeypatch.setattr(common, "RESULTS_JSON", path)
    return path


def test_a_config_measured_again_replaces_its_records_and_keeps_the_others(results):
    def record(config, mode, ms):
        return common.Record("quantization", "some CPU", config, mode, 1, ms_per_token=ms)

    common.write_results([record("mid", "float32", 1.0), record("mid", "float32+int8", 2.0)], {})
    common.write_results([record("v0.1", "float32", 3.0)], {})
    common.write_results([record("mid", "float32", 4.0)], {})
    rows = {(r["config"], r["mode"]): r["ms_per_token"] for r in json.loads(results.read_text())["records"]}
    assert rows == {("v0.1", "float32"): 3.0, ("mid", "float32"): 4.0}


def test_one_at_a_time_times_every_mode_and_flight(results, capsys):
    quantization.main(["--config", "tiny", "--modes", "float32,float32+int8", "--flights", "1,2",
                       "--steps", "2", "--rounds", "2", "--one-at-a-time", "--threads", "1"])
    records = json.loads(results.read_text())["records"]
    assert {(r["mode"], r["objects_in_flight"]) for r in records} == {
        ("float32", 1), ("float32", 2), ("float32+int8", 1), ("float32+int8", 2)}
    assert all(r["ms_per_token"] > 0 and r["extra"]["one_at_a_time"] for r in records)
    # At one object, the whole object's average: its first token (prompt, prefill) counted once.
    for r in records:
        if r["objects_in_flight"] == 1:
            assert r["extra"]["first_token_ms"] > 0
            expected = (r["extra"]["first_token_ms"] + 31 * r["ms_per_token"]) / 32  # tiny: 32 tokens
            assert r["extra"]["whole_object_ms_per_token"] == pytest.approx(expected)
    int8 = next(r for r in records if r["mode"] == "float32+int8")
    f32 = next(r for r in records if r["mode"] == "float32")
    # Each engine's memory is read before it is freed: int8's weights are the smaller.
    assert 0 < int8["extra"]["gpt_weight_mb"] < f32["extra"]["gpt_weight_mb"]
    assert "| float32+int8 |" in capsys.readouterr().out
