"""CPU threads from the cgroup's quota (engine/threads.py) and their division among a pod's
engine processes (serving/cpu_share.py), on fake /proc and /sys trees."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from cubeserve.engine.threads import cgroup_cpu_quota, decide_cpu_threads
from cubeserve.serving.cpu_share import engine_processes, loaded_versions

V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw,nsdelegate\n"
V1_MOUNTS = ("32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
             "34 31 0:31 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset\n"
             "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n")


def write(root: Path, path: str, text: str) -> None:
    p = root / path.lstrip("/")
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def v2_root(root: Path, cgroup: str, limits: dict[str, str]) -> Path:
    """A cgroup v2 host: the process in `cgroup`; `limits`: cgroup dir -> cpu.max."""
    write(root, "proc/self/cgroup", f"0::{cgroup}\n")
    write(root, "proc/self/mountinfo", "22 1 8:1 / / rw - ext4 /dev/sda1 rw\n" + V2_MOUNT)
    write(root, "sys/fs/cgroup/cgroup.controllers", "cpuset cpu io memory pids\n")
    for directory, cpu_max in limits.items():
        write(root, f"sys/fs/cgroup{directory}/cpu.max", cpu_max + "\n")
    return root


def v1_root(root: Path, cgroup: str, limits: dict[str, tuple[int, int]], mount_root: str = "/") -> Path:
    """A cgroup v1 host; `limits`: cgroup dir (relative to the mount) -> (quota_us, period_us)."""
    write(root, "proc/self/cgroup", f"12:memory:{cgroup}\n4:cpu,cpuacct:{cgroup}\n3:cpuset:{cgroup}\n0::/\n")
    write(root, "proc/self/mountinfo", V1_MOUNTS.replace(" / /sys", f" {mount_root} /sys"))
    for directory, (quota, period) in limits.items():
        write(root, f"sys/fs/cgroup/cpu,cpuacct{directory}/cpu.cfs_quota_us", f"{quota}\n")
        write(root, f"sys/fs/cgroup/cpu,cpuacct{directory}/cpu.cfs_period_us", f"{period}\n")
    return root


def threads(root: Path, affinity: int = 64, environ: dict | None = None, **kw) -> int:
    return decide_cpu_threads(root=root, affinity=affinity, environ=environ or {}, **kw).threads


def test_cgroup_v2_quota_of_the_process_cgroup(tmp_path):
    root = v2_root(tmp_path, "/kubepods/pod1/ctr", {"/kubepods/pod1/ctr": "200000 100000", "": "max 100000"})
    quota = cgroup_cpu_quota(root)
    assert quota.cpus == 2.0 and quota.version == 2 and quota.path == "/sys/fs/cgroup/kubepods/pod1/ctr"
    decision = decide_cpu_threads(root=root, affinity=64, environ={})
    assert decision.threads == 2 and decision.source == "quota"


def test_cgroup_v2_max_is_no_limit_and_the_affinity_decides(tmp_path):
    root = v2_root(tmp_path, "/", {"": "max 100000"})
    assert cgroup_cpu_quota(root).cpus is None
    decision = decide_cpu_threads(root=root, affinity=6, environ={})
    assert decision.threads == 6 and decision.source == "affinity"


def test_cgroup_v2_in_a_cgroup_namespace_reads_the_mount_root(tmp_path):
    """containerd on v2: the container sees its own cgroup as "/" and its limit at the mount."""
    root = v2_root(tmp_path, "/", {"": "400000 100000"})
    assert threads(root) == 4


def test_the_tightest_limit_on_the_way_up_wins(tmp_path):
    """A pod's limit sits on the pod's cgroup; the container's own may say max."""
    root = v2_root(tmp_path, "/kubepods/pod1/ctr",
                   {"/kubepods/pod1/ctr": "max 100000", "/kubepods/pod1": "300000 100000",
                    "/kubepods": "max 100000"})
    quota = cgroup_cpu_quota(root)
    assert quota.cpus == 3.0 and quota.path == "/sys/fs/cgroup/kubepods/pod1"
    assert threads(root) == 3


def test_cgroup_v1_cfs_quota(tmp_path):
    root = v1_root(tmp_path, "/kubepods/burstable/pod1/ctr", {"/kubepods/burstable/pod1/ctr": (300000, 100000)})
    quota = cgroup_cpu_quota(root)
    assert quota.cpus == 3.0 and quota.version == 1
    assert threads(root) == 3


def test_cgroup_v1_minus_one_is_no_limit(tmp_path):
    root = v1_root(tmp_path, "/", {"": (-1, 100000)})
    assert cgroup_cpu_quota(root).cpus is None and cgroup_cpu_quota(root).version == 1
    assert threads(root, affinity=5) == 5


def test_cgroup_v1_container_without_a_namespace_counts_from_the_mount_root(tmp_path):
    """Docker on v1: /proc/self/cgroup names the host's path, the mount's root is that path; the
    container's own cgroup is the mount point itself, not a directory of that name below it."""
    root = v1_root(tmp_path, "/docker/abc123", {"": (200000, 100000), "/docker/abc123": (100000, 100000)},
                   mount_root="/docker/abc123")
    assert cgroup_cpu_quota(root).cpus == 2.0
    assert threads(root) == 2


def test_hybrid_host_v2_without_the_cpu_controller_falls_to_v1(tmp_path):
    root = v1_root(tmp_path, "/job", {"/job": (100000, 100000)})
    write(root, "proc/self/mountinfo", (root / "proc/self/mountinfo").read_text()
          + "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n")
    write(root, "sys/fs/cgroup/unified/cgroup.procs", "")  # v2 mounted, no cpu.max anywhere
    assert cgroup_cpu_quota(root).version == 1 and threads(root) == 1


@pytest.mark.parametrize("cpu_max, expected", [("50000 100000", 1), ("150000 100000", 1), ("250000 100000", 2),
                                               ("399999 100000", 3), ("100000 50000", 2)])
def test_fractional_quotas_round_down_to_at_least_one(tmp_path, cpu_max, expected):
    assert threads(v2_root(tmp_path, "/", {"": cpu_max})) == expected


def test_an_affinity_mask_smaller_than_the_quota_wins(tmp_path):
    root = v2_root(tmp_path, "/", {"": "800000 100000"})
    decision = decide_cpu_threads(root=root, affinity=3, environ={})
    assert decision.threads == 3 and decision.source == "affinity"


def test_an_unreadable_quota_file_is_no_limit(tmp_path):
    assert threads(v2_root(tmp_path, "/", {"": "lots 100000"}), affinity=3) == 3


def test_no_cgroup_files_leave_the_affinity(tmp_path):
    assert cgroup_cpu_quota(tmp_path).cpus is None
    assert threads(tmp_path, affinity=7) == 7


def test_without_mountinfo_the_usual_places_are_read(tmp_path):
    root = v2_root(tmp_path, "/", {"": "200000 100000"})
    (root / "proc/self/mountinfo").unlink()
    assert threads(root) == 2


def test_an_explicit_setting_overrides_the_quota(tmp_path):
    root = v2_root(tmp_path, "/", {"": "100000 100000"})
    env = decide_cpu_threads(root=root, affinity=64, environ={"OMP_NUM_THREADS": "6"})
    assert env.threads == 6 and env.source == "OMP_NUM_THREADS"
    arg = decide_cpu_threads(5, root=root, affinity=64, environ={"OMP_NUM_THREADS": "6"})
    assert arg.threads == 5 and arg.source == "argument"
    assert threads(root, environ={"OMP_NUM_THREADS": "two"}) == 1  # not a number: ignored
    assert threads(root, environ={"OMP_NUM_THREADS": "4,2"}) == 4  # OpenMP's nested list: the outer level


def test_engines_in_one_pod_divide_the_cpus(tmp_path):
    root = v2_root(tmp_path, "/", {"": "400000 100000"})
    assert threads(root, engines=2) == 2
    assert threads(root, engines=3) == 1
    assert threads(root, engines=8) == 1  # at least one each
    # An explicit setting is per process and is not divided.
    assert threads(root, engines=2, environ={"OMP_NUM_THREADS": "4"}) == 4


def model_dir(tmp_path: Path, versions: list[int]) -> Path:
    for v in versions:
        (tmp_path / "cube3d_stream" / str(v)).mkdir(parents=True)
    return tmp_path / "cube3d_stream"


def test_engine_processes_of_the_shipped_config(tmp_path):
    """What Triton hands the python backend as model_config for triton_models/cube3d_stream."""
    config = {"version_policy": {"latest": {"num_versions": 1}},
              "instance_group": [{"name": "cube3d_stream_0", "kind": "KIND_CPU", "count": 1, "gpus": []}]}
    assert engine_processes(config, model_dir(tmp_path, [1, 2, 3])) == 1


def test_engine_processes_of_a_version_set_and_of_gpu_groups(tmp_path):
    models = model_dir(tmp_path, [3, 4, 5])
    experiment = {"version_policy": {"specific": {"versions": ["3", "5"]}},
                  "instance_group": [{"kind": "KIND_CPU", "count": 1}]}
    assert loaded_versions(experiment, models) == 2 and engine_processes(experiment, models) == 2
    two_gpus = {"version_policy": {"latest": {"num_versions": 2}},
                "instance_group": [{"kind": "KIND_GPU", "count": 1, "gpus": [0, 1]}]}
    assert engine_processes(two_gpus, models) == 4
    assert engine_processes({"version_policy": {"all": {}}, "instance_group": [{"count": 2}]}, models) == 6
    assert engine_processes({}, models) == 1


def test_the_engine_applies_its_decision_to_every_thread(tiny_weights, monkeypatch):
    """Decided once at load, from $OMP_NUM_THREADS here, process-wide: the scheduler's threads
    (started later) take it at their first kernel."""
    from cubeserve.engine import Engine

    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    try:
        engine = Engine.from_dir(tiny_weights)
        assert engine.cpu_threads.threads == 1 and engine.cpu_threads.source == "OMP_NUM_THREADS"
        seen = []
        thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        assert torch.get_num_threads() == 1 and seen == [1]
        assert "1 CPU threads (from OMP_NUM_THREADS" in engine.cpu_threads.describe()
    finally:
        torch.set_num_threads(before)
