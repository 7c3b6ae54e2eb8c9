"""What the tests of the real servers share: reading tritonserver's cube3d_* metrics, and waiting
with a deadline."""

from __future__ import annotations

import re
import time
import urllib.request


def wait_until(condition, timeout: float, what: str, poll: float = 0.05) -> None:
    """Poll `condition` until it holds; fail naming `what` after `timeout` seconds, so that no test
    waits forever on something that never happens."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g} s"
        time.sleep(poll)


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
