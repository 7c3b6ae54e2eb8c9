"""The one place that says how tritonserver runs in a cluster: ports, health paths, where the
model repository is, and the server's command line.

`k8s/` (the ServingRuntime, the probes, the Prometheus annotations), `k8s/Dockerfile` (its CMD)
and the client's defaults must agree with these values; tests/test_k8s.py holds them to it, so a
port or a flag changes here first and the YAML follows.
"""

from __future__ import annotations

import re
import secrets

# Triton's own defaults, also used by `cubeserve serve` and `cube3d-client` on a laptop.
HTTP_PORT = 8000  # REST: the KServe predict API (Open Inference Protocol v2) and generate_stream
GRPC_PORT = 8001  # gRPC: ModelInfer and the decoupled stream
METRICS_PORT = 8002  # Prometheus text format
# tritonserver's own REST and gRPC endpoints, on the loopback only: clients reach HTTP_PORT and
# GRPC_PORT, where the supervisor's front ends (server/front.py, server/grpc_front.py) check
# every request and forward it here.
TRITON_HTTP_PORT = 8010
TRITON_GRPC_PORT = 8011

READY_PATH = "/v2/health/ready"  # 200 once every model in the repository is loaded
LIVE_PATH = "/v2/health/live"  # 200 while the server process is healthy
METRICS_PATH = "/metrics"

# The two models of triton_models/ (docs/serving/api.md).
PREDICT_MODEL = "cube3d"
STREAM_MODEL = "cube3d_stream"

# KServe's storage initializer downloads `storageUri` here (or mounts a pvc:// there).
KSERVE_MODEL_DIR = "/mnt/models"
# The runtime image keeps the repository's code and the demo checkpoint (models/demo) here
# (k8s/Dockerfile); the CPU overlay serves it without any storage.
IMAGE_MODEL_REPOSITORY = "/opt/cube-serve/triton_models"
# Non-root user of the runtime image; numeric so that Kubernetes can check runAsNonRoot.
IMAGE_UID = 10001

# Seconds a request may take end to end: the InferenceService predictor's `timeout` (KServe
# makes it the Knative revision's timeoutSeconds, or the HTTPRoute's timeout; a plain Ingress
# needs its controller's own setting: docs/deploy/draining.md). A large mesh at high resolution is slow.
REQUEST_TIMEOUT_S = 600
# What a client's connection gets, on the front ends (server/front.py, server/grpc_front.py) and
# at the gateway (gateway/envoy.py, k8s/gateway/clienttrafficpolicy.yaml), so that silent and
# slow connections cannot hold the connection caps (docs/security.md, "Timeouts"):
# - HEADER_TIMEOUT_S: to send the first byte and the whole request head (or, on gRPC, the
#   connection's preface), from the connection's opening (or the previous answer's end);
# - IDLE_TIMEOUT_S: a connection, or a gRPC stream, with no request in progress is closed after
#   this long (the REST front end: HEADER_TIMEOUT_S, aiohttp has one timer for both);
# - BODY_TIMEOUT_S: to send the whole request (a body is at most MAX_REQUEST_BYTES);
# none of them runs while an answer is awaited: a generation has REQUEST_TIMEOUT_S.
HEADER_TIMEOUT_S = 10
IDLE_TIMEOUT_S = 60
BODY_TIMEOUT_S = 60
# Triton's --exit-timeout-secs (its default is 30): how long tritonserver, once signalled, waits
# for open HTTP connections and then for the requests in flight before it exits and cuts them.
# As long as a request may take, so that a SIGTERM without a drain first (Serverless mode, where
# Knative's queue-proxy drains, `docker stop`, Ctrl-C) cuts nothing a client still waits for.
EXIT_TIMEOUT_S = REQUEST_TIMEOUT_S

# Request headers that tritonserver hands to the models as request parameters: the experiment's
# user key and arm pin (cubeserve/serving/experiment.py). HTTP keeps the header's case as sent
# (RE2, case-insensitive here); gRPC metadata keys are lowercase.
HTTP_HEADER_FORWARD_PATTERN = "(?i)^x-cube3d-"
GRPC_HEADER_FORWARD_PATTERN = "^x-cube3d-"

# -- the admin surface (docs/security.md) ------------------------------------------------------
# Triton's APIs that only an operator may call: over HTTP and gRPC alike, tritonserver refuses
# them without the header ADMIN_HEADER carrying the admin key (--http-restricted-api,
# --grpc-restricted-protocol), and so does the front end. Health, metadata, model config and
# inference stay open (probes and every client need them).
RESTRICTED_APIS = ("shared-memory", "model-repository", "logging", "trace", "statistics")
# Not x-cube3d-...: the header-forward patterns below would hand it to the models.
ADMIN_HEADER = "cube3d-admin-key"
# Triton's gRPC frontend prefixes the key of a restricted protocol (grpc_server.h,
# kRestrictedProtocolHeaderTemplate at v2.51.0): the metadata a gRPC admin call carries.
GRPC_ADMIN_METADATA = "triton-grpc-protocol-" + ADMIN_HEADER
# The key comes from this environment variable: on Kubernetes the Secret ADMIN_SECRET (key
# ADMIN_KEY_ENV); where it is unset the supervisor locks the APIs with a random key nobody holds.
ADMIN_KEY_ENV = "CUBE3D_ADMIN_KEY"
ADMIN_SECRET = "cube-serve-admin"
# The predictor pods' service account (k8s/base/runtime/serviceaccount.yaml) and the Secret it
# lists, whose S3 credentials KServe's storage initializer uses.
PREDICTOR_SERVICE_ACCOUNT = "cube-serve-predictor"
STORAGE_SECRET = "cube-serve-s3"
# Characters Triton's flag parser takes in a value (no ':', ',' or '='), and a length worth guessing.
ADMIN_KEY_PATTERN = re.compile(r"[A-Za-z0-9._~-]{32,512}")
# Request bodies the front end reads: an inference request is a prompt and a few numbers (the
# prompt is at most 4096 bytes); an admin's model load carries the version's files.
MAX_REQUEST_BYTES = 1 << 20
MAX_ADMIN_REQUEST_BYTES = 1 << 30


def new_admin_key() -> str:
    return secrets.token_hex(32)


def check_admin_key(key: str) -> str:
    if not ADMIN_KEY_PATTERN.fullmatch(key):
        raise ValueError(f"{ADMIN_KEY_ENV}: must be 32 to 512 characters of A-Z a-z 0-9 . _ ~ - "
                         "(e.g. `openssl rand -hex 32`)")
    return key


def restricted_api_flags(key: str) -> list[str]:
    """tritonserver's flags that lock RESTRICTED_APIS behind ADMIN_HEADER = `key`."""
    apis = ",".join(RESTRICTED_APIS)
    check_admin_key(key)
    return [f"--http-restricted-api={apis}:{ADMIN_HEADER}={key}",
            f"--grpc-restricted-protocol={apis}:{ADMIN_HEADER}={key}"]


# Flags every tritonserver of this project runs with, here and on a laptop: the config.pbtxt
# files are complete, so Triton must not rewrite them from what model.py reports; the exit
# timeout above; the experiment's headers.
COMMON_FLAGS = ("--disable-auto-complete-config", f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
                f"--http-header-forward-pattern={HTTP_HEADER_FORWARD_PATTERN}",
                f"--grpc-header-forward-pattern={GRPC_HEADER_FORWARD_PATTERN}")


def tritonserver_args(model_repository: str = KSERVE_MODEL_DIR) -> list[str]:
    """The server's arguments in a container (after the `tritonserver` executable).

    REST and gRPC listen on the pod's loopback only (the supervisor's front ends are HTTP_PORT and
    GRPC_PORT); metrics on all interfaces of the pod, said explicitly: Triton's metrics address
    defaults to --http-address (`tritonserver --help`), which would leave Prometheus, the
    autoscalers' scrapes and the gateway's checks nothing to reach. The ports are written out, because the probes, the Service and the Prometheus annotations name them. The
    restricted APIs' flags are added by the supervisor, with a key of its own (never in a manifest).
    """
    return [
        f"--model-store={model_repository}",
        "--http-address=127.0.0.1",
        f"--http-port={TRITON_HTTP_PORT}",
        "--grpc-address=127.0.0.1",
        f"--grpc-port={TRITON_GRPC_PORT}",
        "--metrics-address=0.0.0.0",
        f"--metrics-port={METRICS_PORT}",
        "--allow-http=true",
        "--allow-grpc=true",
        "--allow-metrics=true",
        *COMMON_FLAGS,
    ]


# tritonserver runs under cubeserve's supervisor (cubeserve/server/supervisor.py): it serves the
# REST and gRPC front ends on HTTP_PORT and GRPC_PORT (all interfaces of the pod), opens the admin
# APIs with the key of ADMIN_KEY_ENV, and when a python backend stub dies (Triton keeps answering ready while the model
# fails every request) it stops the server (readiness fails at once) and exits, and the kubelet
# restarts the container.
SUPERVISOR = ["python3", "-m", "cubeserve.server.supervisor", "--on-fault", "exit",
              "--rest-address=0.0.0.0", f"--rest-port={HTTP_PORT}",
              "--grpc-address=0.0.0.0", f"--grpc-port={GRPC_PORT}", "--"]


def server_command(model_repository: str = KSERVE_MODEL_DIR) -> list[str]:
    """The container's full command line: what the ServingRuntime's `args` and the image's CMD say
    (the NGC image's entrypoint script runs it)."""
    return [*SUPERVISOR, "tritonserver", *tritonserver_args(model_repository)]


# -- stopping a pod (RawDeployment; docs/deploy/draining.md) ------------------------------------------
# The preStop hook, cubeserve/serving/drain.py: the models refuse new requests at once (HTTP 503,
# gRPC UNAVAILABLE) and the hook waits until those accepted are answered, at least
# DRAIN_SETTLE_S (endpoint removal reaching kube-proxy and the ingress) and at most
# DRAIN_TIMEOUT_S; then the kubelet's SIGTERM stops tritonserver, with nothing left in flight.
DRAIN_SETTLE_S = 5
DRAIN_TIMEOUT_S = REQUEST_TIMEOUT_S  # a request accepted just before the drain has this long
# How often Prometheus scrapes the metrics port (k8s/monitoring/: the PodMonitor's and the
# scrape config's interval). Once drained, the hook also waits this long after the counters last
# changed, plus DRAIN_SCRAPE_MARGIN_S for the scrape itself, so that a scrape has the pod's final
# counts before it exits: the usage of its last seconds is billed (cubeserve usage).
SCRAPE_INTERVAL_S = 15
DRAIN_SCRAPE_MARGIN_S = 2
# The hook's longest run: the drain's timeout, the wait for a scrape, starting python and the
# last metrics poll.
PRESTOP_MAX_S = DRAIN_TIMEOUT_S + SCRAPE_INTERVAL_S + DRAIN_SCRAPE_MARGIN_S + 10
# The pod's terminationGracePeriodSeconds, which the preStop hook and then tritonserver's own
# shutdown (at most EXIT_TIMEOUT_S: it waits for clients' open keep-alive connections to close,
# and for anything the drain gave up on) share before the kubelet kills the container. Only a
# bound: a drained pod exits within seconds of its last request. Knative (Serverless mode) sets
# it itself from the revision timeout and refuses it in the spec (k8s/components/raw-deployment).
TERMINATION_GRACE_PERIOD_S = PRESTOP_MAX_S + EXIT_TIMEOUT_S + 30


def drain_command(http_port: int = TRITON_HTTP_PORT, metrics_port: int = METRICS_PORT,
                  timeout: float = DRAIN_TIMEOUT_S, settle: float = DRAIN_SETTLE_S,
                  scrape_interval: float = SCRAPE_INTERVAL_S) -> list[str]:
    """The preStop hook's command (the image's python3, as the supervisor's)."""
    return [SUPERVISOR[0], "-m", "cubeserve.serving.drain", f"--http-port={http_port}",
            f"--metrics-port={metrics_port}", f"--timeout={timeout:g}", f"--settle={settle:g}",
            f"--scrape-interval={scrape_interval:g}"]


PRESTOP_COMMAND = drain_command()


# -- autoscaling on concurrency (docs/deploy/autoscaling.md) -------------------------------------
# The engine's shipped limits (triton_models/cube3d_stream/config.pbtxt: max_objects, and
# max_queue empty = 8 x max_objects): a replica holds at most MAX_OBJECTS + MAX_QUEUE requests and
# refuses the next as busy, so that is Knative's hard limit (containerConcurrency): what exceeds
# it waits in the queue-proxy or the activator instead of being refused.
MAX_OBJECTS = 8
MAX_QUEUE = 8 * MAX_OBJECTS
CONTAINER_CONCURRENCY = MAX_OBJECTS + MAX_QUEUE
# Requests in progress per replica that the autoscalers aim at: the knee of bench/capacity.py (the
# most concurrent requests whose p99 stays within the SLO). On a GPU the decode batch is nearly
# free up to its slots, so the target is MAX_OBJECTS there: an estimate until bench/gpu_check.sh's
# capacity run measures it (BENCHMARKS.md, "Capacity of one replica"). The CPU overlay's target is
# the knee measured on a 2-core CPU with the demo model.
SCALE_TARGET = MAX_OBJECTS
SCALE_TARGET_CPU = 2
# Knative aims at target x utilization (70% by default, which would make 8 mean 5.6): 100 makes
# scaleTarget the target itself.
TARGET_UTILIZATION_PERCENT = 100
MAX_REPLICAS = 4
# A replica takes minutes to become ready (weights, CUDA graphs), so it is kept through a lull:
# Knative's scale-down-delay, KEDA's (HPA's) scale-down stabilization window.
SCALE_DOWN_DELAY_S = 900
# Where KEDA reads the metric: the Prometheus that scrapes k8s/monitoring's PodMonitor. A
# placeholder, like the model bucket: kube-prometheus-stack's default in-cluster address.
PROMETHEUS_URL = "http://prometheus-operated.monitoring.svc:9090"
# The requests a replica holds (waiting, decoding, in geometry), counted once: by the engine model,
# which every request reaches (the predict model forwards to it). Knative's `concurrency` metric
# counts the same thing at the queue-proxy.
CONCURRENCY_METRIC = "cube3d_requests_in_progress"


def concurrency_query(isvc: str = "cube3d") -> str:
    """The PromQL that KEDA evaluates for a raw InferenceService: requests in progress summed over
    the stable predictor's pods (Deployment `<isvc>-predictor`; its pods are named after it). KEDA
    (HPA, metric type AverageValue) then wants ceil(value / SCALE_TARGET) replicas
    (tests/kserve_standin.py, hpa_replicas)."""
    return (f'sum({CONCURRENCY_METRIC}{{model="{STREAM_MODEL}",pod=~"{isvc}-predictor-[a-z0-9]+-[a-z0-9]+"}})')

