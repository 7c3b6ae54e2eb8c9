"""KEDA v2.20.2's operator and metrics adapter on a cluster_stack.Stack, as KEDA's own manifests
run them (config/manager, config/metrics-server) but outside a pod: the real controller chain
InferenceService -> ScaledObject (KServe) -> HorizontalPodAutoscaler (KEDA's operator) -> the
Deployment's scale (kube-controller-manager's HPA controller, reading the External metric through
the API server's aggregation layer from KEDA's adapter, which asks the operator over gRPC, which
queries Prometheus).

The network rule holds: every listener takes 127.0.0.1 (the adapter's own /metrics by
cluster/build.py's patch), and the aggregation layer reaches the adapter through a Service of type
ExternalName whose name is 127.0.0.1: kube-apiserver's default resolver makes that
https://127.0.0.1:<the APIService's port> (k8s.io/apiserver pkg/util/proxy/proxy.go,
ResolveEndpoint) and verifies the certificate for keda-metrics-apiserver.keda.svc, as in a pod.
Both KEDA processes act as the admin (KEDA's ClusterRoles are not installed, as for KServe's
manager); the HPA controller acts as its own ServiceAccount, so RBAC's bootstrap role decides
whether it may read external metrics, as on any cluster.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import yaml

import cluster_stack as cs

NAMESPACE = "keda"
OPERATOR_SERVICE = "keda-operator"
ADAPTER_SERVICE = "keda-metrics-apiserver"
APISERVICE = "v1beta1.external.metrics.k8s.io"


def start(stack: cs.Stack) -> dict[str, int]:
    """Starts KEDA on `stack` (stopped with it); returns its ports."""
    comp = cs.build.component("keda")
    ports = {name: cs.free_port() for name in ("operator-metrics", "operator-probe", "operator-grpc",
                                               "adapter", "adapter-metrics")}
    stack.kubectl("create", "namespace", NAMESPACE)
    stack.apply([yaml.safe_load(p.read_text()) for p in sorted((comp.share / "crd").glob("*.yaml"))])
    stack.kubectl("wait", "--for=condition=Established", "crd", "--all", "--timeout=60s")

    # One certificate for the operator's gRPC server, the adapter's client of it (mutual TLS, both
    # read tls.crt, tls.key and ca.crt from one folder) and the adapter's HTTPS server.
    certs = stack.root / "keda-certs"
    certs.mkdir()
    svc = lambda name: (f"{name}.{NAMESPACE}.svc", f"{name}.{NAMESPACE}.svc.cluster.local")  # noqa: E731
    cert, key = stack.pki.issue("keda", "keda", server=True, client_too=True,
                                hosts=(*svc(OPERATOR_SERVICE), *svc(ADAPTER_SERVICE), "127.0.0.1", "localhost"))
    for name, path in (("tls.crt", cert), ("tls.key", key), ("ca.crt", stack.pki.ca_file)):
        (certs / name).write_bytes(path.read_bytes())
    # The CAs the scalers trust (--ca-dir): every file there must be a certificate.
    (certs / "ca").mkdir()
    (certs / "ca" / "ca.crt").write_bytes(stack.pki.ca_file.read_bytes())
    env = {"KUBECONFIG": str(stack.kubeconfig), "WATCH_NAMESPACE": "", "POD_NAMESPACE": NAMESPACE,
           "KEDA_CLUSTER_OBJECT_NAMESPACE": NAMESPACE}

    stack._start("keda-operator", [
        str(comp.binary("keda-operator")), "--leader-elect=false", "--enable-cert-rotation=false",
        f"--cert-dir={certs}", f"--ca-dir={certs / 'ca'}", "--zap-log-level=info",
        f"--metrics-bind-address=127.0.0.1:{ports['operator-metrics']}",
        f"--health-probe-bind-address=127.0.0.1:{ports['operator-probe']}",
        f"--metrics-service-bind-address=127.0.0.1:{ports['operator-grpc']}"], env=env)
    stack._wait("keda-operator", lambda: stack._get(f"http://127.0.0.1:{ports['operator-probe']}/readyz") == "ok", 120)

    stack._start("keda-adapter", [
        str(comp.binary("keda-adapter")), "--bind-address=127.0.0.1", f"--secure-port={ports['adapter']}",
        f"--cert-dir={certs}", f"--tls-cert-file={certs / 'tls.crt'}", f"--tls-private-key-file={certs / 'tls.key'}",
        f"--lister-kubeconfig={stack.kubeconfig}", f"--authentication-kubeconfig={stack.kubeconfig}",
        f"--authorization-kubeconfig={stack.kubeconfig}", f"--port={ports['adapter-metrics']}",
        f"--metrics-service-address=127.0.0.1:{ports['operator-grpc']}",
        f"--metrics-service-grpc-authority={OPERATOR_SERVICE}.{NAMESPACE}.svc"], env=env)
    stack._wait("keda-adapter", lambda: stack._get(f"https://127.0.0.1:{ports['adapter']}/readyz",
                                                   stack._self_signed()) == "ok", 120)

    ca = base64.b64encode(stack.pki.ca_file.read_bytes()).decode()
    stack.apply([
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": ADAPTER_SERVICE, "namespace": NAMESPACE},
         "spec": {"type": "ExternalName", "externalName": "127.0.0.1"}},
        {"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService", "metadata": {"name": APISERVICE},
         "spec": {"group": "external.metrics.k8s.io", "version": "v1beta1", "caBundle": ca,
                  "groupPriorityMinimum": 100, "versionPriority": 100,
                  "service": {"name": ADAPTER_SERVICE, "namespace": NAMESPACE, "port": ports["adapter"]}}}])
    stack._wait("the external metrics API (KEDA's APIService Available)", lambda: _available(stack), 120)
    return ports


def _available(stack: cs.Stack) -> bool:
    conditions = (stack.get("apiservice", APISERVICE) or {}).get("status", {}).get("conditions", [])
    return any(c["type"] == "Available" and c["status"] == "True" for c in conditions)


def external_metric(stack: cs.Stack, namespace: str, metric: str, scaled_object: str) -> float:
    """The External metric's value as the HPA controller reads it (through the aggregation layer)."""
    path = (f"/apis/external.metrics.k8s.io/v1beta1/namespaces/{namespace}/{metric}"
            f"?labelSelector=scaledobject.keda.sh%2Fname%3D{scaled_object}")
    items = json.loads(stack.kubectl("get", "--raw", path).stdout)["items"]
    return sum(quantity(i["value"]) for i in items)


def quantity(text: str) -> float:
    # The external metrics API writes values as resource quantities: "24", "2500m".
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


