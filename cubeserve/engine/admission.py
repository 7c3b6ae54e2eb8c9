"""Which waiting request gets the next free slot, and which one gives way when the queue is full.

Requests wait by priority band (cubeserve/requests.py BANDS: interactive, standard, batch) and,
inside a band, by tenant (the gateway's tenant header; "" without one). A free slot goes to the
first band with a waiting request, and inside it to its tenants in turn (round robin, each
tenant's own requests first come, first served), so a tenant's burst does not hold back the
others of its band: tenants with requests waiting get slots at the same rate. Every object of a
model costs the same number of decode steps, so equal turns are equal shares of the engine.

When the queue is full, a newcomer takes the place of a waiting request that counts for less:
the newest request of the lowest band below the newcomer's, or else, inside the newcomer's band,
the newest request of the tenant with the most waiting when that tenant has at least two more
waiting than the newcomer's own. The request that gives way fails with `Shed` (429: retry here
later). Otherwise the newcomer is refused: `Shed` when it is the one over its share (a higher
band fills the queue, or its tenant already has the most waiting beside other tenants), and
`Unavailable` (503: no capacity, try elsewhere) when the queue is full of its equals.

The idea is llm-d's flow control (priority bands, fairness inside a band, bounded queues with a
TTL, 429 for shed, 503 for no capacity), inside the engine, where the decode slots are.
"""

from __future__ import annotations

import collections
from typing import Iterator, Protocol

from cubeserve.requests import BANDS


class Waiting(Protocol):
    band: int  # rank in BANDS: 0 first
    tenant: str


class WaitingQueue:
    """The waiting requests; not thread-safe (the scheduler holds its lock)."""

    def __init__(self):
        # band rank -> tenant -> that tenant's waiting requests, oldest first; the tenants in
        # the order their next turn comes.
        self._bands: list[collections.OrderedDict[str, collections.deque]] = [
            collections.OrderedDict() for _ in BANDS]
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Waiting]:
        for tenants in self._bands:
            for queue in tenants.values():
                yield from queue

    def push(self, item: Waiting) -> None:
        self._bands[item.band].setdefault(item.tenant, collections.deque()).append(item)
        self._len += 1

    def peek(self) -> Waiting | None:
        """The request `pop` would return, left waiting."""
        for tenants in self._bands:
            if tenants:
                return next(iter(tenants.values()))[0]
        return None

    def pop(self) -> Waiting | None:
        """The next request to admit: first band first, its tenants in turn."""
        for tenants in self._bands:
            if not tenants:
                continue
            tenant, queue = next(iter(tenants.items()))
            item = queue.popleft()
            if queue:
                tenants.move_to_end(tenant)  # its next request waits for the others' turns
            else:
                del tenants[tenant]
            self._len -= 1
            return item
        return None

    def remove_if(self, predicate) -> list[Waiting]:
        """Take out (and return) every waiting request for which predicate(request) is true."""
        removed = []
        for tenants in self._bands:
            for tenant in list(tenants):
                kept = collections.deque()
                for item in tenants[tenant]:  # the predicate once per request: it may end it
                    (removed if predicate(item) else kept).append(item)
                if kept:
                    tenants[tenant] = kept
                else:
                    del tenants[tenant]
        self._len -= len(removed)
        return removed

    def waiting(self, band: int, tenant: str) -> int:
        queue = self._bands[band].get(tenant)
        return len(queue) if queue else 0

    def make_room(self, band: int, tenant: str) -> tuple[Waiting | None, str]:
        """For a newcomer of (band, tenant) to a full queue: (the waiting request to shed in its
        place, why) or (None, why the newcomer is refused: "higher band", "over its share" or
        "no capacity")."""
        for lower in range(len(BANDS) - 1, band, -1):
            if self._bands[lower]:
                return self._take_newest_of_largest(lower), f"{BANDS[band]} before {BANDS[lower]}"
        tenants = self._bands[band]
        own = self.waiting(band, tenant)
        largest = max(tenants, key=lambda t: len(tenants[t]), default=None)
        if largest is not None and largest != tenant and len(tenants[largest]) >= own + 2:
            return self._take_newest_of_largest(band), "over its share"
        if any(self._bands[higher] for higher in range(band)):
            return None, "higher band"
        others = max((len(q) for t, q in tenants.items() if t != tenant), default=0)
        if own and others and own >= others:
            return None, "over its share"
        return None, "no capacity"

    def _take_newest_of_largest(self, band: int) -> Waiting:
        tenants = self._bands[band]
        tenant = max(tenants, key=lambda t: len(tenants[t]))
        queue = tenants[tenant]
        item = queue.pop()
        if not queue:
            del tenants[tenant]
        self._len -= 1
        return item
