"""Knative Serving v0.48.1's controller and webhook (the release KServe v0.20.0 pins) on a
cluster_stack.Stack, as Knative's own manifests run them (config/core/deployments/controller.yaml,
webhook.yaml) but outside a pod: the real chain InferenceService (Serverless) -> Knative Service
(KServe's manager) -> Configuration, Route -> Revision -> Deployment, PodAutoscaler, KIngress
(Knative's controller) -> pods (kube-controller-manager, kube-scheduler, KWOK: Running and Ready
without a process).

Knative's CRDs and its config-* ConfigMaps come from the module zips the binaries were built from
(cluster/build.py, _knative_assets), and `start` runs before KServe's manager starts
(Stack(before_kserve=...)): KServe v0.20.0 watches Knative Services only where their CRD is
served when it starts (pkg/controller/v1beta1/inferenceservice/controller.go SetupWithManager,
629) and reads Knative's config-autoscaler for each Serverless InferenceService (241-260).

What does not run, and what the test does in its place (`settle`):
* No networking layer (Istio, Kourier, ...): nothing reconciles the KIngress that the Route
  makes, so its status is written by the test (`kubectl patch --subresource=status`: Ready, the
  generation observed, a load balancer named under .invalid) as a networking layer would; the
  Route then propagates it (pkg/reconciler/route/route.go ReconcileKind).
* No autoscaler (KPA) or activator: Knative's autoscaler would scrape the pods' IPs (KWOK's fake
  10.244.x addresses, which nothing here may dial), so the PodAutoscaler's status is written by
  the test once the revision's Deployment has ready replicas: Ready, Active, ScaleTargetInitialized
  and SKSReady True, serviceName the revision's name, desired and actual scale the ready
  replicas, as pkg/reconciler/autoscaling/kpa/kpa.go would with an activated SKS. The revision
  reconciler reads it (pkg/apis/serving/v1/revision_lifecycle.go PropagateAutoscalerStatus).

The network rule holds: the patched knative.dev/pkg binds every listener of both processes to
127.0.0.1 (cluster/build.py, _KNATIVE_*_LOOPBACK), the Prometheus exporter is off
(config-observability's default) and bound to 127.0.0.1 if turned on (METRICS_PROMETHEUS_HOST),
the revision reconciler resolves no image tag to a digest (config-deployment's
registries-skipping-tag-resolving names every registry the manifests use; it would otherwise ask
the registry: pkg/reconciler/revision/resolve.go Resolve), and the webhooks are registered by URL
(https://127.0.0.1:PORT/<path>) with the stack's CA, which signed the webhook's serving certificate
in the Secret webhook-certs. Knative's own webhook reconcilers expect a Service reference (knative.dev/pkg
webhook/resourcesemantics/defaulting/defaulting.go 257, validation/reconcile_config.go 225): they
log "missing service reference" and leave these configurations as registered, with the rules of
Knative's own config/core/webhooks/ manifests. Both processes act as the admin (Knative's
ClusterRoles are not installed, as for KServe's manager). The controller logs "Failed to create
resolver transport" once: it reads the in-pod CA file (pkg/reconciler/revision/controller.go 115,
resolve.go 44), which a process outside a pod lacks; the transport serves tag resolution only,
which is off here.
"""

from __future__ import annotations

import base64
import json

import yaml

import cluster_stack as cs

NAMESPACE = "knative-serving"
# Every registry the repository's manifests and KServe's config name: Knative resolves no tag of
# theirs (config-deployment, registries-skipping-tag-resolving; the default three kept).
SKIPPED_REGISTRIES = ("kind.local", "ko.local", "dev.local", "registry.example.com", "index.docker.io", "docker.io",
                      "registry.invalid")
QUEUE_IMAGE = "registry.invalid/knative/queue:v0.48.1"  # never pulled: KWOK runs no container
WEBHOOK_PATHS = {"webhook.serving.knative.dev": "/defaulting",  # cmd/webhook/main.go 107-160
                 "validation.webhook.serving.knative.dev": "/resource-validation",
                 "config.webhook.serving.knative.dev": "/config-validation"}


def component():
    return cs.build.component("knative-serving")


def _docs(path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def configmaps() -> list[dict]:
    """Knative's config-* ConfigMaps as shipped, but config-deployment (the queue-proxy image, which
    its shipped `ko://` reference is not, and no tag resolution: see the module docstring)."""
    share = component().share / "config"
    found = []
    for path in sorted(share.glob("*.yaml")):
        for doc in _docs(path):
            if doc.get("kind") != "ConfigMap":
                continue
            if doc["metadata"]["name"] == "config-deployment":
                doc["data"]["queue-sidecar-image"] = QUEUE_IMAGE
                doc["data"]["registries-skipping-tag-resolving"] = ",".join(SKIPPED_REGISTRIES)
            found.append(doc)
    return found


def start(stack: cs.Stack) -> dict[str, int]:
    """Installs Knative's CRDs and configuration and starts its webhook and controller on `stack`
    (stopped with it); returns their ports. Pass as Stack(before_kserve=start)."""
    comp = component()
    ports = {name: cs.free_port() for name in ("webhook", "webhook-profiling", "webhook-metrics",
                                               "controller-profiling", "controller-metrics", "controller-probes")}
    stack.kubectl("create", "namespace", NAMESPACE)
    crds = [d for p in sorted((comp.share / "crd").glob("*.yaml")) for d in _docs(p)]
    stack.apply(crds)
    for crd in crds:
        stack.kubectl("wait", "--for=condition=Established", f"crd/{crd['metadata']['name']}", "--timeout=60s")
    stack.apply(configmaps())

    # The webhook's serving certificate, from the stack's CA, in the Secret Knative's certificates
    # reconciler keeps (webhook/certificates/certificates.go reconcileCertificate 65-110: kept as it
    # is while it has the three keys and is valid for more than a day).
    cert, key = stack.pki.issue("knative-webhook", "webhook.knative-serving.svc", server=True,
                                hosts=("127.0.0.1", "webhook.knative-serving.svc"), days=1.5)
    stack.apply([{"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "webhook-certs", "namespace": NAMESPACE},
                  "data": {name: base64.b64encode(path.read_bytes()).decode() for name, path in
                           (("server-cert.pem", cert), ("server-key.pem", key), ("ca-cert.pem", stack.pki.ca_file))}}])

    env = {"KUBECONFIG": str(stack.kubeconfig), "SYSTEM_NAMESPACE": NAMESPACE, "CONFIG_LOGGING_NAME": "config-logging",
           "CONFIG_OBSERVABILITY_NAME": "config-observability", "METRICS_PROMETHEUS_HOST": "127.0.0.1"}
    stack._start("knative-webhook", [str(comp.binary("webhook")), f"--kubeconfig={stack.kubeconfig}", "--disable-ha"],
                 env={**env, "POD_NAME": "knative-webhook", "WEBHOOK_NAME": "webhook",
                      "WEBHOOK_PORT": str(ports["webhook"]), "PROFILING_PORT": str(ports["webhook-profiling"]),
                      "METRICS_PROMETHEUS_PORT": str(ports["webhook-metrics"])})
    # The webhook answers on its port once its informers have synced (webhook/webhook.go Run).
    stack._wait("knative-webhook", lambda: _tls_up(stack, ports["webhook"]), 120)

    ca = base64.b64encode(stack.pki.ca_file.read_bytes()).decode()
    configurations = [d for p in sorted((comp.share / "config").glob("*.yaml")) for d in _docs(p)
                      if d.get("kind", "").endswith("WebhookConfiguration")]
    for configuration in configurations:
        for hook in configuration["webhooks"]:
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{ports['webhook']}{WEBHOOK_PATHS[hook['name']]}",
                                    "caBundle": ca}
    stack.apply(configurations)
    # The configuration as applied passes Knative's own ConfigMap validation (a server-side dry
    # run through the webhook just registered).
    stack._wait("Knative's webhooks (the ConfigMaps, a server-side dry run through them)", lambda: stack.kubectl(
        "apply", "--server-side", "--field-manager=cube-serve-tests", "--dry-run=server", "-f", "-",
        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": configmaps()}), check=False).returncode == 0, 60)

    # The controller has no --disable-ha (cmd/controller/main.go calls sharedmain.MainWithConfig, which
    # defines none): it takes its leader election Leases in knative-serving, alone, at once.
    stack._start("knative-controller", [str(comp.binary("controller")), f"--kubeconfig={stack.kubeconfig}"],
                 env={**env, "POD_NAME": "knative-controller", "PROFILING_PORT": str(ports["controller-profiling"]),
                      "METRICS_PROMETHEUS_PORT": str(ports["controller-metrics"]),
                      "PROBES_PORT": str(ports["controller-probes"])})
    stack._wait("knative-controller", lambda: stack._get(
        f"http://127.0.0.1:{ports['controller-probes']}/readiness") is not None, 120)
    return ports


def _tls_up(stack: cs.Stack, port: int) -> bool:
    import socket
    import ssl

    context = ssl.create_default_context(cafile=str(stack.pki.ca_file))
    with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
        with context.wrap_socket(sock, server_hostname="127.0.0.1"):
            return True


# -- what a networking layer and Knative's autoscaler would write -------------------------------

def _patch_status(stack: cs.Stack, kind: str, name: str, ns: str, status: dict) -> None:
    stack.kubectl("patch", kind, name, "-n", ns, "--subresource=status", "--type=merge",
                  "-p", json.dumps({"status": status}))


def _true(*types: str) -> list[dict]:
    return [{"type": t, "status": "True"} for t in types]


def settle(stack: cs.Stack, ns: str) -> list[str]:
    """Writes, once, the status a networking layer and Knative's autoscaler would write where it
    is missing or stale (module docstring): every KIngress whose generation is not observed yet,
    and the PodAutoscaler of every revision whose Deployment has ready replicas. Returns what it
    wrote, e.g. ["ingress cube3d-predictor", "podautoscaler cube3d-predictor-00001"]."""
    wrote = []
    for ingress in stack.get("ingresses.networking.internal.knative.dev", None, ns)["items"]:
        meta, status = ingress["metadata"], ingress.get("status") or {}
        if status.get("observedGeneration") == meta["generation"] and _ready(ingress):
            continue
        balancer = {"ingress": [{"domainInternal": f"{meta['name']}.ingress.invalid"}]}
        _patch_status(stack, "ingresses.networking.internal.knative.dev", meta["name"], ns, {
            "observedGeneration": meta["generation"],
            "conditions": _true("LoadBalancerReady", "NetworkConfigured", "Ready"),
            "publicLoadBalancer": balancer, "privateLoadBalancer": balancer})
        wrote.append(f"ingress {meta['name']}")
    deployments = {d["metadata"]["name"]: d for d in stack.get("deployment", None, ns)["items"]}
    for pa in stack.get("podautoscalers.autoscaling.internal.knative.dev", None, ns)["items"]:
        meta = pa["metadata"]
        deployment = deployments.get(pa["spec"]["scaleTargetRef"]["name"])
        ready = (deployment or {}).get("status", {}).get("readyReplicas", 0)
        status = pa.get("status") or {}
        if not ready or (_ready(pa) and status.get("actualScale") == ready
                         and status.get("observedGeneration") == meta["generation"]):
            continue
        _patch_status(stack, "podautoscalers.autoscaling.internal.knative.dev", meta["name"], ns, {
            "observedGeneration": meta["generation"],
            "conditions": _true("Active", "Ready", "ScaleTargetInitialized", "SKSReady"),
            "serviceName": meta["name"], "metricsServiceName": f"{meta['name']}-private",
            "desiredScale": ready, "actualScale": ready})
        wrote.append(f"podautoscaler {meta['name']}")
    return wrote


def _ready(obj: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in (obj.get("status") or {}).get("conditions") or ())


def knative_objects(stack: cs.Stack, ns: str) -> dict[str, list[dict]]:
    """The Knative objects of `ns` by kind (services, configurations, revisions, routes)."""
    return {kind: stack.get(f"{kind}.serving.knative.dev", None, ns)["items"]
            for kind in ("services", "configurations", "revisions", "routes")}


def log_tails(stack: cs.Stack, lines: int = 8) -> str:
    return "\n".join(f"--- {name}:\n{stack.log_tail(name, lines)}"
                     for name in ("knative-controller", "knative-webhook", "kserve-manager"))

