"""`cube3d_stream`: the decoupled Triton model that owns the cube-serve engine.

Each Triton model instance runs in its own process; this one loads the weights of its version
on its device and runs the engine's batching thread (`Scheduler`). `execute` only parses and
hands requests over, then returns: responses go out through each request's response sender
when ready, progress (with STREAM_PROGRESS) from the decode thread between steps, the mesh from
the geometry thread. A client that goes away (`request.is_cancelled()`) leaves the batch.
The predict-API model `cube3d` (triton_predict.py) forwards here, so one engine serves both.
"""

from __future__ import annotations

import time
from concurrent.futures import CancelledError
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from cubeserve.engine.engine import Engine
from cubeserve.engine.requests import InvalidRequest
from cubeserve.engine.scheduler import EngineStats, Scheduler
from cubeserve.serving import protocol
from cubeserve.serving.triton_common import FINAL, error_response, parameters, response

CANCEL_POLL_S = 0.1  # how often the decode thread asks Triton whether a client went away


def _inputs(request) -> dict[str, np.ndarray | None]:
    out = {}
    for name in protocol.INPUTS:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        out[name] = None if tensor is None else tensor.as_numpy()
    return out


class TritonStats(EngineStats):
    """EngineStats that also updates Prometheus metrics on Triton's metrics port."""

    def __init__(self, labels: dict[str, str]):
        super().__init__()
        counter, gauge = pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE
        # The families must outlive their metrics, so they are kept on the object.
        self.families = {
            name: pb_utils.MetricFamily(name=name, description=desc, kind=kind)
            for name, desc, kind in (
                ("cube3d_tokens_generated_total", "Shape tokens generated", counter),
                ("cube3d_objects_completed_total", "Objects (meshes) completed", counter),
                ("cube3d_decode_steps_total", "Batched decode steps", counter),
                ("cube3d_decode_seconds_total", "Time spent in decode steps", counter),
                ("cube3d_queue_seconds_total", "Time requests waited before joining the batch", counter),
                ("cube3d_objects_in_flight", "Objects in the running batch", gauge),
                ("cube3d_time_per_output_token_seconds", "Duration of the latest decode step", gauge),
            )
        }
        self.metric = {name: family.Metric(labels=labels) for name, family in self.families.items()}

    def on_step(self, objects, seconds):
        super().on_step(objects, seconds)
        m = self.metric
        m["cube3d_tokens_generated_total"].increment(objects)
        m["cube3d_decode_steps_total"].increment(1)
        m["cube3d_decode_seconds_total"].increment(seconds)
        m["cube3d_objects_in_flight"].set(objects)
        m["cube3d_time_per_output_token_seconds"].set(seconds)

    def on_admit(self, queue_seconds):
        super().on_admit(queue_seconds)
        self.metric["cube3d_queue_seconds_total"].increment(queue_seconds)

    def on_in_flight(self, objects):
        super().on_in_flight(objects)
        self.metric["cube3d_objects_in_flight"].set(objects)

    def on_complete(self):
        super().on_complete()
        self.metric["cube3d_objects_completed_total"].increment(1)


class EngineModel:
    """`cube3d_stream`: decoupled; owns the engine of this version on this instance's device.

    Parameters (config.pbtxt): weights (directory; relative paths resolve against the version
    directory; default "weights"), config (preset or YAML; default: the YAML beside the
    weights), device (for KIND_CPU: cpu; KIND_GPU instances use their own GPU), dtype
    (default bfloat16 on GPU, float32 on CPU), max_objects (objects in flight, default 8),
    single_block (reference | causal), cuda_graphs (auto | true | false; auto = on CUDA).
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
        dtype = params.get("dtype") or ("bfloat16" if device.startswith("cuda") else "float32")
        engine = Engine.from_dir(weights, device=device, dtype=dtype,
                                 single_block_mode=params.get("single_block") or "reference",
                                 config=params.get("config") or None)
        self.uses_bbox = engine.cfg.gpt.use_bbox
        labels = {"model": args["model_name"], "version": args["model_version"]}
        graphs = {"": None, "auto": None, "true": True, "false": False}[params.get("cuda_graphs", "").lower()]
        self.scheduler = Scheduler(engine, max_objects=int(params.get("max_objects") or 8),
                                   stats=TritonStats(labels), graphs=graphs).start()
        pb_utils.Logger.log_info(
            f"cube3d engine ready: {engine.cfg.name} from {weights} on {device} ({dtype}), "
            f"{self.scheduler.pool.max_objects} objects in flight")

    def execute(self, requests):
        for request in requests:
            self._submit(request)
        return None  # every response goes through the request's response sender

    def _submit(self, request):
        sender = request.get_response_sender()
        try:
            generation, stream = protocol.parse_request(_inputs(request))
            protocol.validate(generation, self.uses_bbox)
        except InvalidRequest as exc:
            sender.send(error_response(str(exc), invalid=True), flags=FINAL)
            return

        def on_progress(tokens: int) -> None:  # on the decode thread, between steps
            sender.send(response({"PROGRESS": np.array([tokens], dtype=np.int32)}))

        last_poll = [0.0]

        def client_gone() -> bool:  # asking Triton is an IPC round trip: not every step
            now = time.monotonic()
            if now - last_poll[0] < CANCEL_POLL_S:
                return False
            last_poll[0] = now
            return request.is_cancelled()

        def done(future) -> None:  # on the geometry thread (or wherever the ticket ended)
            try:
                sender.send(response(protocol.result_outputs(future.result())), flags=FINAL)
            except CancelledError:
                sender.send(flags=FINAL)
            except Exception as exc:  # noqa: BLE001 - report it; never take the stub down
                sender.send(error_response(f"generation failed: {exc}"), flags=FINAL)

        try:
            ticket = self.scheduler.submit(generation, on_progress=on_progress if stream else None,
                                           client_gone=client_gone)
        except Exception as exc:  # noqa: BLE001 - e.g. the model is being unloaded
            sender.send(error_response(str(exc)), flags=FINAL)
            return
        ticket.future.add_done_callback(done)

    def finalize(self):
        self.scheduler.stop()
