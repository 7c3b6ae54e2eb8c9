"""The server's load, reported in every answer of its front ends as an ORCA load report (Open
Request Cost Aggregation, the xDS load report that Envoy and gRPC's load balancers read), so that
a gateway can choose servers and regions by measured load (gateway/envoy.py, `routing:
load-aware`; docs/gateway/regions-models-traces.md).

What a report says, counted by the front ends themselves (no scraping: cheap and exact):

* application_utilization: the generation requests in progress at this server (forwarded by
  either front end, their answer not yet ended; the one being answered included) divided by the
  server's scaling target, the requests in progress per replica the autoscalers aim at
  (deploy.SCALE_TARGET on a GPU, deploy.SCALE_TARGET_CPU on the CPU): 1.0 is "as busy as the
  autoscaler wants a replica to be", above 1 is past it;
* rps_fractional: generation answers per second, recently (an exponentially weighted rate with
  a time constant of RATE_TIME_CONSTANT_S: a steady rate reads as itself);
* eps: of those, the ones that failed on the server's side (5xx, gRPC UNAVAILABLE or INTERNAL;
  a busy server's refusal is one), per second, the same way;
* named_metrics.queue: the requests in progress beyond what the engine decodes at once
  (max_objects of cube3d_stream's config.pbtxt): waiting in its queue. Left out where the
  front end does not know max_objects (a front end started on its own, outside the supervisor);
* named_metrics.seconds: the time a generation took here recently, from the front end's
  forwarding it to its answer (waiting in the queue included), a moving average over the last
  few successful answers (SECONDS_WEIGHT each). Left out until the first one. The gateway's
  load-aware routing predicts a region's latency from it (gateway/weights.py).

Where it is: over REST the response header `endpoint-load-metrics` in Envoy's text form
(`TEXT application_utilization=0.5,rps_fractional=2,eps=0,named_metrics.queue=0`: Envoy 1.40's
source/common/orca/orca_parser.cc takes `TEXT ` then comma-separated name=value or name:value
pairs, and refuses a value without the prefix); over gRPC the trailing metadata
`endpoint-load-metrics-bin`, the serialized xds.data.orca.v3.OrcaLoadReport that gRPC's own ORCA
clients read and Envoy prefers (its router takes the first report in a response's headers or
trailers, the binary one first), and the same text as over REST in `endpoint-load-metrics`: gRPC's
client libraries consume the binary entry and show the application only the text one (grpcio
1.85 drops `endpoint-load-metrics-bin` from a call's trailing metadata). Every answer carries
one, refused ones included.
"""

from __future__ import annotations

import math
import re
import struct
import threading
import time
from pathlib import Path

from cubeserve import deploy

HEADER = "endpoint-load-metrics"  # REST: Envoy's text form
GRPC_METADATA = "endpoint-load-metrics-bin"  # gRPC trailing metadata: the serialized report
RATE_TIME_CONSTANT_S = 10.0  # of the answers' rates: a generation takes seconds
QUEUE_METRIC = "queue"
SECONDS_METRIC = "seconds"
SECONDS_WEIGHT = 0.25  # of each answer in the moving average of a generation's time


def _double(field: int, value: float) -> bytes:
    return struct.pack("<Bd", field << 3 | 1, value)  # wire type 1: 64-bit


class LoadReport:
    """The requests in progress at one server and the rates of its answers, shared by its REST
    and gRPC front ends (which run on threads of their own: a lock guards the counts)."""

    def __init__(self, target: float, max_objects: int | None = None, clock=time.monotonic):
        if target <= 0:
            raise ValueError(f"the scaling target must be positive, got {target!r}")
        self.target, self.max_objects, self._clock = float(target), max_objects, clock
        self.in_progress = 0
        self.seconds: float | None = None  # a generation's recent time (the module's docstring)
        self._lock = threading.Lock()
        self._rates = [0.0, 0.0]  # answers/s, failed answers/s, as of self._at
        self._at = clock()

    @classmethod
    def for_repository(cls, model_repository: str | Path | None) -> "LoadReport":
        """The report of a server of `model_repository`: its engine's config.pbtxt says its
        max_objects and where it runs (KIND_GPU: deploy.SCALE_TARGET, else SCALE_TARGET_CPU). A
        repository not there (yet) or not readable: deploy.SCALE_TARGET and no queue."""
        try:
            text = (Path(model_repository) / deploy.STREAM_MODEL / "config.pbtxt").read_text()
        except (OSError, TypeError):
            return cls(deploy.SCALE_TARGET)
        gpu = re.search(r"^instance_group\s*\[.*KIND_GPU", text, re.MULTILINE) is not None
        found = re.search(r'key:\s*"max_objects"\s*value:\s*\{\s*string_value:\s*"([0-9]+)"', text)
        return cls(deploy.SCALE_TARGET if gpu else deploy.SCALE_TARGET_CPU,
                   int(found.group(1)) if found else None)

    def _decay(self, now: float) -> None:
        factor = math.exp(-(now - self._at) / RATE_TIME_CONSTANT_S)
        self._rates = [r * factor for r in self._rates]
        self._at = now

    def started(self) -> float:
        """A generation forwarded to tritonserver; the time it started, for finished()."""
        with self._lock:
            self.in_progress += 1
        return self._clock()

    def finished(self, failed: bool = False, started: float | None = None) -> None:
        """Its answer ended (`failed`: on the server's side; `started`: what started() returned,
        given for a generation answered in full only: its time goes into `seconds`)."""
        with self._lock:
            now = self._clock()
            self.in_progress = max(self.in_progress - 1, 0)
            self._decay(now)
            self._rates[0] += 1 / RATE_TIME_CONSTANT_S
            self._rates[1] += failed / RATE_TIME_CONSTANT_S
            if started is not None and not failed:
                took = now - started
                self.seconds = took if self.seconds is None else self.seconds + SECONDS_WEIGHT * (took - self.seconds)

    def values(self) -> tuple[float, float, float, dict[str, float]]:
        """(utilization, answers/s, failed answers/s, the named metrics known), now."""
        with self._lock:
            self._decay(self._clock())
            rps, eps = self._rates
            in_progress, seconds = self.in_progress, self.seconds
        named = {}
        if self.max_objects is not None:
            named[QUEUE_METRIC] = max(in_progress - self.max_objects, 0)
        if seconds is not None:
            named[SECONDS_METRIC] = seconds
        return in_progress / self.target, rps, eps, named

    def header(self) -> str:
        """The REST header's value (Envoy's text form)."""
        utilization, rps, eps, named = self.values()
        text = f"TEXT application_utilization={utilization:.4g},rps_fractional={rps:.4g},eps={eps:.4g}"
        return "".join([text, *(f",named_metrics.{k}={v:.4g}" for k, v in named.items())])

    def binary(self) -> bytes:
        """The serialized xds.data.orca.v3.OrcaLoadReport (gRPC's trailing metadata): fields
        application_utilization (9), rps_fractional (6), eps (7), named_metrics (8, a map)."""
        utilization, rps, eps, named = self.values()
        out = _double(9, utilization) + _double(6, rps) + _double(7, eps)
        for name, value in named.items():  # map entries: key (1), value (2)
            entry = bytes([0x0A, len(name)]) + name.encode() + _double(2, float(value))
            out += bytes([0x42, len(entry)]) + entry
        return out

    def trailing_metadata(self) -> tuple[tuple[str, bytes | str], ...]:
        """A gRPC call's: the report in both forms (the module's docstring)."""
        return ((GRPC_METADATA, self.binary()), (HEADER, self.header()))
