"""Region weights for `routing: load-aware`, computed here from the servers' own load reports and
set in Envoy's runtime (gateway/envoy.py: each region's cluster is drawn by its weight).

Why not Envoy's own policy: 1.40's load_aware_locality (work in progress upstream) shares the
regions in proportion to their headroom, so a slow near region that is not full keeps about a
third of the requests, and those set the p99 (measured: BENCHMARKS.md, "Regions: static priority
vs load-aware routing"). A request's latency is its region's round trip plus the time a generation
takes there, queueing included, and the p99 is set by the worst 1 %: the region that promises
the lowest latency should take nearly everything.

Every PERIOD_S the weigher asks each server for its readiness (the path Envoy's health checks
use) and reads the load report its answer carries (server/load_report.py), through the same
address Envoy sends requests to, so that the time the question takes is the region's round trip
(the least of the last RTT_SAMPLES: a busy server answers later, and that is counted once, in its
report). A region's expected latency is that round trip plus the time a generation took there recently
(`seconds`) plus the wait its queue predicts (queue / answers per second). A server with nothing
in progress is idle: its `seconds` is from its last load, so the best any region of the model
reports stands for it. The chosen region gets all but PROBE_SHARE of the requests (the others
share that: their reports stay fresh, and a recovered region is seen): the near region (the
lowest priority's) while it promises nearly the best latency, else the region promising the
lowest (Choice says how near, and how it avoids flapping between near equals).

What stays Envoy's: the requests drawn for a region whose servers fail their health checks go to
the next region at once (its cluster's priorities), and a full region's 503 is retried there;
the server in a region is LEAST_REQUEST's choice.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from cubeserve import deploy
from cubeserve.server.load_report import HEADER, QUEUE_METRIC, SECONDS_METRIC

log = logging.getLogger("cubeserve.gateway")

PERIOD_S = 0.5  # the servers asked this often
POLL_TIMEOUT_S = 2.0  # a server that does not answer within this is left out of the choice
PROBE_SHARE = 0.005  # of the requests, for the regions not chosen together
# How much more the chosen region may promise than another before the other is chosen: room for
# the noise of a recent time (a moving average of a few answers) and a round trip's difference.
SWITCH_MARGIN = 0.2
HOLD_S = 2.0  # a choice stays at least this long (a burst past one region's capacity moves it back and forth)
DOWN_AFTER = 2  # polls unanswered in a row before a server counts as down (one lost poll is not)
RTT_SAMPLES = 20  # a server's round trip: the least of its last this many polls (10 s)
TOTAL_WEIGHT = 10000  # the regions' weights together (Envoy's route weights are integers, here at least 1)


def parse_report(value: str | None) -> dict[str, float]:
    """Envoy's text form (`TEXT name=value,...`) as a dict; {} if absent or not that form."""
    if not value or not value.startswith("TEXT "):
        return {}
    out = {}
    for item in value[5:].split(","):
        name, sep, number = item.strip().partition("=")
        try:
            out[name] = float(number) if sep else math.nan
        except ValueError:
            continue
    return out


@dataclass
class Server:
    """What the weigher knows of one server: its round trip and its last report."""
    address: tuple[str, int]
    rtts: deque = field(default_factory=lambda: deque(maxlen=RTT_SAMPLES))
    report: dict[str, float] = field(default_factory=dict)
    up: bool = False
    failures: int = 0  # polls unanswered in a row

    def observe(self, rtt_s: float | None, report: dict[str, float]) -> None:
        """A poll's outcome: `rtt_s` None if nothing answered (down after DOWN_AFTER such in a
        row, as Envoy's health checks count), `report` {} if the answer had none (a region's
        ingress refusing the poll: the last one stays)."""
        if rtt_s is None:
            self.failures += 1
            self.up = self.up and self.failures < DOWN_AFTER
            return
        self.up, self.failures = True, 0
        self.rtts.append(rtt_s)
        if report:
            self.report = report

    @property
    def seconds(self) -> float | None:
        value = self.report.get(f"named_metrics.{SECONDS_METRIC}")
        return value if value is not None and math.isfinite(value) else None

    @property
    def idle(self) -> bool:
        return self.report.get("application_utilization", 0.0) == 0.0

    def expected_s(self, best_seconds: float | None) -> float | None:
        """The latency a request sent now should see (the module's docstring); None if unknown."""
        if not self.up:
            return None
        seconds = self.seconds
        if self.idle and best_seconds is not None:
            seconds = best_seconds if seconds is None else min(seconds, best_seconds)
        if seconds is None:
            return None
        queue, rps = self.report.get(f"named_metrics.{QUEUE_METRIC}", 0.0), self.report.get("rps_fractional", 0.0)
        wait = queue / rps if queue > 0 and rps > 0 else queue * seconds
        return min(self.rtts) + seconds + wait


class Choice:
    """The region chosen for one model, from the regions' expected latencies (pure: tests and
    the benchmark drive it with their own numbers and clock). The near region is chosen while it
    promises at most SWITCH_MARGIN more than the best (so a generation of seconds does not leave
    it for a round trip's difference, and comes back to it as its load goes); another region only
    once the one chosen promises SWITCH_MARGIN more than it, and no sooner than HOLD_S after the last
    move, unless the chosen one stopped answering."""

    def __init__(self, regions: list[str], near: str, clock=time.monotonic):
        self.regions, self.near, self.chosen, self._clock = regions, near, near, clock
        self._since = clock()

    def update(self, expected: dict[str, float | None]) -> str:
        known = {r: e for r, e in expected.items() if e is not None}
        if not known:
            return self.chosen
        best = min(known, key=known.get)
        near_holds = self.near in known and known[self.near] <= known[best] * (1 + SWITCH_MARGIN)
        wanted = self.near if near_holds else best
        current = known.get(self.chosen)
        if wanted == self.chosen or (wanted != self.near and current is not None
                                     and current <= known[wanted] * (1 + SWITCH_MARGIN)):
            return self.chosen
        now = self._clock()
        if current is None or now - self._since >= HOLD_S:
            self.chosen, self._since = wanted, now
        return self.chosen

    def shares(self) -> dict[str, float]:
        """Each region's share of the requests: the chosen one all but PROBE_SHARE."""
        others = [r for r in self.regions if r != self.chosen]
        if not others:
            return {self.chosen: 1.0}
        return {r: (1 - PROBE_SHARE) if r == self.chosen else PROBE_SHARE / len(others) for r in self.regions}


def choice(model) -> Choice:
    """A model's Choice: its regions, the near one first (the lowest priority: config.py sorts them)."""
    return Choice([r.name for r in model.regions], model.regions[0].name)


def region_weights(shares: dict[str, float]) -> dict[str, int]:
    """Envoy's integer weights for `shares` (each at least 1)."""
    return {r: max(1, round(s * TOTAL_WEIGHT)) for r, s in shares.items()}


class Weigher:
    """The loop (a daemon thread) that keeps each model's region weights up to date: `publish`
    (model, region -> weight) is called at each change of a model's choice (gateway/envoy.py
    sets them in Envoy's runtime); the weights Envoy starts with are the near region's choice."""

    def __init__(self, models, publish, period_s: float = PERIOD_S):
        self.period_s, self._publish = period_s, publish
        self._models = [(model, {r.name: [Server(b) for b in r.backends] for r in model.regions},
                         choice(model)) for model in models]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="weigher")
        self.history: list[tuple[float, str, str]] = []  # (time, model, region chosen) at each change
        # What Envoy has (it starts with the near region chosen): a failed publish is tried again.
        self._published = {model.name: region_weights(choice.shares()) for model, _, choice in self._models}

    def poll(self, server: Server) -> None:
        host, port = server.address
        started = time.monotonic()
        try:
            with urllib.request.urlopen(f"http://{host}:{port}{deploy.READY_PATH}", timeout=POLL_TIMEOUT_S) as r:
                r.read()
                report = parse_report(r.headers.get(HEADER))
            server.observe(time.monotonic() - started, report)
        except urllib.error.HTTPError as e:  # an answer (a full region's 503): its round trip counts
            server.observe(time.monotonic() - started, parse_report(e.headers.get(HEADER)))
        except (urllib.error.URLError, OSError, ValueError):
            server.observe(None, {})

    def step(self) -> None:
        """One round: every server asked at once, then each model's choice, published if it changed."""
        every = [s for _, servers, _ in self._models for region in servers.values() for s in region]
        list(self._pool.map(self.poll, every))
        for model, servers, choice in self._models:
            known = [s.seconds for region in servers.values() for s in region if s.up and s.seconds is not None]
            best = min(known) if known else None
            expected = {}
            for name, region in servers.items():
                values = [e for e in (s.expected_s(best) for s in region) if e is not None]
                expected[name] = sum(values) / len(values) if values else None
            before = choice.chosen
            if choice.update(expected) != before:
                self.history.append((time.monotonic(), model.name, choice.chosen))
                log.info("model %s: region %s takes the requests now (expected latency: %s)", model.name,
                         choice.chosen, ", ".join(f"{r} {e * 1000:.0f} ms" if e is not None else f"{r} unknown"
                                                  for r, e in expected.items()))
            wanted = region_weights(choice.shares())
            if wanted != self._published[model.name]:
                self._publish(model, wanted)
                self._published[model.name] = wanted

    def chosen(self, model: str) -> str:
        """The region the model's requests go to, as Envoy has it (the largest weight published)."""
        weights = self._published[model]
        return max(weights, key=weights.get)

    def start(self) -> "Weigher":
        self._thread = threading.Thread(target=self._run, name="cubeserve-weigher", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.step()
            except Exception:  # the weights stay as they are; the next round tries again
                log.exception("load-aware routing: a round of the weigher failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        self._pool.shutdown(wait=False, cancel_futures=True)
