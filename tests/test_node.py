"""The runtime image served by a real node (`make node-test`, marker `node`): the control plane of
tests/cluster_stack.py with KServe's newest manager, plus one real node (tests/node_stack.py:
containerd, runc, the CNI bridge, the kubelet and kube-proxy), all in a network namespace of the
run's own (tests/netns.py).

Before the run (tests/node_stack.py images), podman builds k8s/Dockerfile on a Debian base that
carries the Triton the tests run (the nvidia-pytriton wheel's 2.51; the production image's base,
Triton 2.71, cannot be pulled here) and KServe's storage initializer image from the release's own
source; both move into containerd. An S3 server on the node's address holds two packaged versions
of the demo checkpoint. A user's kustomization over the production overlays (their image, their
bucket, CPU resources for a CPU node) is applied as the docs say, and every pod is KServe's: its
manager makes the Deployment and Service, its webhook adds the storage initializer, which
downloads the version. From inside the namespace the project's client gets meshes through the
Services' virtual IPs (kube-proxy's rules) while a stub is killed in the pod, the kubelet is killed
and started again, the pod is deleted mid-request and the node is drained; Prometheus scrapes the
pod as the shipped scrape config selects it; a raw canary runs and is promoted on real pods.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import yaml

import cluster_stack as cs
import go_programs
from guards import cannot_run
from netns import own_network_namespace

pytestmark = pytest.mark.node

REPO = Path(__file__).resolve().parents[1]
RELEASE = cs.build.kserve_releases()[0]  # the newest KServe: the CPU overlay autoscales through KEDA (v0.16+)
ISVC = "cube3d"  # the production overlays' InferenceService


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """The stack with its real node; the pause, storage initializer and runtime images in containerd."""
    if not own_network_namespace():
        cannot_run("the node tests run in a network namespace of their own: `make node-test` (tests/netns.py)")
    missing = go_programs.not_built(go_programs.node_needs(RELEASE))
    if missing:
        cannot_run(f"not built: {', '.join(missing)}: run `make node`")
    import image_build as ib
    import node_stack

    ib.require_podman()
    images = (node_stack.PAUSE_IMAGE, node_stack.storage_initializer_ref(RELEASE), node_stack.RUNTIME_IMAGE)
    if not all(ib.image_exists(ref) for ref in images):
        cannot_run(f"{', '.join(images)} are not built: `make node-test` builds them first "
                   "(python3 tests/node_stack.py images, outside the namespace)")
    root = tmp_path_factory.mktemp("node")
    say = lambda line: print(line, flush=True)  # noqa: E731
    stack = cs.Stack(RELEASE, root / "stack", say=say, fake_nodes=False)
    real = None
    try:
        stack.start()
        real = node_stack.Node(stack, root / "node").start()
        for ref in images:
            say(f"{ref} moved into containerd in {real.load_image(ref):.0f} s")
        real.image = node_stack.RUNTIME_IMAGE
        yield real
    finally:
        if real is not None:
            real.stop()
        stack.stop()


def wait_for(what: str, check, timeout: float, node=None):
    def events() -> str:
        return "" if node is None else "\n" + node.stack.kubectl(
            "get", "events", "-A", "--sort-by=.lastTimestamp", check=False).stdout[-4000:]

    return cs.wait_for(what, check, timeout, events, poll=1)


def ready_pods(node, ns: str) -> list[dict]:
    """The predictor pods of ISVC that are Ready (KServe labels them with their InferenceService)."""
    pods = node.stack.get("pods", namespace=ns)["items"]
    return [p for p in pods if p["metadata"].get("labels", {}).get("serving.kserve.io/inferenceservice") == ISVC
            and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))]


def generate(url: str, out: Path, *args: str) -> subprocess.CompletedProcess:
    """The project's client, as a user runs it (`cube3d-client PROMPT --url HOST:PORT`)."""
    return subprocess.run([sys.executable, "-m", "cube3d_client.cli", "a round table", "--url", url, "--seed", "0",
                           "--resolution", "4", "--out", str(out), *args], capture_output=True, text=True, timeout=300)


BUCKET = "models"


@pytest.fixture(scope="module")
def store(node, tmp_path_factory):
    """An S3 server (rclone serve s3) on the node's address, which pods reach through the bridge,
    holding the demo checkpoint packaged for the CPU as versions 1 and 2 of s3://models/cube3d."""
    from cubeserve.server.local_triton import DEMO_MODEL
    from cubeserve.serving.repository import build_version_repository
    from kfp_pipelines.local_services import ObjectStore
    import node_stack

    data = tmp_path_factory.mktemp("object-store") / "data"
    for version in (1, 2):
        build_version_repository(DEMO_MODEL, version, data / BUCKET / "cube3d" / str(version), "cpu")
    with ObjectStore(data, keep=True, host=node_stack.NODE_ADDRESS.partition("/")[0]) as s3:
        yield s3


def cpu_kustomization(folder: Path, overlay: str, image: str, storage_uri: str, cpus: int = 2) -> Path:
    """What a team with CPU nodes writes over a production overlay (k8s/overlays/OVERLAY): their
    image (docs/deploy/image.md), their object store (the versions' base URI, the first version's
    storageUri) and CPU resources in place of the GPU (request = limit, as the CPU overlay,
    k8s/overlays/cpu, explains)."""
    model = "/spec/predictor/model"
    patch = [{"op": "replace", "path": f"{model}/storageUri", "value": storage_uri},
             {"op": "replace", "path": f"{model}/resources", "value": {
                 "requests": {"cpu": str(cpus), "memory": "4Gi"}, "limits": {"cpu": str(cpus), "memory": "8Gi"}}},
             {"op": "replace", "path": "/spec/predictor/volumes/0/emptyDir/sizeLimit", "value": "1Gi"}]
    base_uri = [{"op": "replace", "path": "/data/baseUri", "value": storage_uri.rstrip("/").rpartition("/")[0]}]
    folder.mkdir()
    (folder / "kustomization.yaml").write_text(json.dumps({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(REPO / "k8s" / "overlays" / overlay, folder)],  # kustomize: relative only
        "images": [{"name": "registry.example.com/cube-serve", "newName": image.rpartition(":")[0],
                    "newTag": image.rpartition(":")[2]}],
        "patches": [{"target": {"kind": "InferenceService", "name": ISVC}, "patch": json.dumps(patch)},
                    {"target": {"kind": "ConfigMap", "name": "cube3d-versions"}, "patch": json.dumps(base_uri)}]}))
    return folder


def deploy(node, store, ns: str, overlay: str, folder: Path, cpus: int = 2) -> float:
    """The user's namespace and Secrets as the docs make them, then `kubectl apply --server-side -k`
    of cpu_kustomization(OVERLAY); returns the seconds until the predictor's pod was Ready."""
    node.stack.user_namespace(ns, store)
    cpu_kustomization(folder, overlay, node.image, f"s3://{BUCKET}/cube3d/1/", cpus)
    t0 = time.monotonic()
    node.stack.kubectl("apply", "--server-side", "-k", str(folder), "-n", ns)
    wait_for("the predictor's pod Ready on the real node", lambda: ready_pods(node, ns), 600, node)
    return time.monotonic() - t0


@pytest.fixture(scope="module")
def served(node, store, tmp_path_factory):
    """The raw overlay (KEDA's ScaledObject, which no KEDA reads here: one replica) deployed in
    namespace `models`: KServe's manager makes the predictor's Deployment and Service, its webhook
    adds the storage initializer, which downloads version 1 from the S3 server; one pod (it asks
    for the node's 2 CPUs), Ready. The Service and its virtual IP."""
    ns = "models"
    ready = deploy(node, store, ns, "raw", tmp_path_factory.mktemp("user") / "raw")
    print(f"the pod was Ready {ready:.0f} s after the apply", flush=True)
    service = node.stack.get("service", f"{ISVC}-predictor", ns)
    return types.SimpleNamespace(ns=ns, ip=service["spec"]["clusterIP"], service=service)


def the_pod(node, served) -> dict:
    [pod] = wait_for("one Ready pod", lambda: ready_pods(node, served.ns), 300, node)
    return pod


def test_kserve_makes_the_pod_that_downloads_its_version_and_serves_a_mesh_through_its_service(node, served, tmp_path):
    """The pod as KServe's manager and webhook make it from the production overlay: the storage
    initializer (KServe's image, built from the release's source) downloads the version from the
    S3 server with the credentials of the Secret the ServiceAccount lists; then the image under the
    kubelet and runc with the ServingRuntime's container as written: its args (supervisor,
    tritonserver on /mnt/models), the non-root user, dropped capabilities, RuntimeDefault seccomp,
    the /dev/shm emptyDir, the startup, readiness and liveness probes; a mesh through the predictor
    Service's virtual IP (kube-proxy): REST on 80, gRPC on 8001."""
    pod = the_pod(node, served)
    assert pod["spec"]["nodeName"] == "node-0"
    assert pod["metadata"]["ownerReferences"][0]["kind"] == "ReplicaSet"
    [init] = pod["status"]["initContainerStatuses"]
    assert init["name"] == "storage-initializer" and init["state"]["terminated"]["exitCode"] == 0, init
    [container] = pod["status"]["containerStatuses"]
    assert container["ready"] and container["restartCount"] == 0, container
    log = node.container_log(pod, "storage-initializer")
    print(f"the storage initializer's log:\n{log[-1500:]}")
    assert f"s3://{BUCKET}/cube3d/1/" in log
    ports = {p["port"]: p["targetPort"] for p in served.service["spec"]["ports"]}
    assert ports == {80: 8000, 8001: 8001}, served.service["spec"]["ports"]
    for url, args in ((f"{served.ip}:80", ()), (f"{served.ip}:8001", ("--protocol", "grpc"))):
        out = generate(url, tmp_path / "mesh.glb", *args)
        assert out.returncode == 0, out.stdout + out.stderr
        mesh = (tmp_path / "mesh.glb").read_bytes()
        assert mesh[:4] == b"glTF", mesh[:16]
        print(f"a mesh of {len(mesh)} bytes through {url} (pod {pod['status']['podIP']}):\n{out.stdout}")


def discovered_targets(pod: dict) -> list[dict]:
    """The targets Prometheus' Kubernetes discovery (role: pod) makes of `pod`, as its
    configuration reference describes them: one per declared container port, and the pod's
    address alone for a container that declares none, init containers included, each with the
    pod's metadata as __meta_kubernetes_* labels (names with [^a-zA-Z0-9_] made _)."""
    meta, ip = pod["metadata"], pod["status"]["podIP"]
    sane = lambda name: re.sub(r"[^a-zA-Z0-9_]", "_", name)  # noqa: E731
    common = {"__meta_kubernetes_namespace": meta["namespace"], "__meta_kubernetes_pod_name": meta["name"],
              "__meta_kubernetes_pod_ip": ip, "__meta_kubernetes_pod_node_name": pod["spec"]["nodeName"],
              **{f"__meta_kubernetes_pod_label_{sane(k)}": v for k, v in meta.get("labels", {}).items()},
              **{f"__meta_kubernetes_pod_annotation_{sane(k)}": v for k, v in meta.get("annotations", {}).items()}}
    targets = []
    for init, containers in (("false", pod["spec"]["containers"]), ("true", pod["spec"].get("initContainers", []))):
        for container in containers:
            labels = {**common, "__meta_kubernetes_pod_container_name": container["name"],
                      "__meta_kubernetes_pod_container_init": init}
            for port in container.get("ports") or [None]:
                targets.append({**labels, "__address__": ip} if port is None else {
                    **labels, "__address__": f"{ip}:{port['containerPort']}",
                    "__meta_kubernetes_pod_container_port_number": str(port["containerPort"]),
                    "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                    "__meta_kubernetes_pod_container_port_protocol": port.get("protocol", "TCP")})
    return targets


def test_prometheus_scrapes_the_pod_that_the_shipped_scrape_config_selects(node, served, tmp_path):
    """k8s/monitoring/scrape-config.yaml on the real pod: its relabelling keeps one target of the
    pod's discovered ones, the metrics port, and a real Prometheus scrapes it across the pod network
    with the namespace, pod and InferenceService labels. Debian's Prometheus has no Kubernetes
    discovery, so the discovered targets are made from the Pod object (discovered_targets)."""
    from cubeserve.serving import metrics as m
    from prometheus_server import PrometheusServer
    from test_monitoring import relabel

    pod = the_pod(node, served)
    out = generate(f"{served.ip}:80", tmp_path / "mesh.glb")
    assert out.returncode == 0, out.stdout + out.stderr
    [job] = yaml.safe_load((REPO / "k8s" / "monitoring" / "scrape-config.yaml").read_text())["scrape_configs"]
    kept = [t for t in (relabel(job["relabel_configs"], t) for t in discovered_targets(pod)) if t]
    assert [t["__address__"] for t in kept] == [f"{pod['status']['podIP']}:8002"], kept
    labels = {k: v for k, v in kept[0].items() if not k.startswith("__")}
    assert labels == {"namespace": served.ns, "pod": pod["metadata"]["name"], "serving_kserve_io_inferenceservice": ISVC}
    prometheus = PrometheusServer(tmp_path / "prometheus", [])
    config = json.loads(prometheus.config.read_text())
    config["scrape_configs"] = [{"job_name": job["job_name"], "metrics_path": job["metrics_path"],
                                 "honor_labels": job["honor_labels"],
                                 "static_configs": [{"targets": [kept[0]["__address__"]], "labels": labels}]}]
    prometheus.config.write_text(json.dumps(config))
    with prometheus:
        query = f'sum({m.REQUESTS}{{namespace="{served.ns}",pod="{pod["metadata"]["name"]}",outcome="ok"}})'
        [sample] = prometheus.wait_for(f"{query} > 0", timeout=60)
    print(f"{query} = {sample['value'][1]}, scraped from {kept[0]['__address__']}")


class Clients:
    """Threads generating through the Service, with the client's retries (6: about a minute of
    backoff; 8: four minutes), until stopped; every answer's outcome kept."""

    def __init__(self, url: str, threads: int = 2, retries: int = 6):
        self.url, self.retries, self.stop, self.done, self.failed = url, retries, threading.Event(), [], []
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        for thread in self.threads:
            thread.start()

    def _run(self) -> None:
        from cube3d_client import Cube3DClient

        with Cube3DClient(self.url, retries=self.retries, timeout=120) as client:
            while not self.stop.is_set():
                try:
                    result = client.generate("a round table", seed=0, resolution=5)
                    self.done.append(len(result.mesh))
                except Exception as exc:  # noqa: BLE001 - counted: a lost request
                    self.failed.append(repr(exc))

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(300)


def test_a_stub_killed_in_the_pod_restarts_its_container_and_no_retried_request_is_lost(node, served):
    """kill -9 of a python backend stub inside the pod (the predict model's, which every request
    passes: Triton answers those that meet it dead with an INTERNAL error, which the front end
    turns into a 503 to retry): the supervisor (--on-fault exit) ends the container, readiness
    takes the pod out of the Service, the kubelet starts the container again and the clients'
    retries land there."""
    before = the_pod(node, served)["status"]["containerStatuses"][0]["restartCount"]
    clients = Clients(f"{served.ip}:80")
    try:
        wait_for("answers before the fault", lambda: len(clients.done) >= 2, 120)
        stubs = set(node.pod_processes(b"triton_python_backend_stub")) & set(node.pod_processes(b"/cube3d/"))
        assert len(stubs) == 1, f"not one stub of the predict model cube3d in the node's pods: {stubs}"
        os.kill(stubs.pop(), signal.SIGKILL)
        restarted = wait_for("the container started again and Ready", lambda: [
            p for p in ready_pods(node, served.ns) if p["status"]["containerStatuses"][0]["restartCount"] > before],
            300, node)
        served_before = len(clients.done)
        wait_for("answers from the restarted container", lambda: len(clients.done) >= served_before + 2, 180)
    finally:
        clients.finish()
    assert not clients.failed, clients.failed[:3]
    state = restarted[0]["status"]["containerStatuses"][0]["lastState"]["terminated"]
    print(f"{len(clients.done)} answers, none lost; the container ended with exit code {state['exitCode']} "
          f"({state.get('reason')}) and was started again")


def test_the_kubelet_killed_and_started_again_leaves_the_pod_serving(node, served, tmp_path):
    """kill -9 of the kubelet: the container runs on under its shim and serves; a new kubelet
    takes the node and the pod back without restarting it."""
    pod = the_pod(node, served)
    restarts = pod["status"]["containerStatuses"][0]["restartCount"]
    node.kill_kubelet()
    try:
        out = generate(f"{served.ip}:80", tmp_path / "mesh.glb")
        assert out.returncode == 0, out.stdout + out.stderr
    finally:
        node.restart_kubelet()
    after = the_pod(node, served)
    assert after["metadata"]["uid"] == pod["metadata"]["uid"]
    assert after["status"]["containerStatuses"][0]["restartCount"] == restarts


def taken_over(node, served, pod: dict, clients: Clients, since: float, event: str) -> list[dict]:
    """Waits until a pod other than `pod` is Ready and has answered two of the clients' requests."""
    replacement = wait_for("a new pod Ready", lambda: [
        p for p in ready_pods(node, served.ns) if p["metadata"]["uid"] != pod["metadata"]["uid"]], 600, node)
    print(f"the new pod was Ready {time.monotonic() - since:.0f} s after {event}", flush=True)
    served_before = len(clients.done)
    wait_for("answers from the new pod", lambda: len(clients.done) >= served_before + 2, 180)
    return replacement


def test_a_pod_deleted_mid_request_finishes_it_and_its_replacement_serves(node, served, tmp_path):
    """`kubectl delete pod` with generations in flight: the preStop drain lets them finish (the
    pod leaves the Service at once), the Deployment's new pod serves the retried requests. One
    replica that asks for all of the node's CPUs: the new pod is scheduled only once the old one
    has drained (the drain waits a scrape interval after its last request), so the Service has no
    pod for most of a minute, and the clients retry for up to four."""
    pod = the_pod(node, served)
    clients = Clients(f"{served.ip}:80", retries=8)
    try:
        wait_for("answers before the deletion", lambda: len(clients.done) >= 2, 120)
        node.stack.kubectl("delete", "pod", pod["metadata"]["name"], "-n", served.ns, "--wait=false")
        deleted = time.monotonic()
        replacement = taken_over(node, served, pod, clients, deleted, "the deletion")
    finally:
        clients.finish()
    assert not clients.failed, clients.failed[:3]
    print(f"{len(clients.done)} answers, none lost; {replacement[0]['metadata']['name']} took over")


def test_kubectl_drain_with_requests_in_flight_loses_none_and_uncordon_brings_the_predictor_back(node, served):
    """`kubectl drain` of the node with generations in flight: the eviction deletes the pod
    gracefully, so its preStop drain finishes them. The pod's emptyDirs (the model download and
    /dev/shm) make drain refuse without --delete-emptydir-data. On a one-node cluster the new pod
    stays Pending while the node is cordoned: the Service has no pod until `kubectl uncordon`, and
    the clients' retries (four minutes) carry the requests over."""
    pod = the_pod(node, served)
    clients = Clients(f"{served.ip}:80", retries=8)
    try:
        wait_for("answers before the drain", lambda: len(clients.done) >= 2, 120)
        refused = node.stack.kubectl("drain", "node-0", "--ignore-daemonsets", "--timeout=30s", check=False)
        assert refused.returncode != 0 and "local storage" in refused.stderr, refused.stderr
        t0 = time.monotonic()
        node.stack.kubectl("drain", "node-0", "--ignore-daemonsets", "--delete-emptydir-data", "--timeout=300s")
        print(f"drained in {time.monotonic() - t0:.0f} s", flush=True)
        others = [p for p in node.stack.get("pods", namespace=served.ns)["items"]
                  if p["metadata"]["uid"] != pod["metadata"]["uid"]]
        assert others and all(p["status"]["phase"] == "Pending" for p in others), others
        node.stack.kubectl("uncordon", "node-0")
        replacement = taken_over(node, served, pod, clients, t0, "the drain began")
    finally:
        node.stack.kubectl("uncordon", "node-0", check=False)
        clients.finish()
    assert not clients.failed, clients.failed[:3]
    print(f"{len(clients.done)} answers, none lost; {replacement[0]['metadata']['name']} took over")


def served_versions(node, ns: str, service: str, tmp_path: Path) -> dict[str, float]:
    """A mesh through `service` (its virtual IP), then {version: requests answered} from the
    metrics of the pods behind it, read on their metrics port."""
    import urllib.request

    from cubeserve.serving import metrics as m

    ip = node.stack.get("service", service, ns)["spec"]["clusterIP"]
    out = generate(f"{ip}:80", tmp_path / "mesh.glb")
    assert out.returncode == 0, out.stdout + out.stderr
    endpoints = node.stack.get("endpoints", service, ns)
    counts: dict[str, float] = {}
    for address in [a["ip"] for subset in endpoints.get("subsets", []) for a in subset.get("addresses", [])]:
        text = urllib.request.urlopen(f"http://{address}:8002/metrics", timeout=10).read().decode()
        for line in text.splitlines():
            found = re.match(rf'{m.REQUESTS}{{.*outcome="ok".*version="(\d+)".*}} (\S+)', line)
            if found:
                counts[found[1]] = counts.get(found[1], 0) + float(found[2])
    return counts


def test_a_raw_canary_with_real_pods_serves_its_version_and_promotes_without_a_restart(node, served, store, tmp_path):
    """The raw-canary overlay on one CPU per pod (the node has two: the pod of the tests before is
    deleted first): `cubeserve rollout canary --version 2 --percent 0` makes a second real pod,
    which downloads version 2 and serves it through the canary's Service while the stable pod
    serves version 1; `promote` keeps that pod (no restart) as the one stable predictor; a canary of
    version 1 gets a pod of its own and `rollback` removes it, the stable pod untouched."""
    from test_cluster import rollout

    node.stack.kubectl("delete", "inferenceservice", ISVC, "-n", served.ns, "--timeout=300s")
    ns = "canary"
    deploy(node, store, ns, "raw-canary", tmp_path / "user", cpus=1)
    code, out = rollout(node.stack, ns, "canary", "--version", "2", "--percent", "0")
    assert code == 0, out
    canary = wait_for("the canary's pod Ready", lambda: [p for p in ready_pods(node, ns)
                                                         if p["metadata"]["name"].startswith(f"{ISVC}-v2-")], 600, node)
    assert served_versions(node, ns, f"{ISVC}-predictor", tmp_path) == {"1": 1}
    assert served_versions(node, ns, f"{ISVC}-v2-predictor", tmp_path) == {"2": 1}
    code, out = rollout(node.stack, ns, "promote", "--wait", "120")
    assert code == 0 and "promote version 2 to stable (was version 1)" in out, out
    wait_for("the old predictor's pod gone", lambda: [p["metadata"]["uid"] for p in ready_pods(node, ns)] ==
             [canary[0]["metadata"]["uid"]], 300, node)
    [pod] = ready_pods(node, ns)
    assert pod["status"]["containerStatuses"][0]["restartCount"] == 0
    assert served_versions(node, ns, f"{ISVC}-v2-predictor", tmp_path) == {"2": 2}
    code, out = rollout(node.stack, ns, "status")
    assert code == 0 and "stable: version 2" in out, out
    # A canary of the old version, rolled back: its pod served version 1, then goes; the stable pod stays.
    code, out = rollout(node.stack, ns, "canary", "--version", "1", "--percent", "0")
    assert code == 0, out
    wait_for("the new canary's pod Ready", lambda: [p for p in ready_pods(node, ns)
                                                    if p["metadata"]["name"].startswith(f"{ISVC}-v1-")], 600, node)
    assert served_versions(node, ns, f"{ISVC}-v1-predictor", tmp_path) == {"1": 1}
    code, out = rollout(node.stack, ns, "rollback")
    assert code == 0 and "roll back the canary of version 1" in out, out
    wait_for("the canary's pod gone", lambda: [p["metadata"]["uid"] for p in ready_pods(node, ns)] ==
             [canary[0]["metadata"]["uid"]], 300, node)
    assert served_versions(node, ns, f"{ISVC}-v2-predictor", tmp_path) == {"2": 3}
