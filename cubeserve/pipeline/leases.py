"""Pipeline runs that overlap: who gets a version number, and who may change what is served.

Two runs started together must not package two checkpoints as the same version N, and only one
may roll out at a time: a roll-out sets the `challenger` alias, changes what the server (or the
InferenceService) serves, and its exit handler undoes that after a failure. Both rules live in
the model store, the one place every run of a model shares, as S3 conditional writes
(`storage.write_if`):

* **version claims**: version N is taken by creating `<model_store>/<N>.claim` with
  `If-None-Match: *`; the run that loses takes N+1;
* **the roll-out lease**: `<model_store>/.rollout-lease.json` names the pipeline run that holds
  the roll-out and until when. A run takes it when it is free, released or expired, by a
  write conditional on what it read (`If-Match`), and gives it back the same way; a run that
  finds it held by another run is refused (the step fails, naming the holder), and a later run
  of the same checkpoint resumes the roll-out.

A store that ignores conditional writes (rclone's `serve s3`, which `make pipeline` uses)
accepts every write: `storage.honours_conditional_writes` finds that out and the steps say so;
nothing is then protected against overlapping runs.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from cubeserve import storage

LEASE_OBJECT = ".rollout-lease.json"
MAX_CLAIM_TRIES = 100


def _iso(epoch: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def claim_uri(model_store: str, version: int) -> str:
    return storage.join(model_store, f"{version}.claim")


def claim_version(model_store: str, first: int, owner: dict) -> int:
    """The first version number from `first` whose claim this call creates (`owner`, e.g. the
    checkpoint's digest, is written into it)."""
    for version in range(first, first + MAX_CLAIM_TRIES):
        try:
            storage.write_if(claim_uri(model_store, version), json.dumps({"version": version, **owner,
                                                                          "claimed": _iso(time.time())}), None)
            return version
        except storage.PreconditionFailed:
            continue  # another run has it
    raise storage.StorageError(f"{model_store}: versions {first} to {first + MAX_CLAIM_TRIES - 1} are all claimed")


class LeaseHeld(RuntimeError):
    """Another pipeline run holds the roll-out."""


@dataclass(frozen=True)
class Lease:
    owner: str  # the pipeline run id; "" when released
    version: str  # the registry version being rolled out
    expires: float  # epoch seconds
    etag: str = ""

    def held_by_other(self, owner: str, now: float) -> bool:
        return bool(self.owner) and self.owner != owner and self.expires > now

    def describe(self) -> str:
        return f"pipeline run {self.owner} holds it (version {self.version}) until {_iso(self.expires)}"


def lease_uri(model_store: str) -> str:
    return storage.join(model_store, LEASE_OBJECT)


def read_lease(model_store: str) -> Lease | None:
    found = storage.read_versioned(lease_uri(model_store))
    if found is None:
        return None
    record = json.loads(found[0])
    return Lease(record.get("owner", ""), str(record.get("version", "")), float(record.get("expires", 0)), found[1])


def acquire(model_store: str, owner: str, version: str, seconds: float) -> Lease:
    """Take (or renew) the roll-out lease for `seconds`; LeaseHeld when another run holds it."""
    for _ in range(10):
        now = time.time()
        current = read_lease(model_store)
        if current is not None and current.held_by_other(owner, now):
            raise LeaseHeld(f"the roll-out of {model_store} is taken: {current.describe()}")
        record = {"owner": owner, "version": version, "expires": now + seconds, "acquired": _iso(now)}
        try:
            etag = storage.write_if(lease_uri(model_store), json.dumps(record), None if current is None else current.etag)
            return Lease(owner, version, now + seconds, etag)
        except storage.PreconditionFailed:
            continue  # another run wrote it between the read and the write: look again
    raise LeaseHeld(f"the roll-out lease of {model_store} keeps changing: another run is taking it")


def release(model_store: str, owner: str) -> bool:
    """Give the lease back if `owner` holds it; False when it does not (then nothing changes)."""
    for _ in range(10):
        current = read_lease(model_store)
        if current is None or current.owner != owner:
            return False
        record = {"owner": "", "version": "", "expires": 0, "released": _iso(time.time()), "previous_owner": owner}
        try:
            storage.write_if(lease_uri(model_store), json.dumps(record), current.etag)
            return True
        except storage.PreconditionFailed:
            continue
    return False


def holds(model_store: str, owner: str) -> bool:
    """Whether `owner` holds the lease now (expired or not: nobody took it over)."""
    current = read_lease(model_store)
    return current is not None and current.owner == owner


def unprotected_warning(model_store: str) -> str:
    """A warning for a store that ignores conditional writes ("" when it honours them)."""
    if storage.honours_conditional_writes(model_store):
        return ""
    return (f"warning: the store {model_store} ignores S3 conditional writes (If-None-Match, If-Match): "
            "version claims and the roll-out lease do not protect runs that overlap there")
