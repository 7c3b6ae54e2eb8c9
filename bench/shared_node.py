"""Two servers sharing a node's cores, each limited to its share, as two CPU pods on one node.

Each server (supervisor, tritonserver, stubs: the whole tree) runs in a CPU cgroup of its own
with a quota of `--cpus` CPUs (cgroup v2 `cpu.max` or v1 `cpu.cfs_quota_us`: what a pod's CPU
limit becomes), made here when this runs as root with a writable cgroup tree and removed after;
otherwise (or with `--limit taskset`) under `taskset -c <a core of its own>`, an affinity mask,
which PyTorch's OpenMP already honours. Clients split evenly between the servers send the load
test's known greedy requests (REST predict, gRPC predict, the gRPC stream; every answer checked
against in-process tokens, bench/load.py).

    before   OMP_NUM_THREADS = the node's cores: the team PyTorch sized without reading the quota
    after    unset: the engine sizes its team from its cgroup's quota and affinity (engine/threads.py)

Both modes' servers start together (each in its own cgroup); the modes take turns under load for
a few rounds, so a shared machine's drift reaches both alike, while the other mode's servers sit
idle. Writes BENCHMARKS.md's `shared-node-<limit>-<servers>` section.

    python -m bench.shared_node [--clients 16] [--seconds 30] [--rounds 2] [--cpus 1]
                                [--limit auto|cgroup|taskset|none] [--servers 2]
                                [--before N] [--after N]
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from bench.load import Stats, client_loop, known_requests, make_repository

MODES = ("before", "after")
CGROUP_ROOT = Path("/sys/fs/cgroup")


class CpuLimit:
    """A CPU cgroup with a quota of `cpus` (v2, else v1's cpu controller), or an affinity mask
    (`taskset -c core`) where no cgroup can be made. `wrap(command)` runs a command inside it."""

    def __init__(self, name: str, cpus: float, core: int, kind: str = "auto"):
        self.cpus, self.core, self.directory = cpus, core, None
        self.kind = {"none": "none", "taskset": "taskset"}.get(kind, "taskset")
        if kind in ("none", "taskset"):
            return
        period = 100000
        quota = int(cpus * period)
        for version, parent, files in ((2, CGROUP_ROOT, {"cpu.max": f"{quota} {period}"}),
                                       (1, CGROUP_ROOT / "cpu", {"cpu.cfs_period_us": str(period),
                                                                 "cpu.cfs_quota_us": str(quota)})):
            if version == 2:  # the cpu controller must be enabled for the root's children already
                try:
                    if "cpu" not in (parent / "cgroup.subtree_control").read_text().split():
                        continue
                except OSError:
                    continue
            directory = parent / name
            try:
                directory.mkdir(exist_ok=True)
                for file, value in files.items():
                    (directory / file).write_text(value)
            except OSError:
                try:
                    directory.rmdir()
                except OSError:
                    pass
                continue
            self.directory, self.kind = directory, f"cgroup v{version} quota {cpus:g} CPU"
            break
        if kind == "cgroup" and self.directory is None:
            raise RuntimeError("no CPU cgroup could be made here (root and a writable cgroup tree)")

    def wrap(self, command: list[str]) -> list[str]:
        if self.kind == "none":
            return command
        if self.directory is None:
            return ["taskset", "-c", str(self.core), *command]
        # The shell joins the cgroup, then becomes the command: the server's whole tree is inside.
        return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(self.directory), *command]

    def remove(self) -> None:
        if self.directory is not None:
            try:
                self.directory.rmdir()
            except OSError as exc:
                print(f"could not remove {self.directory}: {exc}", file=sys.stderr)


def limited_server(limit: CpuLimit, threads: int | None, repo: Path, log: Path):
    """A LocalTriton whose process tree runs inside `limit`, with OMP_NUM_THREADS=threads (None:
    unset, the engine decides)."""
    from cubeserve.server.local_triton import LocalTriton, free_port

    class Limited(LocalTriton):
        def command(self):
            return limit.wrap(super().command())

        def environment(self):
            env = super().environment()
            env.pop("OMP_NUM_THREADS", None)
            if threads is not None:
                env["OMP_NUM_THREADS"] = str(threads)
            return env

    # on_fault="exit": a python backend stub that dies takes its server down at once (as in a pod),
    # so that the run stops with the reason instead of its clients waiting on a dead engine.
    return Limited(repo, free_port(), free_port(), free_port(), log_path=log, supervised=True, on_fault="exit",
                   fault_grace=1.0)


def measure(servers, clients: int, requests: list[dict], seconds: float) -> tuple[Stats, float]:
    """`clients` threads split evenly over `servers` for `seconds`; (stats, elapsed)."""
    stats = Stats()
    start = time.monotonic()
    threads = [threading.Thread(target=client_loop, args=(i, servers[i % len(servers)], requests, start + seconds,
                                                          stats)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return stats, time.monotonic() - start


def warm(servers, clients: int, requests: list[dict]) -> Stats:
    """One request from every client at once (connections, the engine's first steps)."""
    stats = Stats()
    threads = [threading.Thread(target=client_loop, args=(i, servers[i % len(servers)], requests, float("inf"),
                                                          stats, 1)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return stats


def run(clients: int = 16, seconds: float = 30.0, rounds: int = 2, cpus: float = 1.0, resolution: int = 4,
        limit: str = "auto", servers_per_mode: int = 2, before: int | None = None, after: int | None = None,
        write_markdown: bool = True) -> dict:
    """`limit`: "cgroup" (a quota each; fails where none can be made), "taskset" (one core each),
    "auto" (a cgroup where one can be made, else taskset) or "none". `before` / `after`: the
    modes' OMP_NUM_THREADS (None: unset, the engine decides); `before` defaults to the node's
    cores, the team PyTorch sized before the engine read its quota."""
    import torch

    from bench.common import hardware
    from cubeserve.serving.stubs import kill_leftover_stubs, stub_processes

    cores = os.cpu_count() or 1
    load = os.getloadavg()[0]  # before anything of this run starts: other users' work
    settings = {"before": cores if before is None else before, "after": after}
    results = {mode: [] for mode in MODES}  # per round: (objects/s, p50 s, completed, lost, wrong)
    with tempfile.TemporaryDirectory(prefix="cube3d-shared-node-") as tmp:
        repo = make_repository(Path(tmp), None, None)
        requests = known_requests(repo, resolution)
        limits, servers, stubs = {}, {}, []
        try:
            for mode in MODES:
                for i in range(servers_per_mode):
                    cpu_limit = CpuLimit(f"cubeserve-bench-{os.getpid()}-{mode}-{i}", cpus, core=i % cores,
                                         kind=limit)
                    limits[mode, i] = cpu_limit
                    servers[mode, i] = limited_server(cpu_limit, settings[mode], repo, Path(tmp) / f"{mode}-{i}.log")
            started = [threading.Thread(target=s.start) for s in servers.values()]
            for t in started:
                t.start()
            for t in started:
                t.join()
            for key, server in servers.items():
                if server.process is None or server.process.poll() is not None or not server.ready():
                    raise RuntimeError(f"server {key} did not start" + server._log_tail())
                stubs.append(stub_processes(server.tritonserver_pid()))
            decided = {}
            for (mode, i), server in servers.items():
                found = re.search(r"(\d+ CPU threads \(from [^;]+)", server.log_path.read_text(errors="replace"))
                decided[mode, i] = found.group(1) if found else "?"
            pairs = {mode: [servers[mode, i] for i in range(servers_per_mode)] for mode in MODES}
            for mode in MODES:
                check = warm(pairs[mode], clients, requests)
                if check.total("lost") or check.total("wrong"):
                    raise RuntimeError(f"{mode}: warm-up requests failed: {dict(check.messages)}")
            for r in range(rounds):
                for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                    stats, elapsed = measure(pairs[mode], clients, requests, seconds)
                    latencies = [x for v in stats.latencies.values() for x in v]
                    p50 = float(np.percentile(latencies, 50)) if latencies else float("nan")
                    row = (stats.total("completed") / elapsed, p50, stats.total("completed"),
                           stats.total("lost"), stats.total("wrong"))
                    results[mode].append(row)
                    dead = [key for key, server in servers.items() if server.process.poll() is not None]
                    if dead:
                        raise RuntimeError(f"round {r + 1} ({mode}): server(s) {dead} exited (a stub died?); "
                                           f"{row[3]} requests lost" + servers[dead[0]]._log_tail())
                    print(f"round {r + 1} {mode}: {row[0]:.2f} objects/s, p50 {p50:.2f} s, "
                          f"{row[2]} completed, {row[3]} lost, {row[4]} wrong", flush=True)
        finally:
            for server in servers.values():
                server.stop()
            for s in stubs:
                kill_leftover_stubs(s)
            time.sleep(0.5)
            for cpu_limit in limits.values():
                cpu_limit.remove()
    kind = next(iter(limits.values())).kind
    figures = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "hardware": hardware(torch.device("cpu")), "torch": torch.__version__, "cores": cores,
        "clients": clients, "seconds": seconds, "rounds": rounds, "cpus_each": cpus, "resolution": resolution,
        "limit": kind, "servers": servers_per_mode,
        "load_average_1min": round(load, 1),  # the machine's when the run began
        "settings": {mode: ("unset" if v is None else v) for mode, v in settings.items()},
        "threads": {f"{mode} {i}": text for (mode, i), text in decided.items()},
        "results": {mode: [{"objects_per_s": round(a, 2), "p50_s": round(b, 3), "completed": c, "lost": d,
                            "wrong": e} for a, b, c, d, e in rows] for mode, rows in results.items()},
    }
    if write_markdown:
        from bench.__main__ import update_markdown

        section = f"cgroup-{cpus:g}cpu" if kind.startswith("cgroup") else kind
        update_markdown(f"shared-node-{section}-{servers_per_mode}", markdown_lines(figures))
    return figures


def markdown_lines(f: dict) -> list[str]:
    where = {"none": "with no limit", "taskset": "each under `taskset` on a core of its own"}.get(
        f["limit"], f"each in a {f['limit']} of its own (all of them on every core)")
    lines = [
        f"Measured {f['date']} on {f['hardware']}, torch {f['torch']}: {f['servers']} server(s) per mode with "
        f"the demo model, {where}; {f['clients']} client threads split between them (REST predict, gRPC "
        f"predict, the gRPC stream; every answer checked), resolution {f['resolution']}, max_objects 8; "
        f"{f['rounds']} rounds of {f['seconds']:g} s per mode, the modes taking turns. The machine's 1-minute "
        f"load average when the run began (other users' work): {f['load_average_1min']:g}.",
        "",
        "| mode | OMP_NUM_THREADS | engine threads (as each server logged them) | objects/s per round | "
        "p50 per round | objects/s (median) | p50 (median) | lost / wrong |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        rows = f["results"][mode]
        threads = "; ".join(sorted({v + ")" for k, v in f["threads"].items() if k.startswith(mode)}))
        rates = ", ".join(f"{r['objects_per_s']:.2f}" for r in rows)
        p50s = ", ".join(f"{r['p50_s']:.2f} s" for r in rows)
        lines.append(
            f"| {mode} | {f['settings'][mode]} | {threads} | {rates} | {p50s} | "
            f"{statistics.median(r['objects_per_s'] for r in rows):.2f} | "
            f"{statistics.median(r['p50_s'] for r in rows):.2f} s | "
            f"{sum(r['lost'] for r in rows)} / {sum(r['wrong'] for r in rows)} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=16, help="client threads in all, split between the servers")
    parser.add_argument("--seconds", type=float, default=30.0, help="load per mode and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cpus", type=float, default=1.0, help="each server's CPU quota (cgroup)")
    parser.add_argument("--resolution", type=int, default=4)
    parser.add_argument("--limit", choices=("auto", "cgroup", "taskset", "none"), default="auto",
                        help="each server's limit: a CPU quota (cgroup; auto: where one can be made, else "
                             "taskset), one core (taskset) or none")
    parser.add_argument("--servers", type=int, default=2, help="servers per mode")
    parser.add_argument("--before", type=int, help="OMP_NUM_THREADS of 'before' (default: the node's cores)")
    parser.add_argument("--after", type=int, help="OMP_NUM_THREADS of 'after' (default: unset, the engine decides)")
    parser.add_argument("--no-markdown", action="store_true", help="do not write BENCHMARKS.md")
    args = parser.parse_args(argv)
    # SIGTERM (e.g. from `timeout`) unwinds like an exception: the servers are stopped, the cgroups removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    figures = run(args.clients, args.seconds, args.rounds, args.cpus, args.resolution, args.limit, args.servers,
                  args.before, args.after, not args.no_markdown)
    print("\n".join(markdown_lines(figures)))
    bad = sum(r["lost"] + r["wrong"] for rows in figures["results"].values() for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
