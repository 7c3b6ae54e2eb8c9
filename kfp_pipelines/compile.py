"""Compile the pipelines for your runtime image (upload the files in the Kubeflow UI): the checkpoint
pipeline (checkpoint_rollout.py) and the batch pipeline (batch_generate.py).

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

from kfp_pipelines import batch_generate
from kfp_pipelines.checkpoint_rollout import PIPELINE_NAME, build

DEFAULT_OUT = Path("outputs") / f"{PIPELINE_NAME}.yaml"
BATCH_OUT = f"{batch_generate.PIPELINE_NAME}.yaml"  # beside --out


def compile_to(image: str, path: str | Path, build=build) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    compiler.Compiler().compile(build(image), str(path))
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image", required=True, help="the cube-serve runtime image every step runs")
    parser.add_argument("--out", default=str(DEFAULT_OUT),
                        help=f"where to write the checkpoint pipeline's YAML (default: %(default)s); the batch "
                             f"pipeline's goes beside it as {BATCH_OUT}")
    args = parser.parse_args(argv)
    try:
        path = compile_to(args.image, args.out)
        batch = compile_to(args.image, Path(args.out).parent / BATCH_OUT, batch_generate.build)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path} and {batch}: upload them in the Kubeflow UI (Pipelines > Upload pipeline)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
