"""A real Prometheus server (Debian's `prometheus` package) for the tests: scrapes the given
targets every second, bound to 127.0.0.1, stopped by its PID.

`require_prometheus()` installs the package with apt-get when it is missing and the tests run as
root (CI does); otherwise it skips with the reason, or fails under CI=true, where a skipped
measurement test would hide a regression.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from cubeserve.serving.local_triton import free_port

_INSTALL = "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus"


def require_prometheus() -> tuple[str, str]:
    """The paths of `prometheus` and `promtool`, installing the Debian package if needed."""
    if not (shutil.which("prometheus") and shutil.which("promtool")) and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["bash", "-c", _INSTALL], check=False, capture_output=True, timeout=900)
    prometheus, promtool = shutil.which("prometheus"), shutil.which("promtool")
    if not (prometheus and promtool):
        reason = f"Prometheus is not installed (as root: {_INSTALL})"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return prometheus, promtool


class PrometheusServer:
    """`prometheus` scraping `targets` ("127.0.0.1:8002", ...) at /metrics every `interval` s."""

    def __init__(self, workdir: Path, targets: list[str], interval: float = 1.0, rule_files: list[Path] = ()):
        self.binary, _ = require_prometheus()
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": f"{interval:g}s", "evaluation_interval": f"{interval:g}s"},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [{"job_name": "cube3d", "static_configs": [{"targets": list(targets)}]}],
        }
        self.config = self.workdir / "prometheus.yml"
        self.config.write_text(json.dumps(config))  # JSON is YAML
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 60.0) -> "PrometheusServer":
        self.log = open(self.workdir / "prometheus.log", "wb")
        self.process = subprocess.Popen(
            [self.binary, f"--config.file={self.config}", f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited: {(self.workdir / 'prometheus.log').read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.3)
        raise TimeoutError("prometheus did not become ready")

    def query(self, promql: str) -> list[dict]:
        """The result vector of an instant query."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.load(r)
        if body.get("status") != "success":
            raise RuntimeError(f"query {promql!r} failed: {body}")
        return body["data"]["result"]

    def wait_for(self, promql: str, timeout: float = 60.0) -> list[dict]:
        """Poll until the query returns a non-empty vector."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(promql)
            if result or time.monotonic() > deadline:
                return result
            time.sleep(0.5)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if getattr(self, "log", None):
            self.log.close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
