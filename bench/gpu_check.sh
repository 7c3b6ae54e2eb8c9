#!/usr/bin/env bash
# The GPU check, in one go: the CUDA tests, then the engine benchmark with the full v0.1 and
# v0.5 shapes (random weights have the real cost). Runs from the repository root with the
# GPU machine's own python3 (torch with CUDA, transformers, safetensors, scikit-image; no
# install step), e.g.:   bash bench/gpu_check.sh        (copy BENCHMARKS.md back afterwards)
# Sized for about 6 minutes on an H200 including graph capture.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD:$PWD/client${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1
OUT=${OUT:-outputs/gpu}
mkdir -p "$OUT"
python3 - <<'PY' | tee "$OUT/device.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
PY
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_engine.py tests/test_sampling.py 2>&1 | tail -20 | tee "$OUT/tests.txt"
timeout 330 python3 -m bench --only engine 2>&1 | grep -v "it/s" | tee "$OUT/bench.txt"
cp BENCHMARKS.md bench/results.json "$OUT/" 2>/dev/null
