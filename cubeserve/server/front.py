"""The REST front end: what clients reach on the REST port, in front of tritonserver's own HTTP
endpoint, which listens on the loopback only (cubeserve.deploy.TRITON_HTTP_PORT).

Why: Triton 2.51's HTTP frontend crashes (SIGSEGV, every request in flight lost) on bodies a
careless script sends: a JSON body of 8 MB or more without a JSON Content-Type (what curl and
urllib send by default), or a small body nested 100,000 deep. Newer Tritons fix some of these
(server#8172 limits JSON depth, #8432 large JSON inputs, #8770 chunk counts; see
docs/security.md), but the local server is 2.51 and no newer one installs here. So no byte a client
sends reaches Triton's JSON parser: this front end reads the body within a bound (413 past it),
parses it with Python's json module (which fails cleanly on any depth), checks it against the
shape of the v2 request it may be (400 naming the field otherwise), and forwards a document it
wrote itself: compact JSON of bounded size and depth, `Content-Type: application/json`, and the
binary tensor extension's header recomputed. Responses come back as Triton wrote them, with the
server's load report added (the header endpoint-load-metrics: server/load_report.py).

What it lets through, and to whom (the categories of Triton's --http-restricted-api):
* to everyone: health, server and model metadata, model config, and inference (`infer`,
  `generate`, `generate_stream`); a request naming shared memory is refused here, with a key or
  without (the python backend's own regions must never be a client's output buffer);
* with the admin header (cubeserve.deploy.ADMIN_HEADER) and only then: model repository,
  shared memory, statistics, trace and logging; tritonserver checks the same header again;
* nothing else: 404.

Upstream, every request gets a connection of its own (no pool): tritonserver's HTTP endpoint
waits for every open connection before it exits, so idle pooled connections would hold a
stopping server; on the loopback a connection costs well under a millisecond.

It runs inside cubeserve's supervisor (server/supervisor.py), on a thread with its own asyncio
loop, for as long as the supervisor does: while tritonserver restarts or shuts down, clients get
503 "unavailable: ..." instead of a refused connection.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
import re
import threading
from dataclasses import dataclass

from aiohttp import ClientError, ClientSession, ClientTimeout, TCPConnector, web
from aiohttp.http_exceptions import HttpProcessingError

from cubeserve import deploy, tracing
from cubeserve.requests import Shed
from cubeserve.server import checks
from cubeserve.serving import stubs
from cubeserve.server.checks import (INPUT_PARAMETERS, MAX_ELEMENTS, MAX_NAME_BYTES, MAX_RANK, MAX_TENSORS,
                                      OUTPUT_PARAMETERS, REQUEST_PARAMETERS, Refused)
from cubeserve.server.load_report import HEADER as LOAD_HEADER
from cubeserve.server.load_report import LoadReport
from cubeserve.serving.protocol import DATATYPES as MODEL_DATATYPES
from cubeserve.serving.protocol import INPUTS as MODEL_INPUTS

log = logging.getLogger("cubeserve.front")

_NAME = checks.NAME
_MODEL = rf"/v2/models/(?P<model>{_NAME})(?:/versions/(?P<version>[0-9]{{1,19}}))?"
OPEN_GET = re.compile(rf"/v2|/v2/health/(?:live|ready)|{_MODEL}(?:/ready|/config)?")
INFER = re.compile(rf"{_MODEL}/infer")
GENERATE = re.compile(rf"{_MODEL}/generate(?:_stream)?")
ADMIN = re.compile(
    rf"/v2/repository/(?:index|models/{_NAME}/(?:load|unload))"
    rf"|/v2/(?:system|cuda)sharedmemory(?:/region/{_NAME})?/(?:status|register|unregister)"
    rf"|/v2/logging|/v2/trace/setting|/v2/models/{_NAME}/trace/setting"
    rf"|/v2/models(?:/{_NAME}(?:/versions/[0-9]{{1,19}})?)?/stats")
# Request headers passed on: the experiment's and the gateway's (deploy.HTTP_HEADER_FORWARD_PATTERN
# makes tritonserver hand them to the models), and the response encodings Triton may use.
FORWARD_HEADER = re.compile(r"(?i)^x-cube3d-(?:user|arm|tenant|model|band)$")
RESPONSE_HEADERS = ("Content-Type", "Content-Encoding", "Inference-Header-Content-Length")
GENERATIONS = ("infer", "generate")  # the kinds of request the load report counts (server/load_report.py)
_HEADER_LENGTH = re.compile(r"[0-9]{1,19}")  # ASCII digits only: str.isdigit() takes "١٢"
LISTEN_BACKLOG = 128
SHED_RETRY_AFTER_S = 1  # a request the engine's queue shed: about one object's time on a CPU
MAX_ERROR_BODY = 64 * 1024  # an error answer read whole to look at it (Triton's: a line of JSON)
TRACE_SERVICE = "cube3d-front"  # the front end's spans' service name (cubeserve/tracing.py)


@dataclass(frozen=True)
class Limits:
    """What the front end holds at most, whatever clients do (docs/security.md).

    connections: client connections open at once; one more is answered 503 and closed (each
      open connection is a file descriptor, and one more while its request is forwarded).
    header_s: a connection must bring a whole request head within this long of its opening, or
      of its previous answer's end; else it is closed, unanswered. One timer for the silent
      connection (no first byte), the slow head (slowloris: its bytes do not restart the timer)
      and the idle keep-alive connection: aiohttp's `keepalive_timeout`, which starts when the
      connection opens and when an answer ends, and closes the connection when it fires while no
      request is in progress (aiohttp/web_protocol.py, connection_made, _process_keepalive). It
      never runs while a request is handled: a generation is bounded by its own deadline.
    body_s: the time a client has to send a whole body (408 past it).
    linger_s: after a refusal whose body was not read (413, 408, 400), the connection's further
      bytes are dropped unread, undecompressed, this long before it is closed (so that the client
      reads the answer rather than a reset).
    body_bytes: bodies being read by all connections together (503 beyond); the admin's are not
      counted (the key is checked before their body is read)."""

    connections: int = 1024
    header_s: float = deploy.HEADER_TIMEOUT_S
    body_s: float = deploy.BODY_TIMEOUT_S
    linger_s: float = 2.0
    body_bytes: int = 64 << 20


def _error(status: int, message: str, retry_after: int | None = None) -> web.Response:
    response = web.json_response({"error": message}, status=status)
    if retry_after is not None:
        response.headers["Retry-After"] = str(retry_after)
    return response


def _error_message(body: bytes) -> str:
    """The message of an error answer ({"error": ...}, Triton's and ours); "" when it has none."""
    try:
        doc = json.loads(body)
    except ValueError:
        return ""
    return str(doc.get("error", "")) if isinstance(doc, dict) else ""


# -- the request's document ------------------------------------------------------------------------

def parse_json(data: bytes, what: str = "body") -> object:
    """JSON from a client: strict (no NaN or Infinity), UTF-8, any depth fails cleanly."""
    def no_constant(name):
        raise ValueError(f"{name} is not a JSON number")
    try:
        return json.loads(data.decode("utf-8"), parse_constant=no_constant)
    except RecursionError:
        raise Refused(400, f"{what}: nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise Refused(400, f"{what}: not valid JSON ({exc})") from None


def _only(doc: dict, allowed: set, where: str) -> None:
    unknown = sorted(set(doc) - allowed)
    if unknown:
        raise Refused(400, f"{where}.{unknown[0]}: unknown field (allowed: {', '.join(sorted(allowed))})")


def _count_elements(data, where: str, depth_left: int, check) -> int:
    """Elements of a v2 tensor's `data` (flat, or nested as its shape), each passing `check`."""
    if not isinstance(data, list):
        check(data, where)
        return 1
    if depth_left == 0:
        raise Refused(400, f"{where}: is nested deeper than the tensor's shape")
    count = 0
    for item in data:
        count += _count_elements(item, where, depth_left - 1, check)
        if count > MAX_ELEMENTS:
            raise Refused(400, f"{where}: has more than {MAX_ELEMENTS} elements")
    return count


def sanitize_infer(doc, binary_size: int) -> dict:
    """A v2 inference request checked field by field (400 naming the first bad one); returns the
    document to forward. `binary_size`: bytes after the JSON (binary tensor extension)."""
    if not isinstance(doc, dict):
        raise Refused(400, "body: must be a JSON object")
    _only(doc, {"id", "model_name", "model_version", "parameters", "inputs", "outputs"}, "body")
    for key in ("id", "model_name", "model_version"):
        if key in doc:
            checks.string(doc[key], key, MAX_NAME_BYTES)
    if "parameters" in doc:
        checks.parameters(doc["parameters"], "parameters", REQUEST_PARAMETERS)
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or not 1 <= len(inputs) <= MAX_TENSORS:
        raise Refused(400, f"inputs: must be a list of 1 to {MAX_TENSORS} tensors")
    binary_total = 0
    for i, tensor in enumerate(inputs):
        where = f"inputs[{i}]"
        if not isinstance(tensor, dict):
            raise Refused(400, f"{where}: must be an object")
        _only(tensor, {"name", "shape", "datatype", "parameters", "data"}, where)
        checks.string(tensor.get("name"), f"{where}.name", MAX_NAME_BYTES)
        datatype = tensor.get("datatype")
        if datatype not in checks.DATATYPES:
            raise Refused(400, f"{where}.datatype: must be one of {', '.join(sorted(checks.DATATYPES))}")
        shape = tensor.get("shape")
        if (not isinstance(shape, list) or len(shape) > MAX_RANK
                or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_ELEMENTS for d in shape)):
            raise Refused(400, f"{where}.shape: must be a list of at most {MAX_RANK} sizes in [0, {MAX_ELEMENTS}]")
        elements = math.prod(shape)
        if elements > MAX_ELEMENTS:
            raise Refused(400, f"{where}.shape: {shape} has more than {MAX_ELEMENTS} elements")
        parameters = checks.parameters(tensor.get("parameters", {}), f"{where}.parameters", INPUT_PARAMETERS)
        size = parameters.get("binary_data_size")
        if size is not None:
            if "data" in tensor:
                raise Refused(400, f"{where}: has both data and binary_data_size")
            binary_total += size
        elif "data" not in tensor:
            raise Refused(400, f"{where}.data: missing (or give parameters.binary_data_size)")
        else:
            check = checks.element_check(datatype, f"{where}.data")
            count = _count_elements(tensor["data"], f"{where}.data", max(len(shape), 1), check)
            if count != elements:
                raise Refused(400, f"{where}.data: has {count} elements, shape {shape} needs {elements}")
    if binary_total != binary_size:
        raise Refused(400, f"binary data: the inputs' binary_data_size add up to {binary_total} bytes, "
                           f"the body carries {binary_size}")
    outputs = doc.get("outputs", [])
    if not isinstance(outputs, list) or len(outputs) > MAX_TENSORS:
        raise Refused(400, f"outputs: must be a list of at most {MAX_TENSORS} tensors")
    for i, tensor in enumerate(outputs):
        where = f"outputs[{i}]"
        if not isinstance(tensor, dict):
            raise Refused(400, f"{where}: must be an object")
        _only(tensor, {"name", "parameters"}, where)
        checks.string(tensor.get("name"), f"{where}.name", MAX_NAME_BYTES)
        checks.parameters(tensor.get("parameters", {}), f"{where}.parameters", OUTPUT_PARAMETERS)
    return doc


def sanitize_generate(doc) -> dict:
    """Triton's generate extension: an object of the model's input names to a scalar or a flat
    list, and `parameters`. Triton makes every other top-level key a request parameter, so those
    are held to the rules of `parameters` (server/checks.py): only the documented ones pass,
    `shared_memory_*` and the rest are refused by name."""
    if not isinstance(doc, dict):
        raise Refused(400, "body: must be a JSON object")
    if len(doc) > MAX_TENSORS + 1:
        raise Refused(400, f"body: has {len(doc)} fields, at most {MAX_TENSORS + 1} are allowed")
    top_level = {}  # the keys Triton takes as request parameters
    for key, value in doc.items():
        checks.string(key, "body: a key", MAX_NAME_BYTES)
        if key == "parameters":
            checks.parameters(value, "parameters", REQUEST_PARAMETERS)
        elif key in MODEL_INPUTS:
            check = checks.element_check(MODEL_DATATYPES[key], key)
            if isinstance(value, list):
                _count_elements(value, key, 1, check)
            else:
                check(value, key)
        else:
            top_level[key] = value
    checks.parameters(top_level, "body", REQUEST_PARAMETERS,
                      also=f"; or one of the inputs {', '.join(MODEL_INPUTS)}, or parameters")
    given = {checks.canonical(k) for k in doc.get("parameters", {})} & {checks.canonical(k) for k in top_level}
    if given:
        raise Refused(400, f"body.{sorted(given)[0]}: given both at the top level and in parameters")
    return doc


def check_depth(doc, limit: int, what: str = "body") -> None:
    """Refuses documents nested deeper than `limit` (for the admin APIs' free-form bodies)."""
    stack = [(doc, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            raise Refused(400, f"{what}: nested deeper than {limit} levels")
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)


def dump(doc) -> bytes:
    return json.dumps(doc, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


def rewrite_body(kind: str, body: bytes, header_length: str | None) -> tuple[bytes, int | None]:
    """The body to forward and its new JSON length (binary tensor extension; None without it)."""
    if header_length is None:
        json_part, binary = body, b""
    else:
        if not _HEADER_LENGTH.fullmatch(header_length) or int(header_length) > len(body):
            raise Refused(400, f"Inference-Header-Content-Length: must be an integer in [0, {len(body)}]")
        json_part, binary = body[:int(header_length)], body[int(header_length):]
    doc = parse_json(json_part)
    if kind == "infer":
        doc = sanitize_infer(doc, len(binary))
    elif kind == "generate":
        if binary:
            raise Refused(400, "body: the generate endpoints take JSON only")
        doc = sanitize_generate(doc)
    else:
        check_depth(doc, 32)
    out = dump(doc)
    return out + binary, (len(out) if header_length is not None else None)


# -- the server ------------------------------------------------------------------------------------

class LoopThread:
    """A server on a thread with its own asyncio loop, for as long as the supervisor runs: the
    REST and gRPC front ends. Subclasses give `what` (for messages), `_start()` (listen) and
    `_shutdown()`, and set host, port, upstream and limits."""

    what = "server"

    def start(self, timeout: float = 30.0):
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)  # grpc.aio looks for it there
            try:
                self._loop.run_until_complete(self._start())
            except BaseException as exc:  # e.g. the port is taken
                failure.append(exc)
                started.set()
                return
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name=f"cubeserve-{self.what.replace(' ', '-')}", daemon=True)
        self._thread.start()
        if not started.wait(timeout):
            raise RuntimeError(f"the {self.what} did not start within {timeout:.0f} s")
        if failure:
            raise RuntimeError(f"the {self.what} cannot listen on {self.host}:{self.port}: {failure[0]}")
        log.info("%s on %s:%d, forwarding to %s; at most %d connections", self.what, self.host, self.port,
                 self.upstream, self.limits.connections)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stops listening and ends the loop (answers still being sent get `timeout` seconds)."""
        if self._loop is None or not self._loop.is_running():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(timeout), self._loop).result(timeout)
        except Exception as exc:  # noqa: BLE001 - stopping anyway
            log.warning("the %s did not stop cleanly: %s", self.what, exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)


def _canned(status: str, message: str) -> bytes:
    body = json.dumps({"error": message}).encode()
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nConnection: close\r\nRetry-After: 1\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


class _Busy(asyncio.Protocol):
    """A connection past Limits.connections: answered 503 and closed, nothing read."""

    ANSWER = _canned("503 Service Unavailable", "unavailable: the server has as many connections open as it "
                                                "takes; retry")

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(self.ANSWER)
        transport.close()


class FrontEnd(LoopThread):
    """The front end on `host:port`, forwarding to tritonserver's REST endpoint on the loopback
    port `upstream_port`. `admin_key` is the key clients give for the restricted APIs;
    `upstream_key` the one tritonserver was started with (server/supervisor.py: a key of its
    own, so that the admin key is on no command line). `load`: the server's load report, which
    every answer carries (server/load_report.py; the supervisor shares one with the gRPC front
    end)."""

    what = "REST front end"

    def __init__(self, host: str, port: int, upstream_port: int, admin_key: str, upstream_key: str | None = None,
                 max_body: int = deploy.MAX_REQUEST_BYTES, max_admin_body: int = deploy.MAX_ADMIN_REQUEST_BYTES,
                 limits: Limits = Limits(), load: LoadReport | None = None):
        self.host, self.port, self.upstream = host, port, f"http://127.0.0.1:{upstream_port}"
        self.admin_key = admin_key.encode()
        self.upstream_key = upstream_key or admin_key
        self.max_body, self.max_admin_body = max_body, max_admin_body
        self.limits = limits
        self.load = load or LoadReport(deploy.SCALE_TARGET)
        self._buffered = 0  # body bytes being read now (Limits.body_bytes)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._listener: asyncio.AbstractServer | None = None
        self._session: ClientSession | None = None
        self._thread: threading.Thread | None = None
        self.stopping = False  # set by the supervisor once tritonserver is told to stop
        tracing.tracer(TRACE_SERVICE)  # where tracing is on, the SDK imported now, not in a request's time

    # What the handler does, in order: route, authorize, read within the bound, rewrite, forward.
    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._handle(request)
        except Refused as exc:
            if not request.content.is_eof():
                # The body is not read: drop the rest unread (no decompression) for linger_s, then
                # close, instead of aiohttp's lingering read through the decoder.
                request.protocol.close()
            return self._reported(_error(exc.status, str(exc), exc.retry_after))

    def _reported(self, response: web.StreamResponse) -> web.StreamResponse:
        """`response` with the server's load report (its head not sent yet)."""
        response.headers[LOAD_HEADER] = self.load.header()
        return response

    def _authorized(self, request: web.Request) -> bool:
        # Header values arrive as UTF-8 with surrogate escapes: any bytes compare, none raise.
        given = request.headers.get(deploy.ADMIN_HEADER, "").encode("utf-8", "surrogateescape")
        return hmac.compare_digest(given, self.admin_key)

    def _route(self, request: web.Request) -> tuple[str, int]:
        """(kind of request, the most body bytes it may carry); Refused when it may not be made."""
        path = request.path
        # The admin paths first: /v2/models/stats would otherwise read as a model's metadata.
        if ADMIN.fullmatch(path) and request.method in ("GET", "POST"):
            if not self._authorized(request):
                raise Refused(403, f"This API is restricted: it needs the admin header '{deploy.ADMIN_HEADER}' "
                                   "(docs/security.md)")
            return "admin", self.max_admin_body
        if request.method == "GET" and OPEN_GET.fullmatch(path):
            return "get", 0
        if request.method == "POST" and INFER.fullmatch(path):
            return "infer", self.max_body
        if request.method == "POST" and GENERATE.fullmatch(path):
            return "generate", self.max_body
        raise Refused(404, f"{request.method} {path[:256]}: not an endpoint of this server")

    async def expect(self, request: web.Request) -> web.StreamResponse | None:
        """`Expect: 100-continue` (curl sends it for bodies over 1 MB): refuse before the body
        is sent, instead of reading it first."""
        try:
            _, limit = self._route(request)
            if request.content_length is not None and request.content_length > limit:
                raise Refused(413, f"body: {request.content_length} bytes, at most {limit} are accepted")
        except Refused as exc:
            request.protocol.close()  # the client may send the body anyway: not read
            return self._reported(_error(exc.status, str(exc)))
        if request.headers.get("Expect", "").lower() != "100-continue":
            return _error(417, f"Expect: {request.headers.get('Expect')!r} is not supported")
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # as aiohttp's own handler: the answer has not started
        return None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        kind, limit = self._route(request)
        tracer = tracing.tracer(TRACE_SERVICE) if kind in ("infer", "generate") else None
        if tracer is None:
            return await self._handle_request(request, kind, limit, {})
        from opentelemetry.trace import SpanKind

        # A span for the request, a child of the caller's traceparent; tritonserver's spans and
        # the engine's are its children (tracing.py).
        with tracer.start_as_current_span(f"{request.method} {request.path}", context=tracing.extract(request.headers),
                                          kind=SpanKind.SERVER) as span:
            parent = tracing.traceparent(span)
            response = await self._handle_request(request, kind, limit, {"traceparent": parent,
                                                                         tracing.TRACE_KEY: parent})
            span.set_attribute("http.response.status_code", response.status)
            return response

    async def _handle_request(self, request: web.Request, kind: str, limit: int, trace: dict) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if FORWARD_HEADER.match(k)}
        headers.update(trace)
        accept = request.headers.get("Accept-Encoding")
        if accept:
            headers["Accept-Encoding"] = accept[:256]
        body = None
        if request.method == "POST":
            raw = await self._read(request, limit, counted=kind != "admin")
            if not raw.strip() and kind == "admin":  # e.g. the repository index: no body needed
                return await self._forward(request, {**headers, deploy.ADMIN_HEADER: self.upstream_key}, b"")
            body, json_length = rewrite_body(kind, raw, request.headers.get("Inference-Header-Content-Length"))
            headers["Content-Type"] = "application/json"
            if json_length is not None:
                headers["Inference-Header-Content-Length"] = str(json_length)
        if kind == "admin":
            headers[deploy.ADMIN_HEADER] = self.upstream_key
        if kind not in GENERATIONS:
            return await self._forward(request, headers, body)
        started = self.load.started()  # in progress until its answer has ended
        failed = done = False
        try:
            response = await self._forward(request, headers, body)
            failed, done = response.status >= 500, response.status < 400
            return response
        except Refused as exc:
            failed = exc.status >= 500
            raise
        finally:  # only a generation's own time counts for its time (a refusal is quick)
            self.load.finished(failed, started if done else None)

    async def _read(self, request: web.Request, limit: int, counted: bool = True) -> bytes:
        """The body, at most `limit` bytes (413 past it, before reading it all), within
        Limits.body_s (408) and, when `counted`, Limits.body_bytes for all bodies together (503).
        aiohttp's parser has already undone a gzip or deflate Content-Encoding, chunk by chunk,
        so the bound holds for the decompressed bytes (a compression bomb stops at `limit`)."""
        if request.content_length is not None and request.content_length > limit:
            raise Refused(413, f"body: {request.content_length} bytes, at most {limit} are accepted")
        chunks, size = [], 0
        deadline = self._loop.time() + self.limits.body_s
        try:
            while True:
                try:
                    chunk = await asyncio.wait_for(request.content.readany(), deadline - self._loop.time())
                except asyncio.TimeoutError:
                    raise Refused(408, f"body: not received within {self.limits.body_s:g} s "
                                       f"({size} bytes came)") from None
                except (web.RequestPayloadError, HttpProcessingError) as exc:  # e.g. labelled gzip, is not
                    cause = exc.__cause__ or exc
                    raise Refused(400, "body: cannot be read as its Content-Encoding or Transfer-Encoding says "
                                       f"({getattr(cause, 'message', None) or cause})") from None
                if not chunk:
                    return b"".join(chunks)
                size += len(chunk)
                if size > limit:
                    raise Refused(413, f"body: more than {limit} bytes (decompressed), at most {limit} are accepted")
                if counted:
                    if self._buffered + len(chunk) > self.limits.body_bytes:
                        raise Refused(503, "unavailable: the server is reading as many request bodies as it "
                                           "holds at once; retry")
                    self._buffered += len(chunk)
                chunks.append(chunk)
        finally:
            if counted:
                self._buffered -= sum(len(c) for c in chunks)

    def _gone(self, exc: Exception) -> Refused:
        """tritonserver's endpoint failed before an answer began: 503, to retry."""
        # The models' own words for a drain (triton_common), so clients and tests read one message.
        state = ("the server is shutting down (tritonserver takes no new connections)" if self.stopping
                 else "tritonserver is not answering (starting or restarting)")
        return Refused(503, f"unavailable: {state}; retry ({type(exc).__name__})")

    async def _forward(self, request: web.Request, headers: dict, body: bytes | None) -> web.StreamResponse:
        url = self.upstream + request.path  # the query string is not passed on: no endpoint here uses one
        try:
            upstream = await self._session.request(request.method, url, headers=headers, data=body)
        except (ClientError, OSError) as exc:
            raise self._gone(exc) from None
        async with upstream:
            answer = None
            if upstream.status in (500, 503) and (upstream.content_length or MAX_ERROR_BODY + 1) <= MAX_ERROR_BODY:
                try:
                    answer = await upstream.read()
                except (ClientError, OSError) as exc:
                    raise self._gone(exc) from None
                message = _error_message(answer)
                # Triton's 500 for a model whose stub died, as 503 (stubs.dead_stub_unavailable).
                unavailable = upstream.status == 500 and stubs.dead_stub_unavailable(message)
                if unavailable:
                    raise Refused(503, unavailable)
                # The engine's queue shed it (engine/admission.py): retry here later, not elsewhere
                # now; Triton has no code for it, so the message says it.
                if upstream.status == 503 and message.startswith(Shed.PREFIX):
                    raise Refused(429, message, retry_after=SHED_RETRY_AFTER_S)
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for name in RESPONSE_HEADERS:
                if name in upstream.headers:
                    response.headers[name] = upstream.headers[name]
            if upstream.content_length is not None:
                response.content_length = upstream.content_length
            self._reported(response)
            await response.prepare(request)
            if answer is not None:
                await response.write(answer)
                await response.write_eof()
                return response
            try:
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
            except (ClientError, OSError):
                # tritonserver went away mid-answer: the client sees its connection end early.
                request.transport and request.transport.close()
                return response
            await response.write_eof()
            return response

    # -- life cycle (LoopThread) ----------------------------------------------------------------
    def _connection(self) -> asyncio.Protocol:
        """A new client connection's protocol: aiohttp's, or _Busy past Limits.connections. (The
        count can run past the cap by what one accept burst brings, at most the listen backlog.)"""
        server = self._runner.server
        if len(server.connections) >= self.limits.connections:
            return _Busy()
        return server()

    async def _start(self) -> None:
        # No pool (module docstring); no read timeout: a generation takes as long as its deadline.
        self._session = ClientSession(connector=TCPConnector(force_close=True, limit=0),
                                      timeout=ClientTimeout(total=None, sock_connect=10),
                                      auto_decompress=False, skip_auto_headers=("User-Agent", "Accept-Encoding"))
        app = web.Application(client_max_size=self.max_admin_body)
        app.router.add_route("*", "/{tail:.*}", self.handle, expect_handler=self.expect)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False,
                                     keepalive_timeout=self.limits.header_s, lingering_time=self.limits.linger_s)
        await self._runner.setup()
        self._listener = await asyncio.get_running_loop().create_server(
            self._connection, self.host, self.port, reuse_address=True, backlog=LISTEN_BACKLOG)

    async def _shutdown(self, timeout: float) -> None:
        self._listener.close()
        await self._runner.cleanup()
        await self._session.close()
