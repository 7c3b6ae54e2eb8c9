"""The machine a measurement ran on, in words: the GPU's name, or the CPU's model, its vector
ISA (AVX2, AVX-512, AMX: CPU figures differ widely between them) and its cores. Shared by
`cubeserve window-check` and the benchmarks (bench/common.py)."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

# /proc/cpuinfo's flag and its name, narrowest first.
ISA_FLAGS = (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("amx_tile", "AMX"))


def cpu_model_and_flags() -> tuple[str, set[str]]:
    """The CPU's model name and its /proc/cpuinfo flags (none known off Linux)."""
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
    return cpu, flags


def cpu_isa(flags: set[str] | None = None) -> list[str]:
    """The vector ISAs of ISA_FLAGS this CPU has, narrowest first (e.g. ["AVX2", "AVX-512", "AMX"])."""
    flags = cpu_model_and_flags()[1] if flags is None else flags
    return [name for flag, name in ISA_FLAGS if flag in flags]


def hardware(device: torch.device) -> str:
    """One line: the GPU's name on CUDA, else "<CPU model>, <widest ISA>, <N> cores (CPU)"."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpu, flags = cpu_model_and_flags()
    isa = cpu_isa(flags)
    return f"{cpu}, {isa[-1] if isa else 'no AVX2'}, {os.cpu_count()} cores (CPU)"
