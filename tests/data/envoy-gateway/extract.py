"""Writes the Envoy Gateway CRDs that k8s/gateway/ is checked against, beside this script.

    python tests/data/envoy-gateway/extract.py GATEWAY_GIT_DIR v1.9.0

From a clone of github.com/envoyproxy/gateway (Apache-2.0), at the release tag: the Helm chart's
generated CRDs of the kinds k8s/gateway/ uses (`git show TAG:charts/gateway-crds-helm/templates/
generated/gateway.envoyproxy.io_<plural>.yaml`) and the Gateway API CRDs that release bundles
(`charts/gateway-crds-helm/templates/standard-gatewayapi-crds.yaml`: Gateway API v1.6.1, standard
channel), without Helm's `{{- if }}` / `{{- end }}` wrapper lines and with the `description` texts
removed (size only; nothing else changes), as envoy-gateway-TAG.json.gz. tests/test_gateway.py
validates k8s/gateway/ against them.
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

GENERATED = "charts/gateway-crds-helm/templates/generated/gateway.envoyproxy.io_{}.yaml"
GATEWAY_API = "charts/gateway-crds-helm/templates/standard-gatewayapi-crds.yaml"
ENVOY_GATEWAY_KINDS = ("securitypolicies", "backendtrafficpolicies", "clienttrafficpolicies", "backends", "envoyproxies",
                       "envoyextensionpolicies")
GATEWAY_API_KINDS = ("gatewayclasses", "gateways", "httproutes")


def _show(git_dir: str, tag: str, path: str) -> list[dict]:
    text = subprocess.run(["git", "--git-dir", git_dir, "show", f"{tag}:{path}"], check=True,
                          capture_output=True, text=True).stdout
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("{{"))
    return [doc for doc in yaml.safe_load_all(text) if doc]


def main(git_dir: str, tag: str) -> None:
    crds = [doc for kind in ENVOY_GATEWAY_KINDS for doc in _show(git_dir, tag, GENERATED.format(kind))]
    crds += [doc for doc in _show(git_dir, tag, GATEWAY_API)
             if doc.get("kind") == "CustomResourceDefinition" and doc["spec"]["names"]["plural"] in GATEWAY_API_KINDS]
    bundle = {doc["metadata"].get("annotations", {}).get("gateway.networking.k8s.io/bundle-version")
              for doc in crds} - {None}
    body = {"source": f"envoyproxy/gateway {tag}", "gateway-api": sorted(bundle),
            "crds": [strip(doc) for doc in crds]}
    out = Path(__file__).parent / f"envoy-gateway-{tag}.json.gz"
    out.write_bytes(gzip.compress(json.dumps(body, sort_keys=True).encode(), mtime=0))


if __name__ == "__main__":
    main(*sys.argv[1:])
