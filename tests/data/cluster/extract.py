"""Writes the CRDs that the cluster tests (tests/test_cluster.py) install for the manifests outside
KServe, beside this script: KEDA's (KServe's manager watches ScaledObjects where the CRD exists),
KubeRay's (k8s/batch) and the Prometheus Operator's (k8s/monitoring). KServe's CRDs are
tests/data/kserve/, Envoy Gateway's and the Gateway API's tests/data/envoy-gateway/.

    python tests/data/cluster/extract.py keda v2.20.2 DIR
    python tests/data/cluster/extract.py kuberay v1.7.0 DIR
    python tests/data/cluster/extract.py prometheus-operator v0.85.0 DIR

DIR holds the project's CRD files as tagged (Apache-2.0): kedacore/keda `config/crd/bases/`,
ray-project/kuberay `ray-operator/config/crd/bases/`, prometheus-operator/prometheus-operator
`example/prometheus-operator-crd/` (the last is in its Go module's zip: `go mod download -json
github.com/prometheus-operator/prometheus-operator@v0.85.0`, field Dir). The kinds below, with
their `description` texts removed (size only; nothing else changes), gzipped with a fixed
timestamp, as PROJECT-TAG.json.gz: {"source": ..., "crds": [CRD, ...]}.
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from crd_data import strip  # noqa: E402

PROJECTS = {
    "keda": ("kedacore/keda", "config/crd/bases", ("keda.sh_scaledobjects.yaml", "keda.sh_triggerauthentications.yaml")),
    "kuberay": ("ray-project/kuberay", "ray-operator/config/crd/bases", ("ray.io_rayclusters.yaml", "ray.io_rayjobs.yaml")),
    "prometheus-operator": ("prometheus-operator/prometheus-operator", "example/prometheus-operator-crd",
                            ("monitoring.coreos.com_podmonitors.yaml", "monitoring.coreos.com_prometheusrules.yaml")),
}


def main(project: str, tag: str, directory: str) -> None:
    repository, path, files = PROJECTS[project]
    crds = [strip(yaml.safe_load((Path(directory) / name).read_text())) for name in files]
    body = {"source": f"{repository} {tag}:{path}/", "crds": crds}
    out = Path(__file__).parent / f"{project}-{tag}.json.gz"
    out.write_bytes(gzip.compress(json.dumps(body, sort_keys=True).encode(), compresslevel=9, mtime=0))


if __name__ == "__main__":
    main(*sys.argv[1:])
