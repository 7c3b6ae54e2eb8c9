"""Shared benchmark plumbing: hardware description, records, and the results files."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from cubeserve.hardware import hardware  # noqa: F401  (the benchmarks import it from here)

RESULTS_JSON = Path(__file__).parent / "results.json"


@dataclass
class Record:
    """One measurement (the schema of bench/results.json)."""

    section: str
    device: str
    config: str
    mode: str
    objects_in_flight: int
    ms_per_token: float | None = None
    objects_per_second: float | None = None
    gb_per_second: float | None = None
    extra: dict = field(default_factory=dict)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeat: int = 1) -> float:
    """Best wall time of `repeat` runs of fn(), seconds."""
    best = float("inf")
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def write_results(records: list[Record], header: dict) -> None:
    """Merge these records into bench/results.json (replacing earlier ones of the same
    section, device and config), keeping the others as they were measured."""
    existing = []
    if RESULTS_JSON.exists():
        existing = json.loads(RESULTS_JSON.read_text()).get("records", [])
    keys = {(r.section, r.device, r.config) for r in records}
    kept = [r for r in existing if (r["section"], r["device"], r["config"]) not in keys]
    data = {"generated": header, "records": kept + [asdict(r) for r in records]}
    RESULTS_JSON.write_text(json.dumps(data, indent=2) + "\n")
