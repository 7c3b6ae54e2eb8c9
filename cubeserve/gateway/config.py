"""The gateway's file: who may call (API keys, each a tenant's), how much (a quota in shape
tokens per interval and a concurrency cap per tenant), and where requests go (backends: one or
more predict-API servers, i.e. the servers' REST front ends, serving/front.py).

    listen: 127.0.0.1:8080         # where clients connect (the loopback by default)
    model: v0.1                    # the served config: an object costs its shape tokens
    backends: [127.0.0.1:8000]
    keys_file: gateway-keys.yaml   # tenants from here (relative to this file), or inline:
    tenants:
      - id: team-a                 # [a-z0-9-], at most 63: a label value and an Envoy name
        keys: [...]                # 32 to 512 of A-Z a-z 0-9 . _ ~ -  (`cubeserve gateway --new-key`)
        quota: {shape_tokens: 51200, per: 1h, max_in_flight: 4}

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

TENANT_PATTERN = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
KEY_PATTERN = re.compile(r"[A-Za-z0-9._~-]{32,512}")
_DURATION = re.compile(r"([0-9]+)(s|m|h)")
_UNITS = {"s": 1, "m": 60, "h": 3600}
DEFAULT_LISTEN = ("127.0.0.1", 8080)


class GatewayConfigError(ValueError):
    """The gateway file is wrong: the message names the field (never a key)."""


@dataclass(frozen=True)
class Quota:
    shape_tokens: int  # the budget per `per_s`
    per_s: int
    max_in_flight: int


@dataclass(frozen=True)
class Tenant:
    id: str
    keys: tuple[str, ...] = field(repr=False)  # never in a repr, a log line or an error
    quota: Quota


@dataclass(frozen=True)
class GatewayConfig:
    tenants: tuple[Tenant, ...]
    backends: tuple[tuple[str, int], ...]
    model: str = "v0.1"
    listen: tuple[str, int] = DEFAULT_LISTEN
    admin_port: int = 0  # Envoy's admin and stats, on 127.0.0.1 (0: any free port)
    health_check_interval_s: float = 1.0

    @property
    def tokens_per_object(self) -> int:
        """What one request costs: the served config's shape tokens per object."""
        return get_config(self.model).num_tokens

    @property
    def tenant_ids(self) -> tuple[str, ...]:
        return tuple(t.id for t in self.tenants)


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


def _tenant(doc, where: str, tokens_per_object: int) -> Tenant:
    if not isinstance(doc, dict):
        raise GatewayConfigError(f"{where}: must be a mapping with id, keys and quota")
    _only(doc, {"id", "keys", "quota"}, where)
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
    if tokens < tokens_per_object:
        raise GatewayConfigError(f"{where}: quota.shape_tokens {tokens} is less than one object "
                                 f"({tokens_per_object} shape tokens): the tenant could never be served")
    return Tenant(tenant_id, tuple(keys), Quota(tokens, duration_s(quota.get("per"), f"{where}: quota.per"),
                                               _int(quota.get("max_in_flight"), f"{where}: quota.max_in_flight",
                                                    1, 4096)))


def parse(doc, base: Path = Path(".")) -> GatewayConfig:
    """A GatewayConfig from the file's document; `base` is the folder keys_file is relative to."""
    if not isinstance(doc, dict):
        raise GatewayConfigError("gateway file: must be a mapping")
    _only(doc, {"listen", "admin_port", "model", "backends", "keys_file", "tenants", "health_check_interval"},
          "gateway")
    model = doc.get("model", "v0.1")
    try:
        tokens_per_object = get_config(model).num_tokens
    except (ValueError, KeyError, FileNotFoundError) as exc:
        raise GatewayConfigError(f"gateway.model: {exc}") from None
    backends = doc.get("backends")
    if not isinstance(backends, list) or not backends:
        raise GatewayConfigError("gateway.backends: must be a non-empty list of HOST:PORT")
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
    tenants = tuple(_tenant(t, f"tenants[{i}]", tokens_per_object) for i, t in enumerate(raw))
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
    return GatewayConfig(
        tenants=tenants, backends=tuple(_address(b, f"gateway.backends[{i}]") for i, b in enumerate(backends)),
        model=model, listen=listen, admin_port=_int(doc.get("admin_port", 0), "gateway.admin_port", 0, 65535),
        health_check_interval_s=duration_s(interval, "gateway.health_check_interval"))


def load(path: str | Path) -> GatewayConfig:
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise GatewayConfigError(f"{path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise GatewayConfigError(f"{path}: not valid YAML ({exc})") from None
    return parse(doc, path.parent)
