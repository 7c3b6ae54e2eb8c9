"""A real trace backend for the tests: Jaeger v2 (its OTLP receivers, in-memory storage and query
API) from the binary cluster/build.py builds (`make trace-backend`), on free 127.0.0.1 ports,
stopped by its PID.

    with Jaeger(tmp_path) as jaeger:
        env OTEL_EXPORTER_OTLP_ENDPOINT=jaeger.otlp_http   (the SDK's, tritonserver's)
        gateway tracing.collector: jaeger.otlp_grpc        (Envoy's)
        jaeger.trace(trace_id) -> [span, ...] (Jaeger's JSON: operationName, startTime and
                                  duration in microseconds, references, service)
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import go_programs
from cubeserve.lifetime import ends_with_this_process
from cubeserve.server.local_triton import free_port


def binary() -> Path | None:
    """Jaeger's binary where `make trace-backend` built it, else None."""
    needs = go_programs.traces_need()
    if go_programs.not_built(needs):
        return None
    (jaeger,) = needs
    return jaeger.binary("jaeger")


CONFIG = """
service:
  extensions: [jaeger_storage, jaeger_query]
  pipelines:
    traces: {{receivers: [otlp], exporters: [jaeger_storage_exporter]}}
  telemetry:
    metrics: {{level: none}}
    logs: {{level: warn}}
extensions:
  jaeger_storage:
    backends:
      memstore: {{memory: {{max_traces: 10000}}}}
  jaeger_query:
    storage: {{traces: memstore}}
    http: {{endpoint: "127.0.0.1:{query}"}}
    grpc: {{endpoint: "127.0.0.1:{query_grpc}"}}
receivers:
  otlp:
    protocols:
      grpc: {{endpoint: "127.0.0.1:{grpc}"}}
      http: {{endpoint: "127.0.0.1:{http}"}}
exporters:
  jaeger_storage_exporter: {{trace_storage: memstore}}
"""


class Jaeger:
    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.ports = {"query": free_port(), "query_grpc": free_port(), "grpc": free_port(), "http": free_port()}
        self.process: subprocess.Popen | None = None

    @property
    def otlp_http(self) -> str:
        return f"http://127.0.0.1:{self.ports['http']}"

    @property
    def otlp_grpc(self) -> str:
        return f"127.0.0.1:{self.ports['grpc']}"

    @property
    def query_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['query']}"

    def start(self, timeout: float = 60.0) -> "Jaeger":
        path = binary()
        if path is None:
            raise RuntimeError("Jaeger is not built: run `make trace-backend` (cluster/build.py trace-backend)")
        config = self.folder / "jaeger.yaml"
        config.write_text(CONFIG.format(**self.ports))
        self.log = open(self.folder / "jaeger.log", "wb")
        self.process = subprocess.Popen([str(path), "--config", f"file:{config}"], stdout=self.log,
                                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        preexec_fn=ends_with_this_process())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"jaeger exited with {self.process.returncode}: "
                                   + self.log_tail())
            try:
                urllib.request.urlopen(self.query_url + "/api/services", timeout=2).read()
                return self
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("jaeger was not ready in time: " + self.log_tail())

    def log_tail(self, chars: int = 2000) -> str:
        path = self.folder / "jaeger.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def trace(self, trace_id: str) -> list[dict]:
        """The trace's spans as stored (none yet: []), each with its service name."""
        try:
            with urllib.request.urlopen(f"{self.query_url}/api/traces/{trace_id}", timeout=10) as r:
                doc = json.loads(r.read())
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return []
            raise
        spans = []
        for trace in doc.get("data") or []:
            for span in trace["spans"]:
                spans.append({**span, "service": trace["processes"][span["processID"]]["serviceName"]})
        return spans

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if getattr(self, "log", None):
            self.log.close()

    def __enter__(self) -> "Jaeger":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
