"""The Prometheus metrics of a cube-serve server: names, labels and buckets in one place, free of
torch and Triton, so that the Triton models that write them, `cubeserve rollout analyze` that
queries them, and the alerts and dashboard in k8s/monitoring/ agree.

Labels on every series: `model` (the Triton model that recorded it), `version` (the checkpoint
version, which is the Triton model version: serving/repository.py), and on the per-request and
per-object series `arm` (the experiment arm that served it; "" outside an experiment, "shadow"
for a shadow test's copy of a request, see serving/experiment.py).

Per request, recorded by the model the client called (the predict model `cube3d`, or
`cube3d_stream` for its own clients), so that a request is counted once:
    cube3d_requests_total{outcome}                    counter
    cube3d_request_duration_seconds                   histogram, requests that succeeded
Per generated object, recorded by the engine (`cube3d_stream`) of the version that made it:
    cube3d_time_per_output_token_seconds              histogram, decode time / tokens
    cube3d_request_queue_seconds                      histogram, wait before joining the batch
    cube3d_meshes_total{quality}                      counter
Per shadowed request, recorded by the predict model (`version` is the shadow's, `baseline`
the version whose answer the client got):
    cube3d_shadow_requests_total{outcome}             counter (outcomes as above, or "skipped")
    cube3d_shadow_request_duration_seconds            histogram, shadow copies that succeeded
    cube3d_shadow_agreement{measure}                  histogram in [0, 1]
Usage per tenant and model (the gateway's headers, experiment.TENANT_KEY and MODEL_KEY), recorded
by the predict model, `version` the one that served; `cubeserve usage` reads them back:
    cube3d_tenant_requests_total{tenant, gateway_model, outcome}  counter
    cube3d_tenant_objects_total{tenant, gateway_model}            counter, meshes made
    cube3d_tenant_shape_tokens_total{tenant, gateway_model}       counter, shape tokens generated
    cube3d_tenant_engine_seconds_total{tenant, gateway_model}     counter, decode + geometry seconds
`tenant` is bounded: one of the ids in $CUBE3D_TENANTS (the gateway's tenants, from its key
file), "other" for any other value a client sent past the gateway, "" without one.
`gateway_model` (the gateway's name of the model a request was sent to; `model` is Triton's)
likewise: one of the names in $CUBE3D_MODELS, "other", or "".
When the counters began, set by the predict model before it counts anything:
    cube3d_server_start_time_seconds                 gauge, when tritonserver started (Unix time),
                                                      the same for every version of the server
A server's counters start at 0 with its tritonserver process, so `cubeserve usage` takes a change
of this value between two scrapes of one address for a reset, even one the counters do not show
by dropping, and counts all of a server started in its window, samples before its first scrape
included.
"""

from __future__ import annotations

REQUESTS = "cube3d_requests_total"
REQUEST_DURATION = "cube3d_request_duration_seconds"
TIME_PER_OUTPUT_TOKEN = "cube3d_time_per_output_token_seconds"
QUEUE_TIME = "cube3d_request_queue_seconds"
MESHES = "cube3d_meshes_total"
SHADOW_REQUESTS = "cube3d_shadow_requests_total"
SHADOW_DURATION = "cube3d_shadow_request_duration_seconds"
SHADOW_AGREEMENT = "cube3d_shadow_agreement"
TENANT_REQUESTS = "cube3d_tenant_requests_total"
TENANT_OBJECTS = "cube3d_tenant_objects_total"
TENANT_SHAPE_TOKENS = "cube3d_tenant_shape_tokens_total"
TENANT_ENGINE_SECONDS = "cube3d_tenant_engine_seconds_total"
SERVER_START_TIME = "cube3d_server_start_time_seconds"

# Each family's unit and one PromQL query of it, for the metrics reference (docs/gen/reference.py
# renders them; the docs build fails for a registered family missing here or an entry naming none).
# Every family is here, also the engine's (serving/triton_engine.py registers those) and the drain's
# gauge (serving/triton_common.py, its name drain.IN_PROGRESS_METRIC). Documentation only.
UNIT_AND_EXAMPLE = {
    REQUESTS: ("requests", "sum by (outcome) (rate(cube3d_requests_total[5m]))"),
    REQUEST_DURATION: ("seconds", "histogram_quantile(0.95, sum by (le, version) "
                                  "(rate(cube3d_request_duration_seconds_bucket[5m])))"),
    TIME_PER_OUTPUT_TOKEN: ("seconds", "histogram_quantile(0.5, sum by (le, version) "
                                       "(rate(cube3d_time_per_output_token_seconds_bucket[5m])))"),
    QUEUE_TIME: ("seconds", "histogram_quantile(0.99, sum by (le) (rate(cube3d_request_queue_seconds_bucket[5m])))"),
    MESHES: ("meshes", 'sum(rate(cube3d_meshes_total{quality!="ok"}[1h])) / sum(rate(cube3d_meshes_total[1h]))'),
    SHADOW_REQUESTS: ("requests", "sum by (version, outcome) (rate(cube3d_shadow_requests_total[5m]))"),
    SHADOW_DURATION: ("seconds", "histogram_quantile(0.95, sum by (le, version) "
                                 "(rate(cube3d_shadow_request_duration_seconds_bucket[5m])))"),
    SHADOW_AGREEMENT: ("ratio, 0 to 1", "histogram_quantile(0.5, sum by (le, measure) "
                                        "(rate(cube3d_shadow_agreement_bucket[1h])))"),
    TENANT_REQUESTS: ("requests", "sum by (tenant) (rate(cube3d_tenant_requests_total[5m]))"),
    TENANT_OBJECTS: ("meshes", "sum by (tenant) (increase(cube3d_tenant_objects_total[1d]))"),
    TENANT_SHAPE_TOKENS: ("shape tokens", "sum by (tenant, gateway_model) "
                                          "(increase(cube3d_tenant_shape_tokens_total[1h]))"),
    TENANT_ENGINE_SECONDS: ("seconds", "sum by (tenant) (rate(cube3d_tenant_engine_seconds_total[5m]))"),
    SERVER_START_TIME: ("seconds, Unix time", "time() - max by (version) (cube3d_server_start_time_seconds)"),
    "cube3d_tokens_generated_total": ("shape tokens", "sum by (version) (rate(cube3d_tokens_generated_total[5m]))"),
    "cube3d_objects_completed_total": ("objects", "sum by (version) (rate(cube3d_objects_completed_total[5m]))"),
    "cube3d_decode_steps_total": ("steps", "sum by (version) (rate(cube3d_decode_steps_total[5m]))"),
    "cube3d_decode_seconds_total": ("seconds", "rate(cube3d_decode_seconds_total[5m]) "
                                               "/ rate(cube3d_decode_steps_total[5m])"),
    "cube3d_queue_seconds_total": ("seconds", "rate(cube3d_queue_seconds_total[5m]) "
                                              "/ rate(cube3d_objects_completed_total[5m])"),
    "cube3d_objects_in_flight": ("objects", "max_over_time(cube3d_objects_in_flight[5m])"),
    "cube3d_decode_step_seconds": ("seconds", "avg_over_time(cube3d_decode_step_seconds[5m])"),
    "cube3d_requests_waiting": ("requests", "sum by (version) (cube3d_requests_waiting)"),
    "cube3d_requests_dropped_total": ("requests", "sum by (reason) (rate(cube3d_requests_dropped_total[5m]))"),
    "cube3d_requests_in_progress": ("requests", "sum by (version) (cube3d_requests_in_progress)"),
}

# outcome label values
OK = "ok"
INVALID = "invalid"  # the caller's mistake (HTTP 400)
FAILED = "failed"  # the server's failure: generation failed (HTTP 500)
UNAVAILABLE = "unavailable"  # refused or cut: busy, draining, deadline passed, engine gone (503)
CANCELLED = "cancelled"  # the client went away first
SKIPPED = "skipped"  # a shadow copy not sent: the shadow already had max_in_flight copies
OUTCOMES = (OK, INVALID, FAILED, UNAVAILABLE, CANCELLED)
# protocol.error_kind -> outcome
OUTCOME_OF_ERROR = {"invalid": INVALID, "unavailable": UNAVAILABLE, "internal": FAILED}

# quality label values of cube3d_meshes_total
MESH_OK = "ok"
MESH_EMPTY = "empty"  # no surface at all (num_faces 0)
MESH_NOT_WATERTIGHT = "not_watertight"
MESH_QUALITIES = (MESH_OK, MESH_EMPTY, MESH_NOT_WATERTIGHT)


def mesh_quality(mesh) -> str:
    """The `quality` label of a mesh (vertices, faces, empty): empty, not_watertight (an edge not
    shared by exactly two faces, trimesh's test, which the pipeline's evaluation uses too) or ok.
    The test runs on the faces' edges alone: building a Trimesh around them took twice as long,
    between the mesh and its answer (issue 53)."""
    import numpy as np
    import trimesh

    if mesh.empty:
        return MESH_EMPTY
    closed, _ = trimesh.graph.is_watertight(trimesh.geometry.faces_to_edges(np.asarray(mesh.faces)))
    return MESH_OK if closed else MESH_NOT_WATERTIGHT

# measure label values of cube3d_shadow_agreement
AGREEMENT_TOKENS = "tokens"  # greedy requests: share of positions with the same shape token (1 = identical)
AGREEMENT_MESH_IOU = "mesh_iou"  # sampled requests: volumetric IoU of the two meshes

SHADOW_ARM = "shadow"  # the `arm` of a shadow copy's engine series

# Histogram buckets (upper bounds, seconds unless noted). A mesh takes seconds to minutes.
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300, 600)
TOKEN_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512)
QUEUE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300)
AGREEMENT_BUCKETS = (0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999, 1.0)  # 0.999 < x <= 1: identical

# The tenant label's values (see the docstring): the environment variable lists the ids.
TENANTS_ENV = "CUBE3D_TENANTS"
OTHER_TENANT = "other"


def known_tenants(text: str | None) -> frozenset[str]:
    """The tenant ids of $CUBE3D_TENANTS ("team-a,team-b")."""
    return frozenset(t.strip() for t in (text or "").split(",") if t.strip())


def tenant_label(value: str | None, known: frozenset[str]) -> str:
    if not value:
        return ""
    return value if value in known else OTHER_TENANT


# The model label's values: the gateway's model names this server may be sent ("cube3d,cube3d-v05").
MODELS_ENV = "CUBE3D_MODELS"
GATEWAY_MODEL_LABEL = "gateway_model"
model_label = tenant_label  # the same bounds: known, "other", or "" without the header
