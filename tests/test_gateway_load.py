"""Servers report their load, and the gateway routes by it (issue 51; docs/gateway/regions-models-
traces.md, "Load-aware routing").

The report (server/load_report.py): every answer of the REST front end carries the header
`endpoint-load-metrics` (Envoy's text form), every gRPC call ends with `endpoint-load-metrics-bin`
in its trailing metadata, refused ones included, with the generations in progress at the server
(the REST and gRPC ones together) over its scaling target: the front ends alone, in this process,
in front of a stand-in tritonserver that holds requests until the test lets them go (what the
report counts is the front end's own bookkeeping, the same whatever Triton computes).

The routing (`routing: load-aware`, gateway/envoy.py): the real Envoy in front of two regions on
the loopback (gateway/regions.py: 2 ms near, 40 ms far) with tests/stub_backend.py servers that
report their load as the front ends do. An idle near region keeps nearly every request; one made
busy by requests held in flight there (sent to its server directly, unseen by the gateway) sends
a measurable share to the far one, and gets it back when the load is gone; a full near region
spills over and a dead one fails over, no request lost."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest
from tritonclient.grpc import service_pb2 as pb

from cubeserve import deploy
from cubeserve.gateway import config as gateway_config
from cubeserve.gateway import weights
from cubeserve.gateway.envoy import model_cluster, model_clusters, render, via_cluster, weights_key
from cubeserve.server import load_report
from cubeserve.server.front import FrontEnd
from cubeserve.server.grpc_front import INFER, STREAM, GrpcFrontEnd
from cubeserve.server.load_report import LoadReport
from cubeserve.server.local_triton import copy_model_repository, free_port
from serving_helpers import wait_until
from test_gateway import KEYS, call, envoy, tenant  # noqa: F401 (fixtures)
from test_gateway_regions import FAR_MS, NEAR_MS, fleet, load, two_regions  # noqa: F401 (fixtures)

GENERATE = "/v2/models/cube3d/generate"


def parse_text(value: str) -> dict[str, float]:
    """Envoy's text form, as its parser (orca_parser.cc) reads it."""
    assert value.startswith("TEXT "), value
    pairs = [item.strip().split("=", 1) for item in value.removeprefix("TEXT ").split(",")]
    return {name: float(number) for name, number in pairs}


def orca_message():
    """xds.data.orca.v3.OrcaLoadReport (the fields the servers send), built here from its field
    numbers: the report's bytes are read by protobuf itself, not by our encoder's inverse."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    f = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="test_orca.proto", package="xds.data.orca.v3", syntax="proto3")
    report = file.message_type.add(name="OrcaLoadReport")
    for name, number in (("cpu_utilization", 1), ("rps_fractional", 6), ("eps", 7), ("application_utilization", 9)):
        report.field.add(name=name, number=number, type=f.TYPE_DOUBLE, label=f.LABEL_OPTIONAL)
    entry = report.nested_type.add(name="NamedMetricsEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=f.TYPE_STRING, label=f.LABEL_OPTIONAL)
    entry.field.add(name="value", number=2, type=f.TYPE_DOUBLE, label=f.LABEL_OPTIONAL)
    report.field.add(name="named_metrics", number=8, type=f.TYPE_MESSAGE, label=f.LABEL_REPEATED,
                     type_name=".xds.data.orca.v3.OrcaLoadReport.NamedMetricsEntry")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("xds.data.orca.v3.OrcaLoadReport"))


def parse_binary(raw: bytes) -> dict[str, float]:
    report = orca_message().FromString(raw)
    out = {"application_utilization": report.application_utilization, "rps_fractional": report.rps_fractional,
           "eps": report.eps}
    out.update({f"named_metrics.{k}": v for k, v in report.named_metrics.items()})
    return out


def parse_trailing(metadata) -> dict[str, float]:
    """A gRPC call's report: the text entry (grpcio hands the application no -bin one: it
    consumes it; test_the_binary_report_says_what_the_text_does holds the two together)."""
    [text] = [value for key, value in metadata or () if key == load_report.HEADER]
    return parse_text(text)


class HeldTriton:
    """A stand-in for tritonserver's REST endpoint: GETs answered at once; each POST waits for
    `release()` (one at a time), then answers 200, or 503 when its body says "busy", 400 "bad"."""

    def __init__(self):
        self.waiting = 0
        self._gate = threading.Semaphore(0)
        held = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self, status: int) -> None:
                body = b'{"model_name":"cube3d"}'
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._answer(200)

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                held.waiting += 1
                held._gate.acquire()
                held.waiting -= 1
                self._answer(503 if b"busy" in body else 400 if b"bad" in body else 200)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def release(self) -> None:
        self._gate.release()

    def stop(self) -> None:
        for _ in range(16):
            self._gate.release()
        self.server.shutdown()


def rest(port: int, path: str, body: bytes | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, method="POST" if body else "GET",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            return reply.status, dict(reply.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers)


def test_every_rest_answer_carries_the_servers_load_and_it_follows_the_requests_in_flight():
    """Scaling target 2, max_objects 1: idle reads 0; three generations held in flight read 1.5
    (3 / 2) with 2 queued, on a refused answer (400, 404) too; as each is answered its own answer
    reads the requests still in progress, itself included; then answers per second, a 503
    counted as an error, and a generation's recent time from answered generations only."""
    triton = HeldTriton()
    load = LoadReport(target=2, max_objects=1)
    front = FrontEnd("127.0.0.1", free_port(), triton.port, deploy.new_admin_key(), load=load).start()
    try:
        status, headers = rest(front.port, deploy.READY_PATH)
        assert status == 200 and parse_text(headers[load_report.HEADER]) == {
            "application_utilization": 0, "rps_fractional": 0, "eps": 0, "named_metrics.queue": 0}
        answers: list = []
        threads = [threading.Thread(target=lambda: answers.append(rest(front.port, GENERATE, b'{"PROMPT": "a"}')))
                   for _ in range(3)]
        for t in threads:
            t.start()
        wait_until(lambda: triton.waiting == 3, 10, "three generations held in flight")
        for path, body, code in ((GENERATE, b"{", 400), ("/v2/nothing", None, 404)):
            status, headers = rest(front.port, path, body)
            report = parse_text(headers[load_report.HEADER])
            assert status == code and report["application_utilization"] == 1.5 and report["named_metrics.queue"] == 2, \
                (path, report)
        for expected in (1.5, 1.0, 0.5):  # each answer counts itself
            triton.release()
            wait_until(lambda: len(answers) == round(4 - 2 * expected), 10, "an answer")
            status, headers = answers[-1]
            assert status == 200 and parse_text(headers[load_report.HEADER])["application_utilization"] == expected
        status, headers = rest(front.port, deploy.READY_PATH)
        report = parse_text(headers[load_report.HEADER])
        assert report["application_utilization"] == 0 and report["named_metrics.queue"] == 0
        assert 0.2 < report["rps_fractional"] <= 0.3 and report["eps"] == 0  # 3 answers, time constant 10 s
        triton.release()
        status, headers = rest(front.port, GENERATE, b'{"PROMPT": "busy"}')
        assert status == 503 and parse_text(headers[load_report.HEADER])["application_utilization"] == 0.5
        assert parse_text(rest(front.port, deploy.READY_PATH)[1][load_report.HEADER])["eps"] > 0
        # A generation's recent time: from the answered ones only (a refusal's quick answer is none).
        seconds = f"named_metrics.{load_report.SECONDS_METRIC}"
        before = parse_text(rest(front.port, deploy.READY_PATH)[1][load_report.HEADER])[seconds]
        assert before > 0
        for body in (b'{"PROMPT": "bad"}', b'{"PROMPT": "busy"}'):
            triton.release()
            assert rest(front.port, GENERATE, body)[0] in (400, 503)
        assert parse_text(rest(front.port, deploy.READY_PATH)[1][load_report.HEADER])[seconds] == before
    finally:
        front.stop()
        triton.stop()


class HeldGrpcTriton:
    """A stand-in for tritonserver's gRPC endpoint: ModelInfer, and each request of a
    ModelStreamInfer, wait for `release()`, then are answered."""

    def __init__(self):
        from concurrent import futures

        self.waiting = 0
        self._gate = threading.Semaphore(0)
        held = self

        def infer(raw, context):
            held.waiting += 1
            held._gate.acquire()
            held.waiting -= 1
            return pb.ModelInferResponse(model_name="cube3d").SerializeToString()

        def stream(requests, context):
            for raw in requests:
                yield pb.ModelStreamInferResponse(infer_response=pb.ModelInferResponse.FromString(
                    infer(raw, context))).SerializeToString()

        class Handler(grpc.GenericRpcHandler):
            def service(self, details):
                if details.method == INFER:
                    return grpc.unary_unary_rpc_method_handler(infer)
                if details.method == STREAM:
                    return grpc.stream_stream_rpc_method_handler(stream)
                return None

        self.server = grpc.server(futures.ThreadPoolExecutor(8))
        self.server.add_generic_rpc_handlers((Handler(),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def release(self) -> None:
        self._gate.release()

    def stop(self) -> None:
        for _ in range(16):
            self._gate.release()
        self.server.stop(0)


def _infer_request(inputs: bool = True) -> bytes:
    request = pb.ModelInferRequest(model_name="cube3d")
    if inputs:
        tensor = request.inputs.add(name="PROMPT", datatype="BYTES", shape=[1])
        tensor.contents.bytes_contents.append(b"a chair")
    return request.SerializeToString()


def test_every_grpc_call_ends_with_the_servers_load_in_its_trailing_metadata():
    """The same over gRPC, in the serialized OrcaLoadReport: two ModelInfer calls held in flight
    read 1.0 (2 / 2) and 1 queued on a refused call (INVALID_ARGUMENT); a stream's request held
    counts too; each answer reads what is still in progress, itself included; and the REST front
    end sharing the report (as the supervisor makes them) counts the gRPC calls."""
    triton = HeldGrpcTriton()
    load = LoadReport(target=2, max_objects=1)
    front = GrpcFrontEnd("127.0.0.1", free_port(), triton.port, deploy.new_admin_key(), load=load).start()
    rest_front = FrontEnd("127.0.0.1", free_port(), free_port(), deploy.new_admin_key(), load=load).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{front.port}")
    infer = channel.unary_unary(INFER)
    try:
        answers: list = []
        threads = [threading.Thread(target=lambda: answers.append(infer.with_call(_infer_request(), timeout=30)))
                   for _ in range(2)]
        for t in threads:
            t.start()
        wait_until(lambda: triton.waiting == 2, 10, "two ModelInfer calls held in flight")
        with pytest.raises(grpc.RpcError) as refused:
            infer(_infer_request(inputs=False), timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        report = parse_trailing(refused.value.trailing_metadata())
        assert report["application_utilization"] == 1.0 and report["named_metrics.queue"] == 1, report
        status, headers = rest(rest_front.port, "/v2/nothing")  # one report for both ports
        assert status == 404 and parse_text(headers[load_report.HEADER])["application_utilization"] == 1.0
        for expected in (1.0, 0.5):
            triton.release()
            wait_until(lambda: len(answers) == round(4 - 2 * expected) - 1, 10, "an answer")
            assert parse_trailing(answers[-1][1].trailing_metadata())["application_utilization"] == expected
        # A stream's request counts while it is in progress; the stream ends with a report.
        done = threading.Event()

        def requests():
            yield _infer_request()
            done.wait(30)

        call = channel.stream_stream(STREAM)(requests(), timeout=30)
        wait_until(lambda: triton.waiting == 1, 10, "the stream's request held in flight")
        with pytest.raises(grpc.RpcError) as refused:
            infer(_infer_request(inputs=False), timeout=30)
        assert parse_trailing(refused.value.trailing_metadata())["application_utilization"] == 0.5
        triton.release()
        assert len(list(zip(range(1), call))) == 1  # its answer
        done.set()
        list(call)
        report = parse_trailing(call.trailing_metadata())
        assert report["application_utilization"] == 0 and report["rps_fractional"] > 0, report
    finally:
        channel.close()
        rest_front.stop()
        front.stop()
        triton.stop()


def test_the_report_takes_the_servers_target_and_max_objects_from_its_repository(tmp_path):
    """The supervisor's report: KIND_CPU (the shipped config) is deploy.SCALE_TARGET_CPU, KIND_GPU
    deploy.SCALE_TARGET; max_objects from cube3d_stream's parameters; both front ends share it."""
    from cubeserve.serving.repository import _GPU_GROUP, _config_with_instance_group
    from cubeserve.server.supervisor import Supervisor, front_limits

    repo = copy_model_repository(tmp_path / "models", {"max_objects": "3"})
    report = LoadReport.for_repository(repo)
    assert (report.target, report.max_objects) == (deploy.SCALE_TARGET_CPU, 3)
    config = repo / deploy.STREAM_MODEL / "config.pbtxt"
    config.write_text(_config_with_instance_group(config, _GPU_GROUP))
    assert LoadReport.for_repository(repo).target == deploy.SCALE_TARGET
    assert LoadReport.for_repository(tmp_path / "nothing").max_objects is None  # no queue reported
    supervisor = Supervisor(["tritonserver", "--http-address=127.0.0.1", f"--http-port={free_port()}",
                             "--grpc-address=127.0.0.1", f"--grpc-port={free_port()}", f"--model-repository={repo}"],
                            rest_port=free_port(), grpc_port=free_port(), limits=front_limits(4096), env={})
    rest_front, grpc_front = supervisor.fronts
    assert rest_front.load is grpc_front.load is supervisor.load and supervisor.load.max_objects == 3


# -- the gateway: routing by the reports ----------------------------------------------------------------

def test_load_aware_routing_renders_a_cluster_per_region_drawn_by_runtime_weights():
    """routing load-aware: a cluster per region that starts there (that region at priority 0, the
    others after it by their priorities, so a 503 or a dead region still spills over), the model's
    route drawing them by weights the runtime can change (the near region's cluster all but the
    probe share at first), an admin runtime layer for the weigher; the clients never see the
    reports. A wrong value names the field and the allowed ones; the default stays priority."""
    doc = {"regions": [{"name": "onprem", "priority": 0, "backends": ["127.0.0.1:1"]},
                       {"name": "cloud", "priority": 3, "backends": ["127.0.0.1:2"]},
                       {"name": "backup", "priority": 5, "backends": ["127.0.0.1:3"]}],
           "tenants": [tenant("team-a")]}
    assert gateway_config.parse(doc).routing == "priority"
    cfg = gateway_config.parse({**doc, "routing": "load-aware"})
    model = cfg.models[0]
    rendered = render(cfg)
    clusters = {c["name"]: c for c in rendered["static_resources"]["clusters"]}
    assert model_cluster(model) not in clusters
    layouts = {name: [(e["priority"], e["locality"]["region"]) for e in clusters[name]["load_assignment"]["endpoints"]]
               for name in model_clusters(cfg, model)}
    assert layouts == {
        via_cluster(model, model.regions[0]): [(0, "onprem"), (1, "cloud"), (2, "backup")],
        via_cluster(model, model.regions[1]): [(0, "cloud"), (1, "onprem"), (2, "backup")],
        via_cluster(model, model.regions[2]): [(0, "backup"), (1, "onprem"), (2, "cloud")]}
    [inner] = [listener for listener in rendered["static_resources"]["listeners"] if listener["name"] == "backends"]
    routes = inner["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    drawn = [r["route"]["weighted_clusters"] for r in routes if "weighted_clusters" in r.get("route", {})]
    assert len(drawn) == 2  # the model's paths, and everything else (health, metadata) to the default model
    probe = round(weights.PROBE_SHARE / 2 * weights.TOTAL_WEIGHT)
    assert drawn[0] == {"runtime_key_prefix": weights_key(model), "clusters": [
        {"name": via_cluster(model, model.regions[0]), "weight": weights.TOTAL_WEIGHT - 2 * probe},
        {"name": via_cluster(model, model.regions[1]), "weight": probe},
        {"name": via_cluster(model, model.regions[2]), "weight": probe}]}
    assert {"name": "weigher", "admin_layer": {}} in rendered["layered_runtime"]["layers"]
    assert "layered_runtime" not in render(gateway_config.parse(doc))
    [edge] = [listener for listener in rendered["static_resources"]["listeners"] if listener["name"] == "edge"]
    removed = edge["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]["response_headers_to_remove"]
    assert {load_report.HEADER, load_report.GRPC_METADATA} <= set(removed)
    with pytest.raises(gateway_config.GatewayConfigError, match=r"gateway.routing: must be one of priority, "
                                                                r"load-aware, got 'nearest'"):
        gateway_config.parse({**doc, "routing": "nearest"})
    with pytest.raises(gateway_config.GatewayConfigError, match="load-aware needs one near region per model"):
        gateway_config.parse({**doc, "routing": "load-aware",
                              "regions": [{**r, "priority": 0} for r in doc["regions"]]})


def test_the_weigher_moves_to_the_region_promising_less_latency_and_not_for_a_near_equal():
    """gateway/weights.py without Envoy or servers, on its own clock: a region's expected latency
    is its round trip (the least of the recent polls), its recent generation time and the wait its
    queue predicts; an idle server's
    old time is replaced by the best one reported; the choice starts near, moves only to a region
    SWITCH_MARGIN faster and not within HOLD_S of the last move; a region that does not answer
    (DOWN_AFTER polls in a row) is never chosen; the chosen region gets all but PROBE_SHARE."""
    def server(rtt, seconds=None, utilization=1.0, queue=0.0, rps=0.0):
        s = weights.Server(("127.0.0.1", 1))
        report = {"application_utilization": utilization, "named_metrics.queue": queue, "rps_fractional": rps}
        if seconds is not None:
            report["named_metrics.seconds"] = seconds
        s.observe(rtt, report)
        return s

    assert weights.parse_report("TEXT application_utilization=0.5,named_metrics.seconds=1.25") == {
        "application_utilization": 0.5, "named_metrics.seconds": 1.25}
    assert weights.parse_report("{}") == weights.parse_report(None) == {}
    assert server(0.04, 0.5).expected_s(None) == pytest.approx(0.54)
    assert server(0.04, 0.5, queue=2, rps=4).expected_s(None) == pytest.approx(0.04 + 0.5 + 0.5)
    assert server(0.04, 0.5, queue=2).expected_s(None) == pytest.approx(0.04 + 0.5 + 2 * 0.5)  # no rate yet
    assert server(0.002, 3.0, utilization=0).expected_s(0.5) == pytest.approx(0.502)  # idle: the best time
    assert server(0.002, 3.0).expected_s(0.5) == pytest.approx(3.002)  # busy: its own
    assert server(0.002).expected_s(None) is None  # nothing known yet
    slowed = server(0.04, 0.5)
    slowed.observe(0.3, slowed.report)  # a busy server answers the poll late: counted in its report only
    assert slowed.expected_s(None) == pytest.approx(0.54)
    dead = weights.Server(("127.0.0.1", 1))
    dead.observe(None, {})
    assert dead.expected_s(0.5) is None
    flaky = server(0.04, 0.5)
    flaky.observe(None, {})  # one poll lost: still up, as it was
    assert flaky.expected_s(None) == pytest.approx(0.54)
    flaky.observe(None, {})
    assert flaky.expected_s(None) is None  # DOWN_AFTER in a row
    flaky.observe(0.05, {})  # answered again, without a report (a region's ingress refused the poll)
    assert flaky.expected_s(None) == pytest.approx(0.54)

    now = [0.0]
    choice = weights.Choice(["near", "far", "backup"], "near", clock=lambda: now[0])
    probes = weights.PROBE_SHARE / 2
    assert choice.shares() == {"near": 1 - weights.PROBE_SHARE, "far": probes, "backup": probes}
    m = weights.SWITCH_MARGIN
    assert choice.update({"near": 0.50, "far": 0.50 / (1 + m) + 0.01, "backup": None}) == "near"  # within the margin
    now[0] = 0.5
    faster = {"near": 0.50, "far": 0.50 / (1 + m) - 0.01, "backup": None}
    assert choice.update(faster) == "near"  # better, but within HOLD_S
    now[0] = weights.HOLD_S
    assert choice.update(faster) == "far"
    assert choice.shares() == {"near": probes, "far": 1 - weights.PROBE_SHARE, "backup": probes}
    now[0] += weights.HOLD_S
    far = faster["far"]
    assert choice.update({**faster, "backup": far / (1 + m) + 0.01}) == "far"  # not the margin better
    assert choice.update({**faster, "backup": far / (1 + m) - 0.01}) == "backup"
    now[0] += weights.HOLD_S / 2
    assert choice.update({"near": 0.30, "far": 0.40, "backup": 0.30}) == "backup"  # held
    now[0] += weights.HOLD_S
    assert choice.update({"near": 0.31, "far": 0.40, "backup": 0.30}) == "near"  # back near, though not the best
    assert choice.update({"near": None, "far": 0.40, "backup": 0.50}) == "far"  # it stopped answering: at once
    assert choice.update({"near": None, "far": None, "backup": None}) == "far"  # nothing known: as it was
    assert weights.region_weights({"near": 0.995, "far": 0.005}) == {"near": 9950, "far": 50}
    assert weights.region_weights({"near": 1.0, "far": 0.0}) == {"near": 10000, "far": 1}  # Envoy's minimum


def _busy(address: str, clients: int, stop: threading.Event) -> list[threading.Thread]:
    """`clients` threads sending POSTs straight to a server until `stop`: requests held in flight
    there that the gateway does not send."""
    def client():
        while not stop.is_set():
            request = urllib.request.Request(f"http://{address}{GENERATE}", data=b"{}", method="POST")
            try:
                urllib.request.urlopen(request, timeout=30).read()
            except OSError:
                pass

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    return threads


def _share(results, region: str) -> float:
    return Counter(backend for _, backend in results)[region] / max(1, len(results))


def test_an_idle_near_region_keeps_the_requests_and_a_slow_one_loses_them_until_it_recovers(fleet):
    """Two regions (2 ms, 40 ms), a server in each working on 2 requests at a time, 0.2 s each,
    and reporting its load, routing load-aware. One client: the near region keeps all but the
    probes (PROBE_SHARE). Four more clients at the near server (sent to it directly: the gateway
    sees only the reports) make a queue there, and its answers slower than the far region's round
    trip: the far region takes all but the probes. The load gone: the requests come back. No
    client sees a load report."""
    near_server = fleet.stub("near", delay=0.2, load_target=2, slots=2)
    far_server = fleet.stub("far", delay=0.2, load_target=2, slots=2)
    near, far = fleet.region("near", near_server, NEAR_MS), fleet.region("far", far_server, FAR_MS)
    g = fleet.gateway({"regions": two_regions(near, far), "tenants": [tenant("team-a")], "routing": "load-aware"})
    load(g, clients=1, seconds=2)  # each region has reported (the far one by a probe, or the first weights)
    assert not {k.lower() for k in call(g, key=KEYS["team-a"])[1]} & {load_report.HEADER, load_report.GRPC_METADATA}

    quiet = load(g, clients=1, seconds=4)
    assert {s for s, _ in quiet} == {200} and _share(quiet, "near") >= 0.9, Counter(quiet)  # a probe may go far

    stop = threading.Event()
    background = _busy(near_server.address, 4, stop)
    try:
        wait_until(lambda: g.weigher.chosen("cube3d") == "far", 20, "the far region chosen")
        busy = load(g, clients=1, seconds=4)
    finally:
        stop.set()
        for t in background:
            t.join(30)
    assert {s for s, _ in busy} == {200} and _share(busy, "far") >= 0.9, Counter(busy)

    # Nothing in progress at the near server: its last time is from its load, the far region's
    # stands for it, and its round trip is shorter.
    wait_until(lambda: g.weigher.chosen("cube3d") == "near", 20, "the near region chosen again")
    back = load(g, clients=1, seconds=4)  # as long as `quiet`: one probe in 9 requests is 11 %
    assert _share(back, "near") >= 0.9, Counter(back)


def test_with_load_aware_routing_a_full_near_region_spills_over_and_a_dead_one_fails_over(fleet):
    """The near region's server holds 2 requests at once and answers 503 past them (with its
    report): six clients are all served, the far region taking the rest; the near server killed,
    every request is served by the far one; back, requests return to the near region."""
    near_server = fleet.stub("near", delay=0.1, max_in_flight=2, load_target=2)
    far_server = fleet.stub("far", delay=0.1, load_target=2)
    near, far = fleet.region("near", near_server, NEAR_MS), fleet.region("far", far_server, FAR_MS)
    g = fleet.gateway({"regions": two_regions(near, far), "tenants": [tenant("team-a")], "routing": "load-aware"})
    load(g, clients=1, seconds=1)

    busy = load(g, clients=6, seconds=3)
    assert {s for s, _ in busy} == {200}, Counter(busy)
    assert _share(busy, "near") > 0 and _share(busy, "far") >= 1 / 3, Counter(busy)

    near_server.kill()
    down = load(g, clients=3, seconds=3)
    assert {s for s, _ in down} == {200} and _share(down, "far") == 1, Counter(down)

    near_server.start()
    wait_until(lambda: json.loads(call(g, key=KEYS["team-a"])[2])["backend"] == "near", 20,
               "requests back at the near region")


def test_the_binary_report_says_what_the_text_does():
    """gRPC's endpoint-load-metrics-bin is an xds.data.orca.v3.OrcaLoadReport (read by protobuf
    from the message's field numbers) holding the values of the text form, the queue and the
    recent time of a generation included."""
    now = [100.0]
    report = LoadReport(target=8, max_objects=2, clock=lambda: now[0])
    for _ in range(5):
        report.started()
    report.finished()
    report.finished(failed=True)
    assert parse_binary(report.binary()) == parse_text(report.header()) == {
        "application_utilization": 3 / 8, "rps_fractional": 0.2, "eps": 0.1, "named_metrics.queue": 1}
    now[0] += load_report.RATE_TIME_CONSTANT_S  # rates decay: e^-1 after the time constant
    assert parse_binary(report.binary())["rps_fractional"] == pytest.approx(0.2 / 2.718281828, rel=1e-6)
    assert "named_metrics.queue" not in parse_binary(LoadReport(target=2).binary())
    # A generation's recent time: from the successful answers that say when they started, a
    # moving average (SECONDS_WEIGHT of each new one); none until the first.
    assert f"named_metrics.{load_report.SECONDS_METRIC}" not in parse_text(report.header())
    started = report.started()
    now[0] += 2.0
    report.finished(started=started)
    assert parse_binary(report.binary())[f"named_metrics.{load_report.SECONDS_METRIC}"] == 2.0
    started = report.started()
    now[0] += 6.0
    report.finished(failed=True, started=started)  # a failure's time says nothing of a generation's
    started = report.started()
    now[0] += 6.0
    report.finished(started=started)
    expected = 2.0 + load_report.SECONDS_WEIGHT * (6.0 - 2.0)
    assert parse_text(report.header())[f"named_metrics.{load_report.SECONDS_METRIC}"] == pytest.approx(expected)


def test_a_load_report_costs_microseconds():
    """No measurable cost: a request's bookkeeping and its header take a few microseconds (a
    generation takes hundreds of milliseconds; the front end's own overhead, BENCHMARKS.md, is
    a fraction of a millisecond)."""
    report = LoadReport(target=8, max_objects=8)
    rounds = 20000
    started = time.perf_counter()
    for _ in range(rounds):
        report.started()
        report.header()
        report.finished()
    per_request_us = (time.perf_counter() - started) / rounds * 1e6
    assert per_request_us < 100, per_request_us
