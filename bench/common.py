"""Shared benchmark plumbing: hardware description, records, and the results files."""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

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


def hardware(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
            if cpu and flags:
                break
    except OSError:
        pass
    # The widest vector ISA: CPU figures differ between AVX2-only and AMX machines.
    isa = next((name for flag, name in (("amx_tile", "AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))
                if flag in flags), "no AVX2")
    return f"{cpu}, {isa}, {os.cpu_count()} cores (CPU)"


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
