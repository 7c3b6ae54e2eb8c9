"""`cube3d`: the KServe predict API (`POST /v2/models/cube3d/infer`, gRPC ModelInfer).

Triton refuses those endpoints for decoupled models, so this model is not decoupled. It loads
no weights: each request is forwarded over BLS to the same version of `cube3d_stream`, which
owns the engine, and the final response is relayed. `execute` hands each request to a thread
and returns, answering through the response sender, so concurrent requests reach the engine
together and run batched. Importing no torch keeps this process small.

What BLS in Triton 2.51 does not do, a watchdog thread does:
- a forwarded request cannot be cancelled by its caller: when a client goes away, the
  watchdog sends the engine a control request that cancels the forward by its id;
- a forward to a dead engine process waits forever: the watchdog checks that the engine's stub
  process is alive and ends every waiting forward with UNAVAILABLE when it is not (the
  supervisor, serving/supervisor.py, then restarts the server).

While the server drains before it stops (serving/drain.py), new requests are refused at once as
UNAVAILABLE (HTTP 503) and those already forwarded run to the end.
"""

from __future__ import annotations

import os
import threading
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

from cubeserve.engine.requests import InvalidRequest, Unavailable
from cubeserve.serving import protocol
from cubeserve.serving.stubs import stub_alive
from cubeserve.serving.protocol import CANCEL_PARAMETER, FORWARDED_PARAMETER
from cubeserve.serving.triton_common import Drain, Reply, error_response, parameters

WATCH_INTERVAL_S = 0.25  # how often the watchdog looks at the waiting forwards


class Forward(Reply):
    """One request on its way through the engine, with the id of its forward."""

    def __init__(self, request, drain: Drain):
        super().__init__(request, drain)
        self.id = f"cube3d-{uuid.uuid4().hex}"
        self.cancel_sent = False


class PredictModel:
    """`cube3d`: the predict API; forwards each request to `cube3d_stream` of the same version.

    Parameters: engine_model (default "cube3d_stream"), max_concurrency (requests forwarded at
    once, default 128; more are refused as busy at once: keep it at least the engine's
    max_objects + max_queue, so that the engine's queue is the one that refuses).
    """

    def initialize(self, args):
        params = parameters(args)
        self.engine_model = params.get("engine_model") or "cube3d_stream"
        self.version = int(args["model_version"])
        self.max_concurrency = int(params.get("max_concurrency") or 128)
        self.capacity = threading.BoundedSemaphore(self.max_concurrency)
        self.pending: dict[str, Forward] = {}
        self.pending_lock = threading.Lock()
        self.stopping = threading.Event()
        self.server_pid = os.getppid()  # the stub is a child of tritonserver
        self.drain = Drain(args)
        self.watchdog = threading.Thread(target=self._watch, name="cube3d-watchdog", daemon=True)
        self.watchdog.start()

    def execute(self, requests):
        for request in requests:
            forward = Forward(request, self.drain)
            if self.drain.draining():  # the server stops soon: new requests go elsewhere
                forward.send(self.drain.refusal())
                continue
            if not self.capacity.acquire(blocking=False):
                forward.send(error_response(str(Unavailable(
                    f"the server is busy: {self.max_concurrency} requests in progress (max_concurrency of "
                    f"model cube3d); retry later")), "unavailable"))
                continue
            # A daemon thread per forward: one waiting on a dead engine never returns, and must not
            # keep this process from exiting (a pool's workers would).
            threading.Thread(target=self._forward, args=(forward,), name="cube3d-forward", daemon=True).start()
        return None

    def _forward(self, forward: Forward) -> None:
        with self.pending_lock:
            self.pending[forward.id] = forward
        try:
            forward.send(self._relay(forward))
        except Exception as exc:  # noqa: BLE001 - answer, never take the stub down
            forward.send(error_response(f"forwarding to {self.engine_model} failed: {exc}"))
        finally:
            with self.pending_lock:
                self.pending.pop(forward.id, None)
            self.capacity.release()

    def _relay(self, forward: Forward):
        request = forward.request
        tensors = {name: pb_utils.get_input_tensor_by_name(request, name) for name in protocol.INPUTS
                   if name != "STREAM_PROGRESS"}
        try:  # refuse bad input here, as a 400, before it costs a round trip
            generation, _ = protocol.parse_request({k: t.as_numpy() if t is not None else None
                                                    for k, t in tensors.items()})
            protocol.validate(generation, uses_bbox=True)  # the engine checks the model's own limits
        except InvalidRequest as exc:
            return error_response(str(exc), "invalid")
        bls = pb_utils.InferenceRequest(
            request_id=forward.id, model_name=self.engine_model, model_version=self.version,
            inputs=[t for t in tensors.values() if t is not None],
            requested_output_names=[n for n in protocol.OUTPUTS if n != "PROGRESS"],
            timeout=request.timeout(),  # the client's deadline, enforced by the engine
            parameters={FORWARDED_PARAMETER: True},  # accepted here: the engine takes it even while draining
        )
        final = None
        for response in bls.exec(decoupled=True):
            if response.has_error():
                message = response.error().message()
                if not self._engine_alive():
                    return self._engine_gone_error()
                return error_response(message, protocol.error_kind(message))
            if response.output_tensors():
                final = response
        if final is None:
            return error_response(str(Unavailable("cancelled: the client went away before the mesh was ready")),
                                  "unavailable")
        return pb_utils.InferenceResponse(output_tensors=final.output_tensors())

    # -- the watchdog ---------------------------------------------------------------------------

    def _engine_alive(self) -> bool:
        return stub_alive(self.server_pid, self.engine_model, self.version)

    def _engine_gone_error(self):
        return error_response(str(Unavailable(
            f"the engine process of {self.engine_model} version {self.version} is gone (killed or crashed) "
            f"and this request with it; the server restarts it: retry")), "unavailable")

    def _watch(self) -> None:
        while not self.stopping.wait(WATCH_INTERVAL_S):
            with self.pending_lock:
                forwards = list(self.pending.values())
            if not forwards:
                continue
            if not self._engine_alive():
                for forward in forwards:
                    forward.send(self._engine_gone_error())
                continue
            for forward in forwards:
                if not forward.cancel_sent and forward.client_gone():
                    forward.cancel_sent = True
                    pb_utils.Logger.log_info(f"client of {forward.id} went away: cancelling it")
                    self._cancel(forward)

    def _cancel(self, forward: Forward) -> None:
        """Ask the engine to drop a forward whose client went away (a control request)."""
        prompt = pb_utils.Tensor("PROMPT", np.array([b""], dtype=np.object_))
        control = pb_utils.InferenceRequest(
            model_name=self.engine_model, model_version=self.version, inputs=[prompt],
            requested_output_names=[], parameters={CANCEL_PARAMETER: forward.id})
        try:
            for _ in control.exec(decoupled=True):
                pass
        except Exception as exc:  # noqa: BLE001 - the forward ends anyway when the engine finishes it
            pb_utils.Logger.log_warn(f"cancelling {forward.id} failed: {exc}")

    def finalize(self):
        self.stopping.set()
        self.watchdog.join(2 * WATCH_INTERVAL_S)
