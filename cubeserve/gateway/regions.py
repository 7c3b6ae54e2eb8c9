"""Regions on one machine, for tests and benchmarks: a `RegionFront` is an Envoy listener on
127.0.0.1 standing for a region's ingress: every request (health checks too) waits a fixed delay
there (Envoy's fault filter: the round trip to a far data centre), then goes to that region's
servers; with `max_in_flight`, one request more than that is answered 503 at once (a circuit
breaker: the region is full), which the gateway spills over to its next region. The readiness
probes (deploy.READY_PATH: the gateway's health checks and its weigher's polls) are not counted
against it: a full region's servers still answer them, and several of them at once must not
fill a region of a small cap.

    with RegionFront("near", ["127.0.0.1:8000"], delay_ms=2) as near, \\
         RegionFront("far", ["127.0.0.1:8001"], delay_ms=40) as far:
        gateway file: regions: [{name: near, priority: 0, backends: [near.address]},
                                {name: far, priority: 1, backends: [far.address]}]

Killing a region is killing its servers (the front then answers 503, its health check fails) or
`stop()` (connections refused)."""

from __future__ import annotations

import json

from cubeserve import deploy
from cubeserve.gateway.envoy import _TYPE, Gateway, _hcm, _socket
from cubeserve.server.local_triton import free_port

REGION_HEADER = "x-cube3d-region"


def render(name: str, port: int, backends: list[str], delay_ms: float, max_in_flight: int | None) -> dict:
    many = 1 << 20
    fault = {"name": "envoy.filters.http.fault", "typed_config": {
        "@type": _TYPE + "filters.http.fault.v3.HTTPFault",
        "delay": {"fixed_delay": f"{delay_ms / 1000:g}s", "percentage": {"numerator": 100, "denominator": "HUNDRED"}}}}
    probes = f"{name}.probes"
    # Which region answered, for the benchmark's shares (bench/gateway.py).
    region = [{"header": {"key": REGION_HEADER, "value": name}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]
    routes = [{"match": {"path": deploy.READY_PATH}, "route": {"cluster": probes, "timeout": "0s"}},
              {"match": {"prefix": "/"}, "route": {"cluster": name, "timeout": "0s"}, "response_headers_to_add": region}]
    hcm = _hcm(f"region.{name}", routes, [fault])
    hosts = [b.rsplit(":", 1) for b in backends]
    clusters = [{"name": cluster, "connect_timeout": "2s",
                 "circuit_breakers": {"thresholds": [{"max_connections": many, "max_pending_requests": many,
                                                      "max_requests": cap, "max_retries": 0}]},
                 "load_assignment": {"cluster_name": cluster, "endpoints": [{"lb_endpoints": [
                     {"endpoint": {"address": _socket(h, int(p))}} for h, p in hosts]}]}}
                for cluster, cap in ((name, max_in_flight or many), (probes, many))]
    return {"node": {"id": f"region-{name}", "cluster": f"region-{name}"},
            "admin": {"address": _socket("127.0.0.1", 0)},
            "static_resources": {
                "listeners": [{"name": name, "address": _socket("127.0.0.1", port),
                               "filter_chains": [{"filters": [hcm]}]}],
                "clusters": clusters}}


class RegionFront(Gateway):
    """Envoy as a region's ingress (see the module's docstring), stopped by its PID."""

    def __init__(self, name: str, backends: list[str], delay_ms: float, max_in_flight: int | None = None,
                 port: int | None = None, workdir=None):
        self.name, self.backends, self.delay_ms, self.max_in_flight = name, backends, delay_ms, max_in_flight
        self.port = port or free_port()
        super().__init__(None, workdir, concurrency=1)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _write(self):
        path = self.workdir / "envoy.json"
        path.write_text(json.dumps(render(self.name, self.port, self.backends, self.delay_ms, self.max_in_flight)))
        return path

    def healthy_backends(self) -> int:
        return self.stats().get(f"cluster.{self.name}.membership_healthy", 0)

