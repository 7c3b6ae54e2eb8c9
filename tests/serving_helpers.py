"""What the tests of the real servers share: reading tritonserver's cube3d_* metrics, waiting
with a deadline, and hostile connections (floods, slowloris, silent ones)."""

from __future__ import annotations

import re
import socket
import threading
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


# -- hostile connections (tests/test_security.py, tests/test_gateway.py) --------------------------------

def flood(port: int, count: int) -> list[socket.socket]:
    sockets = []
    for _ in range(count):
        try:
            sockets.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        except OSError:
            break
    return sockets


def closed_by_server(s: socket.socket, received: dict | None = None) -> bool:
    """The server closed `s`; what it answered first is added to received[s]."""
    s.setblocking(False)
    try:
        while data := s.recv(65536):
            if received is not None:
                received[s] = received.get(s, b"") + data
        return True
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


# What a slowloris client sends a byte at a time: a request head (REST), the connection preface (gRPC).
SLOW_HEAD = b"POST /v2/models/cube3d/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Pad: " + b"a" * 4096
SLOW_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\0" * 4096


class Attack:
    """`slow` connections sending one byte of `head` every `interval` s (slowloris; the first
    `burst` bytes at once), then `silent` ones that never send a byte, to `port`. `closed`: the seconds from
    the opening to each one's close by the server; `received`: what each got before (REST: a
    503 past the cap, nothing within it)."""

    def __init__(self, port: int, slow: int, silent: int, head: bytes, interval: float = 0.5, burst: int = 1):
        self.port, self.counts, self.head, self.interval, self.burst = port, (slow, silent), head, interval, burst
        self.closed: dict[socket.socket, float] = {}
        self.received: dict[socket.socket, bytes] = {}
        self._stop = threading.Event()

    def __enter__(self) -> "Attack":
        self.slow = flood(self.port, self.counts[0])
        time.sleep(0.5)  # taken by the server: one accept burst may run past its cap (front.py, _connection)
        self.silent = flood(self.port, self.counts[1])
        assert len(self.slow) + len(self.silent) == sum(self.counts), "the attack could not open its connections"
        self.start = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        sent, size = 0, self.burst
        while not self._stop.is_set() and len(self.closed) < sum(self.counts):
            for s in self.slow:
                if s not in self.closed and sent < len(self.head):
                    try:
                        s.send(self.head[sent:sent + size])
                    except OSError:  # closed by the server: seen below
                        pass
            sent, size = sent + size, 1
            for s in self.slow + self.silent:
                if s not in self.closed and closed_by_server(s, self.received):
                    self.closed[s] = time.monotonic() - self.start
            time.sleep(self.interval)

    def wait_closed(self, timeout: float) -> None:
        wait_until(lambda: len(self.closed) == sum(self.counts), timeout,
                   f"all {sum(self.counts)} slow and silent connections closed by the server "
                   f"({len(self.closed)} were)")

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
        for s in self.slow + self.silent:
            s.close()
