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
stub-crash count (tests/stub_crashes.py) reads it from the kernel log too."""

from __future__ import annotations

import queue
import textwrap
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
