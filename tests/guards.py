"""One rule for a test that cannot run on this machine (a tool or runtime missing): under CI
(CI=true, which .ci/run sets) it fails, since a check that quietly stopped running must not pass;
elsewhere it skips with the reason. Tests that need hardware this machine does not have (a
CUDA device) skip with pytest's own marks instead."""

from __future__ import annotations

import os

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() == "true"


def cannot_run(reason: str) -> None:
    if in_ci():
        pytest.fail(f"{reason} (CI=true: it must run)", pytrace=False)
    pytest.skip(reason)
