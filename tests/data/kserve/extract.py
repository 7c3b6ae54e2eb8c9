"""Writes the KServe CRD files beside this script from KServe's release tags, so that a clone of
this repository with nothing beside it validates the manifests (tests/k8s_validation.py).

    python tests/data/kserve/extract.py KSERVE_CHECKOUT v0.14.0 v0.15.0 v0.16.0 v0.19.0 v0.20.0 aaac4e294

For each tag (or commit): `git show REF:config/crd/full/serving.kserve.io_{inferenceservices,
inferencegraphs,servingruntimes}.yaml` in a checkout of github.com/kserve/kserve (Apache-2.0),
the CustomResourceDefinitions with their `description` texts removed (size only; nothing else
changes), gzipped with a fixed timestamp (the same input gives the same bytes), as REF.json.gz:
{"source": ..., "crds": {file name: CRD}}. The commit after v0.20.0 (aaac4e294, 2026-08-21) is
the newest published schema, "newest.json.gz".
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

FILES = ("serving.kserve.io_inferenceservices.yaml", "serving.kserve.io_inferencegraphs.yaml",
         "serving.kserve.io_servingruntimes.yaml")
NEWEST = "aaac4e294"


def main(checkout: str, *refs: str) -> None:
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    for ref in refs:
        crds = {}
        for name in FILES:
            text = subprocess.run(["git", "-C", checkout, "show", f"{ref}:config/crd/full/{name}"], check=True,
                                  capture_output=True, text=True).stdout
            crds[name] = strip(yaml.load(text, Loader=loader))
        body = json.dumps({"source": f"kserve/kserve {ref}:config/crd/full/", "crds": crds}, sort_keys=True)
        out = Path(__file__).parent / f"{'newest' if ref == NEWEST else ref}.json.gz"
        out.write_bytes(gzip.compress(body.encode(), compresslevel=9, mtime=0))


if __name__ == "__main__":
    main(*sys.argv[1:])
