"""Compile the checkpoint pipeline for your runtime image (upload the file in the Kubeflow UI).

    python -m kfp_pipelines.compile --image REGISTRY/cube-serve:TAG [--out FILE]

The image is the one built from k8s/Dockerfile and pushed where the cluster can pull it; every
step runs in it. There is no default: a pipeline naming an image that does not exist would
start and then hang in ImagePullBackOff.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kfp import compiler

from kfp_pipelines.checkpoint_rollout import PIPELINE_NAME, build

DEFAULT_OUT = Path("outputs") / f"{PIPELINE_NAME}.yaml"


def compile_to(image: str, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(build(image), str(path))
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", required=True, help="the cube-serve runtime image every step runs")
    parser.add_argument("--out", default=str(DEFAULT_OUT), help="where to write the YAML (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        path = compile_to(args.image, args.out)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path}: upload it in the Kubeflow UI (Pipelines > Upload pipeline)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
