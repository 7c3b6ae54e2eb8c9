"""cluster/build.py, loaded once for the tests, and what each end-to-end target needs of it. The
fixtures check exactly these (and nothing else), and tests/test_ci_targets.py holds each make target
to building them, so a target run by itself on a fresh machine finds everything its tests need."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _load():
    module = sys.modules.get("cluster_build")
    if module is None:
        spec = importlib.util.spec_from_file_location("cluster_build", REPO / "cluster" / "build.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["cluster_build"] = module
        spec.loader.exec_module(module)
    return module


build = _load()


def cluster_needs(kserve_release: str) -> list:
    """tests/test_cluster.py's stack for one KServe release (`make cluster-test`)."""
    return build.required("control-plane", kserve_release)


def traces_need() -> list:
    """tests/trace_backend.py's Jaeger (`make gateway-e2e-test`)."""
    return build.required("trace-backend")


def not_built(components: list) -> list[str]:
    env = build.go_env()
    return [c.key for c in components if not build.is_built(c, env)]


def node_needs(kserve_release: str) -> list:
    """tests/test_node.py's stack and its real node (`make node-test`)."""
    return build.required("control-plane", kserve_release) + build.required("node")


def autoscaling_needs(kserve_release: str) -> list:
    """tests/test_keda.py's stack and KEDA (`make autoscaling-test`)."""
    return build.required("control-plane", kserve_release) + build.required("autoscaling")
