"""JSON merge patches (RFC 7386), as `cubeserve rollout` sends them, and the field-by-field
description of what one changes, printed before it is sent."""

from __future__ import annotations

import copy
import json
from typing import Any, Mapping


def merge_patch(target: Any, patch: Any) -> Any:
    """`target` with `patch` applied as the API server applies a JSON merge patch (a copy)."""
    if not isinstance(patch, Mapping):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, Mapping) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def describe_changes(before: Mapping, patch: Mapping, prefix: str = "") -> list[str]:
    """One `path: old -> new` line per field a merge patch changes."""
    lines = []
    for key, value in patch.items():
        path = f"{prefix}.{key}" if prefix else key
        if path == "metadata.resourceVersion":
            continue
        present = isinstance(before, Mapping) and key in before
        old = before[key] if present else None
        if isinstance(value, Mapping) and value:  # merged into the old value
            lines += describe_changes(old if isinstance(old, Mapping) else {}, value, path)
        elif value is None:
            if present:
                lines.append(f"{path}: {_show(old)} -> (removed)")
        else:  # replaces the old value
            lines += _replacement(old, value, path, present)
    return lines


def _replacement(old: Any, new: Any, path: str, present: bool = True) -> list[str]:
    if present and isinstance(old, Mapping) and isinstance(new, Mapping):
        lines = []
        for key in list(old) + [k for k in new if k not in old]:
            lines += _replacement(old.get(key), new.get(key), f"{path}.{key}", key in old) if key in new \
                else [f"{path}.{key}: {_show(old[key])} -> (removed)"]
        return lines
    if present and isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [line for i, (a, b) in enumerate(zip(old, new)) for line in _replacement(a, b, f"{path}[{i}]")]
    if present and old == new:
        return []
    return [f"{path}: {_show(old) if present else '(unset)'} -> {_show(new)}"]


def _show(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def written_paths(patch: Mapping, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The field paths a merge patch sets (not the ones it removes), down to the values it
    writes, and into the objects of a list it writes whole (spec.canary[] is atomic)."""
    paths = []
    for key, value in patch.items():
        path = (*prefix, key)
        if value is None or path == ("metadata", "resourceVersion"):
            continue
        if isinstance(value, Mapping) and value:
            paths += written_paths(value, path)
        elif isinstance(value, list):
            paths.append(path)
            for item in value:
                if isinstance(item, Mapping):
                    paths += written_paths(item, (*path, "[]"))
        else:
            paths.append(path)
    return paths
