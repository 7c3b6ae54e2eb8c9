"""Each end-to-end make target builds what its own tests need, so that it passes run alone on a fresh
machine, in any order (.ci/run runs them one after another on a machine with no caches). A target
whose tests need a Go program that only another target builds passes wherever that other target ran
first and fails on a new machine: these tests read what `make -n` would run and compare."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

import go_programs

REPO = Path(__file__).resolve().parents[1]
build = go_programs.build

# The pytest markers `make test` leaves out -> the make target that runs them and what their
# fixtures check is built (the same functions the fixtures call).
END_TO_END = {
    "image": ("image-test", lambda: []),
    "cluster": ("cluster-test", lambda: [c for r in build.kserve_releases() for c in go_programs.cluster_needs(r)]),
    "gateway_e2e": ("gateway-e2e-test", go_programs.traces_need),
    "scale": ("scale-test", lambda: []),
    "soak": ("soak-test", lambda: []),
    "node": ("node-test", lambda: go_programs.node_needs(build.kserve_releases()[0])),
    "autoscaling": ("autoscaling-test", lambda: go_programs.autoscaling_needs(build.kserve_releases()[0])),
}


def dry_run(target: str) -> list[list[str]]:
    """The commands `make TARGET` would run with nothing up to date (-B), split as the shell would."""
    out = subprocess.run(["make", "-n", "-B", target], cwd=REPO, capture_output=True, text=True, check=True).stdout
    return [shlex.split(line) for line in out.splitlines() if line.strip()]


def built_by(commands: list[list[str]]) -> set[str]:
    """What the cluster/build.py commands among `commands` build, as <name>-<version>."""
    keys = set()
    for words in commands:
        for i, word in enumerate(words):
            if word.endswith("cluster/build.py"):
                args = [w for w in words[i + 1:] if not w.startswith("-")]
                keys |= {c.key for c in build.select(args)}
    return keys


def pytest_marker(commands: list[list[str]]) -> str | None:
    """The -m expression of the first pytest command (`python -m pytest ... -m EXPR`)."""
    for words in commands:
        if "pytest" in words:
            args = words[words.index("pytest") + 1:]
            if "-m" in args:
                return args[args.index("-m") + 1]
    return None


@pytest.mark.parametrize("marker", sorted(END_TO_END))
def test_a_target_builds_every_program_its_tests_check(marker):
    target, needs = END_TO_END[marker]
    commands = dry_run(target)
    assert pytest_marker(commands) == marker, f"`make {target}` does not run the tests marked {marker}"
    missing = {c.key for c in needs()} - built_by(commands)
    assert not missing, (f"the {marker} tests need {sorted(missing)}, which `make {target}` does not build: "
                         f"on a machine where no other target ran first they cannot start")


def test_every_marker_make_test_leaves_out_has_a_target_that_ci_runs():
    (test_marker,) = [pytest_marker([w]) for w in dry_run("test") if "pytest" in w]
    left_out = set(re.findall(r"not (\w+)", test_marker))
    assert left_out == set(END_TO_END), f"`make test` leaves out {sorted(left_out)}; END_TO_END has {sorted(END_TO_END)}"
    ci = (REPO / ".ci" / "run").read_text()
    ran = re.findall(r"^make ([\w-]+)\s*$", ci, flags=re.M)
    assert ran[0] == "test", ".ci/run must run the README's test command first"
    assert {t for t, _ in END_TO_END.values()} <= set(ran), f".ci/run runs {ran}"


def test_the_groups_split_the_programs():
    """Every wrapper in cluster/go/ belongs to a group a make target builds, and no default build
    builds a program no test needs."""
    everything = {c.key for c in build.components()}
    per_group = {g: {c.key for c in build.required(g)} for g in build.GROUPS}
    assert set().union(*per_group.values()) == everything
    assert {c.key for c in build.select([])} == per_group[build.DEFAULT_GROUP]
    needed = set().union(*({c.key for c in needs()} for _, needs in END_TO_END.values()))
    assert needed == everything, f"built but needed by no end-to-end target: {sorted(everything - needed)}"
