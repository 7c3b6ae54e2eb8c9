"""The predict-API contract (Open Inference Protocol v2 tensors) in one place, free of torch
and Triton so that the server, the client and the tests share it.

Inputs (all but PROMPT optional, each with one element unless noted):
    PROMPT BYTES, SEED INT64, GUIDANCE_SCALE FP32, TOP_P FP32, TEMPERATURE FP32,
    RESOLUTION INT32, BBOX FP32 [3], FORMAT BYTES ("glb" | "obj"),
    MESH_ENCODING BYTES ("base64" | "binary"), STREAM_PROGRESS BOOL
Outputs:
    MESH BYTES (the mesh file, base64 text unless MESH_ENCODING is "binary"),
    SHAPE_TOKENS INT32 [N], NUM_VERTICES INT64, NUM_FACES INT64,
    TIMINGS BYTES (JSON, seconds per stage), MODEL_VERSION BYTES (the model version that
    served the request, e.g. "7": the checkpoint version, see serving/repository.py),
    ARM BYTES (the predict model only: the experiment arm that served it, "" outside an
    experiment, see serving/experiment.py), PROGRESS INT32 (the stream model only: tokens
    generated so far)

Why base64 by default: Triton writes a BYTES output into a JSON response as a string, byte for
byte, so raw GLB bytes make the body invalid JSON for every client that does not use the binary
tensor extension (curl, KServe's SDK and InferenceGraph router). Triton does not tell the model
whether a request asked for binary outputs (`binary_data_output` is consumed by its HTTP
frontend), so the request says it instead: MESH_ENCODING "binary" gives the raw file bytes, for
gRPC and binary-extension clients (the project's client does this).

Errors: input errors start with the input's name ("TOP_P: ..."); errors worth retrying (busy,
deadline passed, engine stopping or gone) start with "unavailable:"; anything else is a failure
of the server. The Triton models map them to 400 / 503 / 500 (gRPC INVALID_ARGUMENT /
UNAVAILABLE / INTERNAL).
"""

from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass

import numpy as np

from cubeserve.requests import GenerationRequest, InvalidRequest, Unavailable, band_rank
from cubeserve.serving.experiment import BAND_KEY

# input name -> (GenerationRequest field, numpy kind, elements)
INPUTS = {
    "PROMPT": ("prompt", "bytes", 1),
    "SEED": ("seed", "int", 1),
    "GUIDANCE_SCALE": ("guidance_scale", "float", 1),
    "TOP_P": ("top_p", "float", 1),
    "TEMPERATURE": ("temperature", "float", 1),
    "RESOLUTION": ("resolution", "int", 1),
    "BBOX": ("bbox", "float", 3),
    "FORMAT": ("format", "bytes", 1),
    # serving options, not part of the generation (see ServingOptions)
    "MESH_ENCODING": (None, "bytes", 1),
    "STREAM_PROGRESS": (None, "bool", 1),
}
FIELD_TO_INPUT = {field: name for name, (field, _, _) in INPUTS.items() if field}
OUTPUTS = ("MESH", "SHAPE_TOKENS", "NUM_VERTICES", "NUM_FACES", "TIMINGS", "MODEL_VERSION", "ARM", "PROGRESS")
# The v2 datatype of every tensor on the wire (what config.pbtxt declares; tests hold the
# served metadata to it).
DATATYPES = {"PROMPT": "BYTES", "SEED": "INT64", "GUIDANCE_SCALE": "FP32", "TOP_P": "FP32", "TEMPERATURE": "FP32",
             "RESOLUTION": "INT32", "BBOX": "FP32", "FORMAT": "BYTES", "MESH_ENCODING": "BYTES",
             "STREAM_PROGRESS": "BOOL", "MESH": "BYTES", "SHAPE_TOKENS": "INT32", "NUM_VERTICES": "INT64",
             "NUM_FACES": "INT64", "TIMINGS": "BYTES", "MODEL_VERSION": "BYTES", "ARM": "BYTES", "PROGRESS": "INT32"}
MESH_ENCODINGS = ("base64", "binary")
# A request parameter: a request that carries it cancels the engine's request of that id (how the
# predict model cancels a forward whose client went away; BLS requests cannot be cancelled).
CANCEL_PARAMETER = "cube3d_cancel_request_id"
# A request parameter on the predict model's forwards: the engine takes them while the server
# drains (serving/drain.py), since the predict model accepted them before the drain began.
FORWARDED_PARAMETER = "cube3d_forwarded"
# A request parameter on the predict model's forwards: the experiment arm that the request was
# assigned to ("shadow" for a shadow test's copy), the `arm` label of the engine's measurements.
ARM_PARAMETER = "cube3d_arm"


@dataclass
class ServingOptions:
    """How a response is delivered (the inputs that are not generation fields)."""

    mesh_encoding: str = "base64"
    stream_progress: bool = False


def _scalar(name: str, array: np.ndarray, kind: str, elements: int):
    flat = np.asarray(array).reshape(-1)
    if flat.size != elements:
        raise InvalidRequest(name, f"expected {elements} element(s), got {flat.size}")
    if kind == "bytes":
        value = flat[0]
        if isinstance(value, str):
            return value
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidRequest(name, "is not valid UTF-8") from None
    if kind == "int":
        if flat.dtype.kind not in "iu":
            raise InvalidRequest(name, f"must be an integer tensor, got {flat.dtype}")
        return int(flat[0])
    if kind == "float":
        if flat.dtype.kind not in "fiu":
            raise InvalidRequest(name, f"must be a number tensor, got {flat.dtype}")
        values = [float(v) for v in flat]
        return values[0] if elements == 1 else tuple(values)
    return bool(flat[0])


def parse_request(inputs: dict[str, np.ndarray | None]) -> tuple[GenerationRequest, ServingOptions]:
    """Input tensors by name (None for absent optional inputs) -> (request, not yet validated
    against the model, and its serving options). Errors name the input."""
    if inputs.get("PROMPT") is None:
        raise InvalidRequest("PROMPT", "is required (a BYTES tensor with one UTF-8 string)")
    values, options = {}, ServingOptions()
    for name, (field, kind, elements) in INPUTS.items():
        array = inputs.get(name)
        if array is None:
            continue
        value = _scalar(name, array, kind, elements)
        if field is not None:
            values[field] = value
        elif name == "STREAM_PROGRESS":
            options.stream_progress = bool(value)
        else:
            if value not in MESH_ENCODINGS:
                raise InvalidRequest(name, f"must be one of {list(MESH_ENCODINGS)}, got {value!r}")
            options.mesh_encoding = value
    return GenerationRequest(**values), options


def validate(request: GenerationRequest, uses_bbox: bool) -> None:
    """GenerationRequest.validate with errors renamed to the predict API's input names."""
    try:
        request.validate(uses_bbox=uses_bbox)
    except InvalidRequest as exc:
        name = FIELD_TO_INPUT.get(exc.field, exc.field)
        raise InvalidRequest(name, str(exc).split(": ", 1)[1]) from None


def error_kind(message: str) -> str:
    """"invalid" (a caller's mistake: the message starts with an input's name), "unavailable"
    (retry later or elsewhere) or "internal". Triton's BLS does not carry error codes across,
    so the predict model recognises an engine's errors by their first word."""
    if message.split(":", 1)[0] in (*INPUTS, BAND_KEY):
        return "invalid"
    if message.startswith(Unavailable.PREFIX):
        return "unavailable"
    return "internal"


def queue_band(request_parameters: dict[str, str]) -> str | None:
    """The request's priority band (the gateway's header), checked: InvalidRequest naming the
    header for one that is not a band."""
    band = request_parameters.get(BAND_KEY)
    band_rank(band, BAND_KEY)
    return band


def encode_mesh(data: bytes, encoding: str) -> bytes:
    return base64.b64encode(data) if encoding == "base64" else data


def decode_mesh(data: bytes, encoding: str) -> bytes:
    return base64.b64decode(data, validate=True) if encoding == "base64" else data


def result_outputs(result, mesh_encoding: str, model_version: str) -> dict[str, np.ndarray]:
    """A GenerationResult, made by the model version `model_version`, as output tensors; TIMINGS
    adds `export_s`, the time the mesh took to become its file in MESH_ENCODING."""
    mesh = result.mesh
    started = time.perf_counter()
    mesh_file = encode_mesh(result.mesh_bytes(), mesh_encoding)
    timings = {**result.timings, "export_s": time.perf_counter() - started}
    if mesh.empty:
        timings["message"] = mesh.message
    return {
        "MESH": np.array([mesh_file], dtype=np.object_),
        "SHAPE_TOKENS": np.asarray(result.tokens, dtype=np.int32),
        "NUM_VERTICES": np.array([len(mesh.vertices)], dtype=np.int64),
        "NUM_FACES": np.array([len(mesh.faces)], dtype=np.int64),
        "TIMINGS": np.array([json.dumps(timings).encode()], dtype=np.object_),
        "MODEL_VERSION": np.array([str(model_version).encode()], dtype=np.object_),
        "PROGRESS": np.array([len(result.tokens)], dtype=np.int32),
    }
