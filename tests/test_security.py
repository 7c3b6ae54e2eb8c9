"""Hostile clients against the real server (README, "Security"): the admin APIs locked over HTTP
and gRPC, shared memory refused in requests, oversized and deeply nested bodies refused, each
while a generation is in flight that must still complete, on a server started by LocalTriton
(as `cubeserve serve`) and on one started with the ServingRuntime's own arguments."""

from __future__ import annotations

import gzip
import http.client
import json
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
from cubeserve.serving.front import Refused, rewrite_body
from cubeserve.serving.local_triton import LocalTriton, copy_model_repository, free_port, tritonserver_home
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
             deploy.METRICS_PORT: free_port()}
    home = tritonserver_home()
    args = []
    for arg in container["args"]:
        for port, mine in ports.items():
            arg = arg.replace(f"-port={port}", f"-port={mine}")
        arg = {"python3": sys.executable, "tritonserver": str(home / "bin" / "tritonserver"),
               "--rest-address=0.0.0.0": "--rest-address=127.0.0.1",
               f"--model-store={deploy.KSERVE_MODEL_DIR}": f"--model-store={repo}"}.get(arg, arg)
        args.append(arg)
    # On this machine gRPC and metrics stay on the loopback too (a pod listens on all of its own).
    args += ["--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1", f"--backend-directory={home / 'backends'}"]
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
        assert f"--http-restricted-api={','.join(deploy.RESTRICTED_APIS)}:{deploy.ADMIN_HEADER}={key}" in cmdline
        assert "--http-address=127.0.0.1" in cmdline
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
