"""Writes the RayJob schema file beside this script from a KubeRay release's CRD.

    python tests/data/kuberay/extract.py KUBERAY_CHECKOUT v1.7.0

For each release tag: `git show TAG:ray-operator/config/crd/bases/ray.io_rayjobs.yaml` in a
checkout of github.com/ray-project/kuberay (Apache-2.0), the OpenAPI v3 schema of version v1,
with the `description` texts removed (size only; nothing else changes), as rayjob-TAG.json.gz.
tests/test_batch.py checks k8s/batch/'s RayJob, and what the batch pipeline's step creates,
against it.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from crd_data import strip  # noqa: E402

CRD = "ray-operator/config/crd/bases/ray.io_rayjobs.yaml"


def main(checkout: str, *tags: str) -> None:
    for tag in tags:
        crd = yaml.safe_load(subprocess.run(["git", "-C", checkout, "show", f"{tag}:{CRD}"], check=True,
                                            capture_output=True, text=True).stdout)
        [v1] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
        body = {"source": f"ray-project/kuberay {tag}:{CRD}", "group": crd["spec"]["group"],
                "kind": crd["spec"]["names"]["kind"], "plural": crd["spec"]["names"]["plural"],
                "openAPIV3Schema": strip(v1["schema"]["openAPIV3Schema"])}
        data = json.dumps(body, sort_keys=True).encode() + b"\n"
        (Path(__file__).parent / f"rayjob-{tag}.json.gz").write_bytes(gzip.compress(data, mtime=0))


if __name__ == "__main__":
    main(*sys.argv[1:])
