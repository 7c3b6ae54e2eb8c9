"""Responses carry only the outputs their request asked for, and the python backend's stub survives
clients that ask for fewer outputs than a response holds (issue 56).

Triton 2.51's python backend (r24.10) drops a response's unrequested outputs itself, in
ResponseSender.send, after releasing the GIL: their numpy arrays were then freed by a thread without
the GIL, racing the stub's Python threads in the small-object allocator, and the engine's stub
segfaulted in libpython after minutes of predict-API traffic (its forwards ask for every output but
PROGRESS). `triton_common.Reply` drops them in Python instead (`only_requested`).

The model here makes the race likely within seconds where it is not prevented: each response
carries DROPS outputs nobody asked for, sent from several threads at once, while other threads
allocate and free numpy arrays (the allocator's size class of a dropped tensor's array). It answers
through the project's own Reply, on the real tritonserver; a crash kills the stub, and the suite's
stub-crash count (tests/stub_crashes.py) reads it from the kernel log too.

The same release frees a decoupled BLS request's responses on a thread of the stub's own when
Python lets go of their iterator first; the predict model holds its iterators for that
(`triton_common.LetGoLater`), and the second test watches where the engine's answers are freed."""

from __future__ import annotations

import queue
import textwrap
import threading
import time
import numpy as np
import pytest

from cubeserve.server.local_triton import LocalTriton, free_port
from cubeserve.serving.stubs import python_stubs

DROPS = 8  # unrequested outputs in every response
RESPONSES = 50  # per request
REQUESTS = 240  # 12,000 responses, 96,000 dropped tensors
MODEL = "prune"

CONFIG = """
name: "prune"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [
  { name: "KEEP" data_type: TYPE_INT32 dims: [ 1 ] },
""" + ",\n".join(f'  {{ name: "DROP{i}" data_type: TYPE_INT32 dims: [ 1 ] }}' for i in range(DROPS)) + """
]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

MODEL_PY = textwrap.dedent(f"""
    import threading

    import numpy as np

    from cubeserve.serving.triton_common import Reply, response

    CHURNERS = 2


    class TritonPythonModel:
        def initialize(self, args):
            self.stop = threading.Event()
            for _ in range(CHURNERS):
                threading.Thread(target=self.churn, daemon=True).start()

        def churn(self):
            # Python's allocator busy in other threads, in the size class of a dropped array.
            while not self.stop.is_set():
                arrays = [np.empty(1, np.int32) for _ in range(64)]
                del arrays

        def execute(self, requests):
            for request in requests:
                threading.Thread(target=self.answer, args=(Reply(request),), daemon=True).start()
            return None

        def answer(self, reply):
            for i in range({RESPONSES}):
                outputs = {{"KEEP": np.array([i], np.int32)}}
                outputs.update({{f"DROP{{j}}": np.array([j], np.int32) for j in range({DROPS})}})
                reply.send(response(outputs), final=False)
            reply.send()

        def finalize(self):
            self.stop.set()
""")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("prune-repository")
    (root / MODEL / "1").mkdir(parents=True)
    (root / MODEL / "config.pbtxt").write_text(CONFIG)
    (root / MODEL / "1" / "model.py").write_text(MODEL_PY)
    # A dead stub ends the server at once, as in a container (the supervisor's --on-fault exit): a
    # crash fails the test in seconds instead of leaving requests hanging on the dead stub.
    with LocalTriton(root, free_port(), free_port(), free_port(), log_path=root / "tritonserver.log",
                     supervised=True, on_fault="exit", fault_grace=1.0) as triton:
        yield triton


def test_a_client_asking_for_fewer_outputs_gets_only_those_and_the_stub_survives(server):
    import tritonclient.grpc as grpcclient

    (stub,) = python_stubs(server.tritonserver_pid())
    answers: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)  # the supervisor's gRPC front end, as clients reach it
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        inputs = [grpcclient.InferInput("N", [1], "INT32")]
        inputs[0].set_data_from_numpy(np.array([0], np.int32))
        for i in range(REQUESTS):
            client.async_stream_infer(MODEL, inputs, request_id=str(i), enable_empty_final_response=True,
                                      outputs=[grpcclient.InferRequestedOutput("KEEP")])
        finals, kept, deadline = 0, 0, time.monotonic() + 120
        while finals < REQUESTS:
            assert time.monotonic() < deadline, f"{finals} of {REQUESTS} requests answered in 120 s"
            try:
                result, error = answers.get(timeout=0.5)
            except queue.Empty:  # a dead stub answers nothing until Triton's health check notices
                assert stub in python_stubs(server.tritonserver_pid()), f"the stub died after {kept} responses"
                continue
            assert error is None, f"after {finals} of {REQUESTS} requests: {error}"
            response = result.get_response()
            if response.parameters["triton_final_response"].bool_param:
                finals += 1
                continue
            assert [o.name for o in response.outputs] == ["KEEP"]
            kept += 1
        assert kept == REQUESTS * RESPONSES
    finally:
        client.stop_stream()
        client.close()
    assert stub in python_stubs(server.tritonserver_pid()), "the model's stub died"



# -- the predict model's forwards: decoupled BLS requests to the engine ---------------------------------

# The predict model as shipped, watching which thread frees each engine answer's arrays: a thread
# Python did not start shows as a dummy thread, where running Python at all may crash the stub first.
WATCHED_PREDICT_PY = textwrap.dedent("""
    import threading
    import weakref

    from cubeserve.serving import triton_predict


    class TritonPythonModel(triton_predict.PredictModel):
        def initialize(self, args):
            self.foreign = 0
            return super().initialize(args)

        def _read(self, forward, responses):
            outcome, answer = super()._read(forward, responses)
            if not answer.has_error():
                for tensor in answer.output_tensors():
                    weakref.finalize(tensor.as_numpy(), self._freed)
            return outcome, answer

        def _freed(self):
            if isinstance(threading.current_thread(), threading._DummyThread):
                self.foreign += 1
                triton_predict.pb_utils.Logger.log_error(f"FOREIGN FREE {self.foreign}")
""")
WATCH_S = 30.0
WATCH_CLIENTS = 16


def test_the_engines_answers_are_freed_by_python_threads_and_the_predict_model_survives(tmp_path):
    """python_backend r24.10 frees a BLS response iterator that Python let go of first on its
    stub-to-parent thread, without the GIL (`triton_common.LetGoLater` says how), and the
    responses' arrays with it: the predict model's stub segfaulted after 9 minutes of the soak.
    Here the real server under 16 clients for 30 s, the predict model watching where each of the
    engine's answers is freed: with the iterators let go by Python, never by the stub's own
    threads. Without that, the watched stub died in a third of such 20-second runs (and in
    three of three 90-second soaks, within 15 s); the soak (tests/test_soak.py) is the longer check."""
    from cube3d_client import Cube3DClient
    from cubeserve import deploy
    from cubeserve.checkpoint import write_random_weights
    from cubeserve.server.local_triton import copy_model_repository

    repo = copy_model_repository(tmp_path / "models")
    write_random_weights("tiny", repo / deploy.STREAM_MODEL / "1" / "weights", seed=0)
    (repo / deploy.PREDICT_MODEL / "1" / "model.py").write_text(WATCHED_PREDICT_PY)
    log = tmp_path / "tritonserver.log"
    errors: list[str] = []
    done = [0]
    with LocalTriton(repo, free_port(), free_port(), free_port(), log_path=log, supervised=True,
                     on_fault="exit", fault_grace=1.0) as server:
        server_pid = server.tritonserver_pid()
        stubs = set(python_stubs(server_pid))
        stop = time.monotonic() + WATCH_S

        def client(i: int) -> None:
            c = Cube3DClient(server.grpc_url if i % 2 else server.http_url, "grpc" if i % 2 else "http")
            while time.monotonic() < stop and not errors:
                try:
                    c.generate(f"object {i}", resolution=4)
                    done[0] += 1
                except Exception as exc:  # noqa: BLE001 - a dead stub shows here first
                    errors.append(repr(exc))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(WATCH_CLIENTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WATCH_S + 60)
        # A stub's death ends tritonserver and its supervisor (on_fault="exit").
        alive = server.process.poll() is None and set(python_stubs(server_pid)) == stubs
    text = log.read_text(errors="replace")
    assert "FOREIGN FREE" not in text, "an engine answer's array was freed by a thread of the stub's own"
    assert alive and not errors, f"after {done[0]} objects: {errors[:3]}"
    assert done[0] > 0
