"""What the tests of the real tritonserver share: reading its cube3d_* metrics."""

from __future__ import annotations

import re
import urllib.request


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
