"""`cube3d`: the KServe predict API (`POST /v2/models/cube3d/infer`, gRPC ModelInfer).

Triton refuses those endpoints for decoupled models, so this model is not decoupled. It loads
no weights: each request is forwarded over BLS to the same version of `cube3d_stream`, which
owns the engine, and the final response is relayed. `execute` hands each request to a thread
and returns, answering through the response sender, so concurrent requests reach the engine
together and run batched. Importing no torch keeps this process small.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import triton_python_backend_utils as pb_utils

from cubeserve.engine.requests import InvalidRequest
from cubeserve.serving import protocol
from cubeserve.serving.triton_common import FINAL, error_response, parameters


class PredictModel:
    """`cube3d`: the predict API; forwards each request to `cube3d_stream` of the same version.

    Parameters: engine_model (default "cube3d_stream"), max_concurrency (requests forwarded at
    once, default 64).
    """

    def initialize(self, args):
        params = parameters(args)
        self.engine_model = params.get("engine_model") or "cube3d_stream"
        self.version = int(args["model_version"])
        self.pool = ThreadPoolExecutor(max_workers=int(params.get("max_concurrency") or 64),
                                       thread_name_prefix="cube3d-forward")

    def execute(self, requests):
        for request in requests:
            self.pool.submit(self._forward, request)
        return None

    def _forward(self, request):
        sender = request.get_response_sender()
        tensors = {name: pb_utils.get_input_tensor_by_name(request, name) for name in protocol.INPUTS
                   if name != "STREAM_PROGRESS"}
        try:  # refuse bad input here, as a 400, before it costs a round trip
            generation, _ = protocol.parse_request({k: t.as_numpy() if t is not None else None
                                                    for k, t in tensors.items()})
            protocol.validate(generation, uses_bbox=True)  # the engine checks the model's own limits
        except InvalidRequest as exc:
            sender.send(error_response(str(exc), invalid=True), flags=FINAL)
            return
        try:
            inputs = list(tensors.values())
            bls = pb_utils.InferenceRequest(
                model_name=self.engine_model, model_version=self.version,
                inputs=[t for t in inputs if t is not None],
                requested_output_names=[n for n in protocol.OUTPUTS if n != "PROGRESS"],
            )
            final = None
            for response in bls.exec(decoupled=True):
                if response.has_error():
                    message = response.error().message()
                    sender.send(error_response(message, invalid=protocol.is_input_error(message)), flags=FINAL)
                    return
                if response.output_tensors():
                    final = response
            if final is None:
                sender.send(error_response("the engine returned no result (cancelled or stopped)"), flags=FINAL)
                return
            sender.send(pb_utils.InferenceResponse(output_tensors=final.output_tensors()), flags=FINAL)
        except Exception as exc:  # noqa: BLE001
            sender.send(error_response(f"forwarding to {self.engine_model} failed: {exc}"), flags=FINAL)

    def finalize(self):
        self.pool.shutdown(wait=True, cancel_futures=False)
