"""Helpers shared by the two Triton python_backend models (imported only inside Triton)."""

from __future__ import annotations

import json
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def parameters(args) -> dict[str, str]:
    """The model's config.pbtxt `parameters` as strings."""
    config = json.loads(args["model_config"])
    return {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}


def response(outputs: dict[str, np.ndarray]):
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in outputs.items()])


# protocol.error_kind -> Triton's code: HTTP 400 / 503 / 500, gRPC INVALID_ARGUMENT / UNAVAILABLE /
# INTERNAL (the server's HttpCodeFromError and its gRPC status mapping). Names, because the stub
# adds TritonError to the module only after model.py is imported.
_CODES = {"invalid": "INVALID_ARG", "unavailable": "UNAVAILABLE", "internal": "INTERNAL"}


def error_response(message: str, kind: str = "internal"):
    """kind: "invalid" | "unavailable" | "internal" (see protocol.error_kind)."""
    code = getattr(pb_utils.TritonError, _CODES[kind])
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


def request_timeout_s(request) -> float | None:
    """The request's own deadline: the v2 `timeout` parameter (microseconds; HTTP
    `"parameters": {"timeout": ...}`, gRPC `parameters["timeout"]`, tritonclient's `timeout=`),
    which Triton hands to the model as request.timeout(); None when not set."""
    micros = request.timeout()
    return micros / 1e6 if micros else None


class Reply:
    """A request's response sender, answered once (later answers are dropped), whose client is
    asked about only until then: once the final response is out, Triton frees the request, and
    request.is_cancelled() on it crashes the server (in TRITONBACKEND_ResponseFactoryIsCancelled).
    So asking and the final answer never overlap."""

    def __init__(self, request):
        self.request = request
        self._sender = request.get_response_sender()
        self._lock = threading.Lock()
        self._answered = False

    def send(self, response=None, final: bool = True) -> bool:
        """Send `response` (None: an empty final response); False if already answered."""
        with self._lock:
            if self._answered:
                return False
            self._answered = final
            self._sender.send(response, flags=FINAL if final else 0)
            return True

    def client_gone(self) -> bool:
        with self._lock:
            return not self._answered and self.request.is_cancelled()
