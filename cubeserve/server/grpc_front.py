"""The gRPC front end: what clients reach on the gRPC port, in front of tritonserver's own gRPC
endpoint, which listens on the loopback only (cubeserve.deploy.TRITON_GRPC_PORT).

Why: the REST front end (server/front.py) keeps hostile bodies away from Triton's HTTP code, but
gRPC went straight to tritonserver, where one request kills it: an output asking for a
classification (`class_count`, the parameter `classification`) of a BYTES output divides by
the element size, 0 (SIGFPE; Triton 2.51, fixed upstream in server#8267), and every request in
flight is lost. And the models' own parameters (`cube3d_*`, the tenant) must come from our code
only. So gRPC is checked as REST is, by the same rules (server/checks.py): each ModelInfer and
each ModelStreamInfer request is parsed, checked (400's gRPC twin INVALID_ARGUMENT naming the
field; in a stream, an error response for that request and the stream goes on, as Triton does)
and forwarded as a message written here. Other calls are forwarded as they are, after their
model name is checked; the admin calls (the restricted categories, cubeserve.deploy.
RESTRICTED_APIS) only with the admin key in the metadata deploy.GRPC_ADMIN_METADATA, passed on
with tritonserver's own key.

Bounded, whatever clients do (GrpcLimits): connections (gRPC's connection quota), calls at
once (RESOURCE_EXHAUSTED past it), streams per connection, the TLS-less handshake's time (the
preface and SETTINGS: a silent or slow connection), idle connections and streams, unanswered
keepalive pings, and a message's size: deploy.MAX_REQUEST_BYTES, so a model load carrying its files
(bigger) goes over REST.

Every call ends with the server's load report in its trailing metadata (endpoint-load-metrics-bin
and, as text, endpoint-load-metrics: server/load_report.py), refused ones included; a ModelInfer
and each request of a stream count as in progress until answered.

It runs in the supervisor on a thread with its own asyncio loop, as the REST front end does.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import threading
import time
from dataclasses import dataclass

# The supervisor forks tritonserver (and execs it at once) while this front end's threads run:
# gRPC's fork handlers then skip ("other threads are calling into gRPC") and its event engine
# in the parent died on a closed epoll descriptor (the supervisor exited with 250). No child of
# this process uses gRPC, so there is nothing for fork support to do. Read when grpc loads.
os.environ["GRPC_ENABLE_FORK_SUPPORT"] = "false"

import grpc  # noqa: E402
from google.protobuf.message import DecodeError  # noqa: E402
from tritonclient.grpc import service_pb2 as pb  # noqa: E402

from cubeserve import deploy, tracing  # noqa: E402
from cubeserve.requests import Shed  # noqa: E402
from cubeserve.server import checks  # noqa: E402
from cubeserve.serving import stubs  # noqa: E402
from cubeserve.server.checks import MAX_ELEMENTS, MAX_RANK, MAX_TENSORS, Refused  # noqa: E402
from cubeserve.server.front import TRACE_SERVICE, LoopThread  # noqa: E402
from cubeserve.server.load_report import LoadReport  # noqa: E402

log = logging.getLogger("cubeserve.grpc_front")

SERVICE = "/inference.GRPCInferenceService/"
INFER, STREAM = SERVICE + "ModelInfer", SERVICE + "ModelStreamInfer"
FINAL_RESPONSE = b"triton_final_response"  # the response parameter that ends a decoupled request
# Calls open to everyone, with the message whose `name` is a model's (None: no model named).
OPEN = {SERVICE + "ServerLive": None, SERVICE + "ServerReady": None, SERVICE + "ServerMetadata": None,
        SERVICE + "ModelReady": pb.ModelReadyRequest, SERVICE + "ModelMetadata": pb.ModelMetadataRequest,
        SERVICE + "ModelConfig": pb.ModelConfigRequest, "/grpc.health.v1.Health/Check": None}
# The restricted categories (Triton's --grpc-restricted-protocol) and their calls.
ADMIN = {SERVICE + name for name in (
    "ModelStatistics", "RepositoryIndex", "RepositoryModelLoad", "RepositoryModelUnload",
    "SystemSharedMemoryStatus", "SystemSharedMemoryRegister", "SystemSharedMemoryUnregister",
    "CudaSharedMemoryStatus", "CudaSharedMemoryRegister", "CudaSharedMemoryUnregister",
    "TraceSetting", "LogSettings")}
FORWARD_METADATA = ("x-cube3d-user", "x-cube3d-arm", "x-cube3d-tenant", "x-cube3d-model",
                    "x-cube3d-band")  # as the REST front's headers


@dataclass(frozen=True)
class GrpcLimits:
    """connections: open at once (gRPC's own connection quota refuses more); calls: in progress
    at once (RESOURCE_EXHAUSTED past it); streams: calls at once on one connection; handshake_s:
    to open a connection, the HTTP/2 preface and first SETTINGS included (a silent or slow
    connection is closed: gRPC's server_handshake_timeout_ms, whose deadline also bounds the
    wait for the client's SETTINGS); idle_s: a connection with no call is closed (GOAWAY, which
    clients follow by reconnecting); keepalive_s: a connection that has sent nothing this long is
    pinged, and closed if the ping is not answered within keepalive_timeout_s (a client gone
    without a FIN, a call of it included)."""

    connections: int = 1024
    calls: int = 1024
    streams: int = 100
    idle_s: float = deploy.IDLE_TIMEOUT_S
    handshake_s: float = deploy.HEADER_TIMEOUT_S
    keepalive_s: float = deploy.IDLE_TIMEOUT_S
    keepalive_timeout_s: float = 20.0


def _value(parameter: pb.InferParameter):
    kind = parameter.WhichOneof("parameter_choice")
    return None if kind is None else getattr(parameter, kind)


def _parameters(entries, where: str, allowed: dict) -> None:
    checks.parameters({key: _value(value) for key, value in entries.items()}, where, allowed)


def check_infer(request: pb.ModelInferRequest) -> None:
    """A ModelInferRequest by the rules of server/checks.py; Refused naming the first bad field."""
    checks.name(request.model_name, "model_name")
    if request.model_version and not (request.model_version.isascii() and request.model_version.isdigit()
                                      and len(request.model_version) <= 19):
        raise Refused(400, f"model_version: must be a version number, got {request.model_version[:32]!r}")
    checks.string(request.id, "id", checks.MAX_NAME_BYTES)
    _parameters(request.parameters, "parameters", checks.REQUEST_PARAMETERS)
    if not 1 <= len(request.inputs) <= MAX_TENSORS:
        raise Refused(400, f"inputs: must be a list of 1 to {MAX_TENSORS} tensors")
    for i, tensor in enumerate(request.inputs):
        where = f"inputs[{i}]"
        checks.string(tensor.name, f"{where}.name", checks.MAX_NAME_BYTES)
        if tensor.datatype not in checks.DATATYPES:
            raise Refused(400, f"{where}.datatype: must be one of {', '.join(sorted(checks.DATATYPES))}")
        shape = list(tensor.shape)
        if len(shape) > MAX_RANK or not all(0 <= d <= MAX_ELEMENTS for d in shape):
            raise Refused(400, f"{where}.shape: must be a list of at most {MAX_RANK} sizes in [0, {MAX_ELEMENTS}]")
        total = 1
        for d in shape:
            total *= d
        if total > MAX_ELEMENTS:
            raise Refused(400, f"{where}.shape: {shape} has more than {MAX_ELEMENTS} elements")
        _parameters(tensor.parameters, f"{where}.parameters", {})  # shared memory refused by name
    if len(request.outputs) > MAX_TENSORS:
        raise Refused(400, f"outputs: must be a list of at most {MAX_TENSORS} tensors")
    for i, tensor in enumerate(request.outputs):
        checks.string(tensor.name, f"outputs[{i}].name", checks.MAX_NAME_BYTES)
        _parameters(tensor.parameters, f"outputs[{i}].parameters", checks.OUTPUT_PARAMETERS)


def parse_infer(raw: bytes) -> pb.ModelInferRequest:
    try:
        request = pb.ModelInferRequest.FromString(raw)
    except DecodeError as exc:
        raise Refused(400, f"request: not a ModelInferRequest ({exc})") from None
    check_infer(request)
    return request


def _dead_stub_response(raw: bytes) -> bytes:
    """A stream response whose error says its model's stub died, with an "unavailable: ..." message
    instead, which clients retry (stubs.dead_stub_unavailable); any other response as it came."""
    if b"is not healthy" not in raw:  # most responses carry a mesh: parsed only when it may be one
        return raw
    response = pb.ModelStreamInferResponse.FromString(raw)
    unavailable = stubs.dead_stub_unavailable(response.error_message)
    if not unavailable:
        return raw
    response.error_message = unavailable
    return response.SerializeToString()


class _StreamActivity:
    """A stream's requests in progress (forwarded, their final response not yet back), counted in
    the server's load report too, and when it last carried a message either way."""

    def __init__(self, load: LoadReport | None = None):
        self.outstanding, self.last = 0, time.monotonic()
        self.load = load

    def touch(self) -> None:
        self.last = time.monotonic()

    def forwarded(self) -> None:
        self.outstanding += 1
        if self.load is not None:
            self.load.started()

    def _ended(self) -> None:
        if self.outstanding > 0:
            self.outstanding -= 1
            if self.load is not None:
                self.load.finished()

    def close(self) -> None:
        """The stream is over: what is still in progress on it is no longer the server's load."""
        while self.outstanding > 0:
            self._ended()
        self.load = None

    def answered(self, raw: bytes) -> None:
        """A response from Triton: final unless it says otherwise (a decoupled model's progress
        responses carry triton_final_response=false; an error response ends its request)."""
        self.touch()
        if FINAL_RESPONSE in raw:
            response = pb.ModelStreamInferResponse.FromString(raw)
            final = response.infer_response.parameters.get(FINAL_RESPONSE.decode())
            if final is not None and not final.bool_param and not response.error_message:
                return
        self._ended()

    def idle_for(self, seconds: float) -> bool:
        return self.outstanding == 0 and time.monotonic() - self.last >= seconds


_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 403: grpc.StatusCode.PERMISSION_DENIED,
          503: grpc.StatusCode.UNAVAILABLE}
_FAILED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL)  # the server's failures, in the load report


class GrpcFrontEnd(LoopThread):
    """The gRPC front end on `host:port`, forwarding to tritonserver's gRPC endpoint on the
    loopback port `upstream_port`; keys and `load` as server/front.py's FrontEnd."""

    what = "gRPC front end"

    def __init__(self, host: str, port: int, upstream_port: int, admin_key: str, upstream_key: str | None = None,
                 max_message: int = deploy.MAX_REQUEST_BYTES, limits: GrpcLimits = GrpcLimits(),
                 load: LoadReport | None = None):
        self.host, self.port, self.upstream = host, port, f"127.0.0.1:{upstream_port}"
        self.admin_key = admin_key.encode()
        self.upstream_key = upstream_key or admin_key
        self.max_message, self.limits = max_message, limits
        self.load = load or LoadReport(deploy.SCALE_TARGET)
        self.stopping = False  # set by the supervisor once tritonserver is told to stop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: grpc.aio.Server | None = None
        self._channel: grpc.aio.Channel | None = None
        self._thread: threading.Thread | None = None

    # -- a call ----------------------------------------------------------------------------------
    def _metadata(self, context, admin: bool) -> list[tuple[str, str]]:
        given = dict(context.invocation_metadata() or ())
        metadata = [(key, str(given[key])) for key in FORWARD_METADATA if key in given]
        if admin:
            key = given.get(deploy.GRPC_ADMIN_METADATA, "")
            key = key.encode("utf-8", "surrogateescape") if isinstance(key, str) else bytes(key)
            if not hmac.compare_digest(key, self.admin_key):
                raise Refused(403, f"This API is restricted: it needs the metadata '{deploy.GRPC_ADMIN_METADATA}' "
                                   "(docs/security.md)")
            metadata.append((deploy.GRPC_ADMIN_METADATA, self.upstream_key))
        return metadata

    def _unavailable(self, error: grpc.aio.AioRpcError) -> tuple[grpc.StatusCode, str]:
        dead_stub = error.code() == grpc.StatusCode.INTERNAL and stubs.dead_stub_unavailable(error.details() or "")
        if dead_stub:
            return grpc.StatusCode.UNAVAILABLE, dead_stub
        if error.code() == grpc.StatusCode.UNAVAILABLE and (error.details() or "").startswith(Shed.PREFIX):
            # The engine's queue shed it (engine/admission.py): REST's 429, retry here later.
            return grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
        if error.code() == grpc.StatusCode.UNAVAILABLE and not error.details().startswith("unavailable:"):
            state = ("the server is shutting down (tritonserver takes no new connections)" if self.stopping
                     else "tritonserver is not answering (starting or restarting)")
            return error.code(), f"unavailable: {state}; retry ({error.details()})"
        return error.code(), error.details()

    async def _unary(self, method: str, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        try:
            metadata = self._metadata(context, method in ADMIN)
            if method == INFER:
                raw = parse_infer(raw).SerializeToString()
            elif OPEN.get(method) is not None:
                try:
                    checks.name(OPEN[method].FromString(raw).name, "name")
                except DecodeError as exc:
                    raise Refused(400, f"request: not a {OPEN[method].__name__} ({exc})") from None
        except Refused as exc:
            await context.abort(_CODES.get(exc.status, grpc.StatusCode.INVALID_ARGUMENT), str(exc),
                                self.load.trailing_metadata())
        tracer = tracing.tracer(TRACE_SERVICE) if method == INFER else None
        if tracer is None:
            return await self._call(method, raw, metadata, context)
        from opentelemetry.trace import SpanKind

        # As the REST front end's span (front.py): a child of the caller's traceparent, passed on.
        given = dict(context.invocation_metadata() or ())
        with tracer.start_as_current_span("ModelInfer", context=tracing.extract(given), kind=SpanKind.SERVER) as span:
            parent = tracing.traceparent(span)
            return await self._call(method, raw, [*metadata, ("traceparent", parent), (tracing.TRACE_KEY, parent)],
                                    context)

    async def _call(self, method: str, raw: bytes, metadata: list, context: grpc.aio.ServicerContext) -> bytes:
        """The call forwarded; its answer (or error) ends with the load report, taken while a
        ModelInfer still counts as in progress."""
        counted, failed, started, done = method == INFER, False, None, False
        if counted:
            started = self.load.started()
        try:
            reply = await self._channel.unary_unary(method)(raw, metadata=metadata, timeout=context.time_remaining())
            done = True
            context.set_trailing_metadata(self.load.trailing_metadata())
            return reply
        except grpc.aio.AioRpcError as exc:
            code, details = self._unavailable(exc)
            failed = code in _FAILED
            await context.abort(code, details, self.load.trailing_metadata())
        finally:
            if counted:  # only a generation's own time counts for its time (a refusal is quick)
                self.load.finished(failed, started if done else None)

    async def _stream(self, requests, context: grpc.aio.ServicerContext):
        """ModelStreamInfer: each request checked on its way up; a refused one is answered with an
        error response here and not forwarded; responses come back as Triton sends them. A stream
        with no request in progress and no message either way for GrpcLimits.idle_s is ended
        (UNAVAILABLE, which clients meet by opening a new one): gRPC's own idle timeout spares a
        connection that has a call open, so one silent stream would hold it forever."""
        try:
            metadata = self._metadata(context, admin=False)
        except Refused as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc), self.load.trailing_metadata())
        out: asyncio.Queue = asyncio.Queue()
        done, idle = object(), object()
        activity = _StreamActivity(self.load)

        async def checked():
            async for raw in requests:
                activity.touch()
                try:
                    forwarded = parse_infer(raw).SerializeToString()
                except Refused as exc:
                    request = pb.ModelInferRequest()
                    try:
                        request.MergeFromString(raw)
                    except DecodeError:
                        pass
                    await out.put(pb.ModelStreamInferResponse(
                        error_message=str(exc),
                        infer_response=pb.ModelInferResponse(id=request.id[:256], model_name=request.model_name[:256])
                    ).SerializeToString())
                    continue
                activity.forwarded()
                yield forwarded

        call = self._channel.stream_stream(STREAM)(checked(), metadata=metadata, timeout=context.time_remaining())

        async def relay() -> None:
            try:
                async for response in call:
                    activity.answered(response)
                    await out.put(_dead_stub_response(response))
                await out.put(done)
            except grpc.aio.AioRpcError as exc:
                await out.put(exc)

        async def watch() -> None:
            while not activity.idle_for(self.limits.idle_s):
                await asyncio.sleep(min(1.0, self.limits.idle_s / 4))
            await out.put(idle)

        relaying, watching = asyncio.ensure_future(relay()), asyncio.ensure_future(watch())
        try:
            while True:
                item = await out.get()
                if item is done:
                    context.set_trailing_metadata(self.load.trailing_metadata())
                    return
                if item is idle:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, (
                        f"unavailable: the stream had no request in progress for {self.limits.idle_s:g} s and was "
                        "closed; open a new one"), self.load.trailing_metadata())
                if isinstance(item, grpc.aio.AioRpcError):
                    await context.abort(*self._unavailable(item), self.load.trailing_metadata())
                await context.write(item)
        finally:
            activity.close()
            relaying.cancel()
            watching.cancel()
            call.cancel()

    # -- life cycle --------------------------------------------------------------------------------
    def _handlers(self) -> grpc.GenericRpcHandler:
        front = self

        class Handler(grpc.GenericRpcHandler):
            def service(self, details):
                method = details.method
                if method == STREAM:
                    return grpc.stream_stream_rpc_method_handler(front._stream)
                if method == INFER or method in OPEN or method in ADMIN:
                    async def unary(raw, context, method=method):
                        return await front._unary(method, raw, context)
                    return grpc.unary_unary_rpc_method_handler(unary)
                return None  # UNIMPLEMENTED

        return Handler()

    async def _start(self) -> None:
        limits = self.limits
        self._channel = grpc.aio.insecure_channel(self.upstream, options=[
            ("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1),
            # tritonserver restarts under the supervisor: reconnect within a second, not gRPC's 2 minutes
            ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000)])
        self._server = grpc.aio.server(maximum_concurrent_rpcs=limits.calls, options=[
            ("grpc.max_receive_message_length", self.max_message), ("grpc.max_send_message_length", -1),
            ("grpc.max_allowed_incoming_connections", limits.connections),
            ("grpc.max_concurrent_streams", limits.streams),
            ("grpc.max_connection_idle_ms", int(limits.idle_s * 1000)),
            ("grpc.server_handshake_timeout_ms", int(limits.handshake_s * 1000)),
            ("grpc.keepalive_time_ms", int(limits.keepalive_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(limits.keepalive_timeout_s * 1000)),
            ("grpc.so_reuseport", 0)])
        self._server.add_generic_rpc_handlers((self._handlers(),))
        if self._server.add_insecure_port(f"{self.host}:{self.port}") == 0:
            raise OSError(f"cannot listen on {self.host}:{self.port}")
        await self._server.start()

    async def _shutdown(self, timeout: float) -> None:
        await self._server.stop(grace=min(timeout / 2, 5.0))
        await self._channel.close()
