"""Clients nobody here wrote get the mesh from the real tritonserver intact: KServe's Python SDK
(REST and gRPC, v2), tritonclient (HTTP with and without binary outputs, gRPC), a plain JSON
POST as curl sends it, and the project's own client. Intact means the same sha256 as the mesh
made in process from the same request. The model's metadata and config say what it takes."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from cube3d_client import Cube3DClient
from cubeserve.engine import Engine, GenerationRequest
from cubeserve.serving import protocol
from cubeserve.server.local_triton import LocalTriton, copy_model_repository, ensure_demo_weights, free_port

PROMPT, SEED, RESOLUTION = "a small ball", 3, 5
KSERVE_SDK_CLIENT = Path(__file__).with_name("kserve_sdk_client.py")


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = copy_model_repository(tmp_path_factory.mktemp("model_repository"), {"dtype": "float32"})  # as `expected`
    ensure_demo_weights(root)  # the shipped demo model
    return root


@pytest.fixture(scope="module")
def server(repo, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "tritonserver.log"
    with LocalTriton(repo, free_port(), free_port(), free_port(), log_path=log) as triton:
        yield triton


@pytest.fixture(scope="module")
def expected(repo):
    """sha256 of the GLB and the tokens, made in process from the same request."""
    engine = Engine.from_dir(repo / "cube3d_stream" / "1" / "weights", dtype="float32")
    [result] = engine.generate([GenerationRequest(PROMPT, seed=SEED, resolution=RESOLUTION)])
    assert not result.mesh.empty
    return hashlib.sha256(result.mesh_bytes()).hexdigest(), result.tokens


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def json_body(**extra_inputs) -> dict:
    inputs = {"PROMPT": ("BYTES", PROMPT), "SEED": ("INT64", SEED), "RESOLUTION": ("INT32", RESOLUTION),
              **extra_inputs}
    return {"inputs": [{"name": k, "shape": [1], "datatype": t, "data": [v]} for k, (t, v) in inputs.items()]}


def post_json(server, body: dict, model: str = "cube3d") -> dict:
    """As curl does it: JSON in, JSON out, no binary tensor extension."""
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/{model}/infer", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        assert reply.headers["Content-Type"].startswith("application/json")
        return json.loads(reply.read())  # fails on raw mesh bytes: the bug this file guards against


def test_plain_json_request_gets_valid_json_with_the_mesh_in_base64(server, expected):
    reply = post_json(server, json_body())
    outputs = {o["name"]: o for o in reply["outputs"]}
    assert sha256(base64.b64decode(outputs["MESH"]["data"][0], validate=True)) == expected[0]
    assert outputs["MODEL_VERSION"]["data"] == ["1"] and outputs["MODEL_VERSION"]["datatype"] == "BYTES"
    assert outputs["SHAPE_TOKENS"]["data"] == expected[1]
    timings = json.loads(outputs["TIMINGS"]["data"][0])
    assert timings["total_s"] > 0


def test_obj_format_over_plain_json(server):
    reply = post_json(server, json_body(FORMAT=("BYTES", "obj")))
    mesh = base64.b64decode({o["name"]: o for o in reply["outputs"]}["MESH"]["data"][0])
    assert mesh.decode().lstrip().startswith(("v ", "#", "o ", "mtllib"))


@pytest.mark.parametrize("kind", ["rest", "grpc"])
def test_kserve_python_sdk(server, expected, kind):
    url = server.http_url if kind == "rest" else server.grpc_url
    proc = subprocess.run([sys.executable, str(KSERVE_SDK_CLIENT), kind, url, PROMPT, str(SEED), str(RESOLUTION)],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["mesh_sha256"] == expected[0] and got["tokens"] == expected[1]


@pytest.mark.parametrize("transport,binary_outputs,encoding", [
    ("http", True, "base64"),  # tritonclient's default: binary outputs
    ("http", False, "base64"),  # outputs requested as JSON
    ("http", True, "binary"),  # raw bytes through the binary extension
    ("grpc", None, "base64"),
    ("grpc", None, "binary"),
])
def test_tritonclient(server, expected, transport, binary_outputs, encoding):
    if transport == "http":
        import tritonclient.http as module
        client = module.InferenceServerClient(server.http_url, network_timeout=120)
    else:
        import tritonclient.grpc as module
        client = module.InferenceServerClient(server.grpc_url)
    inputs = []
    for name, dtype, value in (("PROMPT", "BYTES", np.array([PROMPT.encode()], dtype=np.object_)),
                               ("SEED", "INT64", np.array([SEED], dtype=np.int64)),
                               ("RESOLUTION", "INT32", np.array([RESOLUTION], dtype=np.int32)),
                               ("MESH_ENCODING", "BYTES", np.array([encoding.encode()], dtype=np.object_))):
        tensor = module.InferInput(name, [1], dtype)
        tensor.set_data_from_numpy(value)
        inputs.append(tensor)
    outputs = None
    if binary_outputs is not None:
        outputs = [module.InferRequestedOutput(n, binary_data=binary_outputs) for n in ("MESH", "SHAPE_TOKENS")]
    try:
        result = client.infer("cube3d", inputs, outputs=outputs)
    finally:
        client.close()
    mesh = result.as_numpy("MESH")[0]  # str from a JSON output, bytes from a binary one
    mesh = protocol.decode_mesh(mesh.encode() if isinstance(mesh, str) else bytes(mesh), encoding)
    assert sha256(mesh) == expected[0]
    assert result.as_numpy("SHAPE_TOKENS").tolist() == expected[1]


@pytest.mark.parametrize("transport,stream", [("http", False), ("grpc", False), ("grpc", True)])
def test_project_client_gets_raw_bytes(server, expected, transport, stream):
    url = server.http_url if transport == "http" else server.grpc_url
    progress = []
    with Cube3DClient(url, transport) as client:
        assert client.mesh_encoding == "binary"
        result = client.generate(PROMPT, seed=SEED, resolution=RESOLUTION,
                                 on_progress=progress.append if stream else None)
    assert sha256(result.mesh) == expected[0] and result.tokens.tolist() == expected[1]
    assert bool(progress) == stream
    assert result.model_version == "1"  # the version that served it, from the stream too


def test_an_unknown_mesh_encoding_is_refused_naming_the_input(server):
    with pytest.raises(urllib.error.HTTPError) as err:
        post_json(server, json_body(MESH_ENCODING=("BYTES", "hex")))
    assert err.value.code == 400
    assert json.loads(err.value.read())["error"] == "MESH_ENCODING: must be one of ['base64', 'binary'], got 'hex'"


@pytest.mark.parametrize("model", ["cube3d", "cube3d_stream"])
def test_metadata_and_config_describe_every_input_and_output(server, model):
    def get(path):
        with urllib.request.urlopen(f"http://{server.http_url}/v2/models/{model}{path}", timeout=10) as reply:
            return json.loads(reply.read())

    metadata, config = get(""), get("/config")
    expected_inputs = [n for n in protocol.INPUTS if model == "cube3d_stream" or n != "STREAM_PROGRESS"]
    assert [i["name"] for i in metadata["inputs"]] == expected_inputs
    expected_outputs = [n for n in protocol.OUTPUTS if n != ("ARM" if model == "cube3d_stream" else "PROGRESS")]
    assert [o["name"] for o in metadata["outputs"]] == expected_outputs
    assert "MODEL_VERSION" in expected_outputs  # every response says which version served it
    for tensor in metadata["inputs"] + metadata["outputs"]:
        assert tensor["datatype"] == protocol.DATATYPES[tensor["name"]], tensor
    for tensor in metadata["inputs"]:
        assert tensor["shape"] == [protocol.INPUTS[tensor["name"]][2]]
    assert {i["name"] for i in config["input"] if not i.get("optional")} == {"PROMPT"}
    if model == "cube3d_stream":
        assert config["model_transaction_policy"]["decoupled"] is True
        assert {"max_objects", "max_queue"} <= set(config["parameters"])
