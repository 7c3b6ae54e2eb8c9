"""Compile every pipeline to the YAML checked in beside it (upload that file in the Kubeflow UI).

    python -m kfp_pipelines.compile            # rewrite the YAML files
    python -m kfp_pipelines.compile --check    # exit 1 if one is stale (what the tests check)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from kfp import compiler

from kfp_pipelines import checkpoint_rollout

HERE = Path(__file__).parent
# (pipeline function, compiled file) for each pipeline of this package.
PIPELINES = [(checkpoint_rollout.checkpoint_rollout, HERE / "checkpoint_rollout.yaml")]


def compile_to(pipeline, path: Path) -> None:
    compiler.Compiler().compile(pipeline, str(path))


def stale() -> list[Path]:
    """Checked-in YAML files that differ from a fresh compile."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for pipeline, path in PIPELINES:
            fresh = Path(tmp) / path.name
            compile_to(pipeline, fresh)
            if not path.exists() or path.read_text() != fresh.read_text():
                out.append(path)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only report stale YAML files")
    args = parser.parse_args(argv)
    if args.check:
        bad = stale()
        for path in bad:
            print(f"{path} is stale: run python -m kfp_pipelines.compile", file=sys.stderr)
        return 1 if bad else 0
    for pipeline, path in PIPELINES:
        compile_to(pipeline, path)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
