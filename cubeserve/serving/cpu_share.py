"""How many engine processes of one model a pod runs, so that they divide the pod's CPUs.

Triton's python backend runs every model instance in its own stub process, and `cube3d_stream`
(the model that owns an engine) has one instance per instance_group count (times its GPUs, for
KIND_GPU) for every version its version policy loads: one in the shipped configuration, two or
more in a pod that serves an A/B or shadow experiment from a version set. Each engine sizes
PyTorch's thread team from the pod's CPU quota (engine/threads.py); several engines each taking
the whole quota would run teams of Q threads apiece on Q CPUs, and a team whose threads wait for
a descheduled one at every barrier costs far more than its share (BENCHMARKS.md, "Shared CPU
nodes"). So each takes quota // engines threads (at least 1).

Not counted: the predict model's stub (`cube3d`: it forwards, no kernels), tritonserver and the
front end, and each engine's marching cubes worker (one thread, while a mesh is made). Nor a
version that is unloading while its successor loads: for those seconds the old one finishes
what it holds and the new one is idle.
"""

from __future__ import annotations

from pathlib import Path


def version_dirs(model_dir: str | Path) -> list[int]:
    """The numeric version directories of a model in a Triton repository."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        return []
    return sorted(int(p.name) for p in model_dir.iterdir() if p.is_dir() and p.name.isdigit())


def loaded_versions(model_config: dict, model_dir: str | Path) -> int:
    """How many versions the config's version_policy loads from `model_dir` (at least 1: the
    caller is one of them). Triton's default policy is the latest one."""
    present = version_dirs(model_dir)
    policy = model_config.get("version_policy") or {"latest": {"num_versions": 1}}
    if "specific" in policy:
        wanted = {int(v) for v in (policy["specific"] or {}).get("versions", [])}
        count = len(wanted & set(present)) if present else len(wanted)
    elif "all" in policy:
        count = len(present)
    else:
        count = min(int((policy.get("latest") or {}).get("num_versions", 1) or 1), len(present) or 1)
    return max(1, count)


def instances(model_config: dict) -> int:
    """Model instances (stub processes) per loaded version: the instance groups' counts, a
    KIND_GPU group's once for each of its GPUs."""
    total = 0
    for group in model_config.get("instance_group") or [{}]:
        count = int(group.get("count", 1) or 1)
        gpus = group.get("gpus") or []
        total += count * (len(gpus) if group.get("kind") == "KIND_GPU" and gpus else 1)
    return max(1, total)


def engine_processes(model_config: dict, model_dir: str | Path) -> int:
    """Engine processes of this model in the pod: instances x loaded versions."""
    return instances(model_config) * loaded_versions(model_config, model_dir)
