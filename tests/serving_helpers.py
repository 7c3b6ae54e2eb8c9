"""What the tests of the real tritonserver share: a model repository to serve and the metrics."""

from __future__ import annotations

import re
import shutil
import urllib.request
from pathlib import Path

from cubeserve.serving.local_triton import MODEL_REPOSITORY


def copy_model_repository(root: Path, parameters: dict[str, str] | None = None) -> Path:
    """triton_models/ without weights into `root`, with cube3d_stream's config parameters set."""
    for model in ("cube3d", "cube3d_stream"):
        shutil.copytree(MODEL_REPOSITORY / model, root / model, ignore=shutil.ignore_patterns("weights", "__pycache__"))
    config = root / "cube3d_stream" / "config.pbtxt"
    text = config.read_text()
    for key, value in (parameters or {}).items():
        text, count = re.subn(rf'(key: "{key}" value: {{ string_value: )"[^"]*"', rf'\1"{value}"', text)
        assert count == 1, f"no parameter {key} in {config}"
    config.write_text(text)
    return root


def metrics(server) -> dict[str, float]:
    """cube3d_* samples as {"name/v<version>[/<reason>]": value}."""
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"(cube3d_\w+)\{(.*)\} ([0-9.e+-]+)$", line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            key = f"{m.group(1)}/v{labels['version']}" + (f"/{labels['reason']}" if "reason" in labels else "")
            out[key] = float(m.group(3))
    return out
