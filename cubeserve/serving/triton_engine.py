"""`cube3d_stream`: the decoupled Triton model that owns the cube-serve engine.

Each Triton model instance runs in its own process; this one loads the weights of its version
on its device and runs the engine's batching thread (`Scheduler`). `execute` only parses and
hands requests over, then returns: responses go out through each request's response sender
when ready, progress (with STREAM_PROGRESS) from the decode thread between steps, the mesh from
the geometry thread. A client that goes away (`request.is_cancelled()`) leaves the batch, and
so does a request whose deadline (the v2 `timeout` parameter) passes. Waiting requests get slots
by the gateway's priority band and in turn between its tenants (engine/admission.py); past
`max_queue` waiting requests, one that counts for less gives way or the new one is refused at once
as UNAVAILABLE (the front ends answer a shed request 429, "no capacity" 503), and so is every new request
while the server drains before it stops (serving/drain.py), except the predict model's forwards
of requests it accepted before.

The predict-API model `cube3d` (triton_predict.py) forwards here, so one engine serves both.
A BLS request cannot be cancelled by its caller in Triton 2.51, so the predict model cancels a
forward whose client went away with a control request: one carrying the request parameter
CANCEL_PARAMETER, whose value is the forward's request id.
"""

from __future__ import annotations

import gc
import json
import threading
import time
from concurrent.futures import CancelledError
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from cubeserve.config import decode_window_of
from cubeserve.engine.engine import Engine
from cubeserve.engine.fast_paths import check_recipe
from cubeserve.engine.geometry import Mesh
from cubeserve.engine.scheduler import MAX_WAIT_S, EngineStats, Scheduler
from cubeserve.requests import FORMATS, InvalidRequest, Unavailable
from cubeserve.serving import metrics as metric_names
from cubeserve.serving import protocol
from cubeserve.serving.cpu_share import engine_processes
from cubeserve.serving.experiment import BAND_KEY, TENANT_KEY
from cubeserve.serving.protocol import ARM_PARAMETER, CANCEL_PARAMETER, FORWARDED_PARAMETER
from cubeserve.serving.repository import version_settings
from cubeserve.serving.stubs import end_this_process_after, release_backend_objects
from cubeserve.serving.triton_common import (Drain, Reply, error_response, parameters, request_parameter,
                                              request_timeout_s, response)
from cubeserve.serving.triton_metrics import Measurements, kept, locked

CANCEL_POLL_S = 0.1  # how often ClientWatch asks Triton whether a client went away
METRICS_WRITE_S = 0.25  # how often at most the engine's batch metrics are written (TritonStats)
EXIT_GRACE_S = 30.0  # after finalize: an engine process still running then is stuck on its way out


def _inputs(request) -> dict[str, np.ndarray | None]:
    out = {}
    for name in protocol.INPUTS:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        out[name] = None if tensor is None else tensor.as_numpy()
    return out


class TritonStats(EngineStats):
    """EngineStats that also updates the engine's Prometheus metrics (batch-level: tokens, steps,
    the batch's size, waiting requests) on Triton's metrics port. Per-object measurements are
    the `Measurements` of serving/triton_metrics.py.

    Every write of a metric is a round trip to tritonserver (triton_metrics.py), so none is made
    on the decode thread: written there, five or more a step held every step up by as long as
    the step itself on a busy CPU (issue 53). The loop only counts, in this object; a thread of
    its own writes what changed, counters before gauges (a reader that sees the batch empty sees
    its tokens too): at once when the batch or the queue grows, else at most every
    METRICS_WRITE_S. The geometry thread writes too when an object completes,
    before its answer goes out: a client that reads the metrics after its answer finds its
    tokens and steps counted. Drops are written at once (rare; read by tests and alerts right
    after the answer that says so)."""

    COUNTERS = {"cube3d_tokens_generated_total": "tokens_generated", "cube3d_objects_completed_total": "objects_completed",
                "cube3d_decode_steps_total": "steps", "cube3d_decode_seconds_total": "step_seconds",
                "cube3d_queue_seconds_total": "queue_seconds"}
    GAUGES = {"cube3d_objects_in_flight": "in_flight", "cube3d_decode_step_seconds": "last_step_seconds",
              "cube3d_requests_waiting": "waiting"}

    def __init__(self, labels: dict[str, str]):
        super().__init__()
        self.last_step_seconds = 0.0
        counter, gauge = pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE
        # The families must outlive their metrics, so they are kept on the object.
        self.families = {
            name: kept(pb_utils.MetricFamily(name=name, description=desc, kind=kind))
            for name, desc, kind in (
                ("cube3d_tokens_generated_total", "Shape tokens generated", counter),
                ("cube3d_objects_completed_total", "Objects (meshes) completed", counter),
                ("cube3d_decode_steps_total", "Batched decode steps", counter),
                ("cube3d_decode_seconds_total", "Time spent in decode steps", counter),
                ("cube3d_queue_seconds_total", "Time requests waited before joining the batch", counter),
                ("cube3d_objects_in_flight", "Objects in the running batch", gauge),
                ("cube3d_decode_step_seconds", "Duration of the latest decode step", gauge),
                ("cube3d_requests_waiting", "Requests waiting for a slot", gauge),
                ("cube3d_requests_dropped_total", "Requests refused (busy), shed (a higher band or a tenant "
                                                  "under its share came first, or waited too long), expired "
                                                  "(deadline) or cancelled (client gone), by reason", counter),
            )
        }
        self.metric = {name: kept(family.Metric(labels=labels)) for name, family in self.families.items()
                       if name != "cube3d_requests_dropped_total"}
        dropped = self.families["cube3d_requests_dropped_total"]
        self.dropped = {reason: kept(dropped.Metric(labels={**labels, "reason": reason}))
                        for reason in ("refused_busy", "shed", "expired", "cancelled")}
        self._written = dict.fromkeys([*self.COUNTERS, *self.GAUGES], 0)  # what tritonserver shows
        self._write_lock = threading.Lock()
        # changed: something to write; now: the batch or the queue changed, write without waiting
        self._changed, self._now, self._closing = threading.Event(), threading.Event(), threading.Event()
        self._writer = threading.Thread(target=self._write_changes, name="cube3d-metrics", daemon=True)
        self._writer.start()

    def write(self) -> None:
        """Write what changed since the last write (a round trip per metric that did)."""
        with self._write_lock:
            with self.lock:
                now = {name: getattr(self, attr) for name, attr in {**self.COUNTERS, **self.GAUGES}.items()}
            changed = [name for name, value in now.items() if value != self._written[name]]  # counters first
            if not changed:
                return

            def update():
                for name in changed:
                    if name in self.COUNTERS:
                        self.metric[name].increment(now[name] - self._written[name])
                    else:
                        self.metric[name].set(now[name])
            locked(update)
            self._written.update((name, now[name]) for name in changed)

    def _write_changes(self) -> None:
        written = 0.0
        while True:
            self._changed.wait()
            rest = METRICS_WRITE_S - (time.monotonic() - written)
            if rest > 0:
                self._now.wait(rest)
            if self._closing.is_set():
                return
            self._changed.clear()
            self._now.clear()
            try:
                self.write()
            except Exception as exc:  # noqa: BLE001 - metrics never stop the engine
                pb_utils.Logger.log_warn(f"writing the engine's metrics failed: {exc}")
            written = time.monotonic()

    def _batch_changed(self, before: int, after: int) -> None:
        # Only a batch or queue that grew is written at once (a reader waiting for work to start
        # sees it start): a write is several round trips to tritonserver, and one each time the
        # batch empties would land as geometry starts, on the cores its threads hold. The
        # geometry thread's write as the object completes says the batch emptied.
        if after > before:
            self._now.set()
        self._changed.set()

    def close(self) -> None:
        """Stop the writer (after the scheduler: nothing counts any more), then write the rest."""
        self._closing.set()
        self._now.set()
        self._changed.set()
        self._writer.join(METRICS_WRITE_S + 5)
        self.write()

    def on_step(self, objects, seconds):
        before = self.in_flight
        super().on_step(objects, seconds)
        with self.lock:
            self.last_step_seconds = seconds
        self._batch_changed(before, objects)

    def on_window_tokens(self, tokens):
        super().on_window_tokens(tokens)
        self._changed.set()

    def on_admit(self, queue_seconds):
        super().on_admit(queue_seconds)
        self._changed.set()

    def on_in_flight(self, objects):
        before = self.in_flight
        super().on_in_flight(objects)
        self._batch_changed(before, objects)

    def on_complete(self):  # on the geometry thread, before the object's answer
        super().on_complete()
        self.write()

    def on_dropped(self, reason):
        super().on_dropped(reason)
        locked(lambda: self.dropped[reason].increment(1))

    def on_waiting(self, waiting):
        before = self.waiting
        super().on_waiting(waiting)
        if waiting != before:
            self._batch_changed(before, waiting)


class ClientWatch:
    """Asks Triton every CANCEL_POLL_S whether the clients of the requests it watches went away,
    and cancels their tickets (the scheduler drops them at its next step). On a thread of its own:
    each question is a round trip to tritonserver, which on the decode thread held the batch up.
    Only requests from clients are watched: a forward of the predict model cannot be cancelled
    by its caller (BLS), so the predict model cancels it with a control request instead."""

    def __init__(self):
        self._watched: dict[int, tuple[Reply, object]] = {}
        self._lock = threading.Lock()
        self._wake, self._closing = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._run, name="cube3d-clients", daemon=True)
        self._thread.start()

    def watch(self, reply: Reply, ticket) -> None:
        with self._lock:
            self._watched[id(ticket.future)] = (reply, ticket)
        self._wake.set()

    def forget(self, future) -> None:
        """Stops watching the ticket of `future` (by its future: see EngineModel._submit)."""
        with self._lock:
            self._watched.pop(id(future), None)

    def _run(self) -> None:
        while not self._closing.is_set():
            with self._lock:
                watched = list(self._watched.values())
            if not watched:
                self._wake.wait()
                self._wake.clear()
                continue
            for reply, ticket in watched:
                try:
                    if reply.client_gone():
                        ticket.cancel()
                except Exception as exc:  # noqa: BLE001 - the watch goes on; the request ends anyway
                    pb_utils.Logger.log_warn(f"asking whether a client went away failed: {exc}")
            self._closing.wait(CANCEL_POLL_S)

    def close(self) -> None:
        self._closing.set()
        self._wake.set()
        self._thread.join(CANCEL_POLL_S + 5)


def warm_mesh_output() -> None:
    """Export a tetrahedron in every format and judge its quality, once, as the engine loads: the
    first export imports and sets up trimesh's exporters, 0.65 s of the first request's time
    otherwise (measured on a busy 2-core CPU; issue 53)."""
    tetrahedron = Mesh(vertices=np.array([[0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1]], dtype=np.float32),
                       faces=np.array([[0, 2, 1], [0, 1, 3], [0, 3, 2], [1, 2, 3]], dtype=np.int64))
    for file_type in FORMATS:
        protocol.encode_mesh(tetrahedron.export(file_type), "base64")
    metric_names.mesh_quality(tetrahedron)


class EngineModel:
    """`cube3d_stream`: decoupled; owns the engine of this version on this instance's device.

    Parameters (config.pbtxt): weights (directory; relative paths resolve against the version
    directory; default "weights"), config (preset or YAML; default: the YAML beside the
    weights), device (for KIND_CPU: cpu; KIND_GPU instances use their own GPU), dtype
    (default: `engine.default_dtype`: bfloat16 on GPU and on CPUs with native bf16, else
    float32), quantization (none | int8 | int4 | fp8: `fast_paths.quantize`; a packaged version's
    own `repository.VERSION_SETTINGS` say it instead, with the recipe `fast_paths.check_recipe`
    holds this code to), max_objects (objects in flight, default 8),
    max_queue (requests that may wait beyond those in flight; more are refused as busy or shed;
    default 8 x max_objects), max_wait_s (the longest a request waits for a slot before it is
    shed; default scheduler.MAX_WAIT_S), priority_slots (slots kept for the interactive band, which
    then decodes while lower bands pause: engine/scheduler.py; default 0), single_block
    (reference | causal), cuda_graphs (auto | true | false; auto = on CUDA).
    """

    def initialize(self, args):
        params = parameters(args)
        version_dir = Path(args["model_repository"]) / args["model_version"]
        weights = Path(params.get("weights") or "weights")
        weights = weights if weights.is_absolute() else version_dir / weights
        if args["model_instance_kind"] == "GPU":
            device = f"cuda:{args['model_instance_device_id']}"
        else:
            device = params.get("device") or "cpu"
        # The engines of this pod (instances x loaded versions) divide its CPU quota
        # (serving/cpu_share.py); $OMP_NUM_THREADS, when set, overrides for each of them.
        engines = engine_processes(json.loads(args["model_config"]), args["model_repository"])
        # A packaged version says how it is quantized (and how that was done when it was gated);
        # the config's parameter is for a repository written by hand.
        settings = version_settings(version_dir)
        quantization = settings.get("quantization") or params.get("quantization") or "none"
        check_recipe(quantization, settings.get("quantization_recipe"))
        engine = Engine.from_dir(weights, device=device, dtype=params.get("dtype") or None,
                                 quantization=quantization,
                                 single_block_mode=params.get("single_block") or "reference",
                                 config=params.get("config") or None, engines_sharing_cpu=engines,
                                 decode_window=decode_window_of(settings))
        self.uses_bbox = engine.cfg.gpt.use_bbox
        warm_mesh_output()
        self.version = args["model_version"]  # every mesh response says it (MODEL_VERSION)
        labels = {"model": args["model_name"], "version": args["model_version"]}
        graphs = {"": None, "auto": None, "true": True, "false": False}[params.get("cuda_graphs", "").lower()]
        max_queue, max_wait_s = params.get("max_queue"), params.get("max_wait_s")
        priority_slots = params.get("priority_slots") or "0"  # the Scheduler names the range
        self.stats = TritonStats(labels)
        self.scheduler = Scheduler(engine, max_objects=int(params.get("max_objects") or 8),
                                   stats=self.stats, graphs=graphs,
                                   max_queue=int(max_queue) if max_queue else None,
                                   max_wait_s=float(max_wait_s) if max_wait_s else MAX_WAIT_S,
                                   priority_slots=int(priority_slots) if priority_slots.isdigit()
                                   else priority_slots).start()
        self.measurements = Measurements(args["model_name"])
        self.drain = Drain(args)
        self.forwarded: dict[str, object] = {}  # request id -> Ticket, for the predict model's cancels
        self.forwarded_lock = threading.Lock()
        self.clients = ClientWatch()
        pb_utils.Logger.log_info(
            f"cube3d engine ready: {engine.cfg.name} from {weights} on {device} "
            f"({str(engine.dtype).removeprefix('torch.')}, weights {engine.quantization}), "
            f"{self.scheduler.runner.max_objects} objects in flight, max_queue {self.scheduler.max_queue}, "
            f"max_wait_s {self.scheduler.max_wait_s:g}, priority_slots {self.scheduler.priority_slots}; "
            f"{engine.cpu_threads.describe()}")
        # Everything made so far (torch, the engine, trimesh's modules: some 600,000 objects) lasts
        # as long as the process: out of the cyclic collector's count, its full passes take
        # microseconds, not a quarter of a second with the GIL held, and come as often as the
        # requests' own garbage asks. (A trimesh mesh is a reference cycle by design: with the
        # engine's objects counted, full passes came seldom, and the meshes waiting for one grew
        # the stub's heap in the soak.)
        gc.freeze()

    def execute(self, requests):
        for request in requests:
            self._submit(request)
        return None  # every response goes through the request's response sender

    def _submit(self, request):
        started = time.monotonic()
        reply = Reply(request, self.drain)
        request_parameters = json.loads(request.parameters() or "{}")
        cancel_id = request_parameters.get(CANCEL_PARAMETER)
        if cancel_id is not None:  # a control request: cancel a forwarded request, answer nothing
            with self.forwarded_lock:
                ticket = self.forwarded.get(cancel_id)
            if ticket is not None:
                ticket.cancel()
            reply.send()
            return
        forwarded = bool(request_parameters.get(FORWARDED_PARAMETER))
        arm = str(request_parameters.get(ARM_PARAMETER, "")) if forwarded else ""

        def answer(outputs_or_error, outcome: str) -> None:
            """The final answer, measured first; a request from our own client is counted here, a
            forward by the predict model, which the client called."""
            if not forwarded:
                self.measurements.request(self.version, arm, outcome, time.monotonic() - started)
            reply.send(outputs_or_error)

        if not forwarded and self.drain.draining():
            answer(self.drain.refusal(), metric_names.UNAVAILABLE)
            return
        # The queue's band and tenant: the gateway's headers, or what the predict model forwards.
        queue = {key: request_parameter(request_parameters, key) for key in (BAND_KEY, TENANT_KEY)}
        try:
            generation, options = protocol.parse_request(_inputs(request))
            protocol.validate(generation, self.uses_bbox)
            band = protocol.queue_band(queue)
        except InvalidRequest as exc:
            answer(error_response(str(exc), "invalid"), metric_names.INVALID)
            return

        def on_progress(tokens: int) -> None:  # on the decode thread, between steps
            reply.send(response({"PROGRESS": np.array([tokens], dtype=np.int32)}), final=False)

        request_id = request.request_id()

        # `done` names no ticket: the future keeps its callbacks, so a callback holding the ticket
        # (which holds the future) is a reference cycle, and every answer, request and mesh would
        # stay until Python's cyclic collector came by: 7 KB an object of the stub's heap in a soak.
        def done(future) -> None:  # on the geometry thread (or wherever the ticket ended)
            self.clients.forget(future)
            if request_id:
                with self.forwarded_lock:
                    self.forwarded.pop(request_id, None)
            try:
                result = future.result()
            except CancelledError:
                answer(None, metric_names.CANCELLED)
                return
            except Unavailable as exc:
                answer(error_response(str(exc), "unavailable"), metric_names.UNAVAILABLE)
                return
            except Exception as exc:  # noqa: BLE001 - report it; never take the stub down
                answer(error_response(f"generation failed: {exc}"), metric_names.FAILED)
                return
            try:
                outputs = response(protocol.result_outputs(result, options.mesh_encoding, self.version))
            except Exception as exc:  # noqa: BLE001
                answer(error_response(f"generation failed: {exc}"), metric_names.FAILED)
                return
            timings = result.timings
            self.measurements.generated(self.version, arm, len(result.tokens), timings.get("tokens_s", 0.0),
                                        timings.get("queue_s", 0.0), metric_names.mesh_quality(result.mesh))
            answer(outputs, metric_names.OK)

        try:
            ticket = self.scheduler.submit(generation, on_progress=on_progress if options.stream_progress else None,
                                           timeout=request_timeout_s(request),
                                           band=band, tenant=queue[TENANT_KEY] or "")
        except Unavailable as exc:  # busy, or the model is being unloaded
            answer(error_response(str(exc), "unavailable"), metric_names.UNAVAILABLE)
            return
        except Exception as exc:  # noqa: BLE001
            answer(error_response(str(exc)), metric_names.FAILED)
            return
        if request_id:
            with self.forwarded_lock:
                self.forwarded[request_id] = ticket
        if not forwarded:
            self.clients.watch(reply, ticket)
        ticket.future.add_done_callback(done)

    def finalize(self):
        # Logged: until this returns, the unloaded version's process and its memory stay.
        started = time.monotonic()
        self.scheduler.stop()
        self.clients.close()
        self.stats.close()
        pb_utils.Logger.log_info(f"cube3d engine of version {self.version} stopped in "
                                 f"{time.monotonic() - started:.1f} s")
        with self.forwarded_lock:
            self.forwarded.clear()
        release_backend_objects()
        end_this_process_after(EXIT_GRACE_S)
