"""The per-version measurements of serving/metrics.py, written through python_backend's custom
metrics (imported only inside Triton).

Every update goes through one lock per process: python_backend r24.10's Metric.increment,
set and observe each write their value into one shared-memory block of the metric and message
tritonserver (src/metric.cc, Send*Request), and two threads doing so at once corrupt it and crash
the server. Metric objects are made on first use for each label set and kept: a family and its
metrics must outlive the updates.

And none is ever deleted (`kept`): python_backend r24.10 deletes a Metric or MetricFamily by
messaging tritonserver through the stub (Metric::Clear, ~MetricFamily: src/metric.cc,
src/metric_family.cc). Left to the stub's exit, that runs while the stub object is torn down,
after its shared memory is gone: the stub dies on unload with SIGSEGV (a core dump here:
Metric::SaveToSharedMemory <- Metric::Clear <- ~MetricFamily <- ~Stub) or glibc's "free():
invalid pointer" (triton-inference-server/server#8662). Deleting them earlier, in finalize, is
worse: processes with the same label set (the predict model's versions, each counting every
arm's version) share one metric in tritonserver, and the second delete frees it again
(server#8663; tritonserver aborted here with "malloc_consolidate(): unaligned fastbin chunk").
So the process holds them until it ends, as it did whenever its exit got that far.
"""

from __future__ import annotations

import ctypes
import threading

import triton_python_backend_utils as pb_utils

from cubeserve.serving import metrics as names

_LOCK = threading.Lock()


def kept(obj):
    """`obj`, a MetricFamily or Metric, never freed by this process (module docstring): one more
    reference that nothing releases, so no destructor of it runs, at unload or at exit."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
    return obj

# name -> (description, kind, buckets or None)
_FAMILIES = {
    names.REQUESTS: ("Requests answered, by outcome (ok, invalid, failed, unavailable, cancelled)", "COUNTER", None),
    names.REQUEST_DURATION: ("End-to-end duration of requests that succeeded", "HISTOGRAM", names.DURATION_BUCKETS),
    names.TIME_PER_OUTPUT_TOKEN: ("Decode time per shape token of each object", "HISTOGRAM", names.TOKEN_BUCKETS),
    names.QUEUE_TIME: ("Time each object waited before joining the batch", "HISTOGRAM", names.QUEUE_BUCKETS),
    names.MESHES: ("Meshes made, by quality (ok, empty, not_watertight)", "COUNTER", None),
    names.SHADOW_REQUESTS: ("Shadow copies of requests, by outcome (or skipped)", "COUNTER", None),
    names.SHADOW_DURATION: ("Duration of shadow copies that succeeded", "HISTOGRAM", names.DURATION_BUCKETS),
    names.TENANT_REQUESTS: ("Requests answered per tenant (the gateway's), by outcome", "COUNTER", None),
    names.TENANT_OBJECTS: ("Meshes made per tenant", "COUNTER", None),
    names.TENANT_SHAPE_TOKENS: ("Shape tokens generated per tenant", "COUNTER", None),
    names.TENANT_ENGINE_SECONDS: ("Engine seconds (decode and geometry) per tenant", "COUNTER", None),
    names.SERVER_START_TIME: ("When this tritonserver process started, Unix time (its counters started at 0 then)",
                              "GAUGE", None),
    names.SHADOW_AGREEMENT: ("Agreement of a shadow's answer with the served one (tokens: share of equal "
                             "tokens, greedy requests; mesh_iou: sampled requests)", "HISTOGRAM",
                             names.AGREEMENT_BUCKETS),
}


class Measurements:
    """The series of one model (its `model` label), by label set."""

    def __init__(self, model: str):
        self.model = model
        self._families: dict[str, object] = {}
        self._metrics: dict[tuple, object] = {}

    def _metric(self, name: str, labels: dict[str, str]):
        key = (name, *sorted(labels.items()))
        metric = self._metrics.get(key)
        if metric is None:
            description, kind, buckets = _FAMILIES[name]
            family = self._families.get(name)
            if family is None:
                family = self._families[name] = kept(pb_utils.MetricFamily(
                    name=name, description=description, kind=getattr(pb_utils.MetricFamily, kind)))
            full = {"model": self.model, **labels}
            metric = kept(family.Metric(labels=full, buckets=list(buckets)) if buckets else family.Metric(labels=full))
            self._metrics[key] = metric
        return metric

    def count(self, name: str, labels: dict[str, str], value: float = 1.0) -> None:
        with _LOCK:
            self._metric(name, labels).increment(value)

    def observe(self, name: str, labels: dict[str, str], value: float) -> None:
        with _LOCK:
            self._metric(name, labels).observe(value)

    def set(self, name: str, labels: dict[str, str], value: float) -> None:
        with _LOCK:
            self._metric(name, labels).set(value)

    # -- what the models record -------------------------------------------------------------------

    def started(self, version, seconds: float) -> None:
        """When tritonserver started (serving/metrics.py): set before any counter of this process,
        so that every scrape with a count says which process counted it."""
        self.set(names.SERVER_START_TIME, {"version": str(version)}, seconds)


    def loaded(self, version) -> None:
        """The version's answered-request series, at zero from its load on: a version that never
        gets a request then shows a rate of 0, not a missing series, for k8s/monitoring's
        Cube3DNoTraffic (series are otherwise created on first use)."""
        self.count(names.REQUESTS, {"version": str(version), "arm": "", "outcome": names.OK}, 0.0)

    def request(self, version, arm: str, outcome: str, seconds: float) -> None:
        labels = {"version": str(version), "arm": arm}
        self.count(names.REQUESTS, {**labels, "outcome": outcome})
        if outcome == names.OK:
            self.observe(names.REQUEST_DURATION, labels, seconds)

    def generated(self, version, arm: str, tokens: int, decode_seconds: float, queue_seconds: float,
                  quality: str) -> None:
        labels = {"version": str(version), "arm": arm}
        if tokens:
            self.observe(names.TIME_PER_OUTPUT_TOKEN, labels, decode_seconds / tokens)
        self.observe(names.QUEUE_TIME, labels, queue_seconds)
        self.count(names.MESHES, {**labels, "quality": quality})

    def tenants_loaded(self, version, tenants, models=()) -> None:
        """Each known tenant's usage series (for each known model) at zero from the load on, so
        that Prometheus's increase() counts a tenant's first request too (a series first seen at
        1 is not)."""
        for tenant in tenants:
            for model in models or ("",):
                self.usage(version, tenant, model, names.OK, 0, 0.0, count=0.0)

    def usage(self, version, tenant: str, model: str, outcome: str, tokens: int, engine_seconds: float,
              count: float = 1.0) -> None:
        labels = {"version": str(version), "tenant": tenant, names.GATEWAY_MODEL_LABEL: model}
        self.count(names.TENANT_REQUESTS, {**labels, "outcome": outcome}, count)
        if outcome == names.OK:
            self.count(names.TENANT_OBJECTS, labels, count)
            self.count(names.TENANT_SHAPE_TOKENS, labels, float(tokens))
            self.count(names.TENANT_ENGINE_SECONDS, labels, engine_seconds)

    def shadow(self, version, baseline, outcome: str, seconds: float = 0.0) -> None:
        labels = {"version": str(version), "baseline": str(baseline)}
        self.count(names.SHADOW_REQUESTS, {**labels, "outcome": outcome})
        if outcome == names.OK:
            self.observe(names.SHADOW_DURATION, labels, seconds)

    def agreement(self, version, baseline, measure: str, value: float) -> None:
        self.observe(names.SHADOW_AGREEMENT, {"version": str(version), "baseline": str(baseline),
                                              "measure": measure}, value)


def locked(update) -> None:
    """Run another metric update (the engine's own gauges and counters) under the same lock."""
    with _LOCK:
        update()
