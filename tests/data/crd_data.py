"""What the extract.py scripts below this folder share: a CRD without its `description` texts
(size only; nothing else changes)."""

from __future__ import annotations


def strip(node):
    if isinstance(node, dict):
        return {k: strip(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [strip(v) for v in node]
    return node
