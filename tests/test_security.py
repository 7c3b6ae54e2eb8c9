"""Hostile clients against the real server (docs/security.md): the admin APIs locked over HTTP
and gRPC, shared memory refused in requests, oversized and deeply nested bodies refused, each
while a generation is in flight that must still complete, on a server started by LocalTriton
(as `cubeserve serve`) and on one started with the ServingRuntime's own arguments. Round 2: the
parameters that crash Triton (classification) or belong to our own code (cube3d_*, the tenant)
refused over REST, gRPC and the stream; values of the wrong type or range refused by name; the
front ends' bounded resources (connections, idle and body timeouts, no work after a refusal)
under a lowered open-file limit; and the admin key on no command line."""

from __future__ import annotations

import gzip
import http.client
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import yaml

from cube3d_client import Cube3DClient
from cubeserve import deploy
from cubeserve.checkpoint import write_random_weights
from cubeserve.server.front import Refused, rewrite_body
from cubeserve.server.local_triton import LocalTriton, copy_model_repository, free_port, tritonserver_home
from cubeserve.server.supervisor import front_limits
from serving_helpers import SLOW_HEAD, SLOW_PREFACE, Attack, wait_until
from serving_helpers import closed_by_server as _closed_by_server
from serving_helpers import flood as _flood
from test_triton import LONG

REPO = Path(__file__).resolve().parents[1]
MB = 1 << 20


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = copy_model_repository(tmp_path_factory.mktemp("model_repository"))
    # Version 1 is slow (1024 shape tokens): a request still runs while the attacks are sent.
    write_random_weights(LONG, root / "cube3d_stream" / "1" / "weights", seed=1)
    return root


@pytest.fixture(scope="module")
def server(repo, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "tritonserver.log"
    with LocalTriton(repo, free_port(), free_port(), free_port(), log_path=log,
                     extra_args=("--model-control-mode=explicit", "--load-model=cube3d_stream",
                                 "--load-model=cube3d")) as triton:
        yield triton


def call(url: str, path: str, body: bytes | None = None, headers: dict | None = None, method: str | None = None,
         timeout: float = 60) -> tuple[int, bytes]:
    request = urllib.request.Request(f"http://{url}{path}", data=body, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


class InFlight:
    """A generation of the slow version over REST, started before an attack, that must finish
    with a whole mesh (its 1024 tokens) while the attack runs."""

    def __init__(self, url: str):
        self.result, self.error = None, None
        self.thread = threading.Thread(target=self._run, args=(url,), daemon=True)

    def _run(self, url):
        try:
            with Cube3DClient(url, "http", retries=0, timeout=300) as client:
                self.result = client.generate("held while under attack", resolution=4)
        except Exception as exc:  # noqa: BLE001 - reported by check()
            self.error = exc

    def __enter__(self):
        self.thread.start()
        time.sleep(1.0)  # admitted: it decodes for several seconds
        assert self.thread.is_alive(), f"the request in flight ended early: {self.error}"
        return self

    def __exit__(self, *exc):
        self.thread.join(300)
        if exc[0] is None:
            assert self.error is None, f"the request in flight failed: {self.error!r}"
            assert self.result is not None and len(self.result.tokens) == LONG.num_tokens
            assert self.result.num_faces > 0


def assert_survived(server, pid_before: int) -> None:
    assert server.process.poll() is None
    assert server.tritonserver_pid() == pid_before, "tritonserver was restarted: it crashed"
    assert server.ready()
    log = server.log_path.read_text(errors="replace")
    assert "crashed" not in log and "Segmentation fault" not in log and "Signal (11)" not in log


def python_backend_regions() -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob("triton_python_backend_shm_region_*"))


# -- the admin surface ------------------------------------------------------------------------------

ADMIN_CALLS = [  # (method, path, body): one or more per restricted category
    ("POST", "/v2/systemsharedmemory/region/attack/register", {"key": "/x", "offset": 0, "byte_size": 64}),
    ("GET", "/v2/systemsharedmemory/status", None),
    ("POST", "/v2/cudasharedmemory/region/attack/register", {"raw_handle": {"b64": ""}, "device_id": 0, "byte_size": 8}),
    ("POST", "/v2/logging", {"log_verbose_level": 1}),
    ("GET", "/v2/logging", None),
    ("POST", "/v2/trace/setting", {"trace_level": ["TIMESTAMPS"]}),
    ("GET", "/v2/models/cube3d/trace/setting", None),
    ("GET", "/v2/models/stats", None),
    ("GET", "/v2/models/cube3d/versions/1/stats", None),
    ("POST", "/v2/repository/index", {}),
    ("POST", "/v2/repository/models/cube3d/unload", {}),
    ("POST", "/v2/repository/models/cube3d/load", {}),
]


@pytest.mark.parametrize("port", ["front end", "tritonserver's own"])
def test_admin_apis_are_refused_without_the_key_over_http(server, port):
    """Through the front end, and on tritonserver's loopback port too (its own restriction)."""
    url = server.http_url if port == "front end" else f"127.0.0.1:{server.triton_http_port}"
    for method, path, body in ADMIN_CALLS:
        data = None if body is None else json.dumps(body).encode()
        for headers in ({}, {deploy.ADMIN_HEADER: "wrong-" + server.admin_key[6:]}):
            status, reply = call(url, path, data, {"Content-Type": "application/json", **headers}, method)
            assert status == 403, (path, status, reply)
            assert deploy.ADMIN_HEADER in json.loads(reply)["error"]
    assert call(server.http_url, "/v2/health/ready")[0] == 200


def test_admin_apis_answer_with_the_key(server):
    headers = {**server.admin_headers, "Content-Type": "application/json"}
    for path in ("/v2/systemsharedmemory/status", "/v2/logging", "/v2/models/stats", "/v2/trace/setting"):
        status, reply = call(server.http_url, path, headers=headers)
        assert status == 200, (path, reply)
    status, reply = call(server.http_url, "/v2/repository/index", b"", headers, "POST")
    assert status == 200 and {m["name"] for m in json.loads(reply)} == {"cube3d", "cube3d_stream"}


def test_admin_apis_are_refused_without_the_key_over_grpc(server):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(server.grpc_url)
    calls = {
        "shared-memory": lambda h: client.register_system_shared_memory("attack", "/x", 64, headers=h),
        "model-repository": lambda h: client.get_model_repository_index(headers=h),
        "logging": lambda h: client.update_log_settings({"log_verbose_level": 1}, headers=h),
        "trace": lambda h: client.get_trace_settings(headers=h),
        "statistics": lambda h: client.get_inference_statistics("cube3d", headers=h),
    }
    try:
        for api, make in calls.items():
            with pytest.raises(InferenceServerException, match="restricted"):
                make(None)
        # With the key: allowed (the shared-memory register itself then fails on the missing region).
        assert client.get_model_repository_index(headers=server.grpc_admin_headers) is not None
        assert client.get_inference_statistics("cube3d", headers=server.grpc_admin_headers) is not None
        assert client.is_server_ready()
    finally:
        client.close()


def test_the_model_repository_api_loads_and_unloads_with_the_key(server):
    """What the pipeline's local target does (cubeserve/pipeline/serving.py), through the front end."""
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    client = httpclient.InferenceServerClient(server.http_url, network_timeout=120)
    try:
        with pytest.raises(InferenceServerException, match="restricted"):
            client.unload_model("cube3d")
        client.unload_model("cube3d", headers=server.admin_headers)
        deadline = time.monotonic() + 60
        while client.is_model_ready("cube3d") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not client.is_model_ready("cube3d")
        client.load_model("cube3d", headers=server.admin_headers)
        assert client.is_model_ready("cube3d")
    finally:
        client.close()


# -- shared memory in requests ----------------------------------------------------------------------

def _infer_naming(region: str, where: str) -> dict:
    shm = {"shared_memory_region": region, "shared_memory_byte_size": 1 << 16, "shared_memory_offset": 0}
    doc = {"inputs": [{"name": "PROMPT", "datatype": "BYTES", "shape": [1], "data": ["a small ball"]},
                      {"name": "RESOLUTION", "datatype": "INT32", "shape": [1], "data": [4]}],
           "outputs": [{"name": "MESH"}, {"name": "NUM_FACES"}]}
    if where == "output":
        doc["outputs"][0]["parameters"] = shm
    else:
        doc["inputs"][1] = {"name": "RESOLUTION", "datatype": "INT32", "shape": [1], "parameters": shm}
    return doc


def test_the_shared_memory_attack_fails_and_loses_nothing(server):
    """The issue's attack: register the python backend's own region, then name it as an output's
    buffer; over REST and gRPC, with a generation in flight that completes."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    pid = server.tritonserver_pid()
    regions = python_backend_regions()
    assert regions, "the python backend's regions are in /dev/shm (what an attacker lists)"
    with InFlight(server.http_url):
        for region in regions[:2]:
            register = {"key": "/" + region, "offset": 0, "byte_size": 1 << 16}
            status, _ = call(server.http_url, f"/v2/systemsharedmemory/region/{region}/register",
                             json.dumps(register).encode(), {"Content-Type": "application/json"})
            assert status == 403
            for where in ("output", "input"):
                status, reply = call(server.http_url, "/v2/models/cube3d/infer",
                                     json.dumps(_infer_naming(region, where)).encode())
                assert status == 400, reply
                assert "shared memory is not accepted" in json.loads(reply)["error"]
        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            with pytest.raises(InferenceServerException, match="restricted"):
                client.register_system_shared_memory(regions[0], "/" + regions[0], 1 << 16)
            prompt = grpcclient.InferInput("PROMPT", [1], "BYTES")
            prompt.set_data_from_numpy(np.array([b"a small ball"], dtype=object))
            mesh = grpcclient.InferRequestedOutput("MESH")
            mesh.set_shared_memory(regions[0], 1 << 16)
            # Never registered (only an admin could): Triton refuses before the model runs.
            with pytest.raises(InferenceServerException, match="Unable to find|shared memory"):
                client.infer("cube3d", [prompt], outputs=[mesh], model_version="1")
        finally:
            client.close()
    assert_survived(server, pid)


# -- bodies ----------------------------------------------------------------------------------------

def _prompt_body(size: int) -> bytes:
    doc = {"inputs": [{"name": "PROMPT", "datatype": "BYTES", "shape": [1], "data": ["x" * size]}]}
    return json.dumps(doc).encode()


@pytest.mark.parametrize("megabytes", [8, 20, 70])
def test_oversized_bodies_get_413_while_a_request_in_flight_completes(server, tmp_path, megabytes):
    """As curl sends them (`-d @file`: form Content-Type, Expect: 100-continue) and as urllib
    sends them (the whole body, no Expect), with and without a JSON Content-Type."""
    pid = server.tritonserver_pid()
    body = tmp_path / "body.json"
    body.write_bytes(_prompt_body(megabytes * MB))
    with InFlight(server.http_url):
        for content_type in ([], ["-H", "Content-Type: application/json"]):
            out = subprocess.run(["curl", "-s", "-o", str(tmp_path / "reply"), "-w", "%{http_code}", *content_type,
                                  "-d", f"@{body}", f"http://{server.http_url}/v2/models/cube3d/infer"],
                                 capture_output=True, text=True, timeout=120)
            assert out.stdout == "413", (out.stdout, out.stderr)
            assert "at most" in json.loads((tmp_path / "reply").read_bytes())["error"]
        status, reply = call(server.http_url, "/v2/models/cube3d/infer", body.read_bytes(),
                             {"Content-Type": "application/x-www-form-urlencoded"})
        assert status == 413, reply
    assert_survived(server, pid)


def test_a_chunked_body_is_bounded_too(server):
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    chunks = (b"[" * 65536 for _ in range(40))  # 2.5 MB, no Content-Length
    connection.request("POST", "/v2/models/cube3d/infer", body=chunks, encode_chunked=True)
    reply = connection.getresponse()
    assert reply.status == 413, reply.read()
    connection.close()


def test_a_deeply_nested_body_gets_400_while_a_request_in_flight_completes(server):
    pid = server.tritonserver_pid()
    nested = b"[" * 100_000 + b"]" * 100_000  # 200 KB
    body = b'{"inputs": [{"name": "PROMPT", "datatype": "BYTES", "shape": [1], "data": ' + nested + b"}]}"
    with InFlight(server.http_url):
        status, reply = call(server.http_url, "/v2/models/cube3d/infer", body, {"Content-Type": "application/json"})
        assert status == 400 and "nested too deeply" in json.loads(reply)["error"], reply
        # As deep as the shape allows, one level more: refused by name
        shallow = b'{"inputs": [{"name": "PROMPT", "datatype": "BYTES", "shape": [1], "data": [["a"]]}]}'
        status, reply = call(server.http_url, "/v2/models/cube3d/infer", shallow)
        assert status == 400 and "inputs[0].data" in json.loads(reply)["error"], reply
    assert_survived(server, pid)


def test_a_compression_bomb_is_bounded(server):
    bomb = gzip.compress(b"[" * (64 * MB))  # 64 KB compressed
    status, reply = call(server.http_url, "/v2/models/cube3d/infer", bomb,
                         {"Content-Encoding": "gzip", "Content-Type": "application/json"})
    assert status == 413 and "at most" in json.loads(reply)["error"], reply


@pytest.mark.parametrize("value", ["99999999999999999999", "-1", "abc", "1e3"])
def test_a_bad_binary_header_length_is_refused(server, value):
    status, reply = call(server.http_url, "/v2/models/cube3d/infer", _prompt_body(10),
                         {"Inference-Header-Content-Length": value})
    assert status == 400 and "Inference-Header-Content-Length" in json.loads(reply)["error"], reply


@pytest.mark.parametrize("doc, field", [
    ({"inputs": [{"name": "PROMPT", "datatype": "BYTES", "shape": [2], "data": ["a"]}]}, "inputs[0].data"),
    ({"inputs": [{"name": "PROMPT", "datatype": "STRING", "shape": [1], "data": ["a"]}]}, "inputs[0].datatype"),
    ({"inputs": [{"name": "PROMPT", "datatype": "BYTES", "shape": [1 << 20, 1 << 20], "data": []}]},
     "inputs[0].shape"),
    ({"inputs": []}, "inputs"),
    ({"inputs": [{"name": "PROMPT", "datatype": "BYTES", "shape": [1], "data": ["a"]}], "evil": 1}, "body.evil"),
    ({"inputs": [{"name": "SEED", "datatype": "INT64", "shape": [1], "data": [1 << 70]}]}, "inputs[0].data"),
    ({"inputs": [{"name": "PROMPT", "datatype": "BYTES", "shape": [1], "data": ["a"]}],
      "parameters": {"shared_memory_region": "x"}}, "parameters.shared_memory_region"),
])
def test_malformed_requests_are_refused_by_name_before_triton(doc, field):
    with pytest.raises(Refused) as refused:
        rewrite_body("infer", json.dumps(doc).encode(), None)
    assert refused.value.status == 400 and str(refused.value).startswith(field), str(refused.value)


def test_unknown_paths_get_404_and_open_apis_stay_open(server):
    assert call(server.http_url, "/v2/models/cube3d/versions/1/ready")[0] == 200
    assert call(server.http_url, "/v2/models/cube3d/config")[0] == 200
    assert call(server.http_url, "/v2/health/live")[0] == 200
    assert json.loads(call(server.http_url, "/v2")[1])["name"] == "triton"
    for path in ("/metrics", "/v2/models/cube3d/../../repository/index", "/v2/anything"):
        assert call(server.http_url, path)[0] == 404
    assert call(server.http_url, "/v2/models/cube3d/infer", method="DELETE")[0] == 404


def test_the_clients_work_through_the_front_end(server):
    """tritonclient with binary tensors and request compression, and the generate endpoint."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.http_url, network_timeout=300)
    try:
        prompt = httpclient.InferInput("PROMPT", [1], "BYTES")
        prompt.set_data_from_numpy(np.array([b"a small ball"], dtype=object), binary_data=True)
        resolution = httpclient.InferInput("RESOLUTION", [1], "INT32")
        resolution.set_data_from_numpy(np.array([4], dtype=np.int32), binary_data=True)
        outputs = [httpclient.InferRequestedOutput("SHAPE_TOKENS", binary_data=True),
                   httpclient.InferRequestedOutput("NUM_FACES", binary_data=False)]
        result = client.infer("cube3d", [prompt, resolution], outputs=outputs, request_compression_algorithm="gzip",
                              response_compression_algorithm="deflate")
        assert result.as_numpy("SHAPE_TOKENS").shape == (LONG.num_tokens,) and result.as_numpy("NUM_FACES")[0] > 0
    finally:
        client.close()
    status, reply = call(server.http_url, "/v2/models/cube3d_stream/generate",
                         json.dumps({"PROMPT": "a small ball", "RESOLUTION": 4}).encode())
    assert status == 200 and json.loads(reply)["NUM_FACES"] > 0, reply


# -- the ServingRuntime's own command line ---------------------------------------------------------

def test_a_server_started_with_the_servingruntime_args_survives_both_attacks(repo, tmp_path):
    """The container's args as k8s/ declares them, with only the executables, the model store and
    the ports of this machine put in (and the loopback for the pod's address), and the key as
    the Secret hands it over: the admin APIs are locked, the shared-memory and the oversized-body
    attacks fail, and a generation in flight completes."""
    runtime = yaml.safe_load((REPO / "k8s" / "base" / "runtime" / "servingruntime.yaml").read_text())
    [container] = runtime["spec"]["containers"]
    [secret_env] = [e for e in container["env"] if e["name"] == deploy.ADMIN_KEY_ENV]
    assert secret_env["valueFrom"]["secretKeyRef"]["name"] == deploy.ADMIN_SECRET
    ports = {deploy.HTTP_PORT: free_port(), deploy.TRITON_HTTP_PORT: free_port(), deploy.GRPC_PORT: free_port(),
             deploy.TRITON_GRPC_PORT: free_port(), deploy.METRICS_PORT: free_port()}
    home = tritonserver_home()
    args = []
    for arg in container["args"]:
        for port, mine in ports.items():
            arg = arg.replace(f"-port={port}", f"-port={mine}")
        arg = {"python3": sys.executable, "tritonserver": str(home / "bin" / "tritonserver"),
               "--rest-address=0.0.0.0": "--rest-address=127.0.0.1", "--grpc-address=0.0.0.0": "--grpc-address=127.0.0.1",
               # a pod listens on all of its own interfaces; on this machine, the loopback only
               "--metrics-address=0.0.0.0": "--metrics-address=127.0.0.1",
               f"--model-store={deploy.KSERVE_MODEL_DIR}": f"--model-store={repo}"}.get(arg, arg)
        args.append(arg)
    args += [f"--backend-directory={home / 'backends'}"]
    key = deploy.new_admin_key()
    local = LocalTriton(repo, ports[deploy.HTTP_PORT], ports[deploy.GRPC_PORT], ports[deploy.METRICS_PORT],
                        triton_http_port=ports[deploy.TRITON_HTTP_PORT], admin_key=key)
    env = {**local.environment(), **{e["name"]: e["value"] for e in container["env"] if "value" in e}}
    log = open(tmp_path / "server.log", "wb")
    process = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        local.process, local.log_path = process, tmp_path / "server.log"
        deadline = time.monotonic() + 300
        while not local.ready():
            assert process.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()[-3000:]
            time.sleep(0.5)
        pid = local.tritonserver_pid()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        assert "--http-address=127.0.0.1" in cmdline and "--grpc-address=127.0.0.1" in cmdline
        assert any(a.startswith(f"--http-restricted-api={','.join(deploy.RESTRICTED_APIS)}:") for a in cmdline)
        assert not any(key in a for a in cmdline)  # tritonserver has a key of its own
        with InFlight(local.http_url):
            region = python_backend_regions()[0]
            status, _ = call(local.http_url, f"/v2/systemsharedmemory/region/{region}/register",
                             json.dumps({"key": "/" + region, "offset": 0, "byte_size": 4096}).encode())
            assert status == 403
            status, _ = call(local.http_url, "/v2/models/cube3d/infer", json.dumps(_infer_naming(region, "output")).encode())
            assert status == 400
            status, _ = call(local.http_url, "/v2/models/cube3d/infer", _prompt_body(20 * MB),
                             {"Content-Type": "application/x-www-form-urlencoded"})
            assert status == 413
            status, _ = call(local.http_url, "/v2/repository/index", b"", local.admin_headers, "POST")
            assert status == 200
        assert_survived(local, pid)
    finally:
        local.stop()
        log.close()



# -- round 2: parameters -----------------------------------------------------------------------------

def _good_infer(**extra) -> dict:
    doc = {"inputs": [{"name": "PROMPT", "datatype": "BYTES", "shape": [1], "data": ["a small ball"]},
                      {"name": "RESOLUTION", "datatype": "INT32", "shape": [1], "data": [4]}],
           "outputs": [{"name": "NUM_FACES"}]}
    doc.update(extra)
    return doc


def _grpc_inputs():
    import tritonclient.grpc as grpcclient

    prompt = grpcclient.InferInput("PROMPT", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([b"a small ball"], dtype=object))
    resolution = grpcclient.InferInput("RESOLUTION", [1], "INT32")
    resolution.set_data_from_numpy(np.array([4], dtype=np.int32))
    return [prompt, resolution]


def _stream(server, requests: list[dict], final_ids: int) -> list:
    """Sends `requests` (kwargs of async_stream_infer) on one gRPC stream; returns what came back,
    (result, error) pairs, once `final_ids` requests have a final answer."""
    import queue

    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(server.grpc_url)
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for kwargs in requests:
            client.async_stream_infer("cube3d_stream", _grpc_inputs(), **kwargs)
        out, finals = [], 0
        while finals < final_ids:
            result, error = answers.get(timeout=300)
            out.append((result, error))
            finals += error is not None or "NUM_FACES" in {o.name for o in result.get_response().outputs}
        return out
    finally:
        client.stop_stream()
        client.close()


def test_a_classification_is_refused_everywhere_and_kills_nothing(server):
    """Triton 2.51 divides by a BYTES output's element size, 0, when asked to classify it: one
    request was a SIGFPE of the whole server. Over REST, gRPC and the stream, beside a
    generation in flight that completes."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    pid = server.tritonserver_pid()
    with InFlight(server.http_url):
        for output in ("MESH", "NUM_FACES"):
            doc = _good_infer(outputs=[{"name": output, "parameters": {"classification": 2}}])
            status, reply = call(server.http_url, "/v2/models/cube3d/infer", json.dumps(doc).encode())
            assert status == 400 and json.loads(reply)["error"].startswith("outputs[0].parameters.classification"), reply
        client = grpcclient.InferenceServerClient(server.grpc_url)
        try:
            with pytest.raises(InferenceServerException, match="classification") as refused:
                client.infer("cube3d", _grpc_inputs(), outputs=[grpcclient.InferRequestedOutput("MESH", class_count=2)])
            assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
        finally:
            client.close()
        # In a stream: that request gets an error, the next one is served on the same stream.
        answers = _stream(server, [{"request_id": "bad", "outputs": [grpcclient.InferRequestedOutput("MESH", class_count=2)]},
                                   {"request_id": "good"}], final_ids=2)
        errors = [e for _, e in answers if e is not None]
        assert len(errors) == 1 and "classification" in errors[0].message()
        [final] = [r for r, e in answers if r is not None and "NUM_FACES" in {o.name for o in r.get_response().outputs}]
        assert final.get_response().id == "good" and final.as_numpy("NUM_FACES")[0] > 0
    assert_survived(server, pid)


# The engine's own parameters (serving/protocol.py), the tenant (the gateway's header), and a
# parameter nothing documents; the arm value is a label an attacker would grow.
INTERNAL = [("cube3d_cancel_request_id", "cube3d-0123"), ("cube3d_forwarded", True), ("cube3d_arm", "attacker-arm-7"),
            ("X-Cube3D-Tenant", "team-b"), ("x-cube3d-tenant", "team-b"), ("request_tag", 7)]


@pytest.mark.parametrize("name, value", INTERNAL, ids=[n for n, _ in INTERNAL])
def test_internal_parameters_and_the_tenant_are_refused_from_clients(server, name, value):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    for path, doc in (("/v2/models/cube3d/infer", _good_infer(parameters={name: value})),
                      ("/v2/models/cube3d_stream/infer", _good_infer(parameters={name: value})),
                      ("/v2/models/cube3d_stream/generate", {"PROMPT": "a ball", "RESOLUTION": 4,
                                                             "parameters": {name: value}})):
        status, reply = call(server.http_url, path, json.dumps(doc).encode())
        assert status == 400 and json.loads(reply)["error"].startswith(f"parameters.{name}"), (path, reply)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        with pytest.raises(InferenceServerException, match=f"parameters.{name}"):
            client.infer("cube3d", _grpc_inputs(), parameters={name: value})
    finally:
        client.close()
    answers = _stream(server, [{"request_id": "x", "parameters": {name: value}}], final_ids=1)
    [(_, error)] = answers
    assert error is not None and f"parameters.{name}" in error.message()
    assert "attacker-arm-7" not in urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()


def test_the_documented_parameters_still_pass(server):
    """timeout, priority, the user key and the arm pin (as body parameters, in any case), and
    binary outputs: what tritonclient, the KServe SDK and the project's client send."""
    doc = _good_infer(parameters={"timeout": 60_000_000, "priority": 0, "X-Cube3D-User": "user-1"},
                      outputs=[{"name": "NUM_FACES", "parameters": {"binary_data": False}}])
    status, reply = call(server.http_url, "/v2/models/cube3d/infer", json.dumps(doc).encode())
    assert status == 200 and json.loads(reply)["outputs"][0]["data"][0] > 0, reply


# Top-level keys of a generate request that are not the model's inputs: Triton makes each a
# request parameter, so they meet the rules of `parameters` (shared memory, the engine's and the
# gateway's own, classification, anything undocumented, an output's name).
GENERATE_KEYS = [("shared_memory_region", "attack"), ("shared_memory_offset", 0), ("shared_memory_byte_size", 64),
                 ("cube3d_forwarded", True), ("X-Cube3D-Tenant", "team-b"), ("classification", 2),
                 ("request_tag", 7), ("MESH", "x")]


def _inference_count(server) -> int:
    """Requests the models have started, successful or not (Triton's statistics, admin key)."""
    status, reply = call(server.http_url, "/v2/models/stats", headers=server.admin_headers)
    assert status == 200, reply
    return sum(s["inference_stats"]["success"]["count"] + s["inference_stats"]["fail"]["count"]
               for s in json.loads(reply)["model_stats"])


@pytest.mark.parametrize("name, value", GENERATE_KEYS, ids=[n for n, _ in GENERATE_KEYS])
def test_generates_top_level_keys_are_held_to_the_parameters_rules(server, name, value):
    """Each was a 200 (Triton passed it on as a request parameter) where the docs promise 400."""
    before = _inference_count(server)
    for model in ("cube3d", "cube3d_stream"):
        for endpoint in ("generate", "generate_stream"):
            doc = {"PROMPT": "a ball", "RESOLUTION": 4, name: value}
            status, reply = call(server.http_url, f"/v2/models/{model}/{endpoint}", json.dumps(doc).encode())
            assert status == 400 and json.loads(reply)["error"].startswith(f"body.{name}"), (model, endpoint, reply)
    assert _inference_count(server) == before  # refused before any work


def test_generates_documented_top_level_parameters_pass_and_are_given_once(server):
    doc = {"PROMPT": "a ball", "RESOLUTION": 4, "timeout": 60_000_000, "X-Cube3D-User": "user-1"}
    status, reply = call(server.http_url, "/v2/models/cube3d_stream/generate", json.dumps(doc).encode())
    assert status == 200 and json.loads(reply)["NUM_FACES"] > 0, reply
    with pytest.raises(Refused, match=r"^body\.shared_memory_region: shared memory is not accepted"):
        rewrite_body("generate", b'{"PROMPT": "a", "shared_memory_region": "r"}', None)
    with pytest.raises(Refused, match=r"^body\.timeout: given both at the top level and in parameters"):
        rewrite_body("generate", b'{"PROMPT": "a", "timeout": 1, "parameters": {"timeout": 2}}', None)
    with pytest.raises(Refused, match=r"^body\.evil: unknown parameter \(allowed: timeout, .*; or one of the inputs "
                                      r"PROMPT, .*, or parameters\)"):
        rewrite_body("generate", b'{"PROMPT": "a", "evil": 1}', None)


MISTYPED = [  # (what the client sends, the field the 400 names)
    (_good_infer(parameters={"timeout": "soon"}), "parameters.timeout"),
    (_good_infer(parameters={"timeout": -1}), "parameters.timeout"),
    (_good_infer(parameters={"priority": "high"}), "parameters.priority"),
    (_good_infer(parameters={"binary_data_output": "yes"}), "parameters.binary_data_output"),
    (_good_infer(outputs=[{"name": "MESH", "parameters": {"binary_data": 1}}]), "outputs[0].parameters.binary_data"),
    ({"inputs": [{"name": "PROMPT", "datatype": "BYTES", "shape": [1], "data": [5]}]}, "inputs[0].data"),
    (_good_infer(inputs=[{"name": "PROMPT", "datatype": "BYTES", "shape": [1], "data": ["a"]},
                         {"name": "SEED", "datatype": "INT64", "shape": [1], "data": ["7"]}]), "inputs[1].data"),
    (_good_infer(inputs=[{"name": "PROMPT", "datatype": "BYTES", "shape": [1], "data": ["a"]},
                         {"name": "SEED", "datatype": "INT64", "shape": [1], "data": [2 ** 64 - 1]}]), "inputs[1].data"),
    # 2**40 as INT32 reached the model as 0: a wrong answer, not an error
    (_good_infer(inputs=[{"name": "PROMPT", "datatype": "BYTES", "shape": [1], "data": ["a"]},
                         {"name": "RESOLUTION", "datatype": "INT32", "shape": [1], "data": [2 ** 40]}]), "inputs[1].data"),
    (_good_infer(inputs=[{"name": "PROMPT", "datatype": "BYTES", "shape": [1], "data": ["a"]},
                         {"name": "STREAM_PROGRESS", "datatype": "BOOL", "shape": [1], "data": [1]}]), "inputs[1].data"),
    (_good_infer(inputs=[{"name": "PROMPT", "datatype": "BYTES", "shape": [1], "data": ["a"]},
                         {"name": "TOP_P", "datatype": "FP32", "shape": [1], "data": [1e39]}]), "inputs[1].data"),
]


@pytest.mark.parametrize("doc, field", MISTYPED, ids=[f for _, f in MISTYPED])
def test_a_value_of_the_wrong_type_or_range_is_400_naming_it(server, doc, field):
    status, reply = call(server.http_url, "/v2/models/cube3d/infer", json.dumps(doc).encode())
    assert status == 400 and json.loads(reply)["error"].startswith(field), reply


def _raw(port: int, request: bytes, timeout: float = 30) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(request)
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply) < reply.index(b"\r\n\r\n") + 4 + int(
                (dict(line.split(b": ", 1) for line in reply.split(b"\r\n\r\n")[0].split(b"\r\n")[1:] if b": " in line)
                 .get(b"Content-Length", b"0"))):
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
        return reply


@pytest.mark.parametrize("header, value, field", [
    (b"Inference-Header-Content-Length", "١٢".encode(), "Inference-Header-Content-Length"),
    (b"Inference-Header-Content-Length", b"9" * 5000, "Inference-Header-Content-Length"),
    (b"Content-Encoding", b"gzip", "body"),
], ids=["non-ascii-digits", "5000-digits", "gzip-that-is-not"])
def test_headers_that_were_500_are_400_naming_the_field(server, header, value, field):
    body = json.dumps(_good_infer()).encode()
    reply = _raw(server.http_port, b"POST /v2/models/cube3d/infer HTTP/1.1\r\nHost: x\r\n" + header + b": " + value +
                 b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    assert reply.startswith(b"HTTP/1.1 400"), reply[:300]
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"].startswith(field), reply


def test_an_admin_header_that_is_not_utf8_is_403(server):
    reply = _raw(server.http_port, b"GET /v2/models/stats HTTP/1.1\r\nHost: x\r\n"
                 + deploy.ADMIN_HEADER.encode() + b": \xff\xfe\xfd\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 403"), reply[:300]


def test_dot_segments_are_no_model_names(server):
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    for path in ("/v2/models/./ready", "/v2/models/../ready", "/v2/models/../config", "/v2/models/./versions/1/ready"):
        assert call(server.http_url, path)[0] == 404, path
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        for name in (".", ".."):
            with pytest.raises(InferenceServerException, match="is not a model name"):
                client.get_model_metadata(name)
        assert client.is_model_ready("cube3d")
    finally:
        client.close()


def test_the_admin_key_is_on_no_command_line(server):
    """tritonserver is locked with a key of its own (Triton reads it from its command line only,
    which every local user can list); the admin key reaches nothing but the front ends."""
    from cubeserve.serving.stubs import process_tree

    lines = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in process_tree(server.process.pid)]
    assert not any(server.admin_key.encode() in line for line in lines)
    [triton] = [line for line in lines if line.split(b"\0")[0].endswith(b"tritonserver")]
    assert f"--http-restricted-api={','.join(deploy.RESTRICTED_APIS)}:{deploy.ADMIN_HEADER}=".encode() in triton
    # ... and with the admin key, the front ends open the admin APIs (tritonserver's own key behind them).
    status, _ = call(server.http_url, "/v2/repository/index", b"", server.admin_headers, "POST")
    assert status == 200


# -- round 2: bounded resources -----------------------------------------------------------------------

OPEN_FILES = 512  # the bounded server's open-file limit (soft and hard): the supervisor cannot raise it
BOUNDED_HEADER_S = 2  # its header timeout (REST) and handshake timeout (gRPC)
BOUNDED_IDLE_S = 2  # its idle timeout (gRPC connections without a call, streams without a request)


class Bounded(LocalTriton):
    """A LocalTriton whose supervisor runs under a low open-file limit (prlimit execs it: same pid)."""

    def command(self) -> list[str]:
        return ["prlimit", f"--nofile={OPEN_FILES}:{OPEN_FILES}", "--", *super().command()]


@pytest.fixture(scope="module")
def bounded(repo, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "bounded.log"
    with Bounded(repo, free_port(), free_port(), free_port(), log_path=log, supervised=True,
                 supervisor_args=(f"--header-timeout={BOUNDED_HEADER_S}", "--body-timeout=3",
                                  f"--idle-timeout={BOUNDED_IDLE_S}"),
                 extra_args=("--model-control-mode=explicit", "--load-model=cube3d_stream",
                             "--load-model=cube3d")) as triton:
        yield triton


@pytest.fixture
def many_files():
    """This test process may open more files than the bounded server (its own hard limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 1 << 16), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_more_idle_connections_than_files_leave_the_server_serving(bounded, many_files):
    """Three times the server's open-file limit in idle connections, to REST and to gRPC at once:
    the supervisor (which listed /proc with no file left, and died) and tritonserver live on, a
    generation in flight completes, the connections past the cap are answered 503 and closed, the
    idle ones are closed after the idle timeout, and then clients are served again."""
    pid = bounded.tritonserver_pid()
    with InFlight(bounded.http_url):
        rest = _flood(bounded.http_port, 3 * OPEN_FILES // 2)
        grpc_ = _flood(bounded.grpc_port, 3 * OPEN_FILES // 2)
        try:
            # Past the cap: 503 and closed at once; within it: closed by the header timeout (REST)
            # and the handshake timeout (gRPC), 2 s here, which frees the slots the flood holds.
            received: dict = {}
            wait_until(lambda: all([_closed_by_server(s, received) for s in rest + grpc_]), 60,
                       "every flooding connection closed")
            busy = sum(data.startswith(b"HTTP/1.1 503") for data in received.values())
            assert busy > 0, "connections past the cap are answered 503"
            assert bounded.process.poll() is None
        finally:
            for s in rest + grpc_:
                s.close()
    assert_survived(bounded, pid)
    status, reply = call(bounded.http_url, "/v2/models/cube3d/infer", json.dumps(_good_infer()).encode())
    assert status == 200, reply


def _gzip_stream(port: int, outcome: dict, seconds: float = 20.0) -> None:
    """A chunked gzip upload that never ends (zeros, compressed ~1000x) until the server stops it."""
    import zlib

    compressor = zlib.compressobj(1, zlib.DEFLATED, 31)
    zeros = b"\0" * (8 << 20)
    block = compressor.compress(zeros)
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.sendall(b"POST /v2/models/cube3d/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n")
    start, answered = time.monotonic(), None
    reply = b""
    try:
        while time.monotonic() - start < seconds:
            if block:
                s.sendall(b"%x\r\n%s\r\n" % (len(block), block))
            block = compressor.compress(zeros)
            s.setblocking(False)
            try:
                data = s.recv(65536)
                if data:
                    reply += data
                    answered = answered or time.monotonic()
                else:
                    break
            except BlockingIOError:
                pass
            finally:
                s.setblocking(True)
    except OSError:  # reset or broken pipe: the server closed it
        pass
    outcome.update(reply=reply, answered=answered, closed=time.monotonic(), start=start)
    s.close()


def test_a_refused_gzip_upload_is_not_read_on(bounded):
    """After its 413, a compressed upload's further bytes are dropped unread (no decompression)
    and the connection closes after the linger time (front.Limits.linger_s), where aiohttp read and
    inflated for 10 s; four at once left the readiness probe without an answer."""
    from cubeserve.server.front import Limits

    def cpu_seconds() -> float:  # the supervisor's, where the front end runs
        fields = Path(f"/proc/{bounded.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    cpu = cpu_seconds()
    outcomes = [{} for _ in range(4)]
    threads = [threading.Thread(target=_gzip_stream, args=(bounded.http_port, o), daemon=True) for o in outcomes]
    for t in threads:
        t.start()
    probes = []
    while any(t.is_alive() for t in threads):
        t0 = time.monotonic()
        status, _ = call(bounded.http_url, deploy.READY_PATH, timeout=10)
        probes.append((status, time.monotonic() - t0))
        time.sleep(0.2)
    for o in outcomes:
        assert o["reply"].startswith(b"HTTP/1.1 413"), o["reply"][:200]
        # closed within the linger time after the answer (plus the time the client's loop takes)
        assert o["closed"] - o["answered"] < Limits.linger_s + 3, o
    cpu = cpu_seconds() - cpu
    assert all(status == 200 for status, _ in probes)
    assert max(seconds for _, seconds in probes) < 2.0, probes  # a kubelet probe's timeout is 1 s by default
    # CPU seconds, not wall time (robust to a busy machine): dropping the bytes cost 0.07 s here,
    # inflating them while lingering (the close after the refusal removed) 0.74 to 0.87 s.
    assert cpu < 0.35, f"the front end worked {cpu:.2f} CPU s during four refused uploads"


def test_a_body_that_stalls_gets_408_and_its_connection_closes(bounded):
    """Bodies stopped one byte short of 1 MiB held ~0.9 MB each, for ever: the body timeout
    (3 s here) answers them 408 and closes their connections."""
    sockets = []
    for _ in range(8):
        s = socket.create_connection(("127.0.0.1", bounded.http_port), timeout=30)
        s.sendall(b"POST /v2/models/cube3d/infer HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % deploy.MAX_REQUEST_BYTES + b"[" * (deploy.MAX_REQUEST_BYTES - 1))
        sockets.append(s)
    for s in sockets:
        reply = s.recv(65536)
        assert reply.startswith(b"HTTP/1.1 408") and b"body: not received within 3 s" in reply, reply[:300]
        s.settimeout(10)
        assert s.recv(65536) == b""  # closed
        s.close()


def test_all_bodies_together_are_bounded(tmp_path):
    """front.Limits.body_bytes: a body that would take the bodies being read past it is 503 (the
    front end alone, in this process, with a small bound)."""
    from cubeserve.server.front import FrontEnd, Limits

    port = free_port()
    front = FrontEnd("127.0.0.1", port, free_port(), deploy.new_admin_key(),
                     limits=Limits(body_bytes=deploy.MAX_REQUEST_BYTES + 4096, body_s=30)).start()
    try:
        held = socket.create_connection(("127.0.0.1", port), timeout=30)
        held.sendall(b"POST /v2/models/cube3d/infer HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                     % deploy.MAX_REQUEST_BYTES + b"[" * (deploy.MAX_REQUEST_BYTES - 100))
        time.sleep(0.5)  # read and held
        reply = _raw(port, b"POST /v2/models/cube3d/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 8192\r\n\r\n"
                     + b"[" * 8192)
        assert reply.startswith(b"HTTP/1.1 503") and b"request bodies" in reply, reply[:300]
        held.close()
    finally:
        front.stop()


def _nested(levels: int) -> bytes:
    """A JSON document `levels` deep: an object holding lists inside lists."""
    return b'{"ready": false, "x": ' + b"[" * (levels - 1) + b"]" * (levels - 1) + b"}"


def test_an_admin_body_nested_past_the_limit_is_refused_by_name():
    """The admin APIs' bodies are free-form (no field checks as for infer): only the depth
    bound of rewrite_body keeps what the front end forwards to tritonserver shallow."""
    body, _ = rewrite_body("admin", _nested(32), None)
    assert json.loads(body)["ready"] is False  # as deep as allowed: forwarded
    with pytest.raises(Refused) as refused:
        rewrite_body("admin", _nested(33), None)
    assert refused.value.status == 400 and str(refused.value) == "body: nested deeper than 32 levels"


def test_an_admin_body_with_the_key_nested_too_deeply_gets_400_through_the_server(server):
    headers = {**server.admin_headers, "Content-Type": "application/json"}
    status, reply = call(server.http_url, "/v2/repository/index", _nested(40), headers, "POST")
    assert status == 400 and json.loads(reply)["error"] == "body: nested deeper than 32 levels", (status, reply)
    status, reply = call(server.http_url, "/v2/repository/index", _nested(32), headers, "POST")
    assert status == 200 and {m["name"] for m in json.loads(reply)} >= {"cube3d", "cube3d_stream"}, reply


# -- round 3: slow and silent connections ---------------------------------------------------------------

def test_slow_and_silent_connections_are_closed_by_the_header_timeout(server):
    """20 connections sending a request head a byte at a time and 20 that never sent a byte, to
    each front end: they stayed open for the idle timeout (60 s); now they are closed at the
    header timeout (deploy.HEADER_TIMEOUT_S, the default here), REST's unanswered, gRPC's (the
    preface a byte at a time) by its handshake timeout. A client is served meanwhile."""
    limit = deploy.HEADER_TIMEOUT_S
    with Attack(server.http_port, 20, 20, SLOW_HEAD) as rest, Attack(server.grpc_port, 20, 20, SLOW_PREFACE) as grpc_:
        assert call(server.http_url, deploy.READY_PATH, timeout=10)[0] == 200
        rest.wait_closed(limit + 20)
        grpc_.wait_closed(limit + 20)
    for attack in (rest, grpc_):
        # At the timeout, not before (a byte of the head restarts nothing) and not much after.
        assert limit - 1 < min(attack.closed.values()) and max(attack.closed.values()) < limit + 10, attack.closed
    assert not any(rest.received.values()), "closed unanswered"


def test_slow_and_silent_connections_cannot_keep_a_client_out_past_the_header_timeout(bounded, many_files):
    """The issue's 300 slowloris and 1,000 silent connections to a cap of 1,024, scaled to the
    bounded server's cap: the cap's worth of slowloris connections, then three times as many
    silent ones. Past the cap they are answered 503 at once, so a client is refused too; within
    it they hold their slots until the header timeout (2 s here) closes them, and then the client
    is served. A generation running longer than the header timeout completes."""
    cap = front_limits(OPEN_FILES)[0].connections  # as the bounded server's supervisor sizes it
    with InFlight(bounded.http_url):
        with Attack(bounded.http_port, cap, 3 * cap, SLOW_HEAD) as attack:
            statuses = []

            def served() -> bool:
                statuses.append(call(bounded.http_url, deploy.READY_PATH, timeout=10)[0])
                return statuses[-1] == 200

            wait_until(served, BOUNDED_HEADER_S + 10, "a client served within the header timeout")
            attack.wait_closed(BOUNDED_HEADER_S + 10)
        assert 503 in statuses, f"the client was never kept out: the attack did not fill the cap ({statuses})"
        busy = [s for s, data in attack.received.items() if data.startswith(b"HTTP/1.1 503")]
        assert len(busy) >= 2 * cap, "the connections past the cap are answered 503"
        held = [seconds for s, seconds in attack.closed.items() if s not in busy]
        assert held and min(held) > BOUNDED_HEADER_S - 1, "the ones within the cap are held until the timeout"


def test_a_silent_grpc_stream_is_ended_by_the_idle_timeout_and_a_working_one_is_not(bounded):
    """gRPC's idle timeout spares a connection with a call open, so a ModelStreamInfer stream that
    sends nothing held its call and connection as long as its client liked. Now a stream with no
    request in progress is ended after the idle timeout (UNAVAILABLE, which says to open a new one),
    while one whose generation sends nothing for longer than that (no progress responses, the
    engine held by the test: SIGSTOP once it has the request, so however fast the machine) is
    answered, and ended once it has been idle as long after its answer."""
    import grpc
    import tritonclient.grpc as grpcclient

    from cubeserve.server.grpc_front import STREAM
    from cubeserve.serving.stubs import python_stubs
    from serving_helpers import metrics

    channel = grpc.insecure_channel(bounded.grpc_url)
    never = threading.Event()

    def silent():
        never.wait(60)
        yield from ()

    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        for _ in channel.stream_stream(STREAM)(silent(), timeout=60):
            pass
    ended = time.monotonic() - started
    never.set()
    channel.close()
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
    assert err.value.details().startswith("unavailable: the stream had no request in progress"), err.value.details()
    assert BOUNDED_IDLE_S - 0.5 < ended < BOUNDED_IDLE_S + 5, ended

    [engine] = [pid for pid, (model, _) in python_stubs(bounded.tritonserver_pid()).items() if model == "cube3d_stream"]
    prompt = grpcclient.InferInput("PROMPT", [1], "BYTES")
    prompt.set_data_from_numpy(np.array([b"a long generation on a quiet stream"], dtype=np.object_))
    resolution = grpcclient.InferInput("RESOLUTION", [1], "INT32")
    resolution.set_data_from_numpy(np.array([4], dtype=np.int32))
    events = []
    client = grpcclient.InferenceServerClient(bounded.grpc_url)
    client.start_stream(callback=lambda result, error: events.append((time.monotonic(), result, error)))
    try:
        client.async_stream_infer("cube3d_stream", [prompt, resolution])
        # Stopped only once it has taken the request (a stub that does not take one within about
        # a second is "not healthy" to Triton, test_drain.EngineHold), then held past the timeout.
        wait_until(lambda: metrics(bounded).get("cube3d_objects_in_flight/v1", 0) == 1, 60, "the request taken")
        os.kill(engine, signal.SIGSTOP)
        try:
            time.sleep(BOUNDED_IDLE_S + 2)
            assert not events, f"the stream ended while its request was in progress: {events}"
        finally:
            os.kill(engine, signal.SIGCONT)
        wait_until(lambda: len(events) >= 2, 300, "the answer, then the idle stream's end")
    finally:
        client.stop_stream()
        client.close()
    (answered, result, error), (closed, _, idle_error) = events[:2]
    assert error is None and len(result.as_numpy("SHAPE_TOKENS")) == LONG.num_tokens, error
    assert "the stream had no request in progress" in str(idle_error), idle_error
    assert BOUNDED_IDLE_S - 0.5 < closed - answered < BOUNDED_IDLE_S + 5, closed - answered
