"""`cube3d`: the KServe predict API (`POST /v2/models/cube3d/infer`, gRPC ModelInfer).

Triton refuses those endpoints for decoupled models, so this model is not decoupled. It loads
no weights: each request is forwarded over BLS to a version of `cube3d_stream`, which owns the
engine, and the final response is relayed. `execute` hands each request to a thread and returns,
answering through the response sender, so concurrent requests reach the engine together and run
batched. Importing no torch keeps this process small.

Which version serves a request: without an experiment, this model's own version; with one
(serving/experiment.py), the arm's version chosen by the user key, and a share of requests is
also copied to a shadow version, whose answer is compared with the served one and dropped. Every
answer says its version (MODEL_VERSION) and arm (ARM); the per-version measurements are
serving/metrics.py's.

What BLS in Triton 2.51 does not do, a watchdog thread does:
- a forwarded request cannot be cancelled by its caller: when a client goes away, the
  watchdog sends the engine a control request that cancels the forward by its id;
- a forward to a dead engine process waits forever: the watchdog checks that the engine's stub
  process is alive and ends every waiting forward with UNAVAILABLE when it is not (the
  supervisor, server/supervisor.py, then restarts the server).

While the server drains before it stops (serving/drain.py), new requests are refused at once as
UNAVAILABLE (HTTP 503) and those already forwarded run to the end.
"""

from __future__ import annotations

import json
import os
import threading
import time
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

from cubeserve import tracing
from cubeserve.deploy import REQUEST_TIMEOUT_S, STREAM_MODEL
from cubeserve.requests import InvalidRequest, Unavailable
from cubeserve.serving import agreement, experiment, protocol
from cubeserve.serving import metrics as metric_names
from cubeserve.serving.experiment import Experiment
from cubeserve.serving.protocol import ARM_PARAMETER, CANCEL_PARAMETER, FORWARDED_PARAMETER
from cubeserve.serving.stubs import StubLiveness, release_backend_objects, started_at
from cubeserve.serving.triton_common import Drain, LetGoLater, Reply, error_response, parameters
from cubeserve.serving.triton_common import request_parameter as _parameter
from cubeserve.serving.triton_metrics import Measurements

ENGINE_TRACE_SERVICE = "cube3d-engine"  # the engine's spans' service name (cubeserve/tracing.py)
WATCH_INTERVAL_S = 0.25  # how often the watchdog looks at the waiting forwards
RETRY_EXPERIMENT_S = 2.0  # how often an experiment naming versions not loaded yet is tried again
BLS_HOLD_S = 5.0  # a forward's response iterator, held after its last response (triton_common.LetGoLater)
# The outputs the engine gives a forward (PROGRESS is for streams; ARM is this model's).
ENGINE_OUTPUTS = [n for n in protocol.OUTPUTS if n not in ("PROGRESS", "ARM")]


class ExperimentSource:
    """The experiment in force: the file named by $CUBE3D_EXPERIMENT_FILE while it exists, read
    again on every request (a small file; a ConfigMap's update swaps it atomically), else the
    config parameter `experiment`.

    A new experiment applies once every version it names is loaded; until then, and when it
    does not parse, the previous one stays in force and the problem is logged."""

    def __init__(self, inline: str, path: str, engine_model: str):
        self.inline, self.path, self.engine_model = inline, path, engine_model
        self.current: Experiment | None = None
        self._seen = None  # the text last applied or refused
        self._pending = None  # a text that waits for its versions to load
        self._last_try = 0.0
        self._lock = threading.Lock()

    def _read(self) -> str:
        if self.path:
            try:
                with open(self.path) as f:
                    return f.read()
            except FileNotFoundError:  # e.g. an optional ConfigMap not created
                pass
        return self.inline

    def _loaded(self, version: int) -> bool:
        try:
            return pb_utils.is_model_ready(model_name=self.engine_model, model_version=str(version))
        except Exception:  # noqa: BLE001 - an unknown version is one not loaded: never fail requests for it
            return False

    def get(self) -> Experiment | None:
        with self._lock:
            text = self._read()
            now = time.monotonic()
            if text == self._seen or (text == self._pending and now - self._last_try < RETRY_EXPERIMENT_S):
                return self.current
            self._last_try = now
            try:
                candidate = experiment.parse(text)
            except ValueError as exc:
                pb_utils.Logger.log_error(f"experiment ignored, the previous one stays in force: {exc}")
                self._seen = text
                return self.current
            missing = sorted(v for v in (candidate.versions if candidate else ()) if not self._loaded(v))
            if missing:
                if text != self._pending:
                    pb_utils.Logger.log_error(f"experiment {candidate.name!r} waits: {self.engine_model} versions "
                                              f"{missing} are not loaded; the previous one stays in force")
                self._pending = text
                return self.current
            self.current, self._seen, self._pending = candidate, text, None
            pb_utils.Logger.log_info(f"experiment in force: {candidate.to_json() if candidate else 'none'}")
            return self.current


class Forward(Reply):
    """One request on its way through an engine, with the id of its forward and the version and
    arm that serve it."""

    def __init__(self, request, drain: Drain, version: int, arm: str = ""):
        super().__init__(request, drain)
        self.id = f"cube3d-{uuid.uuid4().hex}"
        self.version, self.arm = version, arm
        self.started = time.monotonic()
        self.queue = _queue_parameters(request)
        self.tokens, self.engine_seconds = 0, 0.0  # of its mesh, for the tenant's usage
        self.timings: dict = {}  # the engine's stages (engine.Timings), for the trace
        self.engine_answered: float | None = None  # time.monotonic() when the engine's mesh came back
        self.cancel_sent = False
        self._claim_lock = threading.Lock()
        self._claimed = False

    def claim(self) -> bool:
        """True for the first caller only: who answers (and measures) this request. The watchdog
        answers a forward whose engine died while its thread still waits on the engine."""
        with self._claim_lock:
            claimed, self._claimed = self._claimed, True
            return not claimed


def _queue_parameters(request) -> dict[str, str]:
    """The gateway's band and tenant of a request, for the engine's queue (engine/admission.py):
    the forward to the engine is a request of its own, which carries only what it is given."""
    try:
        given = json.loads(request.parameters() or "{}")
    except Exception:  # noqa: BLE001 - the engine's defaults then
        return {}
    found = {key: _parameter(given, key) for key in (experiment.BAND_KEY, experiment.TENANT_KEY)}
    return {key: value for key, value in found.items() if value is not None}


class ShadowCopy:
    """A copy of a request on its way to the shadow version: it answers no one."""

    def __init__(self, version: int, baseline: int):
        self.id = f"cube3d-shadow-{uuid.uuid4().hex}"
        self.version, self.baseline, self.arm = version, baseline, metric_names.SHADOW_ARM
        self.started = time.monotonic()
        self.queue = {experiment.BAND_KEY: "batch"}  # a copy waits behind every served request


class ServedAnswer:
    """The served answer as a shadow copy waits for it, to compare."""

    def __init__(self):
        self.ready = threading.Event()
        self.outputs: dict[str, np.ndarray] | None = None  # None: no mesh was served

    def set(self, outputs: dict[str, np.ndarray] | None) -> None:
        self.outputs = outputs
        self.ready.set()


def _trace_parent(request) -> str | None:
    """The front end's span as the request carries it (tracing.TRACE_KEY), where tracing is on."""
    if not tracing.endpoint():
        return None
    try:
        return _parameter(json.loads(request.parameters() or "{}"), tracing.TRACE_KEY)
    except Exception:  # noqa: BLE001 - tracing never fails a request
        return None


class PredictModel:
    """`cube3d`: the predict API; forwards each request to a version of `cube3d_stream`.

    Parameters: engine_model (default deploy.STREAM_MODEL, "cube3d_stream"), max_concurrency (requests forwarded at
    once, default 128; more are refused as busy at once: keep it at least the engine's
    max_objects + max_queue, so that the engine's queue is the one that refuses), experiment
    (an experiment's JSON, serving/experiment.py; $CUBE3D_EXPERIMENT_FILE takes precedence).
    """

    def initialize(self, args):
        params = parameters(args)
        self.engine_model = params.get("engine_model") or STREAM_MODEL
        self.version = int(args["model_version"])
        self.max_concurrency = int(params.get("max_concurrency") or 128)
        self.capacity = threading.BoundedSemaphore(self.max_concurrency)
        self.pending: dict[str, Forward] = {}
        self.pending_lock = threading.Lock()
        self.shadows_in_flight = 0
        self.stopping = threading.Event()
        self.server_pid = os.getppid()  # the stub is a child of tritonserver
        self.stubs = StubLiveness(self.server_pid)
        self.drain = Drain(args)
        self.measurements = Measurements(args["model_name"])
        self.measurements.started(self.version, started_at(self.server_pid) or time.time())
        self.measurements.loaded(self.version)
        self.tenants = metric_names.known_tenants(os.environ.get(metric_names.TENANTS_ENV))
        self.models = metric_names.known_tenants(os.environ.get(metric_names.MODELS_ENV))
        tracing.tracer(ENGINE_TRACE_SERVICE)  # the SDK imported now, not in a request's time
        self.measurements.tenants_loaded(self.version, self.tenants, self.models)
        self.experiments = ExperimentSource(params.get(experiment.EXPERIMENT_PARAMETER, ""),
                                            os.environ.get(experiment.EXPERIMENT_FILE_ENV, ""), self.engine_model)
        self.watchdog = threading.Thread(target=self._watch, name="cube3d-watchdog", daemon=True)
        self.watchdog.start()
        self.iterators = LetGoLater(BLS_HOLD_S, "cube3d-let-go")

    def execute(self, requests):
        for request in requests:
            if self.drain.draining():  # the server stops soon: new requests go elsewhere
                self._refuse(Forward(request, self.drain, self.version), self.drain.refusal())
                continue
            if not self.capacity.acquire(blocking=False):
                self._refuse(Forward(request, self.drain, self.version), error_response(str(Unavailable(
                    f"the server is busy: {self.max_concurrency} requests in progress (max_concurrency of "
                    f"model cube3d); retry later")), "unavailable"))
                continue
            # A daemon thread per forward: one waiting on a dead engine never returns, and must not
            # keep this process from exiting (a pool's workers would).
            threading.Thread(target=self._serve, args=(request,), name="cube3d-forward", daemon=True).start()
        return None

    def _refuse(self, forward: Forward, error) -> None:
        self._answer(forward, metric_names.UNAVAILABLE, error)

    def _serve(self, request) -> None:
        forward, served, outputs = None, None, None
        try:
            try:
                forward, served = self._route(request)
            except InvalidRequest as exc:  # a pinned arm that the experiment does not have
                forward = Forward(request, self.drain, self.version)
                self._answer(forward, metric_names.INVALID, error_response(str(exc), "invalid"))
                return
            with self.pending_lock:
                self.pending[forward.id] = forward
            outcome, answer, outputs = self._relay(forward, keep_outputs=served is not None)
            self._answer(forward, outcome, answer)
        except Exception as exc:  # noqa: BLE001 - answer, never take the stub down
            forward = forward or Forward(request, self.drain, self.version)
            self._answer(forward, metric_names.FAILED,
                         error_response(f"forwarding to {self.engine_model} failed: {exc}"))
        finally:
            if forward is not None:
                with self.pending_lock:
                    self.pending.pop(forward.id, None)
            self.capacity.release()
            if served is not None:
                served.set(outputs)

    def _answer(self, forward: Forward, outcome: str, answer) -> None:
        """Measure, then answer: a client that reads the metrics after its answer finds it counted.
        Once a request: a later answer (a forward's thread returning after the watchdog ended it)
        is neither measured nor sent."""
        if not forward.claim():
            return
        self.measurements.request(forward.version, forward.arm, outcome, time.monotonic() - forward.started)
        self.measurements.usage(forward.version, *self._tenant(forward.request), outcome, forward.tokens,
                                forward.engine_seconds)
        parent = _trace_parent(forward.request)  # read before send lets the request go
        ended = time.time_ns(), time.monotonic()
        forward.send(answer)
        self._trace(forward, outcome, parent, ended)

    def _trace(self, forward: Forward, outcome: str, parent: str | None, ended: tuple[int, float]) -> None:
        """The request's time in the engine as spans (cubeserve/tracing.py), children of the span
        the front end sent (TRACE_KEY): `generate` from this model's start to its answer, and
        inside it the engine's stages as its TIMINGS measured them, laid back to back up to the
        moment the engine's answer came back: waiting for a slot, prefill (CLIP and the condition
        prefill), decode, geometry, export (the mesh to its file); then `answer`, this model's own
        part after that (measuring the request, its response). What none of them covers (the
        forward's way to the engine and back, the engine taking the request and sending its
        answer) is left out of every stage. Nothing without a parent or where tracing is off."""
        tracer = tracing.tracer(ENGINE_TRACE_SERVICE) if parent else None
        if tracer is None:
            return
        try:
            from opentelemetry import trace as otel

            end, end_monotonic = ended
            start = end - int((end_monotonic - forward.started) * 1e9)
            span = tracer.start_span("generate", context=tracing.extract({"traceparent": parent}), start_time=start,
                                     attributes={"cube3d.version": str(forward.version), "cube3d.arm": forward.arm,
                                                 "cube3d.outcome": outcome, "cube3d.shape_tokens": forward.tokens})
            stages = forward.timings
            if stages.get("total_s") is not None:
                context = otel.set_span_in_context(span)
                answered = end if forward.engine_answered is None else \
                    end - int((end_monotonic - forward.engine_answered) * 1e9)
                mesh_ready = answered - int((stages.get("export_s") or 0.0) * 1e9)
                engine_start = mesh_ready - int(stages["total_s"] * 1e9)
                prefill = stages.get("prefill_s") or 0.0
                at = engine_start
                for name, seconds in (("queue", stages.get("queue_s", 0.0) - prefill), ("prefill", prefill),
                                      ("decode", stages.get("tokens_s", 0.0))):
                    stage_end = at + int(max(0.0, seconds) * 1e9)
                    tracer.start_span(name, context=context, start_time=at).end(end_time=stage_end)
                    at = stage_end
                for name, stage_start, stage_end in (
                        ("geometry", mesh_ready - int(stages.get("geometry_s", 0.0) * 1e9), mesh_ready),
                        ("export", mesh_ready, answered), ("answer", answered, end)):
                    tracer.start_span(name, context=context, start_time=stage_start).end(end_time=stage_end)
            span.end(end_time=end)
        except Exception as exc:  # noqa: BLE001 - tracing never fails a request
            pb_utils.Logger.log_warn(f"tracing {forward.id} failed: {exc}")

    def _route(self, request) -> tuple[Forward, ServedAnswer | None]:
        """The forward that serves the request and, when a shadow copy goes out, where the copy
        finds the served answer."""
        current = self.experiments.get()
        if current is None:
            return Forward(request, self.drain, self.version), None
        request_parameters = json.loads(request.parameters() or "{}")
        # Without a user key, the gateway's tenant keeps a team on one arm.
        arm = current.arm_for(_parameter(request_parameters, experiment.USER_KEY)
                              or _parameter(request_parameters, experiment.TENANT_KEY),
                              _parameter(request_parameters, experiment.PIN_ARM_KEY))
        forward = Forward(request, self.drain, arm.version if arm else self.version, arm.name if arm else "")
        if not current.shadowed():
            return forward, None
        with self.pending_lock:
            busy = self.shadows_in_flight >= current.shadow.max_in_flight
            if not busy:
                self.shadows_in_flight += 1
        if busy:  # the shadow never queues live traffic's copies without bound
            self.measurements.shadow(current.shadow.version, forward.version, metric_names.SKIPPED)
            return forward, None
        served = ServedAnswer()
        copy = ShadowCopy(current.shadow.version, forward.version)
        arrays, deadline_us = self._inputs(request), request.timeout() or int(REQUEST_TIMEOUT_S * 1e6)
        threading.Thread(target=self._shadow, args=(copy, arrays, deadline_us, served),
                         name="cube3d-shadow", daemon=True).start()
        return forward, served

    @staticmethod
    def _inputs(request) -> dict[str, np.ndarray | None]:
        """The request's inputs as arrays of their own: a shadow copy still reads them after the
        served answer went out, when Triton has freed the request."""
        out = {}
        for name in protocol.INPUTS:
            tensor = pb_utils.get_input_tensor_by_name(request, name) if name != "STREAM_PROGRESS" else None
            out[name] = None if tensor is None else np.array(tensor.as_numpy(), copy=True)
        return out

    def _exec(self, forward: Forward | ShadowCopy, arrays: dict[str, np.ndarray | None], timeout_us: int,
              keep_outputs: bool = False):
        """Forward to the engine; (outcome, the final response or an error response, the outputs
        as arrays when `keep_outputs`, for a shadow comparison, else None)."""
        bls = pb_utils.InferenceRequest(
            request_id=forward.id, model_name=self.engine_model, model_version=forward.version,
            inputs=[pb_utils.Tensor(name, a) for name, a in arrays.items() if a is not None],
            requested_output_names=ENGINE_OUTPUTS,
            timeout=timeout_us,  # the client's deadline, enforced by the engine
            # accepted here: the engine takes it even while draining; the arm labels its measurements
            parameters={FORWARDED_PARAMETER: True, ARM_PARAMETER: forward.arm, **forward.queue},
        )
        with self.iterators.responses(bls) as responses:  # let go by Python, not by the stub (LetGoLater)
            outcome, answer = self._read(forward, responses)
        if outcome != metric_names.OK:
            return outcome, answer, None
        outputs = {t.name(): t.as_numpy() for t in answer.output_tensors()} if keep_outputs else None
        return outcome, answer, outputs

    def _read(self, forward: Forward | ShadowCopy, responses):
        """The engine's responses to a forward read to the end: (outcome, the final response or an
        error response)."""
        final = None
        for response in responses:
            if response.has_error():
                message = response.error().message()
                if not self._engine_loaded(forward.version):  # unloaded, or unloading: not now
                    return metric_names.UNAVAILABLE, error_response(str(Unavailable(
                        f"{self.engine_model} version {forward.version} is not loaded (unloaded, or being "
                        f"loaded again): retry")), "unavailable")
                if not self._engine_alive(forward.version):
                    return metric_names.UNAVAILABLE, self._engine_gone_error(forward.version)
                kind = protocol.error_kind(message)
                return metric_names.OUTCOME_OF_ERROR[kind], error_response(message, kind)
            if response.output_tensors():
                final = response
        if final is None:
            return metric_names.CANCELLED, error_response(str(Unavailable(
                "cancelled: the client went away before the mesh was ready")), "unavailable")
        return metric_names.OK, final

    def _relay(self, forward: Forward, keep_outputs: bool):
        request = forward.request
        arrays = self._inputs(request)
        try:  # refuse bad input here, as a 400, before it costs a round trip
            generation, _ = protocol.parse_request(arrays)
            protocol.validate(generation, uses_bbox=True)  # the engine checks the model's own limits
            protocol.queue_band(forward.queue)
        except InvalidRequest as exc:
            return metric_names.INVALID, error_response(str(exc), "invalid"), None
        outcome, answer, outputs = self._exec(forward, arrays, request.timeout(), keep_outputs)
        if outcome != metric_names.OK:
            return outcome, answer, None
        forward.engine_answered = time.monotonic()
        self._measure_work(forward, answer)
        arm = pb_utils.Tensor("ARM", np.array([forward.arm.encode()], dtype=np.object_))
        return outcome, pb_utils.InferenceResponse(output_tensors=[*answer.output_tensors(), arm]), outputs

    def _tenant(self, request) -> tuple[str, str]:
        """The request's tenant and model labels (metrics.tenant_label, model_label: bounded by
        $CUBE3D_TENANTS and $CUBE3D_MODELS)."""
        try:
            parameters = json.loads(request.parameters() or "{}")
            tenant, model = (_parameter(parameters, experiment.TENANT_KEY),
                             _parameter(parameters, experiment.MODEL_KEY))
        except Exception:  # noqa: BLE001 - metering never fails a request
            tenant = model = None
        return metric_names.tenant_label(tenant, self.tenants), metric_names.model_label(model, self.models)

    @staticmethod
    def _measure_work(forward: Forward, answer) -> None:
        """The shape tokens and engine seconds (decode and geometry, not the queue) of the mesh."""
        try:
            outputs = {t.name(): t.as_numpy() for t in answer.output_tensors()}
            forward.tokens = int(outputs["SHAPE_TOKENS"].size)
            timings = forward.timings = json.loads(bytes(outputs["TIMINGS"].reshape(-1)[0]))
            forward.engine_seconds = float(timings.get("tokens_s") or 0) + float(timings.get("geometry_s") or 0)
        except Exception as exc:  # noqa: BLE001 - metering never fails a request
            pb_utils.Logger.log_warn(f"measuring the work of {forward.id} failed: {exc}")

    # -- the shadow test --------------------------------------------------------------------------

    def _shadow(self, copy: ShadowCopy, arrays: dict, deadline_us: int, served: ServedAnswer) -> None:
        """Send a copy of the request to the shadow version, measure it, compare it with the
        served answer. Runs beside the served forward and answers no one."""
        outcome, outputs = metric_names.FAILED, None
        with self.pending_lock:
            self.pending[copy.id] = copy
        try:
            generation, options = protocol.parse_request(arrays)
            outcome, _, outputs = self._exec(copy, arrays, deadline_us, keep_outputs=True)
        except InvalidRequest:
            outcome = metric_names.INVALID
        except Exception as exc:  # noqa: BLE001 - a shadow's failure is measured, never raised
            pb_utils.Logger.log_warn(f"shadow copy {copy.id} to version {copy.version} failed: {exc}")
        finally:
            with self.pending_lock:
                mine = self.pending.pop(copy.id, None) is not None
                if mine:
                    self.shadows_in_flight -= 1
        if not mine:  # the watchdog ended it: its engine died
            return
        self.measurements.shadow(copy.version, copy.baseline, outcome, time.monotonic() - copy.started)
        if outcome != metric_names.OK or not served.ready.wait(REQUEST_TIMEOUT_S) or served.outputs is None:
            return
        try:
            if generation.greedy:
                measure = metric_names.AGREEMENT_TOKENS
                value = agreement.token_agreement(served.outputs["SHAPE_TOKENS"], outputs["SHAPE_TOKENS"])
            else:
                measure = metric_names.AGREEMENT_MESH_IOU
                meshes = [agreement.read_mesh(protocol.decode_mesh(bytes(o["MESH"].reshape(-1)[0]),
                                                                   options.mesh_encoding), generation.format)
                          for o in (served.outputs, outputs)]
                value = agreement.mesh_iou(*meshes)
        except Exception as exc:  # noqa: BLE001
            pb_utils.Logger.log_warn(f"comparing shadow copy {copy.id} failed: {exc}")
            return
        self.measurements.agreement(copy.version, copy.baseline, measure, value)

    # -- the watchdog ---------------------------------------------------------------------------

    def _engine_loaded(self, version: int) -> bool:
        try:
            return pb_utils.is_model_ready(model_name=self.engine_model, model_version=str(version))
        except Exception:  # noqa: BLE001 - an unknown version is one not loaded
            return False

    def _engine_alive(self, version: int) -> bool:
        return self.stubs.alive(self.engine_model, version)

    def _engine_gone_error(self, version: int):
        return error_response(str(Unavailable(
            f"the engine process of {self.engine_model} version {version} is gone (killed or crashed) "
            f"and this request with it; the server restarts it: retry")), "unavailable")

    def _watch(self) -> None:
        while not self.stopping.wait(WATCH_INTERVAL_S):
            try:
                self._look()
            except Exception as exc:  # noqa: BLE001 - a watchdog that dies would leave forwards hanging
                pb_utils.Logger.log_error(f"watchdog: {exc!r}")

    def _look(self) -> None:
        with self.pending_lock:
            forwards = list(self.pending.values())
        if not forwards:
            return
        alive = {v: self._engine_alive(v) for v in {f.version for f in forwards}}
        for forward in forwards:
            if isinstance(forward, ShadowCopy):
                if not alive[forward.version]:
                    self._end_shadow(forward)
            elif not alive[forward.version]:
                self._answer(forward, metric_names.UNAVAILABLE, self._engine_gone_error(forward.version))
            elif not forward.cancel_sent and forward.client_gone():
                forward.cancel_sent = True
                pb_utils.Logger.log_info(f"client of {forward.id} went away: cancelling it")
                # On a thread of its own: a control request that waits must not stop the watching.
                threading.Thread(target=self._cancel, args=(forward,), name="cube3d-cancel", daemon=True).start()

    def _end_shadow(self, copy: ShadowCopy) -> None:
        """A shadow copy whose engine died waits forever on its thread: measured as unavailable
        now, and its slot freed."""
        with self.pending_lock:
            if self.pending.pop(copy.id, None) is None:
                return  # its thread got there first
            self.shadows_in_flight -= 1
        self.measurements.shadow(copy.version, copy.baseline, metric_names.UNAVAILABLE)

    def _cancel(self, forward: Forward) -> None:
        """Ask the engine to drop a forward whose client went away (a control request)."""
        prompt = pb_utils.Tensor("PROMPT", np.array([b""], dtype=np.object_))
        control = pb_utils.InferenceRequest(
            model_name=self.engine_model, model_version=forward.version, inputs=[prompt],
            requested_output_names=[], parameters={CANCEL_PARAMETER: forward.id})
        try:
            for _ in control.exec(decoupled=True):
                pass
        except Exception as exc:  # noqa: BLE001 - the forward ends anyway when the engine finishes it
            pb_utils.Logger.log_warn(f"cancelling {forward.id} failed: {exc}")

    def finalize(self):
        tracing.flush()
        self.stopping.set()
        self.watchdog.join(2 * WATCH_INTERVAL_S)
        with self.pending_lock:
            self.pending.clear()
        self.iterators.now()
        release_backend_objects()
