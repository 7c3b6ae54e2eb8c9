"""Helpers shared by the two Triton python_backend models (imported only inside Triton)."""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from contextlib import contextmanager

import numpy as np
import triton_python_backend_utils as pb_utils

from cubeserve.requests import Unavailable
from cubeserve.serving.drain import IN_PROGRESS_METRIC, marker_path
from cubeserve.serving.triton_metrics import kept, locked

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def parameters(args) -> dict[str, str]:
    """The model's config.pbtxt `parameters` as strings."""
    config = json.loads(args["model_config"])
    return {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}


def request_parameter(request_parameters: dict, key: str) -> str | None:
    """A request parameter by name, case-insensitively (forwarded HTTP headers keep the case the
    client sent; gRPC metadata and HTTP/2 proxies lowercase them)."""
    for name, value in request_parameters.items():
        if name.lower() == key:
            return str(value)
    return None


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


class Drain:
    """What a model instance knows of a drain (cubeserve/serving/drain.py, the preStop hook):
    whether the server refuses new requests now, and how many of its requests are in progress
    (accepted, not answered yet), as the gauge `cube3d_requests_in_progress` that the drain waits
    on (summed over its series).

    One series per model instance (the `instance` label), set to this process's count under the
    process's metrics lock (serving/triton_metrics.py says why)."""

    def __init__(self, args: dict):
        # A stub is a child of tritonserver; the marker names that process.
        self.marker = marker_path(os.getppid())
        self.family = kept(pb_utils.MetricFamily(
            name=IN_PROGRESS_METRIC, kind=pb_utils.MetricFamily.GAUGE,
            description="Requests accepted and not yet answered (a drain waits for 0)"))
        self.gauge = kept(self.family.Metric(labels={"model": args["model_name"], "version": args["model_version"],
                                                     "instance": args["model_instance_name"]}))
        self._count = 0
        self._lock = threading.Lock()

    def draining(self) -> bool:
        return self.marker is not None and self.marker.exists()

    def refusal(self):
        """The answer to a new request while draining: UNAVAILABLE (HTTP 503), retry elsewhere."""
        return error_response(str(Unavailable(
            "the server is shutting down (draining): it takes no new requests; retry, another "
            "replica will serve it")), "unavailable")

    def add(self, n: int) -> None:
        with self._lock:
            self._count += n
            locked(lambda: self.gauge.set(self._count))  # in order: still under self._lock


def only_requested(response, requested: frozenset[str]):
    """`response` without the outputs the request did not ask for, dropped here, in Python.

    python_backend r24.10's ResponseSender.send drops them itself (InferResponse::
    PruneOutputTensors, src/response_sender.cc) after it has released the GIL: the dropped
    tensor's numpy array is freed by a thread without the GIL, against the other threads of the
    stub, which corrupts Python's small-object allocator; the stub segfaulted in libpython
    minutes later under sustained load (issue 56: the predict model's forwards ask for every output
    but PROGRESS). Upstream holds the GIL there from r24.12 (python_backend#390)."""
    if response is None or response.has_error():
        return response
    tensors = response.output_tensors()
    wanted = [t for t in tensors if t.name() in requested]
    if len(wanted) == len(tensors):
        return response
    return pb_utils.InferenceResponse(output_tensors=wanted)


class Reply:
    """A request's response sender, answered once (later answers are dropped), whose client is
    asked about only until then: once the final response is out, Triton frees the request, and
    request.is_cancelled() on it crashes the server (in TRITONBACKEND_ResponseFactoryIsCancelled).
    So asking and the final answer never overlap. Every response carries only the outputs the
    request asked for (`only_requested` says why): a client that names none gets every output."""

    def __init__(self, request, drain: Drain | None = None):
        self.request = request
        self._sender = request.get_response_sender()
        self._requested = frozenset(request.requested_output_names())
        self._lock = threading.Lock()
        self._answered = False
        self._drain = drain  # counted in progress until the final answer
        if drain is not None:
            drain.add(1)

    def send(self, response=None, final: bool = True) -> bool:
        """Send `response` (None: an empty final response); False if already answered."""
        with self._lock:
            if self._answered:
                return False
            self._answered = final
            try:
                self._sender.send(only_requested(response, self._requested), flags=FINAL if final else 0)
            finally:
                if final:
                    if self._drain is not None:
                        self._drain.add(-1)
                    # The request and its sender hold the stub's shared memory: let them go now.
                    # One still referenced when the stub exits (a callback's closure, a cycle)
                    # is freed after that memory is unmapped, and the stub segfaults.
                    self.request = self._sender = None
            return True

    def client_gone(self) -> bool:
        with self._lock:
            return not self._answered and self.request.is_cancelled()


class LetGoLater:
    """Holds what `hold` is given for `after_s` seconds, then lets it go on a Python thread of its
    own (with the GIL); `now()` lets go of everything (finalize). `responses(bls)` reads a decoupled
    BLS request's responses so.

    What it is for: a decoupled BLS request's response iterator. python_backend r24.10 (the
    Triton of nvidia-pytriton 0.7.0) keeps each iterator twice, as the Python object and in the
    stub's map, whose entry its stub-to-parent thread erases some time after the last response
    (pb_stub.cc, Stub::SendCleanupId). Whichever lets go last runs ~ResponseIterator, and with it
    the responses' ~PbTensor, which drops their numpy arrays; that thread holds no GIL, and
    r24.10's ~PbTensor does not take it (upstream does from r24.12, python_backend#390). An object
    array of bytes (MESH, TIMINGS) freed there corrupts Python's allocator against the stub's
    other threads: the predict model's stub segfaulted copying an object array after 9 minutes of
    the soak's traffic. Held here for seconds, the iterator is let go by Python, long after the
    map's entry is gone (a queue of IPC messages that takes milliseconds)."""

    def __init__(self, after_s: float, name: str):
        self.after_s = after_s
        self._held: deque = deque()  # (due, object), oldest first
        self._lock = threading.Lock()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def hold(self, obj) -> None:
        with self._lock:
            self._held.append((time.monotonic() + self.after_s, obj))

    @contextmanager
    def responses(self, bls):
        """`bls.exec(decoupled=True)`'s responses, to read in the block; the iterator held here
        after it, however the block ends."""
        responses = bls.exec(decoupled=True)
        try:
            yield responses
        finally:
            self.hold(responses)

    def _due(self, until: float) -> list:
        with self._lock:
            out = []
            while self._held and self._held[0][0] <= until:
                out.append(self._held.popleft()[1])
            return out

    def _run(self) -> None:
        while True:
            time.sleep(min(1.0, self.after_s / 4))
            self._due(time.monotonic()).clear()  # the last references: their destructors run here, with the GIL

    def now(self) -> None:
        self._due(float("inf")).clear()
