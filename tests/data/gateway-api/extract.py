"""Writes the HTTPRoute schema files beside this script from Gateway API release CRDs.

    python tests/data/gateway-api/extract.py GATEWAY_API_CHECKOUT v1.1.0 v1.2.0 v1.6.1

For each release tag: `git show TAG:config/crd/standard/gateway.networking.k8s.io_httproutes.yaml`
in a checkout of github.com/kubernetes-sigs/gateway-api (Apache-2.0), the OpenAPI v3 schema of
version v1, with the `description` texts removed (size only; nothing else changes), as
httproute-TAG.json. tests/k8s_validation.py checks the HTTPRoute of k8s/overlays/ab against them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from crd_data import strip  # noqa: E402

CRD = "config/crd/standard/gateway.networking.k8s.io_httproutes.yaml"


def main(checkout: str, *tags: str) -> None:
    for tag in tags:
        crd = yaml.safe_load(subprocess.run(["git", "-C", checkout, "show", f"{tag}:{CRD}"], check=True,
                                            capture_output=True, text=True).stdout)
        annotations = crd["metadata"]["annotations"]
        assert annotations["gateway.networking.k8s.io/channel"] == "standard", annotations
        [v1] = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
        body = {"bundle-version": annotations["gateway.networking.k8s.io/bundle-version"],
                "channel": "standard", "source": f"kubernetes-sigs/gateway-api {tag}:{CRD}",
                "openAPIV3Schema": strip(v1["schema"]["openAPIV3Schema"])}
        (Path(__file__).parent / f"httproute-{tag}.json").write_text(json.dumps(body, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
