"""CUDA-only behaviour: captured decode graphs produce the eager path's tokens (with float weights
and with weight-only int8/int4 and fp8), a runner steps on its own device from any thread, bfloat16
serving, Warp's marching cubes on the device, and the engine model as a Triton KIND_GPU instance.
Skipped, with the reason, where no CUDA device is present; bench/gpu_check.sh runs them on the
GPU machine.

What only a GPU proves. tests/test_runner_device.py holds the runner to torch.cuda's semantics
with a stand-in (tests/fake_cuda.py): capture runs nothing and a replay re-runs the captured
operations on the captured tensors (a buffer rebound after capture is stale), streams are ordered
only by wait_stream or the host waiting (else a race is raised), events are done when the device
has done the work and time it, a host synchronisation while capturing is refused. It records
aten operations on the CPU, in order, on one thread, so these are left to this module:
- real capture: that what a replay runs is what the eager step computes on the device: kernels
  that allocate, initialise lazily or pick a workspace during capture, graph-unsafe operations
  the stand-in does not know of (a copy between host and device inside a step, RNG offsets);
- memory pools: graphs sharing one pool (largest captured first) overwrite neither each other's
  memory nor the runner's live buffers, and replays allocate nothing;
- numerics: cuBLAS and bfloat16 rounding, rounding that changes with the batch shape, and the
  attention kernels really chosen under the pinned backends (cuDNN left out);
- stream concurrency: a device that really runs behind the host, overlap with other streams,
  event timings of real kernels, and a runner stepped from another thread (the stand-in's
  dispatch modes see one thread's operations);
- devices: cuda:1 is a label to the stand-in; here a runner binds to a real device;
- Warp's marching cubes on a CUDA grid (where the machine has NVIDIA Warp);
- the engine model as a Triton KIND_GPU instance: Triton gives the python backend its GPU, the
  stub's torch has CUDA, the engine decodes there with its graphs (where the machine has
  Triton, the nvidia-pytriton wheel)."""

import json
import urllib.request

import pytest
import torch

from cubeserve.config import TINY
from cubeserve.engine import Engine, fast_paths
from cubeserve.engine import GenerationRequest as Req
from cubeserve.engine.scheduler import Scheduler

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")

REQUESTS = [Req("a red chair"), Req("a lamp", top_p=0.9, seed=3), Req("a boat", guidance_scale=1.0),
            Req("", temperature=0.8, seed=9), Req("a mug", guidance_scale=0.0)]


@pytest.fixture(scope="module", params=["reference", "causal"])
def cuda_engine(tiny_weights, request):
    return Engine.from_dir(tiny_weights, device="cuda", dtype="float32", single_block_mode=request.param)


def test_graph_steps_equal_eager_steps(cuda_engine):
    eager = cuda_engine.generate_tokens(REQUESTS)
    pool = cuda_engine.decode_runner(max_objects=8, graph_buckets=(1, 2, 4, 8))
    pool.admit(REQUESTS)
    for _ in range(cuda_engine.cfg.num_tokens):
        pool.step()
    assert torch.equal(pool.tokens[: len(REQUESTS)], eager)


def test_graphs_with_requests_joining_mid_generation(cuda_engine, run_steps):
    alone = [cuda_engine.generate_tokens([r])[0] for r in REQUESTS[:3]]
    pool = cuda_engine.decode_runner(max_objects=4, graph_buckets=(1, 2, 4))
    done = {}
    pool.admit([REQUESTS[0]])
    run_steps(pool, 7, done)
    pool.admit(REQUESTS[1:3])
    run_steps(pool, 3 * cuda_engine.cfg.num_tokens, done)
    for slot, expected in enumerate(alone):
        assert torch.equal(done[slot], expected)


@pytest.mark.parametrize("window", [4, 16])
def test_window_decoding_on_the_gpu_gives_the_eager_tokens_without_graphs(cuda_engine, run_steps, window):
    """decode_window > 1 runs eagerly (graph buckets ignored) with cuBLAS's shapes of T positions
    per row: the tokens of one token per step, slots joining mid-generation."""
    alone = [cuda_engine.generate_tokens([r])[0] for r in REQUESTS]
    pool = cuda_engine.decode_runner(max_objects=8, graph_buckets=(1, 2, 4, 8), window=window)
    assert not pool.graphs
    done = {}
    pool.admit(REQUESTS[:2])
    run_steps(pool, 3, done)
    pool.admit(REQUESTS[2:])
    run_steps(pool, 3 * cuda_engine.cfg.num_tokens, done)
    for slot, expected in enumerate(alone):
        assert torch.equal(done[slot], expected)


def test_a_runner_steps_on_its_own_device_from_any_thread_two_steps_ahead_timed_by_events(cuda_engine):
    """A runner built for cuda:0, stepped from a fresh thread (as the scheduler's): its graphs
    replay there, the host never runs more than two steps ahead, and step times are device times."""
    import threading

    from cubeserve.engine.runner import MAX_STEPS_IN_FLIGHT

    eager = cuda_engine.generate_tokens(REQUESTS[:2])
    pool = cuda_engine.decode_runner(max_objects=2, graph_buckets=(2,))
    assert len(pool.graphs) == 2 * len(pool.length_buckets)  # sampling and greedy-only per bucket
    seen = []

    def decode():
        pool.admit(REQUESTS[:2])
        for _ in range(cuda_engine.cfg.num_tokens):
            pool.step()
            seen.append(len(pool._in_flight))

    thread = threading.Thread(target=decode)
    thread.start()
    thread.join(120)
    assert max(seen) == MAX_STEPS_IN_FLIGHT and 0 < pool.last_step_seconds < 1
    assert torch.equal(torch.stack([pool.tokens_of(0), pool.tokens_of(1)]), eager.cpu())


def test_bfloat16_scheduler_with_graphs_serves_concurrent_requests(tiny_weights, float32_shortfall):
    """bfloat16 tokens may part from float32's at a near-tie (and batch shapes change cuBLAS's
    rounding); what must hold is that every token is float32's best choice given the tokens
    before it: a wrong row, slot or condition would fall far short."""
    engine = Engine.from_dir(tiny_weights, device="cuda", dtype="bfloat16")
    prompts = ["a red chair", "a lamp", "a boat", "a mug", "a wooden table", "a sports car", "a dragon", ""]
    reqs = [Req(p, resolution=5, guidance_scale=0.0 if i % 4 == 3 else 3.0) for i, p in enumerate(prompts)]
    with Scheduler(engine, max_objects=8) as sched:
        assert sched.runner.graphs
        results = [t.result(timeout=120) for t in [sched.submit(r) for r in reqs]]
    assert all(not r.mesh.empty and len(r.tokens) == engine.cfg.num_tokens for r in results)
    for r, res in zip(reqs, results):
        assert float32_shortfall(r, res.tokens) < float32_shortfall.bfloat16_bound, r.prompt


def test_warp_marching_cubes_on_the_gpu_gives_the_cpu_mesh():
    """A CUDA grid meshes with Warp on the device (where the `gpu` extra is installed)."""
    import numpy as np

    from cubeserve.engine import geometry

    if geometry.marching_cubes_backend(torch.zeros(1, device="cuda")) != "warp":
        pytest.skip("NVIDIA Warp is not installed (pip install 'cubeserve[gpu]')")
    r = 6
    n = geometry.grid_size(r)
    p = geometry.grid_points(r, device="cuda")
    grid = (0.6 - (p * torch.tensor([1.0, 1.3, 0.8], device="cuda")).norm(dim=-1)).view(n, n, n)
    gpu = geometry.marching_cubes(grid, r)
    cpu = geometry.marching_cubes(grid.cpu(), r)
    assert len(gpu.faces) == len(cpu.faces) > 0
    key = lambda v: v[np.lexsort(np.round(v, 5).T[::-1])]  # noqa: E731
    np.testing.assert_allclose(key(gpu.vertices), key(cpu.vertices), rtol=0, atol=3e-5)


def assert_graphs_replay_eager(engine) -> None:
    """The decode steps captured in CUDA graphs make the eager step's tokens."""
    eager = engine.generate_tokens(REQUESTS)
    pool = engine.decode_runner(max_objects=8, graph_buckets=(1, 2, 4, 8))
    assert pool.graphs
    pool.admit(REQUESTS)
    for _ in range(engine.cfg.num_tokens):
        pool.step()
    assert torch.equal(pool.tokens[: len(REQUESTS)], eager)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_weights_capture_into_the_decode_graphs(tiny_weights, quantization):
    """The weight-only kernels on CUDA (int8: _weight_int8pack_mm; int4: tinygemm) run inside
    the captured decode graphs and replay what the eager quantized step computes."""
    engine = Engine.from_dir(tiny_weights, device="cuda", dtype="bfloat16", quantization=quantization)
    assert_graphs_replay_eager(engine)


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="fp8's kernel (torch._scaled_mm) needs compute capability 8.9 (Ada, Hopper)")
def test_fp8_captures_into_the_decode_graphs(tiny_weights, monkeypatch):
    """fp8 on a GPU with fp8 tensor cores: every quantized product is `torch._scaled_mm` (rowwise
    scales, the activations quantized on the device), it runs inside the captured decode graphs
    and replays what the eager fp8 step computes; and one layer's kernel product is the CPU's
    emulation of it, up to bf16 rounding of a different summation order."""
    from cubeserve.engine.fast_paths import Fp8Linear

    engine = Engine.from_dir(tiny_weights, device="cuda", dtype="bfloat16", quantization="fp8")
    layers = [m for m in engine.gpt.modules() if isinstance(m, Fp8Linear)]
    assert layers and all(m.native for m in layers)
    assert_graphs_replay_eager(engine)

    torch.manual_seed(0)
    weight, x = torch.randn(50, 72, device="cuda"), torch.randn(5, 72, device="cuda")  # padded to 64 x 80
    native = Fp8Linear(weight, None)
    monkeypatch.setattr(fast_paths, "fp8_native", lambda device: False)
    emulated = Fp8Linear(weight, None)
    assert native.native and not emulated.native
    torch.testing.assert_close(native(x), emulated(x), rtol=1e-2, atol=1e-2)


def serve_one(weights, tmp_path, instance_kind: str, request: Req) -> tuple[dict, str]:
    """One request to the predict model `cube3d` of a one-version repository built as a pod's
    (cubeserve.serving.repository, `instance_kind` "gpu": the engine model a KIND_GPU instance
    on GPU 0), served by a local Triton: the outputs by name, and the server's log."""
    from cubeserve.server.local_triton import LocalTriton, free_port, tritonserver_home
    from cubeserve.serving.repository import build_version_repository

    try:
        tritonserver_home()
    except RuntimeError as exc:
        pytest.skip(f"no Triton on this machine: {exc}")
    repo = build_version_repository(weights, 1, tmp_path / "repo", instance_kind=instance_kind)
    triton = LocalTriton(repo, free_port(), free_port(), free_port(), log_path=tmp_path / "tritonserver.log")
    body = {"inputs": [{"name": "PROMPT", "shape": [1], "datatype": "BYTES", "data": [request.prompt]},
                       {"name": "RESOLUTION", "shape": [1], "datatype": "INT32", "data": [request.resolution]},
                       {"name": "FORMAT", "shape": [1], "datatype": "BYTES", "data": ["obj"]}],
            "outputs": [{"name": "SHAPE_TOKENS"}, {"name": "NUM_FACES"}, {"name": "MODEL_VERSION"}]}
    try:
        triton.start(timeout=80)
        call = urllib.request.Request(f"http://{triton.http_url}/v2/models/cube3d/versions/1/infer",
                                      data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(call, timeout=60).read())
    finally:
        triton.stop()
    return {o["name"]: o["data"] for o in reply["outputs"]}, triton.log_path.read_text(errors="replace")


def test_the_engine_model_as_a_triton_kind_gpu_instance_decodes_on_its_gpu(tiny_weights, tmp_path,
                                                                            float32_shortfall):
    """The repository a GPU pod serves: Triton gives the engine model's KIND_GPU instance GPU 0,
    the engine decodes there in bfloat16 (with its graphs: cuda_graphs auto), and every token is
    float32's best choice given those before it."""
    request = Req("a red chair", resolution=4)
    outputs, log = serve_one(tiny_weights, tmp_path, "gpu", request)
    assert "kind: KIND_GPU" in (tmp_path / "repo" / "cube3d_stream" / "config.pbtxt").read_text()
    assert "cube3d engine ready" in log and " on cuda:0 (bfloat16)" in log, log[-3000:]
    tokens = outputs["SHAPE_TOKENS"]
    assert outputs["MODEL_VERSION"] == ["1"] and outputs["NUM_FACES"][0] > 0
    assert len(tokens) == TINY.num_tokens
    assert float32_shortfall(request, tokens) < float32_shortfall.bfloat16_bound
