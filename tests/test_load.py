"""A short `make load` (bench/load.py): the real server under concurrent clients over every
transport, each answer checked against the in-process tokens, and refusals under overload
retried without losing a request."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from bench import load
from serving_helpers import wait_until


def check(figures: dict) -> None:
    assert figures["server_exit_code"] is None, "\n".join(figures["server_log_tail"])
    assert figures["lost"] == 0 and figures["wrong"] == 0, figures["messages"]
    assert figures["completed"] > 0
    for transport, counts in figures["transports"].items():
        assert counts["completed"] > 0, f"{transport} was not used"
    # the tree was walked: tritonserver and the stubs of both models
    assert figures["server_processes"] >= 3 and figures["rss_mb"]["start"] > 0
    # which process grew can be told: tritonserver and each model's stub by name
    assert {"tritonserver", "stub cube3d", "stub cube3d_stream"} <= set(figures["rss_mb"]["by_process"])


def test_short_load_over_every_transport_loses_nothing(tmp_path, monkeypatch):
    import bench.__main__

    markdown = tmp_path / "BENCHMARKS.md"
    monkeypatch.setattr(bench.__main__, "BENCHMARKS_MD", markdown)
    figures = load.run_load(clients=8, duration=5)
    check(figures)
    assert "<!-- bench:load:begin -->" in markdown.read_text() and "| completed |" in markdown.read_text()


def test_overload_is_refused_and_retried_not_lost():
    # 2 requests may be outstanding (1 in flight + 1 waiting); 4 clients keep more than that coming.
    figures = load.run_load(clients=4, duration=4, max_objects=1, max_queue=1, write_markdown=False, warm_up=False)
    check(figures)
    assert (figures["max_objects"], figures["max_queue"]) == (1, 1)
    assert figures["refused"] > 0 and "the server is busy" in figures["refusals_by_kind"]


def test_process_tree_walks_every_level():
    # a child shell with a grandchild: both are found under this process, and their RSS summed
    child = subprocess.Popen(["sh", "-c", "sleep 30 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(child.stdout.readline())
        from cubeserve.serving.stubs import process_tree

        # sh prints $! as soon as it forks: wait for the grandchild to be sleep, past its exec
        wait_until(lambda: Path(f"/proc/{grandchild}/cmdline").read_bytes().startswith(b"sleep\0"), 10, "sleep started")

        tree = process_tree(os.getpid())
        assert tree[0] == os.getpid() and child.pid in tree and grandchild in tree
        by_process = load.tree_rss_mb(os.getpid())
        assert len(by_process) >= 3 and {"sh", "sleep"} <= set(by_process)  # each process by its role
        assert sum(by_process.values()) > sum(load.tree_rss_mb(grandchild).values()) > 0
    finally:
        os.kill(grandchild, signal.SIGTERM)
        child.wait(10)


def test_model_repository_copy_sets_the_engine_parameters(tmp_path):
    from cubeserve.server.local_triton import copy_model_repository

    repo = copy_model_repository(tmp_path / "models", {"max_objects": 3, "max_queue": 5})
    config = (repo / "cube3d_stream" / "config.pbtxt").read_text()
    assert '{ key: "max_objects" value: { string_value: "3" } }' in config
    assert '{ key: "max_queue" value: { string_value: "5" } }' in config
    assert not (repo / "cube3d_stream" / "1" / "weights").exists()
    with pytest.raises(ValueError, match="no_such_key"):
        copy_model_repository(tmp_path / "other", {"no_such_key": 1})
