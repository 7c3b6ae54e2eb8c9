"""Drain a running tritonserver before it is stopped: the container's preStop hook in
RawDeployment mode (cubeserve.deploy.PRESTOP_COMMAND).

What Triton 2.51 does on SIGTERM by itself (server src/main.cc, src/http_server.cc at v2.51.0;
core src/server.cc, src/dynamic_batch_scheduler.cc on r24.10) is not a drain:

1. the HTTP endpoint stops accepting connections (HTTPServer::Stop: a new connection is closed
   without an answer, a reset for the client) but keeps serving, new requests included, on the
   connections already open, and waits for all of them to close, at most --exit-timeout-secs;
2. only then the core enters EXITING (readiness fails with "Server exiting"), each model's
   scheduler refuses new requests as UNAVAILABLE ("Server is stopping, scheduler for model has
   stopped accepting new inference requests"), and the server waits for the requests in flight
   and the models' unloading with what is left of the exit timeout, then exits (1 if it expired,
   cutting what still runs);
3. gRPC accepts new work until step 2 and is stopped last.

So this module makes the models themselves refuse new work, at once and on every endpoint, and
waits for what they accepted:

* it writes a marker file for the tritonserver process (`marker_path`); both models check it on
  every request and answer new ones with UNAVAILABLE, "unavailable: the server is shutting down
  ..." (HTTP 503, gRPC UNAVAILABLE: the client retries elsewhere), on new and kept-alive
  connections alike; requests already accepted go on (the predict model's forwards to the
  engine included);
* it waits until the models report no request in progress (the `cube3d_requests_in_progress`
  gauges on the metrics port), at least `--settle` seconds (the time kube-proxy and ingress
  controllers take to drop the terminating pod from the Service: meanwhile new connections still
  get a clean 503, not a reset), at most `--timeout` seconds;
* and until Prometheus has scraped the final counts: `--scrape-interval` (plus
  deploy.DRAIN_SCRAPE_MARGIN_S) after the counters (cube3d_*_total) last changed, counted from
  the drain's start at least, since a scrape starts in every interval. Without that a pod that
  exits right after its last requests (or after refusing some) takes their counts with it, and
  `cubeserve usage` never sees them;
* then it exits, and the kubelet's SIGTERM (through cubeserve's supervisor, which forwards it and
  waits) finds nothing left to wait for: Triton's own shutdown above is quick.

A terminating pod leaves its Service's ready endpoints whatever its readiness probe says, so
Triton's readiness staying 200 during the drain sends no traffic to it.

    python -m cubeserve.serving.drain [--http-port 8010] [--metrics-port 8002] [--timeout S] [--settle S]
                                      [--scrape-interval S]

Exit status: 0 drained (or no server to drain), 1 requests still in progress at the timeout.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from cubeserve import deploy

# Requests a model instance has accepted and not answered yet (triton_common.InProgress).
IN_PROGRESS_METRIC = "cube3d_requests_in_progress"

_SAMPLE = re.compile(rf"^{IN_PROGRESS_METRIC}(?:{{[^}}]*}})? ([0-9.e+-]+)$", re.M)
# cube-serve's counters (serving/metrics.py), whose last values Prometheus must scrape.
_COUNT = re.compile(r"^cube3d_\w+_total(?:{[^}]*})? [0-9.e+-]+$", re.M)


def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot, /proc/<pid>/stat field 22): with the pid,
    it names one process for good, so a marker never applies to a later process with a reused pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def marker_path(server_pid: int) -> Path | None:
    """The drain marker of the tritonserver process `server_pid` (None when it is gone). The
    models compute it from their parent process (a python backend stub is tritonserver's child)."""
    started = _start_time(server_pid)
    if started is None:
        return None
    return Path(tempfile.gettempdir()) / f"cubeserve-draining-{server_pid}-{started}"


def is_draining(server_pid: int) -> bool:
    path = marker_path(server_pid)
    return path is not None and path.exists()


def clear_markers(server_pid: int) -> None:
    """Remove the markers of a tritonserver that has exited (the supervisor's tidying up)."""
    for path in Path(tempfile.gettempdir()).glob(f"cubeserve-draining-{server_pid}-*"):
        path.unlink(missing_ok=True)


def find_tritonserver(http_port: int) -> int | None:
    """The pid of the tritonserver process whose --http-port is `http_port`."""
    wanted = f"--http-port={http_port}".encode()
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            args = (pid_dir / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if args and os.path.basename(args[0]) == b"tritonserver" and wanted in args:
            return int(pid_dir.name)
    return None


def _metrics(metrics_url: str) -> str | None:
    """The metrics endpoint's text; None when it does not answer (the server is gone or stopping)."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=5) as reply:
            return reply.read().decode()
    except (urllib.error.URLError, OSError):
        return None


def _in_progress(text: str) -> int:
    return round(sum(float(v) for v in _SAMPLE.findall(text)))


def in_progress(metrics_url: str) -> int | None:
    """Requests the models have accepted and not answered (the sum of their gauges); None when
    the metrics endpoint does not answer."""
    text = _metrics(metrics_url)
    return None if text is None else _in_progress(text)


def drain(http_port: int, metrics_port: int, timeout: float, settle: float, scrape_interval: float = 0.0,
          poll: float = 0.5, out=sys.stdout) -> int:
    def say(message: str) -> None:
        print(f"cubeserve drain: {message}", file=out, flush=True)

    pid = find_tritonserver(http_port)
    marker = marker_path(pid) if pid is not None else None
    if marker is None:
        say(f"no tritonserver with --http-port={http_port}: nothing to drain")
        return 0
    marker.write_text(f"{time.time():.3f}\n")
    say(f"tritonserver {pid} refuses new requests from now on; waiting for those in progress "
        f"(at most {timeout:g} s)")
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    # The wait for a scrape is counted from the look that saw the counters' last change (or the
    # first look): the change was no later, and a scrape starts within every interval after it.
    scrape_wait = scrape_interval + deploy.DRAIN_SCRAPE_MARGIN_S if scrape_interval > 0 else 0.0
    start = changed = time.monotonic()
    counts = None
    while True:
        text = _metrics(metrics_url)
        elapsed = time.monotonic() - start
        if text is None:
            if elapsed >= settle:
                say("the metrics endpoint is gone: stopping")
                return 0
            left = None
        else:
            left = _in_progress(text)
            if _COUNT.findall(text) != counts:
                changed, counts = time.monotonic(), _COUNT.findall(text)
            if left == 0 and elapsed >= settle and time.monotonic() - changed >= scrape_wait:
                say(f"drained in {elapsed:.1f} s")
                return 0
        if left and elapsed >= timeout:  # (the wait for a scrape may go past it: deploy.PRESTOP_MAX_S)
            say(f"{left} requests still in progress after {elapsed:.0f} s: giving up")
            return 1
        time.sleep(poll)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cubeserve.serving.drain", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--http-port", type=int, default=deploy.TRITON_HTTP_PORT,
                        help="tritonserver's own REST port (its --http-port): finds the tritonserver process")
    parser.add_argument("--metrics-port", type=int, default=deploy.METRICS_PORT)
    parser.add_argument("--timeout", type=float, default=deploy.DRAIN_TIMEOUT_S,
                        help="seconds to wait for requests in progress at most")
    parser.add_argument("--settle", type=float, default=deploy.DRAIN_SETTLE_S,
                        help="seconds to wait at least (for the endpoints to drop the pod)")
    parser.add_argument("--scrape-interval", type=float, default=deploy.SCRAPE_INTERVAL_S,
                        help="Prometheus's scrape interval of the metrics port: once drained, wait this long "
                             f"(+{deploy.DRAIN_SCRAPE_MARGIN_S} s) after the counters last changed, so that a scrape "
                             "has the final counts (0: no Prometheus, no wait)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("timeout", "settle", "scrape_interval"):
        if getattr(args, name) < 0:
            build_parser().error(f"--{name.replace('_', '-')}: seconds, 0 or more, got {getattr(args, name):g}")
    return drain(args.http_port, args.metrics_port, args.timeout, args.settle, args.scrape_interval)


if __name__ == "__main__":
    sys.exit(main())
