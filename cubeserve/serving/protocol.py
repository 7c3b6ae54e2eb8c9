"""The predict-API contract (Open Inference Protocol v2 tensors) in one place, free of torch
and Triton so that the server, the client and the tests share it.

Inputs (all but PROMPT optional, each with one element unless noted):
    PROMPT BYTES, SEED INT64, GUIDANCE_SCALE FP32, TOP_P FP32, TEMPERATURE FP32,
    RESOLUTION INT32, BBOX FP32 [3], FORMAT BYTES ("glb" | "obj"), STREAM_PROGRESS BOOL
Outputs:
    MESH BYTES, SHAPE_TOKENS INT32 [N], NUM_VERTICES INT64, NUM_FACES INT64,
    TIMINGS BYTES (JSON, seconds per stage), PROGRESS INT32 (tokens generated so far)
"""

from __future__ import annotations

import json

import numpy as np

from cubeserve.engine.requests import GenerationRequest, InvalidRequest

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
    "STREAM_PROGRESS": (None, "bool", 1),
}
FIELD_TO_INPUT = {field: name for name, (field, _, _) in INPUTS.items() if field}
OUTPUTS = ("MESH", "SHAPE_TOKENS", "NUM_VERTICES", "NUM_FACES", "TIMINGS", "PROGRESS")


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


def parse_request(inputs: dict[str, np.ndarray | None]) -> tuple[GenerationRequest, bool]:
    """Input tensors by name (None for absent optional inputs) -> (validated request without
    the model-specific checks, stream_progress). Errors name the input."""
    if inputs.get("PROMPT") is None:
        raise InvalidRequest("PROMPT", "is required (a BYTES tensor with one UTF-8 string)")
    values, stream = {}, False
    for name, (field, kind, elements) in INPUTS.items():
        array = inputs.get(name)
        if array is None:
            continue
        value = _scalar(name, array, kind, elements)
        if field is None:
            stream = bool(value)
        else:
            values[field] = value
    request = GenerationRequest(**values)
    return request, stream


def validate(request: GenerationRequest, uses_bbox: bool) -> None:
    """GenerationRequest.validate with errors renamed to the predict API's input names."""
    try:
        request.validate(uses_bbox=uses_bbox)
    except InvalidRequest as exc:
        name = FIELD_TO_INPUT.get(exc.field, exc.field)
        raise InvalidRequest(name, str(exc).split(": ", 1)[1]) from None


def is_input_error(message: str) -> bool:
    """Errors about input name themselves first ("TOP_P: must be ..."): a caller's mistake.
    (Triton's BLS does not carry error codes across, so the relay recognises them by name.)"""
    return message.split(":", 1)[0] in INPUTS


def result_outputs(result) -> dict[str, np.ndarray]:
    """A GenerationResult as output tensors."""
    mesh = result.mesh
    timings = dict(result.timings)
    if mesh.empty:
        timings["message"] = mesh.message
    return {
        "MESH": np.array([result.mesh_bytes()], dtype=np.object_),
        "SHAPE_TOKENS": np.asarray(result.tokens, dtype=np.int32),
        "NUM_VERTICES": np.array([len(mesh.vertices)], dtype=np.int64),
        "NUM_FACES": np.array([len(mesh.faces)], dtype=np.int64),
        "TIMINGS": np.array([json.dumps(timings).encode()], dtype=np.object_),
        "PROGRESS": np.array([len(result.tokens)], dtype=np.int32),
    }
