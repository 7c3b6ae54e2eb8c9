"""`cubeserve usage`: what each tenant used over a window, from the servers' per-tenant counters
(serving/metrics.py, cube3d_tenant_*) in Prometheus: requests by outcome, objects, shape tokens and
engine seconds, per tenant, model (the gateway's name) and model version, as a table or CSV.

Exact, not PromQL's increase() (which extrapolates to the window's edges: 32 tokens read as 39, and
misses a series' first request): each series' raw samples in the window (a range vector, so the
series of a server that is gone count as fully as those of one that runs), split by the server
process that counted them, and for each process the growth from the value it started from. The
process of a sample is the `cube3d_server_start_time_seconds` of the same scrape (the same
timestamp); a server's counters start at 0 with its process, so a change of it between two scrapes
of one address is a reset even where the counters do not drop (a server restarted or replaced at
the same address that counted as much again). A process's first sample in the window counts from:
- the series' value at the window's start (`offset`), if the same process had it then;
- else 0, if the process started in the window (all it counted is in the window, the requests it
  answered before Prometheus first scraped it included: a new pod serves before it is discovered),
  or if an earlier scrape of the process in the window did not have the series yet (a counter
  series is created by its first increment: a tenant's first `invalid` request, the `other` and
  unmetered rows);
- else from that first sample: a process that started before the window and was not scraped with
  the series before it (what it held at the window's start is unknown).
A drop within one process counts from 0 (a reset of a server without the start time).
What Prometheus never scraped is not here: a server killed after answering requests and before
the next scrape of its counts (a drained server waits for that scrape: serving/drain.py).
"""

from __future__ import annotations

import bisect
import csv
import io
import json
import re
import urllib.parse
import urllib.request

from cubeserve.serving import metrics as names

COLUMNS = ("tenant", "model", "version", *names.OUTCOMES, "objects", "shape_tokens", "engine_seconds")
_KEYS = 3  # the columns that name a row
_WINDOW = re.compile(r"([0-9]+)([smhdw])")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
NO_TENANT = "(none)"  # requests that did not come through the gateway


def query(prometheus: str, promql: str, at: float | None = None, timeout: float = 30.0) -> list[dict]:
    """An instant query's result, evaluated at `at` (Unix time; Prometheus's now without it)."""
    params = {"query": promql, **({} if at is None else {"time": f"{at:.3f}"})}
    url = prometheus.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode(params)
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


class _Scrapes:
    """Every successful scrape of each server (job, instance) from the window's start on, with the
    process it found (its start time; None from a server that does not report one)."""

    def __init__(self, prometheus: str, since: str, at: float, start: float):
        self.start = start
        process = {(_target(s["metric"]), float(t)): float(v)
                   for s in query(prometheus, f"{names.SERVER_START_TIME}[{since}]", at) for t, v in s["values"]}
        at_start = {_target(s["metric"]): float(s["value"][1])
                    for s in query(prometheus, f"{names.SERVER_START_TIME} offset {since}", at)}
        self.times: dict[tuple, list[float]] = {}
        self.processes: dict[tuple, list[float | None]] = {}
        self.first: dict[tuple, dict[float | None, float]] = {}  # each process's first scrape
        for series in query(prometheus, f"up offset {since}", at):  # the scrape the window starts from
            if float(series["value"][1]) == 1:
                self._add(_target(series["metric"]), start, at_start.get(_target(series["metric"])))
        for series in query(prometheus, f"up[{since}]", at):
            target = _target(series["metric"])
            for t, v in series["values"]:
                if float(v) == 1:
                    self._add(target, float(t), process.get((target, float(t))))

    def _add(self, target: tuple, t: float, process: float | None) -> None:
        self.times.setdefault(target, []).append(t)
        self.processes.setdefault(target, []).append(process)
        self.first.setdefault(target, {}).setdefault(process, t)

    def process(self, target: tuple, t: float) -> float | None:
        """The process of `target`'s scrape at `t` (a sample's timestamp is its scrape's)."""
        i = bisect.bisect_right(self.times.get(target, []), t) - 1
        return self.processes[target][i] if i >= 0 else None

    def counted_from(self, target: tuple, t: float, value: float, process: float | None) -> float:
        """What a series counted from where its first sample of `process` in the window, `value`
        at `t`, had no earlier one of the same process (the module docstring's rules)."""
        if process is not None and process >= self.start:
            return 0.0  # the process started in the window
        created = self.first.get(target, {}).get(process, t) < t  # an earlier scrape did not have it
        return 0.0 if created else value


def usage(prometheus: str, since: str, at: float | None = None) -> list[dict]:
    """One row per (tenant, model, version) with any request in the `since` (e.g. 24h, 7d) before
    `at` (Unix time, default now)."""
    window = _WINDOW.fullmatch(since)
    if not window:
        raise ValueError(f"--since: a Prometheus duration like 24h, 7d or 30m, got {since!r}")
    if at is None:  # Prometheus's now; every query at this one instant: one window
        at = float(query(prometheus, "time()")[0])
    scrapes = _Scrapes(prometheus, since, at, at - int(window[1]) * _SECONDS[window[2]])
    rows: dict[tuple[str, str, str], dict] = {}
    columns = [(names.TENANT_REQUESTS, None), (names.TENANT_OBJECTS, "objects"),
               (names.TENANT_SHAPE_TOKENS, "shape_tokens"), (names.TENANT_ENGINE_SECONDS, "engine_seconds")]
    for metric, column in columns:
        at_start = {_identity(s["metric"]): float(s["value"][1])
                    for s in query(prometheus, f"{metric} offset {since}", at)}
        for series in query(prometheus, f"{metric}[{since}]", at):
            labels = series["metric"]
            key = (labels.get("tenant", "") or NO_TENANT, labels.get(names.GATEWAY_MODEL_LABEL, ""), labels.get("version", ""))
            row = rows.setdefault(key, {**dict(zip(COLUMNS, key)), **{c: 0 for c in COLUMNS[_KEYS:]}})
            name = column or labels.get("outcome", "")
            if name in row:
                row[name] += _counted(series, at_start.get(_identity(labels)), scrapes)
    for row in rows.values():
        for c in COLUMNS[_KEYS:]:
            row[c] = round(row[c], 1) if c == "engine_seconds" else round(row[c])
    used = [r for r in rows.values() if any(r[c] for c in COLUMNS[_KEYS:])]
    return sorted(used, key=lambda r: (r["tenant"], r["model"], r["version"]))


def _counted(series: dict, at_start: float | None, scrapes: _Scrapes) -> float:
    """What one series counted in the window: per process, its growth from where it started."""
    target = _target(series["metric"])
    total, values = 0.0, []
    previous = scrapes.process(target, scrapes.start) if at_start is not None else None
    if at_start is not None:
        values = [at_start]
    for t, v in series["values"]:
        t, value = float(t), float(v)
        process = scrapes.process(target, t)
        if not values or process != previous:  # the first sample of a process in the window
            total += increase(values)
            values = [scrapes.counted_from(target, t, value, process)]
        values.append(value)
        previous = process
    return total + increase(values)


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
