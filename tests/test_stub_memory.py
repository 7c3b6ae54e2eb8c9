"""A finished request leaves nothing behind in either model's stub.

Python frees most objects as soon as the last reference goes; objects in a reference cycle wait for
the cyclic collector, whose full passes come rarer as the heap grows (torch's objects count). The
engine model's done-callback once held its ticket, which holds the future, which holds its
callbacks: every answer, request and mesh stayed in the stub's heap until such a pass, and the
soak saw the engine's stub grow by about 7 KB an object (45 MiB over the second half of ten
minutes, past its bound).

Here both models run as shipped, subclassed only to turn the cyclic collector off once they are
ready and to log, as each request comes in, how many objects of the request path's own types
(cubeserve's, futures, python_backend's requests and responses) are alive. Two requests are
counted, each after a pause longer than what the predict model holds its forwards for
(`triton_common.LetGoLater`), with 60 requests between them: a cycle made per request grows the
count by every request. Trimesh's meshes
are cycles by design and are not counted: the engine model freezes what it made at start-up out of
the collector's count (`gc.freeze`), so that the collector's full passes, which free them, are
cheap and come often; the test checks that it did."""

from __future__ import annotations

import re
import textwrap
import time

from cubeserve.server.local_triton import LocalTriton, free_port

WATCHED_PY = textwrap.dedent("""
    import gc

    import triton_python_backend_utils as pb_utils

    from {module} import {cls} as Shipped

    OWN = ("cubeserve.", "concurrent.futures", "c_python_backend_utils", "triton_python_backend_utils")


    def _own(module):  # a metaclass made in C may answer a descriptor
        return isinstance(module, str) and module.startswith(OWN)


    class TritonPythonModel(Shipped):
        def initialize(self, args):
            super().initialize(args)
            self.frozen = gc.get_freeze_count()
            gc.disable()  # from here a cycle stays for good: the count below shows it

        def execute(self, requests):
            own = sum(1 for o in gc.get_objects() if _own(type(o).__module__))
            pb_utils.Logger.log_warn(f"ALIVE {name} {{own}} FROZEN {{self.frozen}}")
            return super().execute(requests)
""")
WARM = 10  # requests first (metric children, caches)
QUIET_S = 6.5  # past the predict model's hold of its forwards' iterators (LetGoLater, 5 s, let go each second)
MEASURED = 60  # requests between the two counted ones, one at a time
MAX_GROWTH_PER_REQUEST = 1.0  # objects; a cycle per request leaves its ticket, future, reply, request, ...


def test_a_finished_request_leaves_no_reference_cycle_in_either_models_stub(tmp_path):
    from cube3d_client import Cube3DClient
    from cubeserve import deploy
    from cubeserve.checkpoint import write_random_weights
    from cubeserve.server.local_triton import copy_model_repository

    repo = copy_model_repository(tmp_path / "models")
    write_random_weights("tiny", repo / deploy.STREAM_MODEL / "1" / "weights", seed=0)
    for name, module, cls in ((deploy.STREAM_MODEL, "cubeserve.serving.triton_engine", "EngineModel"),
                              (deploy.PREDICT_MODEL, "cubeserve.serving.triton_predict", "PredictModel")):
        (repo / name / "1" / "model.py").write_text(WATCHED_PY.format(module=module, cls=cls, name=name))
    log = tmp_path / "tritonserver.log"
    with LocalTriton(repo, free_port(), free_port(), free_port(), log_path=log) as server, \
            Cube3DClient(server.http_url, "http") as http, Cube3DClient(server.grpc_url, "grpc") as grpc:
        clients = (http, grpc)
        counted = []  # the requests whose counts are compared: each after a pause, with nothing held
        for i in range(WARM + 1 + MEASURED + 1):
            if i in (WARM, WARM + 1 + MEASURED):
                time.sleep(QUIET_S)
                counted.append(i)
            clients[i % 2].generate(f"object {i % 7}", resolution=4)
    text = log.read_text(errors="replace")
    for name in (deploy.STREAM_MODEL, deploy.PREDICT_MODEL):
        # one execute a request: one at a time, each model gets each request alone
        alive = [int(n) for n in re.findall(rf"ALIVE {re.escape(name)} (\d+)", text)]
        assert len(alive) == WARM + MEASURED + 2, f"{name}: {len(alive)} executes logged for {WARM + MEASURED + 2} requests"
        first, last = (alive[i] for i in counted)
        assert (last - first) / (MEASURED + 1) < MAX_GROWTH_PER_REQUEST, (
            f"{name}'s stub: {first} -> {last} objects of the request path alive over {MEASURED} requests: "
            "a reference cycle per request")
    frozen = re.search(rf"ALIVE {deploy.STREAM_MODEL} \d+ FROZEN (\d+)", text)
    assert int(frozen.group(1)) > 100_000, "the engine model left its start-up objects in the collector's count"
