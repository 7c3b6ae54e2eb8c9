"""A small real HTTP server standing in for a predict-API server where a gateway test is about
the gateway alone (identity, quotas, balancing, retries): it answers the readiness path and any
POST after `--delay` seconds, and records every request but the health checks (method, path,
headers) as a JSON line in `--log`, so a test can tell exactly what reached a backend.

Why not the real server there: a tritonserver per backend costs tens of seconds to start and a
GB of memory on the two shared cores, and what those tests check is what Envoy does, the same
whatever the backend computes. The tests that need the server itself (a mesh, its metrics) use
the real one (tests/test_gateway.py).

With `--load-target N` every answer carries the server's load report as the real front ends
write it (cubeserve/server/load_report.py, imported from the project only then): POSTs in
progress / N, for the gateway's load-aware routing (tests/test_gateway_load.py). With `--slots
N` it works on N POSTs at a time, as the engine decodes max_objects at once: the rest wait their
turn (and are reported as its queue), so that a load there makes its answers slower, as a real
server's; without, every POST takes `--delay` however many there are.

    python tests/stub_backend.py --port P --log FILE [--delay S] [--name NAME] [--max-in-flight N]
                                 [--load-target N] [--slots N]
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

READY_PATH = "/v2/health/ready"  # cubeserve.deploy.READY_PATH (not imported: this runs without the project)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--log", required=True)
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--name", default="backend")
    p.add_argument("--max-in-flight", type=int, default=0,
                   help="answer 503 at once while this many POSTs are in progress (a full server); 0: no limit")
    p.add_argument("--load-target", type=float, default=0.0,
                   help="report the load (ORCA) in every answer, POSTs in progress / this; 0: no report")
    p.add_argument("--slots", type=int, default=0, help="POSTs worked on at once, the rest wait; 0: no limit")
    args = p.parse_args()
    load = None
    if args.load_target:
        from cubeserve.server.load_report import HEADER, LoadReport

        load = LoadReport(args.load_target, args.slots or None)
    slots = threading.Semaphore(args.slots) if args.slots else None
    lock = threading.Lock()
    in_flight = [0]
    log = open(args.log, "a", buffering=1)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as Envoy's upstream connections use

        def _reply(self, status: int, body: bytes) -> None:
            self.send_response(status)
            if load is not None:
                self.send_header(HEADER, load.header())
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == READY_PATH:
                return self._reply(200, b"")
            self._record()
            self._reply(200, json.dumps({"backend": args.name}).encode())

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            with lock:
                full = args.max_in_flight and in_flight[0] >= args.max_in_flight
                in_flight[0] += not full
            started = load.started() if load is not None else None  # as the front end counts what it forwards
            try:
                if full:  # as the real server's busy answer: 503, nothing recorded
                    return self._reply(503, json.dumps({"error": "unavailable: busy", "backend": args.name}).encode())
                try:
                    self._record()
                    if slots is not None:
                        with slots:
                            time.sleep(args.delay)
                    else:
                        time.sleep(args.delay)
                    self._reply(200, json.dumps({"backend": args.name}).encode())
                finally:
                    with lock:
                        in_flight[0] -= 1
            finally:
                if load is not None:
                    load.finished(failed=bool(full), started=started)

        def _record(self) -> None:
            line = json.dumps({"backend": args.name, "method": self.command, "path": self.path,
                               "headers": {k.lower(): v for k, v in self.headers.items()}})
            with lock:
                log.write(line + "\n")

        def log_message(self, *a):  # quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
