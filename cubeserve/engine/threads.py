"""One OpenMP thread team on the CPU: the decode thread's.

PyTorch's CPU kernels run on OpenMP, and libgomp keeps a pool of worker threads for every
thread that has ever run a parallel region. Once the pools hold more workers than there are
CPUs, every team's idle workers sleep between parallel regions instead of spinning, and each
region pays a wake-up. A decode step is a few dozen parallel products in a few ms, so on the
scheduler's thread it ran far slower than on the thread that built the engine (BENCHMARKS.md)
only because that other thread kept its idle pool. So the scheduler's decode thread keeps the only team: the thread that built the
engine hands its workers back when the scheduler starts, and the geometry thread runs its
kernels on one thread while objects are decoding (on all of them, releasing the pool after,
when nothing is).

Both calls go to the OpenMP runtime PyTorch loaded (its symbols are in the process's global
scope); where there is none, they do nothing.

How many threads that team has is decided once, when an engine loads (`decide_cpu_threads`,
below): the CPUs the container's cgroup quota and the affinity mask allow, not the node's cores.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_OMP_PAUSE_HARD = 2  # OpenMP 5.0 omp_pause_resource_t


def _openmp():
    try:
        lib = ctypes.CDLL(None)
    except (OSError, TypeError):
        return None
    needed = ("omp_pause_resource_all", "omp_set_num_threads")
    return lib if all(hasattr(lib, name) for name in needed) else None


def release_openmp_workers() -> bool:
    """Free the calling thread's OpenMP worker pool (it is rebuilt if this thread runs a
    parallel region again). Returns whether the runtime released it."""
    lib = _openmp()
    if lib is None:
        return False
    released = lib.omp_pause_resource_all(_OMP_PAUSE_HARD) == 0
    if not released:
        log.debug("the OpenMP runtime kept this thread's workers")
    return released


def set_thread_openmp_threads(n: int) -> None:
    """Run the calling thread's CPU kernels on n threads (1: on itself, with no worker pool),
    leaving every other thread's setting, and torch's process-wide default, as they are."""
    lib = _openmp()
    if lib is None:
        return
    torch.get_num_threads()  # torch sets a thread's OpenMP threads on first use: do that first
    lib.omp_set_num_threads(max(1, int(n)))


# -- how many threads: the CPUs this process may use ------------------------------------------------
#
# PyTorch sizes its OpenMP team by the node's cores (or the affinity mask), not by the CPU
# quota of the container: a pod limited to 2 CPUs on a 64-core node runs teams of 64 threads
# that the kernel throttles once they have used the quota, and a team whose threads are not all
# running waits at every barrier. So the engine takes its thread count from the quota
# (BENCHMARKS.md, "Shared CPU nodes": two servers with a 1-CPU quota each on 2 cores).

THREADS_ENV = "OMP_NUM_THREADS"  # OpenMP's own setting (PyTorch reads it at import): it wins


@dataclass(frozen=True)
class CpuQuota:
    """A cgroup's CPU bandwidth limit: `cpus` = quota / period (None: no limit), read from `path`."""

    cpus: float | None
    path: str | None = None
    version: int | None = None  # 1 (cpu.cfs_quota_us) or 2 (cpu.max)

    def describe(self) -> str:
        if self.version is None:
            return "no cgroup CPU controller found"
        kind = "cgroup v2 cpu.max" if self.version == 2 else "cgroup v1 cpu.cfs_quota_us"
        return f"{kind} {'no limit' if self.cpus is None else f'{self.cpus:g} CPUs'} ({self.path})"


@dataclass(frozen=True)
class CpuThreads:
    """The engine's decision: `threads` for PyTorch's intra-op team, and why."""

    threads: int
    source: str  # "argument" | OMP_NUM_THREADS | "quota" | "affinity"
    quota: CpuQuota
    affinity: int  # CPUs in the process's affinity mask
    engines: int = 1  # engine processes sharing the quota (their threads divide it)

    def describe(self) -> str:
        shared = f", shared by {self.engines} engine processes" if self.engines > 1 else ""
        return (f"{self.threads} CPU threads (from {self.source}; {self.quota.describe()}; "
                f"affinity {self.affinity} CPUs{shared})")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _cgroup_dirs(root: Path) -> list[tuple[int, Path, str]]:
    """(version, mount point, this process's cgroup relative to the mount's root) of each
    hierarchy that holds the CPU controller, v2 first, from /proc/self/cgroup and
    /proc/self/mountinfo under `root`. A process outside the mount's root (a container that
    sees only its own cgroup, mounted as the root) counts from the root. Without mountinfo: the
    usual places under sys/fs/cgroup."""
    membership: dict[str, str] = {}  # controller ("" for v2) -> the process's cgroup
    for line in (_read(root / "proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(","):
                membership[controller] = parts[2]
    mounts = []  # (fstype, super options, mount root, mount point)
    mountinfo = _read(root / "proc/self/mountinfo")
    for line in (mountinfo or "").splitlines():
        before, sep, after = line.partition(" - ")
        fields, tail = before.split(), after.split()
        if sep and len(fields) >= 5 and len(tail) >= 3:
            mounts.append((tail[0], tail[2].split(","), fields[3], fields[4]))
    if mountinfo is None:
        base = "/sys/fs/cgroup"
        if (root / base.lstrip("/") / "cgroup.controllers").exists():
            mounts.append(("cgroup2", [], "/", base))
        mounts += [("cgroup", ["cpu"], "/", f"{base}/{name}") for name in ("cpu,cpuacct", "cpu")
                   if (root / base.lstrip("/") / name).is_dir()][:1]
    found = []
    for fstype, options, mount_root, mount_point in mounts:
        if fstype == "cgroup2" and "" in membership:
            version, path = 2, membership[""]
        elif fstype == "cgroup" and "cpu" in options and "cpu" in membership:
            version, path = 1, membership["cpu"]
        else:
            continue
        path = os.path.normpath(path)
        inside = os.path.commonpath([path, mount_root]) == mount_root
        relative = os.path.relpath(path, mount_root) if inside else "."
        found.append((version, root / mount_point.lstrip("/"), "" if relative == "." else relative))
    return sorted(found, key=lambda f: -f[0])


def _quota_at(version: int, directory: Path) -> tuple[float | None, bool]:
    """(CPUs, whether the directory states a limit at all) of one cgroup directory; a file that
    does not parse states nothing."""
    try:
        return _parse_quota(version, directory)
    except (ValueError, ZeroDivisionError):
        log.warning("unreadable CPU quota in %s", directory)
        return None, False


def _parse_quota(version: int, directory: Path) -> tuple[float | None, bool]:
    if version == 2:
        text = _read(directory / "cpu.max")
        if text is None:
            return None, False
        quota, _, period = text.partition(" ")
        if quota == "max":
            return None, True
        return int(quota) / int(period or 100000), True
    quota, period = _read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us")
    if quota is None or period is None:
        return None, False
    return (None if int(quota) < 0 else int(quota) / int(period)), True


def cgroup_cpu_quota(root: str | Path = "/") -> CpuQuota:
    """This process's CPU quota from the cgroup files under `root` ("/": the real ones): cgroup v2
    `cpu.max` ("max 100000" = no limit, "150000 100000" = 1.5 CPUs) or v1 `cpu.cfs_quota_us` /
    `cpu.cfs_period_us` (-1 = no limit). The tightest limit on the way from the process's cgroup
    up to the mount's root wins (a pod's limit sits on the pod's cgroup, a container's on its own)."""
    root = Path(root)
    for version, mount, relative in _cgroup_dirs(root):
        directory = mount / relative
        best, where, seen = None, None, False
        while True:
            cpus, stated = _quota_at(version, directory)
            seen = seen or stated
            if cpus is not None and (best is None or cpus < best):
                best, where = cpus, directory
            if directory == mount or mount not in directory.parents:
                break
            directory = directory.parent
        if seen:
            shown = where if where is not None else mount / relative
            return CpuQuota(best, "/" + str(shown.relative_to(root)), version)
    return CpuQuota(None)


def affinity_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def decide_cpu_threads(explicit: int | None = None, engines: int = 1, root: str | Path = "/",
                       environ: dict | None = None, affinity: int | None = None) -> CpuThreads:
    """The intra-op threads for an engine: `explicit` if given, else $OMP_NUM_THREADS if set,
    else the CPUs the process may use, min(cgroup quota, affinity mask), rounded down (at least 1)
    and divided among the `engines` engine processes that share them (at least 1 each)."""
    environ = os.environ if environ is None else environ
    affinity = affinity_cpus() if affinity is None else affinity
    quota = cgroup_cpu_quota(root)
    if explicit is not None:
        if explicit < 1:
            raise ValueError(f"cpu threads must be at least 1, got {explicit}")
        return CpuThreads(int(explicit), "argument", quota, affinity, engines)
    env = (environ.get(THREADS_ENV) or "").split(",")[0].strip()
    if env:
        try:
            if int(env) >= 1:
                return CpuThreads(int(env), THREADS_ENV, quota, affinity, engines)
        except ValueError:
            pass
        log.warning("ignoring %s=%r: not a positive integer", THREADS_ENV, environ.get(THREADS_ENV))
    cpus, source = float(affinity), "affinity"
    if quota.cpus is not None and quota.cpus < cpus:
        cpus, source = quota.cpus, "quota"
    return CpuThreads(max(1, int(cpus) // max(1, engines)), source, quota, affinity, engines)


def apply_cpu_threads(decision: CpuThreads) -> None:
    """PyTorch's intra-op threads, process-wide: the calling thread now, every other thread at its
    first parallel kernel (it reads torch's setting then; the scheduler's threads start later)."""
    torch.set_num_threads(decision.threads)
