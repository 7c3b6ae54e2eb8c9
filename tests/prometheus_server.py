"""A real Prometheus server (Debian's `prometheus` package) for the tests: scrapes the given
targets every second, bound to 127.0.0.1, stopped by its PID. `discovered=True`: the targets come
from a file it watches (file_sd), which `discover()` rewrites, as a new pod is discovered some
time after it starts serving.

`require_prometheus()` installs the package with apt-get when it is missing and the tests run as
root (CI does); otherwise it skips with the reason, or fails under CI (guards.cannot_run), where a
skipped measurement test would hide a regression.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from guards import cannot_run
from kfp_pipelines.local_services import Prometheus

_INSTALL = "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus"


def require_prometheus() -> tuple[str, str]:
    """The paths of `prometheus` and `promtool`, installing the Debian package if needed."""
    if not (shutil.which("prometheus") and shutil.which("promtool")) and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["bash", "-c", _INSTALL], check=False, capture_output=True, timeout=900)
    prometheus, promtool = shutil.which("prometheus"), shutil.which("promtool")
    if not (prometheus and promtool):
        cannot_run(f"Prometheus is not installed (as root: {_INSTALL})")
    return prometheus, promtool


class PrometheusServer(Prometheus):
    """kfp_pipelines/local_services.py's `Prometheus` (what `make pipeline` runs), its binary
    found or installed by `require_prometheus()`."""

    def __init__(self, workdir: Path, targets: list[str], interval: float = 1.0, rule_files: list[Path] = (),
                 discovered: bool = False):
        binary, _ = require_prometheus()
        super().__init__(workdir, targets, interval, rule_files, binary)
        self.interval = interval
        if discovered:
            self.targets_file = self.workdir / "targets.json"
            self.discover(targets)
            config = json.loads(self.config.read_text())
            [job] = config["scrape_configs"]
            del job["static_configs"]
            job["file_sd_configs"] = [{"files": [str(self.targets_file)], "refresh_interval": "1s"}]
            self.config.write_text(json.dumps(config))

    def discover(self, targets: list[str]) -> None:
        """Scrape these targets from now on (Prometheus applies a change within about 5 s)."""
        new = self.targets_file.with_suffix(".new")
        new.write_text(json.dumps([{"targets": list(targets)}]))
        new.replace(self.targets_file)  # whole, never half written
