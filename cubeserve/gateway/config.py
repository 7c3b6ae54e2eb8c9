"""The gateway's file: who may call (API keys, each a tenant's), how much (a quota in shape
tokens per interval and a concurrency cap per tenant), which models (entitlements, per-model
quotas), and where requests go (models, each served by regions of predict-API servers, i.e. the
servers' REST front ends, server/front.py).

    listen: 127.0.0.1:8080         # where clients connect (the loopback by default)
    model: v0.1                    # the served config: an object costs its shape tokens
    backends: [127.0.0.1:8000]     # one region; or regions, by priority (0 first):
    regions:
      - {name: onprem, priority: 0, backends: [10.0.0.5:8000]}
      - {name: cloud, priority: 1, backends: [cloud.example:8000]}
    keys_file: gateway-keys.yaml   # tenants from here (relative to this file), or inline:
    tenants:
      - id: team-a                 # [a-z0-9-], at most 63: a label value and an Envoy name
        keys: [...]                # 32 to 512 of A-Z a-z 0-9 . _ ~ -  (`cubeserve gateway --new-key`)
        quota: {shape_tokens: 51200, per: 1h, max_in_flight: 4}
        band: interactive          # interactive | standard (default) | batch: when a server's
                                   # queue is full, higher bands get slots first (engine/admission.py)

Several models instead of `model` and `backends`/`regions` (docs/gateway/regions-models-traces.md):

    models:
      - {name: cube3d, config: v0.1, regions: [...]}      # clients call /v2/models/cube3d/...
      - {name: cube3d-v05, config: v0.5, backends: [...]} # /v2/models/cube3d-v05/..., sent on as cube3d
    tenants:
      - id: team-b
        models:                    # what the tenant's keys may call (403 otherwise); absent: all
          cube3d: {}               # the tenant's quota only
          cube3d-v05: {shape_tokens: 10240, per: 1h}   # and at most this much of this model

The first model is the default: paths that name no model (health, server metadata) go to it.
Regions: requests go to the healthy region of the lowest priority; the next takes what it cannot
(a server answering 503 when full, a region down); gateway/envoy.py says with which of Envoy's
mechanisms. Or, opt-in, by measured load:

    routing: load-aware            # default: priority
    # the near region (the lowest priority, alone there; one name for all models) keeps the
    # requests while it promises a latency like the others'; once another promises less (its
    # round trip plus what the servers' load reports predict), requests move there
    # (gateway/weights.py; the reports: server/load_report.py)

A quota of 51200 shape tokens per hour is 100 objects of v0.1 (512 tokens each) or 50 of v0.5
(1024 each): a request's cost is its config's number of shape tokens (config.ModelConfig.num_tokens),
known before anything runs, so a request over budget is refused (429) before it starts. The
budget refills at its rate over `per` (a token bucket of that size).

Keys are secrets: they are read here and written only into the rendered Envoy file (mode 0600),
never printed or logged; errors name the tenant, never the key.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from cubeserve import deploy
from cubeserve.config import get_config
from cubeserve.deploy import PREDICT_MODEL
from cubeserve.requests import BANDS, DEFAULT_BAND

TENANT_PATTERN = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
KEY_PATTERN = re.compile(r"[A-Za-z0-9._~-]{32,512}")
MODEL_PATTERN = re.compile(r"[a-z0-9]([a-z0-9.-]{0,61}[a-z0-9])?")  # no `_`: `<name>_stream` is its stream
_DURATION = re.compile(r"([0-9]+)(s|m|h)")
_UNITS = {"s": 1, "m": 60, "h": 3600}
DEFAULT_LISTEN = ("127.0.0.1", 8080)
# How requests find a region (gateway/envoy.py): `priority`, the near region first and the next
# when it is full or down; `load-aware`, by the load the servers report (ORCA).
ROUTINGS = ("priority", "load-aware")


class GatewayConfigError(ValueError):
    """The gateway file is wrong: the message names the field (never a key)."""


@dataclass(frozen=True)
class Quota:
    shape_tokens: int  # the budget per `per_s`
    per_s: int
    max_in_flight: int


@dataclass(frozen=True)
class ModelQuota:
    shape_tokens: int  # of one model, per `per_s`, within the tenant's quota
    per_s: int


@dataclass(frozen=True)
class Tenant:
    id: str
    keys: tuple[str, ...] = field(repr=False)  # never in a repr, a log line or an error
    quota: Quota
    models: tuple[str, ...] | None = None  # entitled models; None: all
    model_quotas: tuple[tuple[str, ModelQuota], ...] = ()
    band: str = DEFAULT_BAND  # requests.BANDS: the servers' queues serve higher bands first

    def entitled(self, model: str) -> bool:
        return self.models is None or model in self.models


@dataclass(frozen=True)
class Region:
    name: str
    priority: int  # 0 first; equal priorities share the load
    backends: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class Model:
    name: str  # in clients' paths: /v2/models/<name>[_stream]/...
    config: str  # the served config: an object costs its shape tokens
    regions: tuple[Region, ...]

    @property
    def tokens_per_object(self) -> int:
        return get_config(self.config).num_tokens

    @property
    def backends(self) -> tuple[tuple[str, int], ...]:
        return tuple(b for r in self.regions for b in r.backends)


@dataclass(frozen=True)
class GatewayConfig:
    tenants: tuple[Tenant, ...]
    models: tuple[Model, ...]
    listen: tuple[str, int] = DEFAULT_LISTEN
    admin_port: int = 0  # Envoy's admin and stats, on 127.0.0.1 (0: any free port)
    health_check_interval_s: float = 1.0
    # Envoy's overprovisioning factor: a priority keeps all its load while this many times its
    # share of healthy servers is at least 1 (1.4: while 72% or more are healthy), else the
    # next priority takes the rest.
    overprovisioning: float = 1.4
    tracing: "Tracing | None" = None
    routing: str = "priority"  # ROUTINGS

    @property
    def model(self) -> str:
        """The default model's served config."""
        return self.models[0].config

    @property
    def tokens_per_object(self) -> int:
        """What one request to the default model costs: its config's shape tokens per object."""
        return self.models[0].tokens_per_object

    @property
    def backends(self) -> tuple[tuple[str, int], ...]:
        return tuple(b for m in self.models for b in m.backends)

    @property
    def tenant_ids(self) -> tuple[str, ...]:
        return tuple(t.id for t in self.tenants)

    def by_name(self, name: str) -> Model:
        return next(m for m in self.models if m.name == name)


@dataclass(frozen=True)
class Tracing:
    """Where the gateway sends its spans (OTLP over gRPC) and how many requests it samples."""
    collector: tuple[str, int]
    sample_percent: float = 100.0


def new_key() -> str:
    return deploy.new_admin_key()  # 64 hex digits from `secrets`


def duration_s(text, where: str) -> int:
    """"90s", "15m", "1h" or "1h30m" (or a number of seconds) -> seconds."""
    if isinstance(text, int) and not isinstance(text, bool) and text > 0:
        return text
    if isinstance(text, str) and text and re.fullmatch(rf"(?:{_DURATION.pattern})+", text):
        seconds = sum(int(n) * _UNITS[u] for n, u in _DURATION.findall(text))
        if seconds > 0:
            return seconds
    raise GatewayConfigError(f"{where}: must be a duration like 60s, 15m or 1h, got {text!r}")


def _address(text, where: str) -> tuple[str, int]:
    if not isinstance(text, str) or not re.fullmatch(r"[A-Za-z0-9.\-]+:[0-9]{1,5}", text) \
            or not 0 < int(text.rsplit(":", 1)[1]) < 65536:
        raise GatewayConfigError(f"{where}: must be HOST:PORT, got {text!r}")
    host, port = text.rsplit(":", 1)
    return host, int(port)


def _int(value, where: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise GatewayConfigError(f"{where}: must be an integer in [{low}, {high}], got {value!r}")
    return value


def _only(doc: dict, allowed: set, where: str) -> None:
    unknown = sorted(set(doc) - allowed)
    if unknown:
        raise GatewayConfigError(f"{where}.{unknown[0]}: unknown field (allowed: {', '.join(sorted(allowed))})")


def _tenant(doc, where: str, models: tuple[Model, ...]) -> Tenant:
    if not isinstance(doc, dict):
        raise GatewayConfigError(f"{where}: must be a mapping with id, keys and quota")
    _only(doc, {"id", "keys", "quota", "models", "band"}, where)
    tenant_id = doc.get("id")
    if not isinstance(tenant_id, str) or not TENANT_PATTERN.fullmatch(tenant_id):
        raise GatewayConfigError(f"{where}.id: must be 1 to 63 of a-z 0-9 -, not starting or ending with -, "
                                 f"got {tenant_id!r}")
    where = f"tenant {tenant_id}"
    keys = doc.get("keys")
    if not isinstance(keys, list) or not keys:
        raise GatewayConfigError(f"{where}: keys must be a non-empty list")
    for i, key in enumerate(keys):
        if not isinstance(key, str) or not KEY_PATTERN.fullmatch(key):
            raise GatewayConfigError(f"{where}: keys[{i}] must be 32 to 512 of A-Z a-z 0-9 . _ ~ - "
                                     "(make one with `cubeserve gateway --new-key`)")
    quota = doc.get("quota")
    if not isinstance(quota, dict):
        raise GatewayConfigError(f"{where}: quota must be a mapping with shape_tokens, per and max_in_flight")
    _only(quota, {"shape_tokens", "per", "max_in_flight"}, f"{where}: quota")
    # Envoy's token bucket counts in uint32.
    tokens = _int(quota.get("shape_tokens"), f"{where}: quota.shape_tokens", 1, (1 << 32) - 1)
    entitled, model_quotas = _entitlements(doc.get("models"), where, models)
    band = doc.get("band", DEFAULT_BAND)
    if band not in BANDS:
        raise GatewayConfigError(f"{where}: band must be one of {', '.join(BANDS)}, got {band!r}")
    for model in models:
        if entitled is not None and model.name not in entitled:
            continue
        budgets = [("quota", tokens)] + [(f"models.{name}", q.shape_tokens) for name, q in model_quotas
                                          if name == model.name]
        for what, budget in budgets:
            if budget < model.tokens_per_object:
                raise GatewayConfigError(
                    f"{where}: {what}.shape_tokens {budget} is less than one object ({model.tokens_per_object} "
                    f"shape tokens) of model {model.name}: the tenant could never be served it")
    return Tenant(tenant_id, tuple(keys), Quota(tokens, duration_s(quota.get("per"), f"{where}: quota.per"),
                                               _int(quota.get("max_in_flight"), f"{where}: quota.max_in_flight",
                                                    1, 4096)),
                  entitled, model_quotas, band)


def _entitlements(doc, where: str, models: tuple[Model, ...]):
    """A tenant's `models`: a list of names, or a mapping of names to {} or {shape_tokens, per}."""
    if doc is None:
        return None, ()
    names = {m.name for m in models}
    if isinstance(doc, list):
        doc = {name: {} for name in doc}
    if not isinstance(doc, dict) or not doc:
        raise GatewayConfigError(f"{where}: models must be a non-empty list of model names, or a mapping "
                                 "of model names to {} or {shape_tokens, per}")
    quotas = []
    for name, quota in doc.items():
        if name not in names:
            raise GatewayConfigError(f"{where}: models.{name}: no such model (the gateway serves "
                                     f"{', '.join(sorted(names))})")
        if quota in (None, {}):
            continue
        if not isinstance(quota, dict):
            raise GatewayConfigError(f"{where}: models.{name}: must be {{}} or {{shape_tokens, per}}")
        _only(quota, {"shape_tokens", "per"}, f"{where}: models.{name}")
        quotas.append((name, ModelQuota(
            _int(quota.get("shape_tokens"), f"{where}: models.{name}.shape_tokens", 1, (1 << 32) - 1),
            duration_s(quota.get("per"), f"{where}: models.{name}.per"))))
    return tuple(doc), tuple(quotas)


def _backends(doc, where: str) -> tuple[tuple[str, int], ...]:
    if not isinstance(doc, list) or not doc:
        raise GatewayConfigError(f"{where}: must be a non-empty list of HOST:PORT")
    return tuple(_address(b, f"{where}[{i}]") for i, b in enumerate(doc))


def _regions(doc: dict, where: str) -> tuple[Region, ...]:
    """`backends` (one region, "local") or `regions` (each with a name, a priority, backends)."""
    if ("backends" in doc) == ("regions" in doc):
        raise GatewayConfigError(f"{where}: give backends (one region) or regions, not both or neither")
    if "backends" in doc:
        return (Region("local", 0, _backends(doc["backends"], f"{where}.backends")),)
    regions = doc["regions"]
    if not isinstance(regions, list) or not regions:
        raise GatewayConfigError(f"{where}.regions: must be a non-empty list of {{name, priority, backends}}")
    out = []
    for i, region in enumerate(regions):
        at = f"{where}.regions[{i}]"
        if not isinstance(region, dict):
            raise GatewayConfigError(f"{at}: must be a mapping with name, priority and backends")
        _only(region, {"name", "priority", "backends"}, at)
        name = region.get("name")
        if not isinstance(name, str) or not TENANT_PATTERN.fullmatch(name):
            raise GatewayConfigError(f"{at}.name: must be 1 to 63 of a-z 0-9 -, got {name!r}")
        out.append(Region(name, _int(region.get("priority", 0), f"{at}.priority", 0, 127),
                          _backends(region.get("backends"), f"{at}.backends")))
    names = [r.name for r in out]
    if len(set(names)) != len(names):
        raise GatewayConfigError(f"{where}.regions: region names must be unique")
    return tuple(sorted(out, key=lambda r: r.priority))


def _model(doc, where: str) -> Model:
    if not isinstance(doc, dict):
        raise GatewayConfigError(f"{where}: must be a mapping with name, config and backends or regions")
    _only(doc, {"name", "config", "backends", "regions"}, where)
    name = doc.get("name")
    if not isinstance(name, str) or not MODEL_PATTERN.fullmatch(name):
        raise GatewayConfigError(f"{where}.name: must be 1 to 63 of a-z 0-9 . -, got {name!r}")
    return Model(name, _config_name(doc.get("config"), f"model {name}.config"), _regions(doc, f"model {name}"))


def _config_name(config, where: str) -> str:
    try:
        get_config(config).num_tokens
    except (ValueError, KeyError, FileNotFoundError, TypeError) as exc:
        raise GatewayConfigError(f"{where}: {exc}") from None
    return config


def parse(doc, base: Path = Path(".")) -> GatewayConfig:
    """A GatewayConfig from the file's document; `base` is the folder keys_file is relative to."""
    if not isinstance(doc, dict):
        raise GatewayConfigError("gateway file: must be a mapping")
    _only(doc, {"listen", "admin_port", "model", "backends", "regions", "models", "keys_file", "tenants",
                "health_check_interval", "overprovisioning", "tracing", "routing"}, "gateway")
    if "models" in doc:
        if {"model", "backends", "regions"} & set(doc):
            raise GatewayConfigError("gateway: give models, or model with backends or regions, not both")
        if not isinstance(doc["models"], list) or not doc["models"]:
            raise GatewayConfigError("gateway.models: must be a non-empty list of {name, config, backends or regions}")
        models = tuple(_model(m, f"gateway.models[{i}]") for i, m in enumerate(doc["models"]))
        names = [m.name for m in models]
        if len(set(names)) != len(names):
            raise GatewayConfigError("gateway.models: model names must be unique")
    else:  # one model, the predict model's own name (the first form, kept)
        models = (Model(PREDICT_MODEL, _config_name(doc.get("model", "v0.1"), "gateway.model"),
                        _regions(doc, "gateway")),)
    raw = list(doc.get("tenants") or [])
    if doc.get("keys_file"):
        path = base / doc["keys_file"]
        try:
            keys_doc = yaml.safe_load(path.read_text())
        except OSError as exc:
            raise GatewayConfigError(f"gateway.keys_file: cannot read {path}: {exc.strerror}") from None
        if not isinstance(keys_doc, dict) or set(keys_doc) != {"tenants"} or not isinstance(keys_doc["tenants"], list):
            raise GatewayConfigError(f"gateway.keys_file {path}: must be a mapping with one field, tenants (a list)")
        raw += keys_doc["tenants"]
    if not raw:
        raise GatewayConfigError("gateway: no tenants (give tenants, or keys_file)")
    tenants = tuple(_tenant(t, f"tenants[{i}]", models) for i, t in enumerate(raw))
    ids = [t.id for t in tenants]
    if len(set(ids)) != len(ids):
        raise GatewayConfigError(f"gateway.tenants: tenant ids must be unique, {sorted({i for i in ids if ids.count(i) > 1})} repeat")
    owner: dict[str, str] = {}
    for t in tenants:
        for key in t.keys:
            if key in owner:
                raise GatewayConfigError(f"tenant {t.id}: a key is also tenant {owner[key]}'s; keys must be unique")
            owner[key] = t.id
    listen = _address(doc["listen"], "gateway.listen") if "listen" in doc else DEFAULT_LISTEN
    interval = doc.get("health_check_interval", "1s")
    overprovisioning = doc.get("overprovisioning", 1.4)
    if isinstance(overprovisioning, bool) or not isinstance(overprovisioning, (int, float)) \
            or not 1 <= overprovisioning <= 10:
        raise GatewayConfigError(f"gateway.overprovisioning: must be a number in [1, 10], got {overprovisioning!r}")
    return GatewayConfig(
        tenants=tenants, models=models, listen=listen,
        admin_port=_int(doc.get("admin_port", 0), "gateway.admin_port", 0, 65535),
        health_check_interval_s=duration_s(interval, "gateway.health_check_interval"),
        overprovisioning=float(overprovisioning), tracing=_tracing(doc.get("tracing")),
        routing=_routing(doc.get("routing", "priority"), models))


def _routing(routing, models: tuple[Model, ...]) -> str:
    """`routing`, checked: load-aware needs one near region (the gateway's own: the region of the
    lowest priority, alone there), the same for every model served by several regions."""
    if routing not in ROUTINGS:
        raise GatewayConfigError(f"gateway.routing: must be one of {', '.join(ROUTINGS)}, got {routing!r}")
    if routing == "load-aware":
        near = {}
        for model in (m for m in models if len(m.regions) > 1):
            first = [r.name for r in model.regions if r.priority == model.regions[0].priority]
            if len(first) > 1:
                raise GatewayConfigError(
                    f"gateway.routing: load-aware needs one near region per model (the gateway's own, alone at "
                    f"the lowest priority); model {model.name} has {', '.join(first)} at priority "
                    f"{model.regions[0].priority}")
            near[model.name] = first[0]
        if len(set(near.values())) > 1:
            raise GatewayConfigError(
                "gateway.routing: load-aware needs one near region for all models (the gateway's own region); "
                + ", ".join(f"model {m} has {r}" for m, r in near.items()))
    return routing


def _tracing(doc) -> Tracing | None:
    if doc is None:
        return None
    if not isinstance(doc, dict):
        raise GatewayConfigError("gateway.tracing: must be a mapping with collector (HOST:PORT, OTLP/gRPC)")
    _only(doc, {"collector", "sample_percent"}, "gateway.tracing")
    percent = doc.get("sample_percent", 100)
    if isinstance(percent, bool) or not isinstance(percent, (int, float)) or not 0 <= percent <= 100:
        raise GatewayConfigError(f"gateway.tracing.sample_percent: must be in [0, 100], got {percent!r}")
    return Tracing(_address(doc.get("collector"), "gateway.tracing.collector"), float(percent))


def load(path: str | Path) -> GatewayConfig:
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise GatewayConfigError(f"{path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise GatewayConfigError(f"{path}: not valid YAML ({exc})") from None
    return parse(doc, path.parent)
