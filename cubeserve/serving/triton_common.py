"""Helpers shared by the two Triton python_backend models (imported only inside Triton)."""

from __future__ import annotations

import json

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def parameters(args) -> dict[str, str]:
    """The model's config.pbtxt `parameters` as strings."""
    config = json.loads(args["model_config"])
    return {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}


def response(outputs: dict[str, np.ndarray]):
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in outputs.items()])


def error_response(message: str, invalid: bool = False):
    """INVALID_ARG becomes HTTP 400 / gRPC INVALID_ARGUMENT; anything else is INTERNAL."""
    code = pb_utils.TritonError.INVALID_ARG if invalid else pb_utils.TritonError.INTERNAL
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))
