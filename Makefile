# cube-serve. `make demo` and `make test` work on a fresh machine: they create .venv and install
# what they need, in two steps. `make demo` and `make serve`: `torch==2.13.0` from PyPI (on Linux
# x86-64 the CUDA build, which also runs without a GPU), less its compiler `triton`, and the `serve`
# extra, the Triton server wheel and its client: about 4.7 GB in .venv. `make test` and the other
# targets add the `test` extra (and `triton`): about 7.3 GB in all (README.md).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= a round table
CHECKPOINT ?=

.PHONY: install install-demo test serve gateway demo demo-model bench bench-batch load k8s image image-test pipeline pipelines clean docs

# Two steps, each with its stamp: what the server and the demo need (install-demo), then what the
# tests and the other targets need (install). A .venv from `make demo` gets only the rest at its
# first `make test`. A plain `make` installs both.
.DEFAULT_GOAL := install
$(VENV)/.installed-serve: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[serve]"  # the Triton server wheel and its client
	touch $@

# `make demo` and `make serve` leave out torch's kernel compiler for torch.compile (the `triton`
# package, 0.7 GB), which neither uses: torch imports and runs eagerly without it, as its wheels
# for other platforms do (they have none). The test step puts it back (pip installs torch's
# requirements); a .venv that has had that step keeps it.
$(VENV)/.installed-demo: $(VENV)/.installed-serve
	test -e $(VENV)/.installed-test || $(PY) -m pip uninstall -y -q triton
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed-serve
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install-demo: $(VENV)/.installed-demo
install: $(VENV)/.installed-test

# Two workers (pytest-xdist), a test file each at a time: much of the suite waits on servers,
# builds and downloads. The image build is `make image-test`, the cluster tests `make cluster-test`
# (each marker left out here has its target, which .ci/run runs: tests/test_ci_targets.py).
TEST_WORKERS ?= 2
test: install
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not image and not cluster and not gateway_e2e and not scale and not soak and not node and not autoscaling" --durations=30  # the slowest 30, to keep the suite within its time

# The local Triton server on 127.0.0.1 (REST 8000, gRPC 8001, metrics 8002) with triton_models/;
# the demo model is copied into the version directories on first use. Other ports:
# make serve PORT=8100 [GRPC_PORT=8101] [METRICS_PORT=8102] (a port in use is named at start).
PORT ?=
GRPC_PORT ?=
METRICS_PORT ?=
serve: install-demo
	$(VENV)/bin/cubeserve serve $(if $(PORT),--http-port $(PORT)) $(if $(GRPC_PORT),--grpc-port $(GRPC_PORT)) $(if $(METRICS_PORT),--metrics-port $(METRICS_PORT))

# Envoy on 127.0.0.1:8080 in front of `make serve`'s server: API keys, quotas in shape tokens,
# balancing; tenants and keys from GATEWAY_CONFIG (docs/gateway/index.md). Meter the tenants by
# starting the server with CUBE3D_TENANTS=team-a,team-b.
GATEWAY_CONFIG ?= examples/gateway.yaml
gateway: install
	$(VENV)/bin/cubeserve gateway --config $(GATEWAY_CONFIG)

# Starts the server, generates through the client, writes outputs/demo.glb and outputs/demo.png,
# prints the timings and stops the server.
demo: install-demo
	$(VENV)/bin/cubeserve demo --prompt "$(PROMPT)" --out outputs/demo.glb

# Retrain the shipped demo model (models/demo) from scratch on procedural shapes: ~19 minutes on
# two CPU cores; resumes from outputs/demo-train if stopped. Writes its MODEL_CARD.md.
demo-model: install
	$(VENV)/bin/cubeserve train all --work-dir outputs/demo-train --out models/demo

# Benchmarks on whatever device is present: BENCHMARKS.md tables and bench/results.json.
bench: install
	$(PY) -m bench

# The batch pipeline (`cubeserve batch` on an embedded Ray) against the in-process engine's loop:
# 200 prompts of the demo model, 1 and 2 decode actors. Writes BENCHMARKS.md's batch section.
bench-batch: install
	$(PY) -m bench.batch --rows 200

# Load and soak test of the local server: CLIENTS threads for DURATION seconds over REST, gRPC and
# the gRPC stream, every result checked; fails on a lost or wrong result or on server memory growth.
# Writes BENCHMARKS.md's load section.
CLIENTS ?= 64
DURATION ?= 600
load: install
	$(PY) -m bench.load --clients $(CLIENTS) --duration $(DURATION)

# The documentation site (mkdocs.yml: docs/, the reference generated from the code, the plots from
# bench/results.json) into outputs/site, warnings as errors. tests/test_docs.py builds it too.
# The variables silence two plugins' banners about MkDocs' future, printed on every build.
docs: install
	NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true $(VENV)/bin/mkdocs build --strict

# Render every KServe overlay with kubectl kustomize; check the manifests and `cubeserve rollout`.
k8s: install
	$(PY) -m pytest -q tests/test_k8s.py tests/test_rollout.py

# Compile the pipelines for your runtime image: outputs/cube3d-checkpoint-rollout.yaml and
# outputs/cube3d-batch-generate.yaml, the files to upload in the Kubeflow UI. IMAGE is the image
# `make image` built and you pushed.
pipelines: install
	test -n "$(IMAGE)" || (echo "usage: make pipelines IMAGE=REGISTRY/cube-serve:TAG"; exit 1)
	$(PY) -m kfp_pipelines.compile --image $(IMAGE)

# Run the checkpoint pipeline on this machine as a Kubeflow cluster runs it: an S3 server, the
# MLflow server and a tritonserver as local processes (their data in PIPELINE_STATE, so the next
# run finds this one's champion), every step in its own empty folder. PARAMS: e.g.
# PARAMS="--param min_token_agreement=0.9".
PIPELINE_STATE ?= outputs/pipeline
PARAMS ?=
pipeline: install
	test -n "$(CHECKPOINT)" || (echo "usage: make pipeline CHECKPOINT=DIR [PARAMS=...]"; exit 1)
	$(PY) -m kfp_pipelines.run_local --checkpoint $(CHECKPOINT) --state $(PIPELINE_STATE) $(PARAMS)

# The runtime image, built from the repository root with docker where a docker daemon answers,
# with podman (no daemon) otherwise or with ENGINE=podman. Either pulls nvcr.io/nvidia/tritonserver,
# which this project's machines cannot reach (`make image-test` builds it here on a local base):
# make image IMAGE=REGISTRY/cube-serve:TAG [ENGINE=docker|podman]
IMAGE ?=
ENGINE ?= $(shell docker info >/dev/null 2>&1 && echo docker || echo podman)
image:
	test -n "$(IMAGE)" || (echo "usage: make image IMAGE=REGISTRY/cube-serve:TAG [ENGINE=docker|podman]"; exit 1)
	$(ENGINE) build -f k8s/Dockerfile -t $(IMAGE) .

# Build k8s/Dockerfile here with podman (as root) on a Debian base made with debootstrap in place
# of Triton's, run every pipeline step's imports in the result, and check the image's Python's
# dependency resolution: tests/test_image.py (installs podman and debootstrap when missing).
image-test: install
	$(PY) -m pytest -q -m image tests/test_image.py

clean:
	rm -rf outputs triton_models/*/[0-9]*/weights

# The gateway's heavier end-to-end tests (marker `gateway_e2e`; not part of `make test`): a region
# flapping under load, one request's trace through every hop (docs/gateway/regions-models-traces.md).
# The trace backend they send spans to: Jaeger v2, built from Go modules like the control plane
# below (cluster/go/jaeger-*), cached in the same folder.
.PHONY: gateway-e2e-test trace-backend
trace-backend:
	nice -n 10 $(PYTHON) cluster/build.py trace-backend
gateway-e2e-test: install trace-backend
	$(PY) -m pytest -q -m gateway_e2e tests/test_gateway_regions.py

# Autoscaling's signal end to end (marker `scale`; not part of `make test`): two real servers and a
# real Prometheus under a stepped load, the KEDA query and the replica count it gives, a replica
# drained away under load (docs/deploy/autoscaling.md); and a rollout replacing a server, billed
# in full by `cubeserve usage` (tests/test_usage.py, about 40 s). About 2 minutes on 2 cores.
.PHONY: scale-test
scale-test: install
	$(PY) -m pytest -q -m scale tests/test_autoscaling.py tests/test_usage.py

# The real autoscaling controllers (docs/development.md, "Autoscaling tests"): KEDA's operator and
# metrics adapter and Knative Serving's controller and webhook, built from Go modules like the
# control plane; then (marker `autoscaling`; not part of `make test`) KServe's ScaledObject, KEDA's
# HPA and kube-controller-manager's HPA controller scaling the predictor's Deployment on two real
# servers' load (tests/test_keda.py), and the Serverless overlay as real Knative revisions
# (tests/test_knative.py).
.PHONY: autoscaling autoscaling-test
autoscaling: control-plane
	nice -n 10 $(PYTHON) cluster/build.py autoscaling
autoscaling-test: install autoscaling
	$(PY) -m pytest -q -m autoscaling tests/test_keda.py tests/test_knative.py -s

# The soak (marker `soak`; not part of `make test`): 16 clients through the predict model, REST and
# gRPC, for SOAK_S seconds; fails on a lost or wrong answer or any python backend stub crash.
SOAK_S ?= 600
.PHONY: soak-test
soak-test: install
	CUBESERVE_SOAK_S=$(SOAK_S) $(PY) -m pytest -q -m soak tests/test_soak.py -s

# A real Kubernetes control plane for the cluster tests, built from Go modules with the machine's Go
# (docs/development.md, "Cluster tests"): kube-apiserver, -controller-manager, -scheduler, etcd, KWOK and KServe's
# manager per release, into $CUBESERVE_CONTROL_PLANE_CACHE (default ~/.cache/cube-serve/control-plane);
# what is built already is skipped.
.PHONY: control-plane cluster-test
control-plane:
	nice -n 10 $(PYTHON) cluster/build.py control-plane

# The manifests and `cubeserve rollout` against that control plane and KServe's own controller
# (tests/test_cluster.py, marker `cluster`; not part of `make test`).
cluster-test: install control-plane
	$(PY) -m pytest -q -m cluster tests/test_cluster.py --durations=10

# A real node (docs/development.md, "Node tests"): kubelet and kube-proxy (k8s.io/kubernetes, with a
# patch that leaves the machine's kernel settings alone), containerd, runc (cgo and libseccomp:
# Debian's libseccomp-dev) and the CNI plugins, built like the control plane into the same cache.
.PHONY: node node-test
node: control-plane
	nice -n 10 $(PYTHON) cluster/build.py node

# The runtime image as the pods KServe creates, on that node (tests/test_node.py, marker `node`; not
# part of `make test`): the images built first (podman; their pip installs need the package index),
# then the whole run in a network and mount namespace of its own (tests/netns.py), as root.
node-test: install node
	$(PY) tests/node_stack.py images
	$(PYTHON) tests/netns.py -- $(PY) -m pytest -q -m node tests/test_node.py --durations=10
