"""`cubeserve rollout analyze`: the promotion gate. Compares a candidate checkpoint version with
the baseline over a window of Prometheus data and answers pass, fail or not enough data, with
every figure and the reason of each failed check (as Flagger's canary analysis does).

Three parts, kept apart so that the decision is tested without Prometheus:
* `queries(...)`: the PromQL, built from the metric names of cubeserve/serving/metrics.py (the
  only place that knows how the figures are computed);
* `PrometheusClient`: instant queries over Prometheus' HTTP API (stdlib urllib);
* `decide(candidate, baseline, thresholds)`: a pure function of the figures.

What counts, per version (the `version` label is the checkpoint version):
* requests: answers the version gave, to clients (`cube3d_requests_total`, every arm) and to
  shadow copies (`cube3d_shadow_requests_total`, the shadow's version; `skipped` copies were
  never sent and do not count). The candidate's own answers, either way.
* error rate: (failed + unavailable) / (ok + failed + unavailable). `invalid` is the caller's
  mistake and `cancelled` the client leaving: neither says anything about the version.
  `unavailable` stays in: a slow version refuses more (busy) and misses more deadlines.
* latency p50/p95 (successful requests, client and shadow), time per output token p50/p95,
  queue p95 (per object, recorded by the engine of that version), empty-mesh and
  not-watertight rates (per mesh), and when a shadow ran: agreement mean and the share of
  identical answers (agreement > 0.999, the histogram's last bucket but one).
"""

from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field, fields

from cubeserve.serving import metrics as m

PASS, FAIL, NOT_ENOUGH_DATA = "pass", "fail", "not-enough-data"
IDENTICAL_ABOVE = 0.999  # agreement bucket bound: above it, the shadow's answer counts as identical
assert IDENTICAL_ABOVE in m.AGREEMENT_BUCKETS

MAX_WINDOW_S = 7 * 24 * 3600


def parse_window(text: str | float | int) -> float:
    """Seconds from "300", "30s", "5m", "1h" (Prometheus' units s, m, h, d). ValueError names
    the field and the allowed range."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)?\s*", str(text))
    if not match:
        raise ValueError(f"window: must be a duration like 30s, 5m or 1h, got {text!r}")
    seconds = float(match.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2) or "s"]
    if not 1 <= seconds <= MAX_WINDOW_S:
        raise ValueError(f"window: must be from 1 s to {MAX_WINDOW_S // 86400} days, got {text!r}")
    return seconds


# -- thresholds ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Thresholds:
    """Limits of the gate. A limit of None is not checked. Ratios compare the candidate with the
    baseline and are only checked with a baseline that has figures of its own."""
    min_requests: int = 20  # per version in the window; fewer: not enough data
    max_error_rate: float | None = 0.05
    max_error_rate_increase: float | None = 0.02  # candidate's minus baseline's
    max_p95_seconds: float | None = None
    max_p95_ratio: float | None = 1.5
    max_time_per_token_ratio: float | None = 1.5  # p95 time per output token
    max_empty_mesh_rate: float | None = 0.05
    max_not_watertight_rate: float | None = None
    min_shadow_agreement: float | None = None  # mean; checked when a shadow ran

    # (field, low, high) for validation: rates and agreements are shares, ratios and seconds positive
    _RANGES = {"min_requests": (1, 10**9), "max_error_rate": (0, 1), "max_error_rate_increase": (0, 1),
               "max_p95_seconds": (0, 3600), "max_p95_ratio": (1, 1000), "max_time_per_token_ratio": (1, 1000),
               "max_empty_mesh_rate": (0, 1), "max_not_watertight_rate": (0, 1), "min_shadow_agreement": (0, 1)}

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name != "min_requests":
                continue
            low, high = self._RANGES[f.name]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) \
                    or not low <= value <= high:
                raise ValueError(f"{f.name}: must be a number in [{low:g}, {high:g}], got {value!r}")
        if not float(self.min_requests).is_integer():
            raise ValueError(f"min_requests: must be a whole number, got {self.min_requests!r}")

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


# -- figures --------------------------------------------------------------------------------------

@dataclass
class Figures:
    """One version's measurements over the window (None: nothing to measure it on)."""
    version: str
    requests: float = 0.0  # answers counted for the error rate (ok + failed + unavailable)
    request_rate: float = 0.0  # per second, every outcome
    outcomes: dict = field(default_factory=dict)  # client requests by outcome
    shadow_outcomes: dict = field(default_factory=dict)  # shadow copies by outcome
    error_rate: float | None = None
    p50_seconds: float | None = None
    p95_seconds: float | None = None
    time_per_token_p50: float | None = None
    time_per_token_p95: float | None = None
    queue_p95_seconds: float | None = None
    meshes: float = 0.0
    empty_mesh_rate: float | None = None
    not_watertight_rate: float | None = None
    shadow_agreement_mean: float | None = None
    shadow_identical_share: float | None = None
    shadow_comparisons: float = 0.0


@dataclass(frozen=True)
class Check:
    name: str
    value: float
    limit: float
    passed: bool
    reason: str = ""


@dataclass
class Analysis:
    result: str  # PASS, FAIL or NOT_ENOUGH_DATA
    candidate: Figures
    baseline: Figures | None
    checks: list[Check]
    reasons: list[str]  # of failed checks, or why the data is not enough
    window_seconds: float = 0.0
    at: float = 0.0  # evaluation time (Unix seconds)

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        head = f"{self.result}: version {self.candidate.version}" + (
            f" against {self.baseline.version}" if self.baseline else "") + f" over {self.window_seconds:.0f} s"
        return head + (": " + "; ".join(self.reasons) if self.reasons else "")

    def report(self) -> str:
        """Human-readable: every figure of both versions, then the checks."""
        lines = [self.summary()]
        versions = [self.candidate] + ([self.baseline] if self.baseline else [])
        lines.append(f"  {'':24}" + "".join(f"{'v' + f.version:>14}" for f in versions))
        for name in [f.name for f in fields(Figures)][1:]:
            cells = [getattr(f, name) for f in versions]
            lines.append(f"  {name:24}" + "".join(f"{_fmt(c):>14}" for c in cells))
        for c in self.checks:
            lines.append(f"  {'ok  ' if c.passed else 'FAIL'} {c.name}: {_fmt(c.value)} (limit {_fmt(c.limit)})"
                         + (f" - {c.reason}" if c.reason else ""))
        return "\n".join(lines)


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):
        return ",".join(f"{k}={v:g}" for k, v in sorted(value.items())) or "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


# -- the decision (pure) --------------------------------------------------------------------------

def decide(candidate: Figures, baseline: Figures | None, t: Thresholds, window_seconds: float = 0.0,
           at: float = 0.0) -> Analysis:
    """Pass, fail or not enough data from the figures. Not enough data when either version
    answered fewer than `min_requests` (the checks still listed, none decides); otherwise fail
    when any check fails. A figure that cannot be computed (no successful request, no baseline
    figure to compare with) is not checked."""
    checks: list[Check] = []

    def at_most(name: str, value, limit, what: str) -> None:
        if limit is None or value is None:
            return
        passed = value <= limit
        checks.append(Check(name, value, limit, passed, "" if passed else f"{what} {value:.4g} > {limit:g}"))

    def ratio(name: str, value, base, limit, what: str) -> None:
        if limit is None or value is None or not base:
            return
        r = value / base
        passed = r <= limit
        checks.append(Check(name, r, limit, passed, "" if passed else
                            f"{what} {value:.4g} is {r:.2f}x the baseline's {base:.4g} (limit {limit:g}x)"))

    c = candidate
    at_most("error_rate", c.error_rate, t.max_error_rate, "error rate")
    at_most("p95_seconds", c.p95_seconds, t.max_p95_seconds, "p95 latency (s)")
    at_most("empty_mesh_rate", c.empty_mesh_rate, t.max_empty_mesh_rate, "empty-mesh rate")
    at_most("not_watertight_rate", c.not_watertight_rate, t.max_not_watertight_rate, "not-watertight rate")
    if t.min_shadow_agreement is not None and c.shadow_agreement_mean is not None:
        passed = c.shadow_agreement_mean >= t.min_shadow_agreement
        checks.append(Check("shadow_agreement", c.shadow_agreement_mean, t.min_shadow_agreement, passed,
                            "" if passed else f"shadow agreement {c.shadow_agreement_mean:.4g} < "
                                              f"{t.min_shadow_agreement:g}"))
    if baseline is not None:
        b = baseline
        if t.max_error_rate_increase is not None and c.error_rate is not None and b.error_rate is not None:
            rise = c.error_rate - b.error_rate
            passed = rise <= t.max_error_rate_increase
            checks.append(Check("error_rate_increase", rise, t.max_error_rate_increase, passed,
                                "" if passed else f"error rate {c.error_rate:.4g} is {rise:.4g} above the "
                                                  f"baseline's {b.error_rate:.4g} (limit {t.max_error_rate_increase:g})"))
        ratio("p95_ratio", c.p95_seconds, b.p95_seconds, t.max_p95_ratio, "p95 latency (s)")
        ratio("time_per_token_ratio", c.time_per_token_p95, b.time_per_token_p95, t.max_time_per_token_ratio,
              "p95 time per output token (s)")
    short = [f"version {f.version} answered {f.requests:.0f} requests in the window, fewer than "
             f"min_requests {t.min_requests}" for f in (candidate, baseline) if f is not None
             and f.requests < t.min_requests]
    if short:
        return Analysis(NOT_ENOUGH_DATA, candidate, baseline, checks, short, window_seconds, at)
    failed = [ch.reason for ch in checks if not ch.passed]
    return Analysis(FAIL if failed else PASS, candidate, baseline, checks, failed, window_seconds, at)


# -- the queries ----------------------------------------------------------------------------------

_COUNTED = (m.OK, m.FAILED, m.UNAVAILABLE)  # the error rate's denominator
_ERRORS = (m.FAILED, m.UNAVAILABLE)


def _selector(version: str, extra: str = "", **labels: str) -> str:
    parts = [f'version="{version}"'] + [f'{k}="{v}"' for k, v in labels.items()]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}"


def grown(series: str, window: str) -> str:
    """How much each counter of `series` grew over the window, counting series born in it.
    increase() alone takes a series' first sample as its start, so a series that appears with
    its first event (the server makes a label set's counter on first use) would lose that event,
    and a version with a handful of requests in the window most of them. Series that existed at
    the window's start: increase(); series born since: their whole value. (Binary operators
    match on the labels without the metric name.)"""
    return (f"((increase({series}[{window}]) and {series} offset {window}) "
            f"or ({series} unless {series} offset {window}))")


def queries(version: str, window: str, selector: str = "") -> dict[str, str]:
    """The PromQL of one version's figures over `window` (a Prometheus duration, "300s").
    `selector`: more label matchers for every series (e.g. `namespace="models"` where
    Prometheus scrapes several services)."""
    s = _selector(version, selector)
    durations = f'{{__name__=~"{m.REQUEST_DURATION}_bucket|{m.SHADOW_DURATION}_bucket",{s[1:]}'
    identical = _selector(version, selector, le=str(IDENTICAL_ABOVE))

    def quantile(q: float, buckets: str) -> str:  # increases, not rates: the quantile is the same
        return f"histogram_quantile({q}, sum by (le) ({grown(buckets, window)}))"

    return {
        "outcomes": f"sum by (outcome) ({grown(m.REQUESTS + s, window)})",
        "shadow_outcomes": f"sum by (outcome) ({grown(m.SHADOW_REQUESTS + s, window)})",
        "p50_seconds": quantile(0.5, durations),
        "p95_seconds": quantile(0.95, durations),
        "time_per_token_p50": quantile(0.5, f"{m.TIME_PER_OUTPUT_TOKEN}_bucket{s}"),
        "time_per_token_p95": quantile(0.95, f"{m.TIME_PER_OUTPUT_TOKEN}_bucket{s}"),
        "queue_p95_seconds": quantile(0.95, f"{m.QUEUE_TIME}_bucket{s}"),
        "meshes": f"sum by (quality) ({grown(m.MESHES + s, window)})",
        "agreement_sum": f"sum({grown(m.SHADOW_AGREEMENT + '_sum' + s, window)})",
        "agreement_count": f"sum({grown(m.SHADOW_AGREEMENT + '_count' + s, window)})",
        "agreement_below_identical": f"sum({grown(m.SHADOW_AGREEMENT + '_bucket' + identical, window)})",
    }


def figures_from(version: str, results: dict[str, list[dict]], window_seconds: float) -> Figures:
    """One version's figures from the query results (Prometheus' instant vectors)."""
    def scalar(key: str) -> float | None:
        values = [float(r["value"][1]) for r in results.get(key, [])]
        values = [v for v in values if not math.isnan(v)]
        return values[0] if values else None

    def by(key: str, label: str) -> dict[str, float]:
        return {r["metric"].get(label, ""): float(r["value"][1]) for r in results.get(key, [])}

    f = Figures(version)
    f.outcomes = by("outcomes", "outcome")
    f.shadow_outcomes = by("shadow_outcomes", "outcome")
    answered = {k: f.outcomes.get(k, 0.0) + f.shadow_outcomes.get(k, 0.0) for k in _COUNTED}
    f.requests = sum(answered.values())
    every = sum(f.outcomes.values()) + sum(v for k, v in f.shadow_outcomes.items() if k != m.SKIPPED)
    f.request_rate = every / window_seconds if window_seconds else 0.0
    if f.requests > 0:
        f.error_rate = sum(answered[k] for k in _ERRORS) / f.requests
    for key in ("p50_seconds", "p95_seconds", "time_per_token_p50", "time_per_token_p95", "queue_p95_seconds"):
        setattr(f, key, scalar(key))
    meshes = by("meshes", "quality")
    f.meshes = sum(meshes.values())
    if f.meshes > 0:
        f.empty_mesh_rate = meshes.get(m.MESH_EMPTY, 0.0) / f.meshes
        f.not_watertight_rate = meshes.get(m.MESH_NOT_WATERTIGHT, 0.0) / f.meshes
    count = scalar("agreement_count") or 0.0
    if count > 0:
        f.shadow_comparisons = count
        f.shadow_agreement_mean = (scalar("agreement_sum") or 0.0) / count
        f.shadow_identical_share = 1.0 - (scalar("agreement_below_identical") or 0.0) / count
    return f


# -- Prometheus ---------------------------------------------------------------------------------

class PrometheusError(RuntimeError):
    pass


class PrometheusClient:
    """Instant queries over Prometheus' HTTP API (GET /api/v1/query)."""

    def __init__(self, url: str, timeout: float = 30.0):
        if not re.match(r"https?://[^/]", url or ""):
            raise ValueError(f"prometheus: must be an http:// or https:// URL, got {url!r}")
        self.url = url.rstrip("/")
        self.timeout = timeout

    def query(self, promql: str, at: float | None = None) -> list[dict]:
        params = {"query": promql}
        if at is not None:
            params["time"] = f"{at:.3f}"
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(url, timeout=self.timeout) as r:
                body = json.load(r)
        except urllib.error.HTTPError as exc:  # 400/422: a bad query; the body says why
            try:
                detail = json.load(exc).get("error", "")
            except ValueError:
                detail = ""
            raise PrometheusError(f"{self.url}: query {promql!r} failed: HTTP {exc.code} {detail}".rstrip()) from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise PrometheusError(f"{self.url}: cannot query Prometheus: {exc}") from None
        if body.get("status") != "success":
            raise PrometheusError(f"{self.url}: query {promql!r} failed: {body.get('error', body)}")
        if body["data"]["resultType"] == "scalar":
            return [{"metric": {}, "value": body["data"]["result"]}]
        return body["data"]["result"]

    def latest_scrape(self, selector: str = "") -> float | None:
        """The time of the newest scrape of any target (matching `selector`), or None."""
        result = self.query(f"max(timestamp(up{{{selector}}}))")
        return float(result[0]["value"][1]) if result else None

    def figures(self, version: str, window_seconds: float, at: float, selector: str = "") -> Figures:
        window = f"{int(math.ceil(window_seconds))}s"
        results = {k: self.query(q, at) for k, q in queries(str(version), window, selector).items()}
        return figures_from(str(version), results, window_seconds)


def analyze(prometheus: str | PrometheusClient, candidate: str | int, baseline: str | int | None,
            window_seconds: float, thresholds: Thresholds = Thresholds(), at: float | None = None,
            selector: str = "") -> Analysis:
    """The gate over the `window_seconds` before `at` (default: Prometheus' newest scrape, so the
    window ends where the data does)."""
    client = prometheus if isinstance(prometheus, PrometheusClient) else PrometheusClient(prometheus)
    if baseline is not None and str(baseline) == str(candidate):
        raise ValueError(f"baseline: must differ from the candidate, both are {candidate}")
    if at is None:
        at = client.latest_scrape(selector)
        if at is None:
            raise PrometheusError(f"{client.url}: Prometheus has scraped no target yet")
    cand = client.figures(candidate, window_seconds, at, selector)
    base = client.figures(baseline, window_seconds, at, selector) if baseline is not None else None
    return decide(cand, base, thresholds, window_seconds, at)
