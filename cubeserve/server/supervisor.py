"""Run tritonserver as a child and act when one of its python backend stubs dies.

Triton 2.51 does not restart a python_backend stub that died (an out-of-memory kill, a crash in a
kernel): the model stays "ready", `/v2/health/ready` and `/v2/health/live` answer 200, and every
request to it fails or hangs for as long as the server runs (python_backend r24.10,
`TRITONBACKEND_ModelInstanceExecute`: "TODO: Implement restart on decoupled"; no stub check in
readiness). So the server runs under this supervisor, which watches the stubs (serving/stubs.py)
and, when a model version that Triton still reports READY has no live stub:

1. sends tritonserver SIGTERM: from then on its readiness endpoint no longer answers 200 (Triton
   closes new connections while it shuts down), so KServe stops routing to the pod, and requests
   already on healthy models may finish (`--fault-grace` seconds, then SIGKILL; requests on the
   dead stub never finish by themselves: the predict model has already answered them with
   UNAVAILABLE);
2. `--on-fault restart` (local default): starts tritonserver again, which loads the model anew;
   `--on-fault exit` (the container's): exits with FAULT_EXIT_CODE, and the kubelet restarts the
   container, whose startup probe covers the new load.

A stub can also take tritonserver down with it: killed while it holds one of the interprocess
mutexes in the shared memory it shares with Triton (python_backend r24.10 src/message_queue.h,
`bi::scoped_lock<bi::interprocess_mutex>` in Push/Pop: a stub busy sending responses holds them
often), the server's next lock throws `boost::interprocess::lock_exception`, uncaught, and
tritonserver aborts. Requests in flight then lose their connection instead of getting an answer.
A tritonserver that ends this way, or any other way it was not told to (a signal, a non-zero
exit), after it had started, is a fault too: restarted (`restart`, after a pause that doubles while
crashes follow each other) or reported by exiting (`exit`). One that fails before its endpoint
ever answered (a bad model repository, a taken port) is not restarted: a new start fails the same way.

The supervisor also holds the server's public ports: its front ends (server/front.py for REST,
server/grpc_front.py for gRPC) check every request and forward it to tritonserver's own
endpoints, which must listen on the loopback only (`--http-address=127.0.0.1`,
`--grpc-address=127.0.0.1`); and it locks Triton's admin APIs (cubeserve.deploy.RESTRICTED_APIS,
HTTP and gRPC): clients give the key in $CUBE3D_ADMIN_KEY (or a random key nobody holds when that
is unset, or the key `--admin-key-file` names, written there for the server's life), which the
front ends check; tritonserver itself is locked with a key of its own, made at each start, so
that the admin key is on no process's command line (tritonserver's key is: a local user who can
list processes and reach its loopback ports can use it; docs/security.md). Both front ends count
the server's generations in progress in one load report (server/load_report.py), which every
answer carries, scaled by the target of the engine's config in the model repository.

The front ends hold bounded resources (front.Limits, grpc_front.GrpcLimits): the supervisor
raises its open-file limit (to its hard limit, at most OPEN_FILES) and sizes the connection caps
to fit in it, and its watch loop outlives any error of its own (a full file table included). `--on-fault none` (local servers whose tests kill stubs on purpose) does
neither 1. nor 2. above: a tritonserver that ends ends the supervisor.

SIGTERM or SIGINT to the supervisor is passed to tritonserver, and the supervisor waits for it as
long as it takes (Triton's own shutdown: it waits for open connections and requests in flight up
to its --exit-timeout-secs, cubeserve.deploy.EXIT_TIMEOUT_S); the supervisor exits with
tritonserver's code. One exception: a server that was drained (serving/drain.py, the pod's preStop
hook) and has no request in progress, yet is still running `--drained-grace` seconds after the
signal, is killed. Triton 2.51's HTTP endpoint waits for every open connection to close before it
stops, idle keep-alive connections too (an ingress controller's or a router's pool keeps them for
minutes), and would hold the pod, and its GPU, for the whole exit timeout with nothing to do:
every request on those connections is refused by the drain, so killing it loses nothing.

    python -m cubeserve.server.supervisor [--on-fault exit|restart|none] --rest-port PORT \
        [--rest-address ADDRESS] --grpc-port PORT3 [--grpc-address ADDRESS] -- tritonserver \
        --http-address=127.0.0.1 --http-port=PORT2 --grpc-address=127.0.0.1 --grpc-port=PORT4 ARGS...
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from cubeserve import deploy, tracing
from cubeserve.lifetime import ends_with_this_process
from cubeserve.serving.drain import clear_markers, in_progress, is_draining
from cubeserve.server.front import LISTEN_BACKLOG, FrontEnd, Limits
from cubeserve.server.grpc_front import GrpcFrontEnd, GrpcLimits
from cubeserve.server.load_report import LoadReport
from cubeserve.serving.stubs import (kill_leftover_stubs, orphan_regions, remove_regions, shm_regions,
                                     stub_processes)

log = logging.getLogger("cubeserve.supervisor")

FAULT_EXIT_CODE = 3  # a stub died (tritonserver's own codes are 0 and 1)
# Seconds a drained, idle tritonserver gets to exit by itself after SIGTERM (it needs one or two
# when no client holds a connection open).
DRAINED_GRACE_S = 10.0
# A crashed tritonserver starts again after CRASH_BACKOFF_S, doubled for each crash that follows
# the last start by less than CRASH_WINDOW_S, up to CRASH_BACKOFF_MAX_S (the kubelet's
# CrashLoopBackOff, in small).
CRASH_BACKOFF_S, CRASH_BACKOFF_MAX_S, CRASH_WINDOW_S = 1.0, 30.0, 60.0
# The open-file limit the supervisor raises itself to (within its hard limit), and what of it
# stays for its own use (its loops, /proc, the checks of tritonserver, log files).
OPEN_FILES, OWN_FILES = 65536, 256


def _port(command: list[str], flag: str, default: int) -> int:
    for arg in command:
        if arg.startswith(f"{flag}="):
            return int(arg.split("=", 1)[1])
    return default


def http_port(command: list[str], default: int = 8000) -> int:
    return _port(command, "--http-port", default)


def _flag(command: list[str], flag: str) -> str | None:
    for arg in command:
        if arg.startswith(f"{flag}="):
            return arg.split("=", 1)[1]
    return None


def locked_command(command: list[str], rest_port: int, grpc_port: int | None, key: str) -> list[str]:
    """tritonserver's command with the admin APIs locked by `key`; refuses one whose REST or gRPC
    endpoint would be reachable from outside (the front ends must be the only way in)."""
    if _flag(command, "--http-address") != "127.0.0.1":
        raise ValueError("tritonserver's REST endpoint must listen on the loopback only: give "
                         "--http-address=127.0.0.1 (clients reach the front end on --rest-port)")
    if http_port(command) == rest_port:
        raise ValueError(f"tritonserver's --http-port must differ from --rest-port ({rest_port})")
    grpc_on = _flag(command, "--allow-grpc") not in ("false", "0")
    if grpc_port is None and grpc_on:
        raise ValueError("give --grpc-port (the gRPC front end), or run tritonserver with --allow-grpc=false")
    if grpc_port is not None and grpc_on:
        if _flag(command, "--grpc-address") != "127.0.0.1":
            raise ValueError("tritonserver's gRPC endpoint must listen on the loopback only: give "
                             "--grpc-address=127.0.0.1 (clients reach the front end on --grpc-port)")
        if _port(command, "--grpc-port", 8001) == grpc_port:
            raise ValueError(f"tritonserver's --grpc-port must differ from --grpc-port ({grpc_port})")
    if any(arg.startswith(("--http-restricted-api", "--grpc-restricted-protocol")) for arg in command):
        raise ValueError("the supervisor sets the restricted APIs itself (cubeserve.deploy.RESTRICTED_APIS)")
    return [*command, *deploy.restricted_api_flags(key)]


def raise_open_files(wanted: int = OPEN_FILES) -> int:
    """The soft open-file limit raised towards `wanted` (never above the hard limit); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
    return soft


def front_limits(open_files: int, connections: int | None = None, header_s: float | None = None,
                 idle_s: float | None = None, body_s: float | None = None) -> tuple[Limits, GrpcLimits]:
    """Connection caps that fit in `open_files`: a REST connection holds two files while its
    request is forwarded, a gRPC one one (its calls share one connection to tritonserver), and an
    accept burst may run past a cap by the listen backlog. `connections` (a cap on each) and the
    timeouts override the defaults: `header_s` the REST head's and the gRPC handshake's, `idle_s`
    gRPC's idle connection's (REST's is `header_s`: front.Limits), `body_s` the REST body's."""
    budget = max(open_files - OWN_FILES - 2 * LISTEN_BACKLOG, 64)
    rest, grpc = Limits(), GrpcLimits()
    rest_cap = min(connections or rest.connections, budget // 4)
    grpc_cap = min(connections or grpc.connections, budget // 4)
    return (Limits(connections=rest_cap, **_given(header_s=header_s, body_s=body_s)),
            GrpcLimits(connections=grpc_cap, calls=max(grpc_cap, 16), **_given(handshake_s=header_s, idle_s=idle_s)))


def _given(**values) -> dict:
    return {key: value for key, value in values.items() if value is not None}


def _code_at(pid: int) -> str:
    """Where a stub's code is mapped. A stub's crash is in no log but the kernel's, which names the
    faulting thread's id (not always the stub's pid) and the code's mapping: "triton_python_b[TID]:
    segfault at ... in libc.so.6[8c370,7fed9ca44000+156000]"; these name the stub it was. Its
    executable, libc and libpython: a heap or allocator corruption faults in one of them (issue 56's
    in libpython, on a thread of the stub's Python)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            maps = f.read().splitlines()
    except OSError:
        return ""
    found = {}
    for line in maps:
        fields = line.split()
        name = os.path.basename(fields[5]) if len(fields) > 5 else ""
        if fields[1].startswith("r-x") and (name == "triton_python_backend_stub"
                                            or name.startswith(("libc.so", "libc-", "libpython"))):
            found.setdefault(name, fields[0].split("-")[0])
    return "".join(f"; {name} code at {start}" for name, start in sorted(found.items()))


def write_private(path: str, text: str) -> None:
    """`text` in a new file at `path` that only this user can read."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def admin_key_from_env(env: dict) -> str:
    key = env.get(deploy.ADMIN_KEY_ENV)
    if key is None:
        log.warning("%s is not set: the admin APIs (%s) are locked with a random key nobody holds",
                    deploy.ADMIN_KEY_ENV, ", ".join(deploy.RESTRICTED_APIS))
        return deploy.new_admin_key()
    return deploy.check_admin_key(key)


class Supervisor:
    def __init__(self, command: list[str], on_fault: str = "restart", poll_s: float = 0.5,
                 fault_grace_s: float = 10.0, env: dict | None = None, drained_grace_s: float = DRAINED_GRACE_S,
                 rest_port: int = deploy.HTTP_PORT, rest_address: str = "127.0.0.1",
                 grpc_port: int | None = None, grpc_address: str = "127.0.0.1",
                 admin_key_file: str | None = None, limits: tuple[Limits, GrpcLimits] | None = None):
        if on_fault not in ("restart", "exit", "none"):
            raise ValueError(f"on_fault must be 'restart', 'exit' or 'none', got {on_fault!r}")
        env = dict(os.environ if env is None else env)
        key = admin_key_from_env(env)
        env.pop(deploy.ADMIN_KEY_ENV, None)  # the models need not see it
        # tritonserver's own key: on its command line (Triton reads it nowhere else), so not the admin key.
        server_key = deploy.new_admin_key()
        self.command, self.on_fault, self.env = locked_command(list(command), rest_port, grpc_port, server_key), on_fault, env
        if not any(arg.startswith("--trace-config") for arg in command):
            # Where OTEL_EXPORTER_OTLP_ENDPOINT names a collector, tritonserver traces too (its
            # OpenTelemetry mode), in a pod as on a laptop: cubeserve/tracing.py.
            self.command += tracing.tritonserver_flags(env.get(tracing.ENDPOINT_ENV))
        self.admin_headers = {deploy.ADMIN_HEADER: server_key}  # the supervisor's own calls to tritonserver
        self.admin_key, self.admin_key_file = key, admin_key_file
        rest_limits, grpc_limits = limits or front_limits(raise_open_files())
        # One load report for both front ends: the server's requests in progress, whichever port
        # they came by; its scaling target and max_objects from the engine's config.
        self.load = LoadReport.for_repository(_flag(command, "--model-repository") or _flag(command, "--model-store"))
        self.fronts = [FrontEnd(rest_address, rest_port, http_port(command), key, server_key, limits=rest_limits,
                                load=self.load)]
        if grpc_port is not None and _flag(command, "--allow-grpc") not in ("false", "0"):
            self.fronts.append(GrpcFrontEnd(grpc_address, grpc_port, _port(command, "--grpc-port", 8001), key,
                                            server_key, limits=grpc_limits, load=self.load))
        self.poll_s, self.fault_grace_s, self.drained_grace_s = poll_s, fault_grace_s, drained_grace_s
        self.index_url = f"http://127.0.0.1:{http_port(command)}/v2/repository/index"
        self.metrics_url = f"http://127.0.0.1:{_port(command, '--metrics-port', 8002)}/metrics"
        self.child: subprocess.Popen | None = None
        self.stubs: dict = {}  # every stub seen (pid: model.py), to reap those that outlive the server
        self.regions: set[str] = set()  # their shared memory, to remove what a killed server leaves
        self.restarts = 0
        self._stop = threading.Event()

    def ready_versions(self) -> set[tuple[str, str]] | None:
        """(model, version) pairs Triton reports READY; None when it does not answer."""
        request = urllib.request.Request(self.index_url, data=b"{}", method="POST", headers=self.admin_headers)
        try:
            with urllib.request.urlopen(request, timeout=5) as reply:
                index = json.loads(reply.read())
        except (urllib.error.URLError, OSError, ValueError):
            return None
        return {(m["name"], str(m["version"])) for m in index if m.get("state") == "READY" and "version" in m}

    def dead_models(self, seen: set[tuple[str, str]]) -> tuple[set, set]:
        """(pairs seen with a stub so far, pairs READY in Triton whose stub is gone)."""
        stubs = stub_processes(self.child.pid)
        if set(stubs) - set(self.stubs):
            self.regions |= shm_regions(set(stubs) - set(self.stubs))
            for pid in sorted(set(stubs) - set(self.stubs)):
                log.info("python backend stub %d: %s version %s (tritonserver pid %d%s)", pid,
                         stubs[pid].parent.parent.name, stubs[pid].parent.name, self.child.pid, _code_at(pid))
        self.stubs.update(stubs)
        alive = {(path.parent.parent.name, path.parent.name) for path in stubs.values()}
        vanished = seen - alive
        seen = seen | alive
        if not vanished:
            return seen, set()
        ready = self.ready_versions()
        if ready is None:
            return seen, set()
        # A version unloaded on purpose is no longer READY: forget it. One still READY without a
        # stub has lost it (a reload starts the new stub before the old one goes, so never that).
        dead = vanished & ready
        return (seen - (vanished - ready)), dead

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._forward_signal)
        started = []
        try:
            try:
                for front in self.fronts:
                    front.start()
                    started.append(front)
            except RuntimeError as exc:
                log.error("%s", exc)
                return 1
            if self.admin_key_file:  # written anew: one a killed supervisor left holds an old key
                write_private(self.admin_key_file, self.admin_key + "\n")
            swept = remove_regions(orphan_regions())
            if swept:
                log.warning("removed %d python backend shared-memory regions that a killed server left in "
                            "/dev/shm: %s", len(swept), ", ".join(sorted(swept)))
            return self._run()
        finally:
            if self.admin_key_file:
                try:
                    os.unlink(self.admin_key_file)
                except FileNotFoundError:
                    pass
            for front in started:
                front.stop()

    def _run(self) -> int:
        backoff = 0.0
        while True:
            started = time.monotonic()
            self.child = subprocess.Popen(self.command, env=self.env, preexec_fn=ends_with_this_process())
            code, fault = self._watch()
            log.info("tritonserver (pid %d) ended with %s", self.child.pid,
                     f"signal {-code}" if code < 0 else f"exit code {code}")
            clear_markers(self.child.pid)
            if kill_leftover_stubs(self.stubs):
                log.warning("killed python backend stubs that outlived tritonserver")
            if remove_regions(self.regions):
                log.warning("removed the shared memory that tritonserver left behind")
            self.stubs.clear()
            self.regions.clear()
            if fault is None or self.on_fault == "none":
                return code  # tritonserver exited by itself, or was told to
            if self.on_fault == "exit":
                return FAULT_EXIT_CODE
            quick = time.monotonic() - started < CRASH_WINDOW_S
            backoff = min(2 * backoff, CRASH_BACKOFF_MAX_S) if quick and backoff else CRASH_BACKOFF_S
            self.restarts += 1
            log.warning("starting tritonserver again in %.0f s (restart %d): %s", backoff, self.restarts, fault)
            if self._stop.wait(backoff):
                return code

    def _watch(self) -> tuple[int, str | None]:
        """Until tritonserver exits: (its exit code, what went wrong when that is a fault, else None)."""
        seen: set[tuple[str, str]] = set()
        up = False  # its HTTP endpoint has answered: it started, whatever happens next
        last_error = 0.0  # when a failed look was last logged
        while True:
            code = self.child.poll()
            if code is not None:
                if code == 0 or not up or self._stop.is_set():
                    return code, None
                log.error("tritonserver ended by itself with %s after it had started",
                          f"signal {-code}" if code < 0 else f"exit code {code}")
                return code, "tritonserver crashed"
            if self._stop.is_set():
                log.info("stopping tritonserver (pid %d)", self.child.pid)
                return self._wait_for_shutdown(), None
            try:
                seen, dead = self.dead_models(seen)  # also records the stubs, to reap any that outlive it
                if not up and self.ready_versions() is not None:
                    up = True
                    log.info("tritonserver (pid %d) is up", self.child.pid)
            except Exception as exc:  # noqa: BLE001 - e.g. EMFILE listing /proc: look again next time
                dead = set()
                now = time.monotonic()
                if now - last_error > 10:
                    log.error("watching tritonserver failed, trying again: %r", exc)
                    last_error = now
            if dead and self.on_fault != "none":
                names = ", ".join(f"{m} version {v}" for m, v in sorted(dead))
                log.error("the python backend stub of %s died while Triton reports it READY (tritonserver pid "
                          "%d); stopping tritonserver (readiness now fails)", names, self.child.pid)
                self._terminate()
                return FAULT_EXIT_CODE, f"the stub of {names} died"
            time.sleep(self.poll_s)

    def _wait_for_shutdown(self) -> int:
        """tritonserver has been sent SIGTERM: wait for it to exit, as long as its own shutdown
        takes, unless it was drained and has been idle for `drained_grace_s` (module docstring)."""
        idle_since = None
        while True:
            try:
                return self.child.wait(self.poll_s)
            except subprocess.TimeoutExpired:
                pass
            # None (the metrics endpoint gone): Triton is in its last steps; let it finish.
            if not is_draining(self.child.pid) or in_progress(self.metrics_url) != 0:
                idle_since = None
                continue
            now = time.monotonic()
            idle_since = now if idle_since is None else idle_since
            if now - idle_since >= self.drained_grace_s:
                log.warning("tritonserver was drained and has no request in progress, but still waits "
                            "for clients' idle connections to close: stopping it now")
                self.child.kill()
                self.child.wait()
                return 0

    def _terminate(self) -> None:
        log.info("stopping tritonserver (pid %d)", self.child.pid)
        self.child.send_signal(signal.SIGTERM)
        try:
            self.child.wait(self.fault_grace_s)
        except subprocess.TimeoutExpired:
            log.error("tritonserver still running %.0f s after SIGTERM: killing it", self.fault_grace_s)
            self.child.kill()
            self.child.wait()

    def _forward_signal(self, signum, frame) -> None:
        self._stop.set()
        for front in self.fronts:
            front.stopping = True
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--on-fault", choices=["restart", "exit", "none"], default="restart")
    parser.add_argument("--rest-port", type=int, required=True,
                        help="the public REST port: the front end, forwarding to tritonserver's --http-port")
    parser.add_argument("--rest-address", default="127.0.0.1", help="the front end's address (0.0.0.0 in a pod)")
    parser.add_argument("--grpc-port", type=int,
                        help="the public gRPC port: the gRPC front end, forwarding to tritonserver's --grpc-port")
    parser.add_argument("--grpc-address", default="127.0.0.1", help="the gRPC front end's address (0.0.0.0 in a pod)")
    parser.add_argument("--admin-key-file", help="write the admin key to this file (mode 0600) while the server runs")
    parser.add_argument("--max-connections", type=int,
                        help="client connections each front end holds at once (default: what the open-file limit "
                             f"allows, at most {Limits.connections})")
    parser.add_argument("--header-timeout", type=float,
                        help="seconds a client connection has to send a whole request head (REST) or its "
                             "connection preface (gRPC) from its opening or its previous answer; an idle REST "
                             f"connection is closed after as long (default {Limits.header_s:g})")
    parser.add_argument("--idle-timeout", type=float, help=f"seconds an idle gRPC client connection is kept "
                                                           f"(default {GrpcLimits.idle_s:g})")
    parser.add_argument("--body-timeout", type=float, help=f"seconds a client has to send a request body "
                                                           f"(default {Limits.body_s:g})")
    parser.add_argument("--poll", type=float, default=0.5, help="seconds between looks at the stubs")
    parser.add_argument("--fault-grace", type=float, default=10.0,
                        help="seconds tritonserver gets to finish other requests after a stub died")
    parser.add_argument("--drained-grace", type=float, default=DRAINED_GRACE_S,
                        help="seconds a drained, idle tritonserver gets to exit after SIGTERM before it is killed")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- tritonserver ARGS...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the server's command after --")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s cubeserve supervisor: %(message)s")
    limits = front_limits(raise_open_files(), args.max_connections, args.header_timeout, args.idle_timeout,
                          args.body_timeout)
    try:
        supervisor = Supervisor(command, args.on_fault, args.poll, args.fault_grace, drained_grace_s=args.drained_grace,
                                rest_port=args.rest_port, rest_address=args.rest_address, grpc_port=args.grpc_port,
                                grpc_address=args.grpc_address, admin_key_file=args.admin_key_file, limits=limits)
    except ValueError as exc:
        parser.error(str(exc))
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
