"""`cubeserve usage`: what each tenant used over a window, from the servers' per-tenant counters
(serving/metrics.py, cube3d_tenant_*) in Prometheus: requests by outcome, objects, shape tokens and
engine seconds, per tenant, model (the gateway's name) and model version, as a table or CSV.

Exact, not PromQL's increase() (which extrapolates to the window's edges: 32 tokens read as 39,
and misses a series' first request): each series' raw samples in the window, summed step by
step, a drop being a counter reset (a restarted server) from which the new value counts. The
step before a series' first sample in the window starts from its value at the window's start
(`offset`); where it had none then, from 0 if an earlier scrape of its server in the window did
not have it yet: a counter series is created by its first increment (a tenant's first `invalid`
request, the `other` and unmetered rows), so its first sample already counts that request. A
series present from the first scrape Prometheus has of its server counts from its first sample
(what it held before is unknown).
"""

from __future__ import annotations

import csv
import io
import json
import re
import urllib.parse
import urllib.request

from cubeserve.serving import metrics as names

COLUMNS = ("tenant", "model", "version", *names.OUTCOMES, "objects", "shape_tokens", "engine_seconds")
_KEYS = 3  # the columns that name a row
_WINDOW = re.compile(r"[0-9]+[smhdw]")
NO_TENANT = "(none)"  # requests that did not come through the gateway


def query(prometheus: str, promql: str, timeout: float = 30.0) -> list[dict]:
    url = prometheus.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=timeout) as r:
        body = json.loads(r.read())
    if body.get("status") != "success":
        raise RuntimeError(f"Prometheus refused {promql!r}: {body.get('error')}")
    return body["data"]["result"]


def increase(values: list[float]) -> float:
    """What a counter's samples grew by, resets included."""
    total = 0.0
    for previous, value in zip(values, values[1:]):
        total += value - previous if value >= previous else value
    return total


def _identity(labels: dict) -> frozenset:
    return frozenset(labels.items())


def _target(labels: dict) -> tuple[str, str]:
    return labels.get("job", ""), labels.get("instance", "")


def usage(prometheus: str, since: str) -> list[dict]:
    """One row per (tenant, model, version) with any request in the last `since` (e.g. 24h, 7d)."""
    if not _WINDOW.fullmatch(since):
        raise ValueError(f"--since: a Prometheus duration like 24h, 7d or 30m, got {since!r}")
    rows: dict[tuple[str, str, str], dict] = {}
    columns = [(names.TENANT_REQUESTS, None), (names.TENANT_OBJECTS, "objects"),
               (names.TENANT_SHAPE_TOKENS, "shape_tokens"), (names.TENANT_ENGINE_SECONDS, "engine_seconds")]
    # When each server (job, instance) was first scraped in the window.
    first_scrape = {}
    for series in query(prometheus, f"up[{since}]"):
        up = [float(t) for t, v in series["values"] if float(v) == 1]
        if up:
            first_scrape[_target(series["metric"])] = up[0]
    for metric, column in columns:
        at_start = {_identity(s["metric"]): float(s["value"][1])
                    for s in query(prometheus, f"{metric} offset {since}")}
        for series in query(prometheus, f"{metric}[{since}]"):
            labels = series["metric"]
            key = (labels.get("tenant", "") or NO_TENANT, labels.get(names.GATEWAY_MODEL_LABEL, ""), labels.get("version", ""))
            row = rows.setdefault(key, {**dict(zip(COLUMNS, key)), **{c: 0 for c in COLUMNS[_KEYS:]}})
            name = column or labels.get("outcome", "")
            if name in row:
                values = [float(v) for _, v in series["values"]]
                baseline = at_start.get(_identity(labels))
                if baseline is None:  # created in the window (from 0), or there from the first scrape
                    created = float(series["values"][0][0]) > first_scrape.get(_target(labels), float("inf"))
                    baseline = 0.0 if created else values[0]
                row[name] += increase([baseline] + values)
    for row in rows.values():
        for c in COLUMNS[_KEYS:]:
            row[c] = round(row[c], 1) if c == "engine_seconds" else round(row[c])
    used = [r for r in rows.values() if any(r[c] for c in COLUMNS[_KEYS:])]
    return sorted(used, key=lambda r: (r["tenant"], r["model"], r["version"]))


def as_csv(rows: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def as_table(rows: list[dict]) -> str:
    if not rows:
        return "no usage in this window"
    cells = [list(COLUMNS)] + [[str(r[c]) or "-" for c in COLUMNS] for r in rows]  # "-": no model header
    widths = [max(len(line[i]) for line in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(v.ljust(w) if i < _KEYS else v.rjust(w) for i, (v, w) in enumerate(zip(line, widths)))
                     for line in cells)
