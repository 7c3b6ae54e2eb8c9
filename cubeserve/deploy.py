"""The one place that says how tritonserver runs in a cluster: ports, health paths, where the
model repository is, and the server's command line.

`k8s/` (the ServingRuntime, the probes, the Prometheus annotations), `k8s/Dockerfile` (its CMD)
and the client's defaults must agree with these values; tests/test_k8s.py holds them to it, so a
port or a flag changes here first and the YAML follows.
"""

from __future__ import annotations

# Triton's own defaults, also used by `cubeserve serve` and `cube3d-client` on a laptop.
HTTP_PORT = 8000  # REST: the KServe predict API (Open Inference Protocol v2) and generate_stream
GRPC_PORT = 8001  # gRPC: ModelInfer and the decoupled stream
METRICS_PORT = 8002  # Prometheus text format

READY_PATH = "/v2/health/ready"  # 200 once every model in the repository is loaded
LIVE_PATH = "/v2/health/live"  # 200 while the server process is healthy
METRICS_PATH = "/metrics"

# The two models of triton_models/ (see README, "Serving through Triton").
PREDICT_MODEL = "cube3d"
STREAM_MODEL = "cube3d_stream"

# KServe's storage initializer downloads `storageUri` here (or mounts a pvc:// there).
KSERVE_MODEL_DIR = "/mnt/models"
# The runtime image keeps the repository's code and the demo checkpoint (models/demo) here
# (k8s/Dockerfile); the CPU overlay serves it without any storage.
IMAGE_MODEL_REPOSITORY = "/opt/cube-serve/triton_models"
# Non-root user of the runtime image; numeric so that Kubernetes can check runAsNonRoot.
IMAGE_UID = 10001

# Flags every tritonserver of this project runs with, here and on a laptop: the config.pbtxt
# files are complete, so Triton must not rewrite them from what model.py reports.
COMMON_FLAGS = ("--disable-auto-complete-config",)


def tritonserver_args(model_repository: str = KSERVE_MODEL_DIR) -> list[str]:
    """The server's arguments in a container (after the `tritonserver` executable).

    It listens on all interfaces of the pod (Triton's default address); the ports are Triton's
    defaults written out, because the probes, the Service and the Prometheus annotations name them.
    """
    return [
        f"--model-store={model_repository}",
        f"--http-port={HTTP_PORT}",
        f"--grpc-port={GRPC_PORT}",
        f"--metrics-port={METRICS_PORT}",
        "--allow-http=true",
        "--allow-grpc=true",
        "--allow-metrics=true",
        *COMMON_FLAGS,
    ]


# tritonserver runs under cubeserve's supervisor (cubeserve/serving/supervisor.py): when a python
# backend stub dies, Triton keeps answering ready while the model fails every request; the
# supervisor stops the server (readiness fails at once) and exits, and the kubelet restarts the
# container.
SUPERVISOR = ["python3", "-m", "cubeserve.serving.supervisor", "--on-fault", "exit", "--"]


def server_command(model_repository: str = KSERVE_MODEL_DIR) -> list[str]:
    """The container's full command line: what the ServingRuntime's `args` and the image's CMD say
    (the NGC image's entrypoint script runs it)."""
    return [*SUPERVISOR, "tritonserver", *tritonserver_args(model_repository)]
