# cube-serve. `make demo` and `make test` work on a fresh machine: they create .venv and
# install what they need (torch from the CPU wheel `torch==2.13.0`).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= a round table
CHECKPOINT ?=
STORE ?= outputs/model_store

.PHONY: install test serve demo demo-model bench load k8s image pipeline pipelines clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test]"  # includes the Triton server wheel and its client
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -q

# The local Triton server on 127.0.0.1 (REST 8000, gRPC 8001, metrics 8002) with triton_models/;
# tiny random demo weights are written into the version directories on first use.
serve: install
	$(VENV)/bin/cubeserve serve

# Starts the server, generates through the client, writes outputs/demo.glb and outputs/demo.png,
# prints the timings and stops the server.
demo: install
	$(VENV)/bin/cubeserve demo --prompt "$(PROMPT)" --out outputs/demo.glb

# Retrain the shipped demo model (models/demo) from scratch on procedural shapes: ~19 minutes on
# two CPU cores; resumes from outputs/demo-train if stopped. Writes its MODEL_CARD.md.
demo-model: install
	$(VENV)/bin/cubeserve train all --work-dir outputs/demo-train --out models/demo

# Benchmarks on whatever device is present: BENCHMARKS.md tables and bench/results.json.
bench: install
	$(PY) -m bench

# Load and soak test of the local server: CLIENTS threads for DURATION seconds over REST, gRPC and
# the gRPC stream, every result checked; fails on a lost or wrong result or on server memory growth.
# Writes BENCHMARKS.md's load section.
CLIENTS ?= 64
DURATION ?= 600
load: install
	$(PY) -m bench.load --clients $(CLIENTS) --duration $(DURATION)

# Render every KServe overlay with kubectl kustomize; check the manifests and `cubeserve rollout`.
k8s: install
	$(PY) -m pytest -q tests/test_k8s.py tests/test_rollout.py

# Compile every Kubeflow pipeline to the YAML beside it (upload that file in the Kubeflow UI).
pipelines: install
	$(PY) -m kfp_pipelines.compile

# Run the checkpoint pipeline locally with kfp.local: registry and model store on disk.
pipeline: install
	test -n "$(CHECKPOINT)" || (echo "usage: make pipeline CHECKPOINT=DIR [STORE=DIR]"; exit 1)
	$(PY) -m kfp_pipelines.run_local --checkpoint $(CHECKPOINT) --store $(STORE)

# The runtime image (needs a docker engine; none runs on this project's machines).
IMAGE ?= registry.example.com/cube-serve:0.1.0
image:
	docker build -f k8s/Dockerfile -t $(IMAGE) .

clean:
	rm -rf outputs triton_models/*/[0-9]*/weights
