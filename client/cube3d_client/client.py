"""Cube3DClient: prompt in, mesh out, over the KServe predict API (Open Inference Protocol v2).

REST (`POST /v2/models/cube3d/infer`) and gRPC (ModelInfer) through `tritonclient`; with a
progress callback the request goes to the streaming entry point (`cube3d_stream`, a gRPC
stream) and each intermediate response reports the tokens generated so far. A KServe
InferenceService is reached through its ingress with the service's host name (`host`), the
model name and optionally the version. The mesh comes back as raw bytes (MESH_ENCODING
"binary" with tritonclient's binary outputs) unless `mesh_encoding="base64"`.
Connection failures and refusals that say to retry (HTTP 503 / gRPC UNAVAILABLE: the server is
busy, or restarting; 429 / RESOURCE_EXHAUSTED: the engine's queue shed the request for a higher
priority band or another tenant; each says "unavailable:" first) are retried with backoff;
errors from the model (bad input, failed generation) are not.

One client per thread: tritonclient's HTTP client is not thread-safe.
"""

from __future__ import annotations

import contextlib
import json
import queue
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from cubeserve import tracing
from cubeserve.deploy import PREDICT_MODEL, STREAM_MODEL
from cubeserve.serving.experiment import PIN_ARM_KEY, USER_KEY
from cubeserve.serving.protocol import DATATYPES, MESH_ENCODINGS, decode_mesh, error_kind

_NUMPY = {"INT64": np.int64, "INT32": np.int32, "FP32": np.float32, "BOOL": np.bool_}


class ServerError(RuntimeError):
    """The server answered with an error (bad input: `status` 400 / INVALID_ARGUMENT; busy or
    restarting: 503 / UNAVAILABLE, see `retryable`)."""

    def __init__(self, message: str, status: str | None = None):
        super().__init__(message)
        self.status = status

    @property
    def retryable(self) -> bool:
        # Errors on a gRPC stream reach tritonclient without their status: the message says it.
        return self.status in ("503", "StatusCode.UNAVAILABLE") or error_kind(str(self)) == "unavailable"


@dataclass
class MeshResult:
    mesh: bytes
    format: str
    tokens: np.ndarray
    num_vertices: int
    num_faces: int
    timings: dict = field(default_factory=dict)
    client_seconds: float = 0.0
    # The model version that served the request (the checkpoint version, e.g. "7"); "" from a
    # server whose model has no MODEL_VERSION output.
    model_version: str = ""
    # The experiment arm that served it ("" outside an experiment, or from the stream model).
    arm: str = ""

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self.mesh)
        return path

    def preview_png(self, size: int = 512) -> bytes:
        from cubeserve.preview import render_mesh_file

        return render_mesh_file(self.mesh, self.format, size)


def _is_retryable(exc: Exception) -> bool:
    """A connection failure, or a refusal that says to retry (503 / UNAVAILABLE)."""
    if isinstance(exc, (ConnectionError, OSError, TimeoutError)):
        return True
    # tritonclient's InferenceServerException has status() and message() methods
    status = str(exc.status() or "") if callable(getattr(exc, "status", None)) else ""
    message = exc.message() if callable(getattr(exc, "message", None)) else str(exc)
    return ("UNAVAILABLE" in status or "DEADLINE_EXCEEDED" in status or status == "503"
            or error_kind(message) == "unavailable")  # a stream's errors carry no status

TRACE_SERVICE = "cube3d-client"  # the client's spans' service name (cubeserve/tracing.py)


class Cube3DClient:
    def __init__(self, url: str = "127.0.0.1:8000", protocol: str = "http", model: str = PREDICT_MODEL,
                 stream_model: str = STREAM_MODEL, model_version: str = "", host: str | None = None,
                 timeout: float = 600.0, retries: int = 3, backoff: float = 1.0, ssl: bool = False,
                 mesh_encoding: str = "binary", user: str | None = None, arm: str | None = None,
                 api_key: str | None = None, trace: bool = False):
        if protocol not in ("http", "grpc"):
            raise ValueError(f"protocol must be 'http' or 'grpc', got {protocol!r}")
        if mesh_encoding not in MESH_ENCODINGS:
            raise ValueError(f"mesh_encoding must be one of {list(MESH_ENCODINGS)}, got {mesh_encoding!r}")
        self.mesh_encoding = mesh_encoding
        self.url, self.protocol, self.model, self.stream_model = url, protocol, model, stream_model
        self.model_version, self.host = model_version, host
        self.timeout, self.retries, self.backoff, self.ssl = timeout, retries, backoff, ssl
        # The user key of an experiment (sent as the header x-cube3d-user): one user, one arm;
        # or an arm pinned by name (x-cube3d-arm), e.g. to check one arm by hand.
        self.user, self.arm = user, arm
        self.api_key = api_key  # a tenant's key for the gateway (docs/gateway/index.md), sent as a bearer token
        # Each generation starts a W3C trace (cubeserve/tracing.py): with $OTEL_EXPORTER_OTLP_ENDPOINT
        # the client's own span is its root, exported there; without it only the traceparent is sent.
        self.trace = trace
        self.trace_id: str | None = None  # the last generation's trace id
        self._traceparent: str | None = None
        self._client = None

    # -- transport ------------------------------------------------------------------------------

    def _module(self):
        if self.protocol == "http":
            import tritonclient.http as module
        else:
            import tritonclient.grpc as module
        return module

    def _connect(self):
        if self._client is None:
            module = self._module()
            if self.protocol == "http":
                self._client = module.InferenceServerClient(
                    self.url, ssl=self.ssl, connection_timeout=min(60.0, self.timeout), network_timeout=self.timeout)
            else:
                # KServe routes gRPC by authority: send the service host name as :authority.
                args = {"grpc.default_authority": self.host} if self.host else None
                self._client = module.InferenceServerClient(self.url, ssl=self.ssl, channel_args=(
                    list(args.items()) if args else None))
        return self._client

    def _headers(self) -> dict | None:
        """HTTP headers, or gRPC metadata (the same keys but Host, which gRPC sends as :authority)."""
        headers = {}
        if self.host and self.protocol == "http":
            headers["Host"] = self.host
        if self.user:
            headers[USER_KEY] = self.user
        if self.arm:
            headers[PIN_ARM_KEY] = self.arm
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        if self._traceparent:
            headers["traceparent"] = self._traceparent
        return headers or None

    def _inputs(self, values: dict):
        module = self._module()
        tensors = []
        for name, value in values.items():
            if value is None:
                continue
            dtype = DATATYPES[name]
            if dtype == "BYTES":
                array = np.array([str(value).encode("utf-8")], dtype=np.object_)
            else:
                array = np.asarray(value, dtype=_NUMPY[dtype]).reshape(-1)
            tensor = module.InferInput(name, list(array.shape), dtype)
            tensor.set_data_from_numpy(array)
            tensors.append(tensor)
        return tensors

    def _with_retries(self, call: Callable):
        delay = self.backoff
        for attempt in range(self.retries + 1):
            try:
                return call()
            except Exception as exc:  # noqa: BLE001 - classify below
                if attempt < self.retries and _is_retryable(exc):
                    self._client = None  # reconnect
                    time.sleep(delay)
                    delay *= 2
                    continue
                raise self._as_server_error(exc) from exc

    @staticmethod
    def _as_server_error(exc: Exception) -> Exception:
        from tritonclient.utils import InferenceServerException

        if isinstance(exc, InferenceServerException):
            return ServerError(exc.message(), str(exc.status()))
        return exc

    # -- API ------------------------------------------------------------------------------------

    def ready(self) -> bool:
        try:
            client = self._connect()
            kwargs = {"headers": self._headers()} if self.protocol == "http" else {}
            return bool(client.is_model_ready(self.model, self.model_version, **kwargs))
        except Exception:  # noqa: BLE001
            return False

    def generate(self, prompt: str, *, seed: int | None = None, guidance_scale: float | None = None,
                 top_p: float | None = None, temperature: float | None = None, resolution: int | None = None,
                 bbox: tuple[float, float, float] | None = None, format: str = "glb",
                 on_progress: Callable[[int], None] | None = None) -> MeshResult:
        values = {"PROMPT": prompt, "SEED": seed, "GUIDANCE_SCALE": guidance_scale, "TOP_P": top_p,
                  "TEMPERATURE": temperature, "RESOLUTION": resolution, "BBOX": bbox, "FORMAT": format,
                  "MESH_ENCODING": self.mesh_encoding}
        start = time.perf_counter()
        with self._traced(prompt):
            if on_progress is not None:
                if self.protocol != "grpc":
                    raise ValueError("progress streaming needs protocol='grpc'")
                result = self._with_retries(lambda: self._stream(values, on_progress))
            else:
                result = self._with_retries(lambda: self._infer(values))
        out = self._result(result, format, self.mesh_encoding)
        out.client_seconds = time.perf_counter() - start
        return out

    @contextlib.contextmanager
    def _traced(self, prompt: str):
        """The generation's trace: its traceparent in every request (retries too), its id kept."""
        if not self.trace:
            yield
            return
        tracer = tracing.tracer(TRACE_SERVICE)
        if tracer is None:
            self._traceparent = tracing.new_traceparent()
            self.trace_id = tracing.trace_id(self._traceparent)
            try:
                yield
            finally:
                self._traceparent = None
            return
        from opentelemetry.trace import SpanKind

        with tracer.start_as_current_span("generate", kind=SpanKind.CLIENT,
                                          attributes={"cube3d.model": self.model, "cube3d.url": self.url}) as span:
            self._traceparent = tracing.traceparent(span)
            self.trace_id = tracing.trace_id(self._traceparent)
            try:
                yield
            finally:
                self._traceparent = None
        tracing.flush()

    def _infer(self, values: dict):
        client = self._connect()
        if self.protocol == "http":
            return client.infer(self.model, self._inputs(values), model_version=self.model_version,
                                headers=self._headers(), timeout=int(self.timeout * 1e6))
        return client.infer(self.model, self._inputs(values), model_version=self.model_version,
                            headers=self._headers(), client_timeout=self.timeout)

    def _stream(self, values: dict, on_progress: Callable[[int], None]):
        client = self._connect()
        responses: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: responses.put((result, error)),
                            stream_timeout=self.timeout)
        try:
            client.async_stream_infer(self.stream_model, self._inputs({**values, "STREAM_PROGRESS": True}),
                                      model_version=self.model_version, enable_empty_final_response=True)
            final = None
            deadline = time.monotonic() + self.timeout
            while True:
                result, error = responses.get(timeout=max(0.1, deadline - time.monotonic()))
                if error is not None:
                    raise error
                response = result.get_response()
                names = {o.name for o in response.outputs}
                if "MESH" in names:
                    final = result
                elif "PROGRESS" in names:
                    on_progress(int(result.as_numpy("PROGRESS")[0]))
                if response.parameters.get("triton_final_response") and \
                        response.parameters["triton_final_response"].bool_param:
                    break
            if final is None:
                raise ServerError("the stream ended without a mesh (cancelled?)")
            return final
        finally:
            client.stop_stream()

    @staticmethod
    def _result(result, format: str, mesh_encoding: str) -> MeshResult:
        version = result.as_numpy("MODEL_VERSION")  # None when the server does not send it
        arm = result.as_numpy("ARM")
        return MeshResult(
            mesh=decode_mesh(bytes(result.as_numpy("MESH")[0]), mesh_encoding),
            format=format,
            tokens=result.as_numpy("SHAPE_TOKENS"),
            num_vertices=int(result.as_numpy("NUM_VERTICES")[0]),
            num_faces=int(result.as_numpy("NUM_FACES")[0]),
            timings=json.loads(result.as_numpy("TIMINGS")[0]),
            model_version=bytes(version[0]).decode() if version is not None else "",
            arm=bytes(arm[0]).decode() if arm is not None else "",
        )

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def __enter__(self) -> "Cube3DClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
