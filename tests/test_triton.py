"""The real Triton server (from the nvidia-pytriton wheel) with this repository's models,
started and stopped by these tests, called over REST and gRPC as users do."""

from __future__ import annotations

import dataclasses
import io
import shutil
import threading
import time
import urllib.request

import numpy as np
import pytest
import trimesh

from cube3d_client import Cube3DClient, ServerError
from cubeserve.checkpoint import write_random_weights
from cubeserve.config import TINY
from cubeserve.engine import Engine, GenerationRequest
from cubeserve.server.local_triton import LocalTriton, copy_model_repository, free_port
from serving_helpers import metrics

# Version 2 is a slow checkpoint (1024 shape tokens) so that requests are still running while
# the tests cancel them or unload the other version.
LONG = dataclasses.replace(TINY, name="tiny-long",
                           tokenizer=dataclasses.replace(TINY.tokenizer, num_encoder_latents=1024))


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    # float32 on every CPU (the default is bfloat16 on AMX ones): tokens compare exactly with the
    # in-process engine's whatever a batch held.
    root = copy_model_repository(tmp_path_factory.mktemp("model_repository"), {"dtype": "float32"})
    for model in ("cube3d", "cube3d_stream"):
        shutil.copytree(root / model / "1", root / model / "2")
        config = root / model / "config.pbtxt"
        config.write_text(config.read_text().replace("latest { num_versions: 1 }", "all {}"))
    write_random_weights("tiny", root / "cube3d_stream" / "1" / "weights", seed=0)
    write_random_weights(LONG, root / "cube3d_stream" / "2" / "weights", seed=1)
    return root


@pytest.fixture(scope="module")
def server(repo, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "tritonserver.log"
    triton = LocalTriton(repo, free_port(), free_port(), free_port(), log_path=log,
                         extra_args=("--model-control-mode=explicit", "--load-model=cube3d_stream",
                                     "--load-model=cube3d"))
    with triton:
        yield triton


@pytest.fixture(scope="module")
def engine_v1(repo):
    return Engine.from_dir(repo / "cube3d_stream" / "1" / "weights", dtype="float32")


def expected_tokens(engine, **fields):
    return engine.generate_tokens([GenerationRequest(**fields)])[0].numpy()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_predict_api_returns_a_mesh_with_the_in_process_tokens(server, engine_v1, protocol):
    url = server.http_url if protocol == "http" else server.grpc_url
    with Cube3DClient(url, protocol, model_version="1") as client:
        result = client.generate("a red chair", seed=11, top_p=0.9, resolution=5)
    mesh = trimesh.load(io.BytesIO(result.mesh), file_type="glb", force="mesh")
    assert len(mesh.faces) == result.num_faces > 0 and len(mesh.vertices) == result.num_vertices
    np.testing.assert_array_equal(result.tokens, expected_tokens(engine_v1, prompt="a red chair", seed=11, top_p=0.9))
    assert result.timings["tokens_s"] > 0 and result.timings["geometry_s"] > 0


def test_raw_rest_infer_request(server):
    """POST /v2/models/cube3d/infer with plain JSON, as any v2 client would send it."""
    import json

    body = {"inputs": [{"name": "PROMPT", "shape": [1], "datatype": "BYTES", "data": ["a lamp"]},
                       {"name": "RESOLUTION", "shape": [1], "datatype": "INT32", "data": [4]},
                       {"name": "FORMAT", "shape": [1], "datatype": "BYTES", "data": ["obj"]}],
            "outputs": [{"name": "NUM_FACES"}, {"name": "SHAPE_TOKENS"}]}
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/cube3d/versions/1/infer",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    reply = json.loads(urllib.request.urlopen(req, timeout=60).read())
    outputs = {o["name"]: o for o in reply["outputs"]}
    assert outputs["NUM_FACES"]["data"][0] > 0 and len(outputs["SHAPE_TOKENS"]["data"]) == TINY.num_tokens


def test_concurrent_requests_are_batched_and_each_is_correct(server, engine_v1):
    before = metrics(server)
    prompts = [f"object {i}" for i in range(8)]
    results = [None] * 8

    def call(i):  # one client per thread
        with Cube3DClient(server.http_url, "http", model_version="1") as client:
            results[i] = client.generate(prompts[i], seed=i, resolution=4)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    after = metrics(server)
    tokens = after["cube3d_tokens_generated_total/v1"] - before.get("cube3d_tokens_generated_total/v1", 0)
    steps = after["cube3d_decode_steps_total/v1"] - before.get("cube3d_decode_steps_total/v1", 0)
    assert tokens == 8 * TINY.num_tokens
    assert steps < tokens / 2, f"{steps} steps for {tokens} tokens: the requests were not batched"
    for i, result in enumerate(results):
        np.testing.assert_array_equal(result.tokens, expected_tokens(engine_v1, prompt=prompts[i], seed=i))


def test_stream_progress_arrives_in_order_then_the_mesh(server, engine_v1):
    seen = []
    with Cube3DClient(server.grpc_url, "grpc", model_version="1") as client:
        result = client.generate("a boat", resolution=4, on_progress=seen.append)
    assert seen == list(range(1, TINY.num_tokens + 1))
    assert result.num_faces > 0
    np.testing.assert_array_equal(result.tokens, expected_tokens(engine_v1, prompt="a boat"))


def test_two_versions_side_by_side_and_unloading_one_spares_the_other(server, repo):
    import json

    import tritonclient.http as httpclient

    with Cube3DClient(server.http_url, "http", model_version="1") as c1:
        first = c1.generate("a cup", resolution=4)
    assert len(first.tokens) == TINY.num_tokens and first.model_version == "1"
    done = {}

    def long_request():
        with Cube3DClient(server.http_url, "http", model_version="2") as c2:
            done["result"] = c2.generate("a long one", resolution=4)

    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(1.0)  # version 2 is decoding now
    admin = httpclient.InferenceServerClient(server.http_url)
    for model in ("cube3d", "cube3d_stream"):  # keep only version 2
        config = admin.get_model_config(model)
        config["version_policy"] = {"specific": {"versions": [2]}}
        admin.load_model(model, config=json.dumps(config), headers=server.admin_headers)
    assert not admin.is_model_ready("cube3d", "1") and admin.is_model_ready("cube3d", "2")
    thread.join(120)
    assert len(done["result"].tokens) == LONG.num_tokens and done["result"].num_faces > 0
    assert done["result"].model_version == "2"
    with Cube3DClient(server.http_url, "http", model_version="1", retries=0) as c1:
        with pytest.raises(ServerError):
            c1.generate("a cup", resolution=4)
    for model in ("cube3d_stream", "cube3d"):  # back to both versions for the other tests
        config = admin.get_model_config(model)
        config["version_policy"] = {"all": {}}
        admin.load_model(model, config=json.dumps(config), headers=server.admin_headers)
    admin.close()


@pytest.mark.parametrize("fields,input_name", [
    ({"top_p": 2.0}, "TOP_P"),
    ({"temperature": 0.0}, "TEMPERATURE"),
    ({"resolution": 12}, "RESOLUTION"),
    ({"guidance_scale": -1.0}, "GUIDANCE_SCALE"),
    ({"bbox": (1.0, 1.0, 1.0)}, "BBOX"),  # version 1 takes no bounding box
    ({"format": "stl"}, "FORMAT"),
])
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_out_of_range_values_are_refused_naming_the_input(server, fields, input_name, protocol):
    url = server.http_url if protocol == "http" else server.grpc_url
    with Cube3DClient(url, protocol, model_version="1") as client:
        with pytest.raises(ServerError) as err:
            client.generate("a chair", **fields)
    assert str(err.value).startswith(f"{input_name}:")
    assert err.value.status in ("400", "StatusCode.INVALID_ARGUMENT")


def _raw_infer(server, inputs, model="cube3d"):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.http_url)
    tensors = []
    for name, array, dtype in inputs:
        t = httpclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        tensors.append(t)
    try:
        return client.infer(model, tensors, model_version="1")
    finally:
        client.close()


@pytest.mark.parametrize("inputs,message", [
    ([("SEED", np.array([1], dtype=np.int64), "INT64")], "PROMPT"),  # missing
    ([("PROMPT", np.array([1], dtype=np.int32), "INT32")], "PROMPT"),  # wrong type
    ([("PROMPT", np.array([b"a", b"b"], dtype=np.object_), "BYTES")], "PROMPT"),  # wrong shape
    ([("PROMPT", np.array([b"\xff\xfe bad"], dtype=np.object_), "BYTES")], "PROMPT: is not valid UTF-8"),
    # (64 KB: the model's own limit; past 1 MiB the front end refuses the body, tests/test_security.py)
    ([("PROMPT", np.array([b"x" * (1 << 16)], dtype=np.object_), "BYTES")], "PROMPT: is longer than"),
    ([("PROMPT", np.array([b"a"], dtype=np.object_), "BYTES"),
      ("SEED", np.array([-5], dtype=np.int64), "INT64")], "SEED:"),
])
def test_malformed_requests_get_an_error_naming_the_input_and_the_server_keeps_serving(server, inputs, message):
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as err:
        _raw_infer(server, inputs)
    assert message in err.value.message()
    ok = _raw_infer(server, [("PROMPT", np.array([b"still fine"], dtype=np.object_), "BYTES"),
                             ("RESOLUTION", np.array([4], dtype=np.int32), "INT32")])
    assert ok.as_numpy("NUM_FACES")[0] > 0


def test_custom_metrics_are_exported(server):
    with Cube3DClient(server.http_url, "http", model_version="1") as client:
        client.generate("a cup", resolution=4)
    names = {k.split("/")[0] for k in metrics(server)}
    assert {"cube3d_tokens_generated_total", "cube3d_objects_in_flight", "cube3d_decode_step_seconds",
            "cube3d_queue_seconds_total", "cube3d_decode_steps_total",  # the engine's batch
            # per request and per object, by version (serving/metrics.py; tests/test_experiments.py)
            "cube3d_requests_total", "cube3d_request_duration_seconds_count",
            "cube3d_time_per_output_token_seconds_count", "cube3d_request_queue_seconds_count",
            "cube3d_meshes_total"} <= names


def test_client_command_with_progress_bar_and_preview(server, tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    exe = Path(sys.executable).parent / "cube3d-client"
    out = tmp_path / "lamp.obj"
    proc = subprocess.run([str(exe), "a lamp", "--url", server.grpc_url, "--protocol", "grpc", "--progress",
                           "--model-version", "1", "--resolution", "4", "--out", str(out),
                           "--preview", str(tmp_path / "lamp.png")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"{TINY.num_tokens}/" in proc.stderr or f"{TINY.num_tokens}tok" in proc.stderr  # the tqdm bar
    assert "time per output token" in proc.stdout
    assert len(trimesh.load(out, force="mesh").faces) > 0
    assert (tmp_path / "lamp.png").read_bytes().startswith(b"\x89PNG")
    bad = subprocess.run([str(exe), "x", "--url", server.http_url, "--top-p", "3"], capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "TOP_P: must be a number in (0, 1]" in bad.stderr


def test_client_retries_connection_errors_then_gives_up():
    port = free_port()  # nothing listens here
    client = Cube3DClient(f"127.0.0.1:{port}", "http", retries=2, backoff=0.2, timeout=5)
    start = time.monotonic()
    with pytest.raises(Exception) as err:
        client.generate("a chair")
    assert time.monotonic() - start >= 0.2 + 0.4  # two retries with backoff
    assert not isinstance(err.value, ServerError)


def test_client_reaches_an_inference_service_through_an_ingress_by_host_header(server):
    """A stand-in for KServe's ingress: routes by Host header to the right backend, as Knative
    and Istio do, and refuses unknown hosts."""
    import http.server

    routes = {"cube3d.models.example.com": f"http://{server.http_url}"}
    seen = []

    class Ingress(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            host = self.headers.get("Host", "")
            seen.append((host, self.path))
            if host not in routes:
                self.send_response(404)
                self.end_headers()
                return
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
            upstream = urllib.request.Request(routes[host] + self.path, data=body, headers=headers, method="POST")
            with urllib.request.urlopen(upstream, timeout=60) as reply:
                data = reply.read()
                self.send_response(reply.status)
                for k, v in reply.headers.items():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        def log_message(self, *args):
            pass

    ingress = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ingress)
    thread = threading.Thread(target=ingress.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"127.0.0.1:{ingress.server_address[1]}"
        with Cube3DClient(url, "http", host="cube3d.models.example.com", model_version="1") as client:
            assert client.generate("a stool", resolution=4).num_faces > 0
        with Cube3DClient(url, "http", host="unknown.example.com", retries=0) as client:
            with pytest.raises(ServerError):
                client.generate("a stool", resolution=4)
    finally:
        ingress.shutdown()
    assert ("cube3d.models.example.com", "/v2/models/cube3d/versions/1/infer") in seen
