#!/usr/bin/env bash
# The GPU check, in one go: a preflight of the decode step (~20 s), the CUDA tests, then the
# engine benchmark with the full v0.1 and v0.5 shapes (random weights have the real cost), and one
# replica's capacity under concurrent clients. The
# CUDA tests (tests/test_cuda.py, whose docstring lists what only a GPU proves) include Warp's
# marching cubes on the device where Warp is installed and the engine model as a Triton KIND_GPU
# instance where nvidia-pytriton is (each skips, with the reason, where it is not); the runner's
# tests against the torch.cuda stand-in (tests/test_runner_device.py) run here too. Runs
# from the repository root with the GPU machine's own python3 (torch with CUDA, transformers,
# safetensors, scikit-image; no install step), e.g.:   bash bench/gpu_check.sh
# (copy BENCHMARKS.md back afterwards). Each part has its own time limit and a failure in one
# does not stop the next: every figure that can be had comes back. Exit status: 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD:$PWD/client${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1
OUT=${OUT:-outputs/gpu}
mkdir -p "$OUT"
status=0
python3 - <<'PY' | tee "$OUT/device.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
PY
timeout 90 python3 -m bench.cuda_preflight 2>&1 | tee "$OUT/preflight.txt" || status=1
# -x: the first failure is the one to read; pytest-timeout only where the machine has it.
per_test=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout=90")
# Each skip's reason (no Warp, no Triton) is in tests.txt (pyproject's -ra). 90 + 200 + 330 s at most.
# test_cuda.py last: its Triton KIND_GPU test may fail on a server without GPU support, and -x
# would then stop the rest.
timeout 200 python3 -m pytest -x -q -p no:cacheprovider $per_test \
    tests/test_runner_device.py tests/test_engine.py tests/test_sampling.py tests/test_cuda.py 2>&1 \
    | tail -30 | tee "$OUT/tests.txt" || status=1
timeout 330 python3 -m bench --only engine 2>&1 | grep -v "it/s" | tee "$OUT/bench.txt" || status=1
# One replica's capacity (the autoscaling target, cubeserve.deploy.SCALE_TARGET): the engine's
# scheduler with the v0.1 shapes under 1, 4, 8 and 16 closed-loop clients (no tritonserver here),
# 15 s a step: under 2 minutes, so the whole check stays within about 12.5 minutes at worst.
timeout 120 python3 -m bench.capacity --engine v0.1 --steps 1,4,8,16 --seconds 15 2>&1 | tee "$OUT/capacity.txt" || status=1
cp BENCHMARKS.md bench/results.json "$OUT/" 2>/dev/null
exit $status
