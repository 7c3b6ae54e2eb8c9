"""The runtime image served by a real node (`make node-test`, marker `node`): the control plane of
tests/cluster_stack.py with KServe's newest manager, plus one real node (tests/node_stack.py:
containerd, runc, the CNI bridge, the kubelet and kube-proxy), all in a network namespace of the
run's own (tests/netns.py).

k8s/Dockerfile is built with podman before the run (tests/node_stack.py images) on a Debian base
that carries the Triton the tests run (the nvidia-pytriton wheel's 2.51; the production image's
base, Triton 2.71, cannot be pulled here) and moved into containerd. The CPU overlay's predictor
(k8s/overlays/cpu, the demo checkpoint baked into the image) runs as the pod of a Deployment made
from its ServingRuntime and InferenceService (KServe cannot run it on this node yet: see
predictor_as_deployment); from inside the namespace, the project's client gets meshes through the
Service's virtual IP (kube-proxy's rules) while a stub is killed in the pod, the kubelet is killed
and started again, and the pod is deleted mid-request.
"""

from __future__ import annotations

import json
import os
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
APP = "cube3d-node-test"  # the Deployment, its pods' label and the Service


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """The stack with its real node, the pause and runtime images in containerd."""
    if not own_network_namespace():
        cannot_run("the node tests run in a network namespace of their own: `make node-test` (tests/netns.py)")
    missing = go_programs.not_built(go_programs.node_needs(RELEASE))
    if missing:
        cannot_run(f"not built: {', '.join(missing)}: run `make node`")
    import image_build as ib
    import node_stack

    ib.require_podman()
    images = (node_stack.PAUSE_IMAGE, node_stack.RUNTIME_IMAGE)
    if not all(ib.image_exists(ref) for ref in images):
        cannot_run(f"{' and '.join(images)} are not built: `make node-test` builds them first "
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


def namespace(node, name: str) -> str:
    """A namespace with the admin key Secret docs/deploy/index.md has users create first."""
    node.stack.kubectl("create", "namespace", name)
    node.stack.kubectl("create", "secret", "generic", "cube-serve-admin", "-n", name,
                       f"--from-literal=CUBE3D_ADMIN_KEY={secrets.token_hex(32)}")  # as the docs make it
    return name


def wait_for(what: str, check, timeout: float, node=None):
    def events() -> str:
        return "" if node is None else "\n" + node.stack.kubectl(
            "get", "events", "-A", "--sort-by=.lastTimestamp", check=False).stdout[-4000:]

    return cs.wait_for(what, check, timeout, events, poll=1)


def ready_pods(node, ns: str, selector: str) -> list[dict]:
    pods = node.stack.get("pods", namespace=ns)["items"]
    return [p for p in pods if p["metadata"].get("labels", {}).get("app") == selector
            and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))]


def generate(url: str, out: Path, *args: str) -> subprocess.CompletedProcess:
    """The project's client, as a user runs it (`cube3d-client PROMPT --url HOST:PORT`)."""
    return subprocess.run([sys.executable, "-m", "cube3d_client.cli", "a round table", "--url", url, "--seed", "0",
                           "--resolution", "4", "--out", str(out), *args], capture_output=True, text=True, timeout=300)


def predictor_as_deployment(objects: list[dict], image: str) -> list[dict]:
    """The pod KServe's manager would make for the overlay's InferenceService, as a Deployment and
    a Service: the ServingRuntime's container (args, env, security context, ports) with the
    predictor's resources, probes and volumes. (The overlay itself cannot run through KServe on
    this node yet: KServe takes a `model` without a storageUri for a multi-model server and adds
    its agent sidecar, kserve/agent:latest, 100m CPU: see test_kserve_adds_an_agent_to_the_cpu_overlay.)"""
    [runtime] = [o for o in objects if o["kind"] == "ServingRuntime"]
    [isvc] = [o for o in objects if o["kind"] == "InferenceService"]
    predictor = isvc["spec"]["predictor"]
    container = {**runtime["spec"]["containers"][0], "image": image}
    container.update({k: predictor["model"][k] for k in ("resources", "startupProbe", "readinessProbe", "livenessProbe",
                                                         "volumeMounts", "lifecycle") if k in predictor["model"]})
    labels = {"app": APP}
    pod = {"serviceAccountName": predictor["serviceAccountName"], "containers": [container],
           "volumes": predictor.get("volumes", []), "terminationGracePeriodSeconds":
           predictor.get("terminationGracePeriodSeconds", 30)}
    return [{"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": APP},
             "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                      "template": {"metadata": {"labels": labels}, "spec": pod}}},
            {"apiVersion": "v1", "kind": "Service", "metadata": {"name": APP},
             "spec": {"selector": labels, "ports": [{"name": "http", "port": 80, "targetPort": 8000},
                                                    {"name": "grpc", "port": 8001, "targetPort": 8001}]}}]


@pytest.fixture(scope="module")
def served(node):
    """The CPU overlay's predictor as a Deployment and Service in namespace `cpu` (one pod: it asks
    for the node's 2 CPUs), Ready; its Service's virtual IP."""
    ns = namespace(node, "cpu")
    rendered = node.stack.kubectl("kustomize", str(REPO / "k8s" / "overlays" / "cpu")).stdout
    objects = [o for o in yaml.safe_load_all(rendered) if o]
    node.stack.apply([o for o in objects if o["kind"] == "ServiceAccount"] + predictor_as_deployment(objects, node.image),
                     "-n", ns)
    t0 = time.monotonic()
    wait_for("the pod Ready on the real node", lambda: ready_pods(node, ns, APP), 300, node)
    print(f"the pod was Ready {time.monotonic() - t0:.0f} s after the apply", flush=True)
    return types.SimpleNamespace(ns=ns, ip=node.stack.get("service", APP, ns)["spec"]["clusterIP"])


def the_pod(node, served) -> dict:
    [pod] = wait_for("one Ready pod", lambda: ready_pods(node, served.ns, APP), 300, node)
    return pod


def test_the_runtime_image_serves_a_mesh_as_a_pod_of_the_real_node_through_its_service(node, served, tmp_path):
    """The image under the kubelet and runc with the CPU overlay's container as written: its args
    (supervisor, tritonserver), the non-root user, dropped capabilities, RuntimeDefault seccomp,
    the /dev/shm emptyDir, and the startup, readiness and liveness probes; a mesh through the
    Service's virtual IP (kube-proxy), over REST and gRPC."""
    pod = the_pod(node, served)
    assert pod["spec"]["nodeName"] == "node-0"
    [container] = pod["status"]["containerStatuses"]
    assert container["ready"] and container["restartCount"] == 0, container
    for url, args in ((f"{served.ip}:80", ()), (f"{served.ip}:8001", ("--protocol", "grpc"))):
        out = generate(url, tmp_path / "mesh.glb", *args)
        assert out.returncode == 0, out.stdout + out.stderr
        mesh = (tmp_path / "mesh.glb").read_bytes()
        assert mesh[:4] == b"glTF", mesh[:16]
        print(f"a mesh of {len(mesh)} bytes through {url} (pod {pod['status']['podIP']}):\n{out.stdout}")


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
            p for p in ready_pods(node, served.ns, APP) if p["status"]["containerStatuses"][0]["restartCount"] > before],
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
        replacement = wait_for("a new pod Ready", lambda: [
            p for p in ready_pods(node, served.ns, APP) if p["metadata"]["uid"] != pod["metadata"]["uid"]], 600, node)
        print(f"the new pod was Ready {time.monotonic() - deleted:.0f} s after the deletion", flush=True)
        served_before = len(clients.done)
        wait_for("answers from the new pod", lambda: len(clients.done) >= served_before + 2, 180)
    finally:
        clients.finish()
    assert not clients.failed, clients.failed[:3]
    print(f"{len(clients.done)} answers, none lost; {replacement[0]['metadata']['name']} took over")
