"""Slow and silent clients against a front end and the gateway (docs/security.md, "Timeouts"):
SLOW slowloris connections (a byte of a request head every second) and then SILENT connections
that never send a byte, opened at once to one server's REST front end, then to a gateway in
front of it, while a client asks for the readiness path every 0.1 s on a new connection. For each:
how long the client was kept out (its last refusal or failure after the attack began), what it
got meanwhile, and when the server closed the attack's connections.

    python -m bench.slow_clients [--slow 300] [--silent 1000]

The numbers go to BENCHMARKS.md by hand, with the machine named ("Slow and silent clients")."""

from __future__ import annotations

import argparse
import collections
import resource
import selectors
import socket
import statistics
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench.common import hardware
from bench.gateway import KEY, bench_gateway_config

HEAD = b"POST /v2/models/cube3d/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Pad: " + b"a" * 4096
WATCH_S = 30.0  # how long each attack is watched


def _client(url: str, headers: dict, stop: threading.Event, seen: list) -> None:
    while not stop.is_set():
        request = urllib.request.Request(url, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=5) as reply:
                seen.append((time.monotonic(), reply.status))
        except urllib.error.HTTPError as exc:
            seen.append((time.monotonic(), exc.code))
        except OSError as exc:
            seen.append((time.monotonic(), type(exc).__name__))
        time.sleep(0.1)


def attack(port: int, url: str, headers: dict, slow: int, silent: int) -> list[str]:
    selector = selectors.DefaultSelector()
    opened = []
    for count in (slow, silent):
        group = []
        for _ in range(count):
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.setblocking(False)
            selector.register(s, selectors.EVENT_READ)
            group.append(s)
        opened.append(group)
        time.sleep(0.5)  # the slow ones taken first, as an attacker holding the cap would
    slow_sockets, silent_sockets = opened
    start = time.monotonic()
    seen: list = []
    stop = threading.Event()
    client = threading.Thread(target=_client, args=(url, headers, stop, seen), daemon=True)
    client.start()
    closed, answered, sent, next_byte = {}, set(), 0, start
    while time.monotonic() - start < WATCH_S and len(closed) < slow + silent:
        if time.monotonic() >= next_byte:
            for s in slow_sockets:
                if s not in closed:
                    try:
                        s.send(HEAD[sent:sent + 1])
                    except OSError:
                        pass
            sent, next_byte = sent + 1, next_byte + 1.0
        for key, _ in selector.select(timeout=0.05):
            s = key.fileobj
            try:
                data = s.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if data:
                answered.add(s)
                continue
            closed[s] = time.monotonic() - start
            selector.unregister(s)
    stop.set()
    client.join(10)
    for s in slow_sockets + silent_sockets:
        s.close()
    statuses = collections.Counter(status for _, status in seen)
    refused = [t - start for t, status in seen if status != 200]
    times = sorted(closed.values())
    held = sorted(t for s, t in closed.items() if s not in answered)
    return [f"  attack: {slow} slowloris + {silent} silent connections; {len(closed)} closed by the server within "
            f"{WATCH_S:g} s ({len(answered)} answered first: 503 past the cap), the rest still open: "
            f"{slow + silent - len(closed)}",
            f"  closes: median {statistics.median(times):.1f} s, last {times[-1]:.1f} s after the attack began"
            if times else "  closes: none",
            f"  held until the timeout: {len(held)}, closed from {held[0]:.1f} s to {held[-1]:.1f} s" if held else
            "  held until the timeout: none",
            f"  the client: {dict(statuses)}; kept out until {max(refused):.1f} s" if refused else
            f"  the client: {dict(statuses)}; never kept out"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slow", type=int, default=300)
    parser.add_argument("--silent", type=int, default=1000)
    args = parser.parse_args()
    from cubeserve import deploy
    from cubeserve.checkpoint import write_random_weights
    from cubeserve.gateway.envoy import Gateway
    from cubeserve.server.local_triton import LocalTriton, copy_model_repository, free_port

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 1 << 16), hard))  # the attack's sockets
    import torch

    print(f"{hardware(torch.device('cpu'))}; header timeout {deploy.HEADER_TIMEOUT_S} s")
    with tempfile.TemporaryDirectory() as tmp:
        repo = copy_model_repository(Path(tmp) / "models")
        write_random_weights("tiny", repo / deploy.STREAM_MODEL / "1" / "weights", seed=0)
        with LocalTriton(repo, free_port(), free_port(), free_port()) as server:
            print("REST front end:")
            print("\n".join(attack(server.http_port, f"http://{server.http_url}{deploy.READY_PATH}", {},
                                   args.slow, args.silent)))
            cfg = bench_gateway_config([server.http_url])
            with Gateway(cfg, Path(tmp) / "gateway") as gateway:
                gateway.wait_healthy()
                print("gateway:")
                print("\n".join(attack(cfg.listen[1], gateway.url + deploy.READY_PATH,
                                       {"Authorization": f"Bearer {KEY}"}, args.slow, args.silent)))


if __name__ == "__main__":
    main()
