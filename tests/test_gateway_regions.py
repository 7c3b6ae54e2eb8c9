"""The gateway across regions and models (cubeserve/gateway, docs/gateway/regions-models-traces.md):
the real Envoy in front of regions emulated on the loopback (gateway/regions.py: an Envoy per
region adding a fixed delay, 2 ms near and 40 ms far), with tests/stub_backend.py servers behind
them (a full one answers 503, as the real server does when its queue is full).

In `make test`: priorities as rendered; the near region first, spill-over when it is full,
fail-over when its servers die, the way back when they return, one quota across regions; models
by path, entitlements (403) and per-model quotas. Behind the marker `gateway_e2e`
(`make gateway-e2e-test`): a flapping region under load, and one request's trace through every
hop in a real trace backend."""

from __future__ import annotations

import json
import re
import threading
import time
from collections import Counter

import pytest

from cubeserve.gateway import config as gateway_config
from cubeserve.gateway.envoy import Gateway, model_cluster, model_path, render, validate, write
from cubeserve.gateway.regions import RegionFront
from cubeserve.serving.experiment import TENANT_KEY
from cubeserve.server.local_triton import free_port
from serving_helpers import wait_until
from test_gateway import (INFER, KEYS, REPO, Stub, call, envoy, gateway_k8s,  # noqa: F401 (fixtures)
                          tenant)

NEAR_MS, FAR_MS = 2, 40


@pytest.fixture
def fleet(tmp_path):
    """stub(name, ...), region(name, stub, delay_ms) and gateway(doc) -> started things, all
    stopped by their PIDs at the end (also used by tests/test_gateway_load.py)."""
    started: list = []

    class Fleet:
        @staticmethod
        def stub(name: str, delay: float = 0.0, max_in_flight: int = 0, load_target: float = 0, slots: int = 0) -> Stub:
            s = Stub(tmp_path, name, delay, max_in_flight, load_target, slots)
            started.append(s)
            return s

        @staticmethod
        def region(name: str, stub: Stub, delay_ms: float) -> RegionFront:
            r = RegionFront(name, [stub.address], delay_ms, workdir=tmp_path / f"region-{name}")
            started.append(r)
            return r.start()

        @staticmethod
        def gateway(doc: dict) -> Gateway:
            cfg = gateway_config.parse({"listen": f"127.0.0.1:{free_port()}", "health_check_interval": "1s", **doc})
            g = Gateway(cfg, tmp_path / f"gateway-{len(started)}", concurrency=1)
            started.append(g)
            g.start()
            g.wait_healthy(timeout=30)
            return g

    yield Fleet
    for thing in reversed(started):
        thing.kill() if isinstance(thing, Stub) else thing.stop()


def two_regions(near: RegionFront, far: RegionFront) -> list[dict]:
    return [{"name": "near", "priority": 0, "backends": [near.address]},
            {"name": "far", "priority": 1, "backends": [far.address]}]


def load(g: Gateway, clients: int, seconds: float, key: str = KEYS["team-a"]) -> list[tuple[int, str]]:
    """`clients` threads calling as fast as answers come: (status, backend or error) of each."""
    out, lock, stop = [], threading.Lock(), time.monotonic() + seconds

    def client():
        while time.monotonic() < stop:
            status, _, body = call(g, key=key, timeout=30)
            with lock:
                out.append((status, json.loads(body).get("backend", "") if status == 200 else body[:200]))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 60)
    return out


def test_regions_render_as_envoy_priorities_with_spill_over_on_retry():
    """What the behaviour below rests on, as rendered: one locality per region, priorities
    made contiguous in the file's order of priority, the overprovisioning factor, retries of
    503 to a priority not tried yet, and health checks that run from the start."""
    cfg = gateway_config.parse({
        "regions": [{"name": "cloud", "priority": 7, "backends": ["127.0.0.1:3"]},
                    {"name": "onprem", "priority": 0, "backends": ["127.0.0.1:1", "127.0.0.1:2"]},
                    {"name": "dc2", "priority": 0, "backends": ["127.0.0.1:4"]}],
        "overprovisioning": 1.2, "tenants": [tenant("team-a")]})
    rendered = render(cfg)
    [cluster] = [c for c in rendered["static_resources"]["clusters"] if c["name"] == model_cluster(cfg.models[0])]
    endpoints = cluster["load_assignment"]["endpoints"]
    assert [(e["locality"]["region"], e["priority"], len(e["lb_endpoints"])) for e in endpoints] == \
        [("onprem", 0, 2), ("dc2", 0, 1), ("cloud", 1, 1)]
    assert cluster["load_assignment"]["policy"]["overprovisioning_factor"] == 120
    [check] = cluster["health_checks"]
    assert check["no_traffic_interval"] == check["interval"] == "1s"
    assert cluster["outlier_detection"]["consecutive_gateway_failure"] >= 1 << 20  # a full region is not rested
    [inner] = [listener for listener in rendered["static_resources"]["listeners"] if listener["name"] == "backends"]
    routes = inner["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    assert [r["direct_response"]["status"] for r in routes if "route" not in r] == [404]  # an unknown model
    for route in (r for r in routes if "route" in r):
        retry = route["route"]["retry_policy"]
        assert 503 in retry["retriable_status_codes"]
        assert retry["retry_priority"]["name"] == "envoy.retry_priorities.previous_priorities"
        assert retry["retry_priority"]["typed_config"]["update_frequency"] == 1
    with pytest.raises(gateway_config.GatewayConfigError, match="give backends \\(one region\\) or regions"):
        gateway_config.parse({"backends": ["127.0.0.1:1"], "regions": [], "tenants": [tenant("team-a")]})


def test_the_near_region_first_then_spill_over_fail_over_and_back(fleet):
    """Two regions, near (2 ms, priority 0) and far (40 ms, priority 1), a server in each
    taking 0.1 s a request; the near one holds 2 requests at once and answers 503 to more.
    One client: every request at the near region. Six: the near region serves what it can,
    the far one the rest, and no client sees a 503. The near server killed: every request at
    the far region, none failed. Back: requests return to the near region. One tenant's quota
    holds across both regions."""
    near_server = fleet.stub("near", delay=0.1, max_in_flight=2)
    far_server = fleet.stub("far", delay=0.1)
    near, far = fleet.region("near", near_server, NEAR_MS), fleet.region("far", far_server, FAR_MS)
    g = fleet.gateway({"regions": two_regions(near, far),
                       "tenants": [tenant("team-a"), tenant("team-b", shape_tokens=2 * 512, per="1h")]})

    quiet = load(g, clients=1, seconds=2)
    assert quiet and Counter(quiet) == {(200, "near"): len(quiet)}, Counter(quiet)

    busy = load(g, clients=6, seconds=3)
    shares = Counter(busy)
    assert set(s for s, _ in busy) == {200}, shares
    assert shares[(200, "near")] > 0 and shares[(200, "far")] >= len(busy) / 3, shares

    assert call(g, key=KEYS["team-b"])[0] == 200  # team-b's first object, in the near region
    near_server.kill()
    down = load(g, clients=3, seconds=3)
    assert set(s for s, _ in down) == {200} and Counter(down)[(200, "far")] == len(down), Counter(down)
    wait_until(lambda: g.stats()[f"cluster.{model_cluster(g.config.models[0])}.membership_healthy"] == 1, 10,
               "the near server failed its health checks")
    status, _, body = call(g, key=KEYS["team-b"])  # its second, in the far region
    assert status == 200 and json.loads(body)["backend"] == "far"
    assert call(g, key=KEYS["team-b"])[0] == 429  # one bucket for the tenant, whatever the region

    near_server.start()
    wait_until(lambda: json.loads(call(g, key=KEYS["team-a"])[2])["backend"] == "near", 20,
               "requests back at the near region")
    back = load(g, clients=1, seconds=1)
    assert Counter(back) == {(200, "near"): len(back)}, Counter(back)


# -- models and entitlements -------------------------------------------------------------------------

def test_models_by_path_with_entitlements_costs_and_per_model_quotas(fleet):
    """Two models on their own servers: /v2/models/cube3d/... (v0.1, 512 shape tokens an object)
    and /v2/models/cube3d-v05/... (v0.5, 1024), the latter sent on as cube3d. team-c may call
    cube3d only: 403 on the other, which no server sees. team-a's one bucket of 2048 tokens pays
    for both models; team-b has 4096 but at most 1024 of them on cube3d-v05."""
    v01, v05 = fleet.stub("v01"), fleet.stub("v05")
    g = fleet.gateway({
        "models": [{"name": "cube3d", "config": "v0.1", "backends": [v01.address]},
                   {"name": "cube3d-v05", "config": "v0.5", "backends": [v05.address]}],
        "tenants": [tenant("team-a", shape_tokens=2048, per="1h"),
                    {**tenant("team-b", shape_tokens=4096, per="1h"),
                     "models": {"cube3d": {}, "cube3d-v05": {"shape_tokens": 1024, "per": "1h"}}},
                    {**tenant("team-c"), "models": ["cube3d"]}]})
    v05_path = "/v2/models/cube3d-v05/infer"

    # By path, rewritten to the servers' name, the model named to the server.
    assert call(g, INFER, key=KEYS["team-c"])[0] == 200
    assert call(g, "/v2/models/cube3d-v05_stream/versions/2/generate", key=KEYS["team-b"])[0] == 200
    assert [(r["path"], r["headers"]["x-cube3d-model"]) for r in v01.requests()] == [(INFER, "cube3d")]
    assert [(r["path"], r["headers"]["x-cube3d-model"]) for r in v05.requests()] == \
        [("/v2/models/cube3d_stream/versions/2/generate", "cube3d-v05")]
    # A client's own model header is not what the server sees.
    assert call(g, INFER, key=KEYS["team-c"], headers={"x-cube3d-model": "cube3d-v05"})[0] == 200
    assert v01.requests()[-1]["headers"]["x-cube3d-model"] == "cube3d"

    # Entitlements: team-c is not entitled to cube3d-v05, on any of its paths.
    for path in (v05_path, "/v2/models/cube3d-v05_stream/generate_stream", "/v2/models/cube3d-v05/config"):
        status, _, body = call(g, path, key=KEYS["team-c"])
        assert status == 403 and b"not entitled to model cube3d-v05" in body, (path, status, body)
    assert len(v05.requests()) == 1  # none of them reached a server

    # Costs: team-a's 2048 = one v0.5 object (1024) and two v0.1 (512 each), from one bucket.
    assert [call(g, p, key=KEYS["team-a"])[0] for p in (v05_path, INFER, INFER, INFER)] == [200, 200, 200, 429]
    # Per-model quota: team-b's second v0.5 object (1024 + 1024 > its 1024 there) is refused,
    # its v0.1 objects are not; its first stream call above already took 1024.
    assert call(g, v05_path, key=KEYS["team-b"])[0] == 429
    assert [call(g, INFER, key=KEYS["team-b"])[0] for _ in range(2)] == [200, 200]
    # Metadata and health cost nothing.
    assert all(call(g, "/v2/models/cube3d-v05/config", key=KEYS["team-a"])[0] == 200 for _ in range(3))
    # A model named by a tenant's entitlements must exist.
    with pytest.raises(gateway_config.GatewayConfigError, match="models.cube3d-v9: no such model"):
        gateway_config.parse({"backends": ["127.0.0.1:1"], "tenants": [{**tenant("team-a"), "models": ["cube3d-v9"]}]})
    with pytest.raises(gateway_config.GatewayConfigError, match="less than one object \\(1024 shape tokens\\) of model m5"):
        gateway_config.parse({"models": [{"name": "m5", "config": "v0.5", "backends": ["127.0.0.1:1"]}],
                              "tenants": [{**tenant("team-a"), "models": {"m5": {"shape_tokens": 512, "per": "1h"}}}]})


def test_the_gateway_joins_the_clients_trace_and_passes_it_on(fleet):
    """With `tracing`, a request's W3C traceparent reaches the server in the same trace, its
    parent one of the gateway's spans; a request without one starts a trace there. (Its spans
    go to a collector that is not there: the request does not wait for them. Every hop in a real
    trace backend: the test below.)"""
    from cubeserve import tracing

    backend = fleet.stub("b1")
    g = fleet.gateway({"backends": [backend.address], "tenants": [tenant("team-a")],
                       "tracing": {"collector": f"127.0.0.1:{free_port()}"}})
    sent = tracing.new_traceparent()
    assert call(g, key=KEYS["team-a"], headers={"traceparent": sent})[0] == 200
    assert call(g, key=KEYS["team-a"])[0] == 200
    [joined, started] = [r["headers"]["traceparent"] for r in backend.requests()]
    assert tracing.trace_id(joined) == tracing.trace_id(sent) and joined.split("-")[2] != sent.split("-")[2]
    assert re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-01", started) and tracing.trace_id(started) != tracing.trace_id(sent)


# -- k8s/gateway: the same for Envoy Gateway v1.9.0 --------------------------------------------------

def test_k8s_gateway_says_what_examples_gateway_regions_does(gateway_k8s, tmp_path):
    """k8s/gateway/ (valid for Envoy Gateway v1.9.0: tests/test_gateway.py) against the local
    example with regions, models, entitlements and tracing: the far region a fallback Backend
    (priority 1) beside the near one, retries moving priority after each try as the local
    previous_priorities does, a rule per model with its path rewritten and its model header, a
    Deny for each model a tenant is not entitled to, the second model's cost and quota, and
    Envoy's spans to an OTLP collector at every request."""
    _, _, objects = gateway_k8s
    by_kind = {o["kind"]: o for o in objects}
    example = gateway_config.load(REPO / "examples" / "gateway-regions.yaml")
    validate(example, write(example, tmp_path))  # Envoy accepts the example
    rendered = render(example)
    default, second = example.models
    # Regions: near first (the predictor Service), the far one a fallback (priority 1).
    assert [r.priority for r in default.regions] == [0, 1]
    [backend] = [o for o in objects if o["kind"] == "Backend"]
    assert backend["spec"]["fallback"] is True
    rules = {r["name"]: r for r in by_kind["HTTPRoute"]["spec"]["rules"]}
    refs = rules[default.name]["backendRefs"]
    assert refs[0] == {"name": "cube3d-predictor", "port": 80}
    assert refs[1] == {"group": "gateway.envoyproxy.io", "kind": "Backend", "name": backend["metadata"]["name"]}
    [inner] = [listener for listener in rendered["static_resources"]["listeners"] if listener["name"] == "backends"]
    local_retry = inner["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]["virtual_hosts"][0][
        "routes"][0]["route"]["retry_policy"]
    retry = by_kind["BackendTrafficPolicy"]["spec"]["retry"]
    assert retry["numAttemptsPerPriority"] == local_retry["retry_priority"]["typed_config"]["update_frequency"]
    assert retry["numRetries"] == local_retry["num_retries"]
    assert by_kind["BackendTrafficPolicy"]["spec"]["healthCheck"]["passive"]["consecutiveGatewayErrors"] >= 1 << 20
    # Models: a rule each, rewritten to the servers' names, the model named in x-cube3d-model.
    for name, prefix, upstream in ((second.name, f"/v2/models/{second.name}", "/v2/models/cube3d"),
                                   (f"{second.name}-stream", f"/v2/models/{second.name}_stream",
                                    "/v2/models/cube3d_stream")):
        rule = rules[name]
        assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": prefix}}]
        filters = {f["type"]: f for f in rule["filters"]}
        assert filters["URLRewrite"]["urlRewrite"]["path"]["replacePrefixMatch"] == upstream
        assert filters["RequestHeaderModifier"]["requestHeaderModifier"]["set"] == \
            [{"name": "x-cube3d-model", "value": second.name}]
    assert rules[default.name]["filters"][0]["requestHeaderModifier"]["set"] == \
        [{"name": "x-cube3d-model", "value": default.name}]
    # Entitlements: a Deny for each (tenant, model) the example refuses, and no other.
    auth = by_kind["SecurityPolicy"]["spec"]["authorization"]
    assert auth["defaultAction"] == "Allow"
    denied = {(h["values"][0], r["operation"]["path"]["value"]) for r in auth["rules"] if r["action"] == "Deny"
              for h in r["principal"]["headers"] if h["name"] == TENANT_KEY}
    expected = {(t.id, m.name) for t in example.tenants for m in example.models if not t.entitled(m.name)}
    assert {(tenant_id, next(m.name for m in example.models if re.fullmatch(regex, f"/v2/models/{m.name}/infer")))
            for tenant_id, regex in denied} == expected == {("team-b", second.name)}
    for tenant_id, regex in denied:  # the same paths as the local 403
        for path in (f"/v2/models/{second.name}/infer", f"/v2/models/{second.name}_stream/generate_stream",
                     f"/v2/models/{second.name}/config", f"/v2/models/{default.name}/infer"):
            assert bool(re.fullmatch(regex, path)) == bool(re.fullmatch(model_path(second), path)), path
    # The second model's cost and team-a's quota of it.
    [v05] = [r for r in by_kind["BackendTrafficPolicy"]["spec"]["rateLimit"]["global"]["rules"]
             if second.name in r["clientSelectors"][0]["path"]["value"]]
    team_a = next(t for t in example.tenants if t.id == "team-a")
    assert v05["cost"]["request"]["number"] == second.tokens_per_object == 1024
    assert v05["limit"] == {"requests": dict(team_a.model_quotas)[second.name].shape_tokens, "unit": "Hour"}
    # Traces: Envoy's OpenTelemetry tracer at every request, to an OTLP/gRPC collector.
    tracing = by_kind["EnvoyProxy"]["spec"]["telemetry"]["tracing"]
    assert tracing["samplingRate"] == example.tracing.sample_percent == 100
    assert tracing["provider"]["type"] == "OpenTelemetry"
    assert tracing["provider"]["backendRefs"][0]["port"] == example.tracing.collector[1] == 4317
    assert by_kind["Gateway"]["spec"]["infrastructure"]["parametersRef"] == \
        {"group": "gateway.envoyproxy.io", "kind": "EnvoyProxy", "name": by_kind["EnvoyProxy"]["metadata"]["name"]}


# -- heavier: make gateway-e2e-test -----------------------------------------------------------------

@pytest.mark.gateway_e2e
def test_a_flapping_region_loses_no_request(fleet):
    """The near region's server killed (SIGKILL, requests in flight cut) and started again every
    2 s for 16 s, under 4 clients: every request is answered 200 (cut ones and refused ones are
    retried in the far region)."""
    near_server, far_server = fleet.stub("near", delay=0.1), fleet.stub("far", delay=0.1)
    near, far = fleet.region("near", near_server, NEAR_MS), fleet.region("far", far_server, FAR_MS)
    g = fleet.gateway({"regions": two_regions(near, far), "tenants": [tenant("team-a")]})
    flaps, stop = [], threading.Event()

    def flap():
        while not stop.wait(2.0):
            near_server.kill()
            flaps.append(time.monotonic())
            if stop.wait(2.0):
                break
            near_server.start()

    flapper = threading.Thread(target=flap)
    flapper.start()
    try:
        statuses = load(g, clients=4, seconds=16)
    finally:
        stop.set()
        flapper.join(30)
    shares = Counter(statuses)
    assert len(flaps) >= 3
    assert set(s for s, _ in statuses) == {200}, shares
    assert shares[(200, "near")] > 0 and shares[(200, "far")] > 0, shares


# -- traces: one request through every hop, in a real trace backend --------------------------------

@pytest.mark.gateway_e2e
def test_one_requests_trace_spans_every_hop_and_its_timing_adds_up(tmp_path, monkeypatch):
    """cube3d-client --trace through the gateway (tracing on), a region's ingress and the real
    server (front end, tritonserver in its OpenTelemetry mode, the engine's stages), all
    exporting to Jaeger: the trace id the client prints finds spans of every hop in Jaeger, each
    hop's span inside its caller's, and the engine's stages inside its generate span, one after
    another. Over gRPC (to the server): the client, the gRPC front end and the engine in one trace."""
    import os
    import subprocess
    import sys

    from cubeserve import tracing
    from cubeserve.server.local_triton import DEMO_MODEL, LocalTriton, copy_model_repository, ensure_demo_weights
    from trace_backend import Jaeger, binary

    if binary() is None:
        from guards import cannot_run

        cannot_run("Jaeger is not built: `make trace-backend`")
    root = copy_model_repository(tmp_path / "models")
    ensure_demo_weights(root, DEMO_MODEL)
    with Jaeger(tmp_path / "jaeger") as jaeger:
        env = {tracing.ENDPOINT_ENV: jaeger.otlp_http}
        with LocalTriton(root, free_port(), free_port(), free_port(), env=env) as server:
            region = RegionFront("near", [server.http_url.removeprefix("http://")], NEAR_MS,
                                 workdir=tmp_path / "region").start()
            try:
                cfg = gateway_config.parse({
                    "listen": f"127.0.0.1:{free_port()}", "model": "demo",
                    "regions": [{"name": "near", "priority": 0, "backends": [region.address]}],
                    "tracing": {"collector": jaeger.otlp_grpc}, "tenants": [tenant("team-a")]})
                with Gateway(cfg, tmp_path / "gateway", concurrency=1) as g:
                    g.wait_healthy()
                    out = subprocess.run(
                        [sys.executable, "-m", "cube3d_client.cli", "a round table", "--url", g.url.removeprefix("http://"),
                         "--api-key", KEYS["team-a"], "--trace", "--seed", "0", "--resolution", "4", "--retries", "0",
                         "--out", str(tmp_path / "mesh.glb")],
                        capture_output=True, text=True, timeout=300, env={**os.environ, **env})
                    assert out.returncode == 0, out.stdout + out.stderr
                    trace_id = re.search(r"trace id: ([0-9a-f]{32})", out.stdout).group(1)
                    services = {"cube3d-client", "cube-serve-gateway", "cube3d-front", tracing.TRITON_SERVICE,
                                "cube3d-engine"}

                    def complete():  # each process exports on its own time (Envoy's: every 5 s)
                        spans = jaeger.trace(trace_id)
                        ids = {s["spanID"] for s in spans}
                        return services <= {s["service"] for s in spans} and \
                            {"queue", "prefill", "decode", "geometry"} <= {s["operationName"] for s in spans} and \
                            sum(s["service"] == "cube-serve-gateway" for s in spans) == 4 and \
                            all(r["spanID"] in ids for s in spans for r in s["references"] if r["refType"] == "CHILD_OF")

                    try:
                        wait_until(complete, 30, f"spans of every hop in Jaeger ({sorted(services)})", poll=0.5)
                    except AssertionError as exc:
                        found = sorted({(s["service"], s["operationName"]) for s in jaeger.trace(trace_id)})
                        raise AssertionError(f"{exc}; found {found}; server log: {server._log_tail()}") from None
                # gRPC, straight to the server (the gateway serves REST): the gRPC front end's span.
                from cube3d_client import Cube3DClient

                monkeypatch.setenv(tracing.ENDPOINT_ENV, jaeger.otlp_http)  # this process's client span too
                with Cube3DClient(f"127.0.0.1:{server.grpc_port}", "grpc", trace=True, retries=0) as client:
                    client.generate("a round table", seed=0, resolution=4)
                # The hops this part is about; tritonserver's own span (checked over REST above) is
                # missing from about 1 gRPC request's trace in 10 here (Triton 2.51's OpenTelemetry
                # mode), while its request, the front end's and the engine's spans all arrive.
                grpc_services = services - {"cube-serve-gateway", tracing.TRITON_SERVICE}
                try:
                    wait_until(lambda: grpc_services <= {s["service"] for s in jaeger.trace(client.trace_id)} and "geometry" in
                               {s["operationName"] for s in jaeger.trace(client.trace_id)}, 30, "the gRPC request's spans")
                except AssertionError as exc:
                    found = sorted({(s["service"], s["operationName"]) for s in jaeger.trace(client.trace_id)})
                    raise AssertionError(f"{exc}; wanted the services {sorted(grpc_services)} and a geometry "
                                         f"span; found {found}; server log: {server._log_tail()}; Jaeger's log: "
                                         f"{jaeger.log_tail()}") from None
                grpc_spans = jaeger.trace(client.trace_id)
            finally:
                region.stop()
        spans = jaeger.trace(trace_id)
    table = "\n".join(f"{s['service']:20} {s['operationName']:32} {s['startTime']:>17} {s['duration']:>9} us"
                      for s in sorted(spans, key=lambda s: s["startTime"]))
    print(table)
    try:
        _check_trace(spans)
    except AssertionError as exc:  # with every span, so that a failure says what the trace was
        raise AssertionError(f"{exc}\n{table}") from None
    by_id = {s["spanID"]: s for s in grpc_spans}
    [front] = [s for s in grpc_spans if s["service"] == "cube3d-front"]
    [generate] = [s for s in grpc_spans if s["service"] == "cube3d-engine" and s["operationName"] == "generate"]
    assert front["operationName"] == "ModelInfer"
    assert by_id[front["references"][0]["spanID"]]["service"] == "cube3d-client"
    assert by_id[generate["references"][0]["spanID"]] is front


def _check_trace(spans: list[dict]) -> None:
    from cubeserve import tracing

    by_id = {s["spanID"]: s for s in spans}

    def parent(span):
        refs = [r["spanID"] for r in span["references"] if r["refType"] == "CHILD_OF"]
        return by_id.get(refs[0]) if refs else None

    def chain(span):
        out = []
        while span is not None:
            out.append(span)
            span = parent(span)
        return out

    tolerance_us = 3000  # clocks are one machine's; timestamps are rounded to microseconds
    for span in spans:
        up = parent(span)
        if up is not None:  # every hop inside its caller's
            assert up["startTime"] - tolerance_us <= span["startTime"], (span["operationName"], up["operationName"])
            assert span["startTime"] + span["duration"] <= up["startTime"] + up["duration"] + tolerance_us, \
                (span["service"], span["operationName"], up["service"], up["operationName"])
    [root] = [s for s in spans if parent(s) is None]
    assert root["service"] == "cube3d-client"
    [front] = [s for s in spans if s["service"] == "cube3d-front"]
    assert [s["service"] for s in chain(front)][1:] == ["cube-serve-gateway"] * 4 + ["cube3d-client"]
    [generate] = [s for s in spans if s["service"] == "cube3d-engine" and s["operationName"] == "generate"]
    assert parent(generate) is front
    assert any(s["service"] == tracing.TRITON_SERVICE and front in chain(s) for s in spans)
    stages = sorted((s for s in spans if parent(s) is generate), key=lambda s: s["startTime"])
    assert [s["operationName"] for s in stages] == ["queue", "prefill", "decode", "geometry", "export", "answer"]
    for before, after in zip(stages, stages[1:]):  # one after another
        assert before["startTime"] + before["duration"] <= after["startTime"] + tolerance_us
    assert sum(s["duration"] for s in stages) <= generate["duration"] + tolerance_us
    assert stages[2]["duration"] > 0  # decoding took time
    # Nothing lost on the way out: the named stages cover all but a few percent of `generate`
    # (the forward's way to the engine and back; issue 53 found 440 ms of 718 ms in none).
    outside = generate["duration"] - sum(s["duration"] for s in stages)
    assert outside < 0.05 * generate["duration"] + tolerance_us, (outside, generate["duration"])
