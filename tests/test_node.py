"""The runtime image served by a real node, as the pods KServe creates (`make node-test`, marker
`node`): the control plane of tests/cluster_stack.py with KServe's newest manager, plus one real
node (tests/node_stack.py: containerd, runc, the CNI bridge, the kubelet and kube-proxy), all in a
network namespace of the run's own (tests/netns.py).

k8s/Dockerfile is built with podman on a Debian base that carries the Triton the tests run (the
nvidia-pytriton wheel's 2.51; the production image's base, Triton 2.71, cannot be pulled here) and
moved into containerd; the CPU overlay (k8s/overlays/cpu, the demo checkpoint baked into the image)
is applied as a user applies it, with the image set to that build. Then, from inside the namespace:
KServe's manager makes the Deployment and Service, the kubelet starts the pod under runc with the
manifests' probes, security context and volumes, and the project's client gets a mesh through the
Service's virtual IP (kube-proxy's rules).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
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
IMAGE = "localhost/cube-serve-node-test"  # + :<pid>; not `latest`, so IfNotPresent: never pulled


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
    root = tmp_path_factory.mktemp("node")
    say = lambda line: print(line, flush=True)  # noqa: E731
    t0 = time.monotonic()
    tag = f"{IMAGE}:{os.getpid()}"
    base = ib.ensure_triton_base(root / "base")
    result = ib.build_image(tag, base, root, root / "image-build.log")
    assert result.returncode == 0, f"podman build -f k8s/Dockerfile failed:\n{(root / 'image-build.log').read_text()[-5000:]}"
    say(f"runtime image {tag} on {base} built in {time.monotonic() - t0:.0f} s")
    pause = node_stack.pause_image(root / "pause")
    stack = cs.Stack(RELEASE, root / "stack", say=say, fake_nodes=False)
    real = None
    try:
        stack.start()
        real = node_stack.Node(stack, root / "node").start()
        for ref in (pause, tag):
            say(f"{ref} moved into containerd in {real.load_image(ref):.0f} s")
        real.image = tag
        yield real
    finally:
        if real is not None:
            real.stop()
        stack.stop()
        ib.remove_image(tag)


def namespace(node, name: str) -> str:
    """A namespace with the admin key Secret docs/deploy/index.md has users create first."""
    node.stack.kubectl("create", "namespace", name)
    node.stack.kubectl("create", "secret", "generic", "cube-serve-admin", "-n", name,
                       f"--from-literal=CUBE3D_ADMIN_KEY={secrets.token_hex(32)}")  # as the docs make it
    return name


def apply_overlay(node, overlay: str, ns: str) -> None:
    """`kubectl apply --server-side` of k8s/overlays/OVERLAY rendered by kustomize, its runtime
    image set to the test's build (what `kustomize edit set image` does in a user's overlay)."""
    rendered = node.stack.kubectl("kustomize", str(REPO / "k8s" / "overlays" / overlay)).stdout
    objects = [o for o in yaml.safe_load_all(rendered) if o]
    for obj in objects:
        if obj["kind"] == "ServingRuntime":
            for container in obj["spec"]["containers"]:
                container["image"] = node.image
    node.stack.apply(objects, "-n", ns)


def wait_for(what: str, check, timeout: float, node=None):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            detail = ""
            if node is not None:
                detail = "\n" + node.stack.kubectl("get", "events", "-A", "--sort-by=.lastTimestamp", check=False).stdout[-4000:]
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}{detail}")
        time.sleep(1)


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
                                                         "volumeMounts") if k in predictor["model"]})
    labels = {"app": "cube3d-node-test"}
    pod = {"serviceAccountName": predictor["serviceAccountName"], "containers": [container],
           "volumes": predictor.get("volumes", []), "terminationGracePeriodSeconds":
           predictor.get("terminationGracePeriodSeconds", 30)}
    return [{"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "cube3d-node-test"},
             "spec": {"replicas": 1, "selector": {"matchLabels": labels},
                      "template": {"metadata": {"labels": labels}, "spec": pod}}},
            {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "cube3d-node-test"},
             "spec": {"selector": labels, "ports": [{"name": "http", "port": 80, "targetPort": 8000},
                                                    {"name": "grpc", "port": 8001, "targetPort": 8001}]}}]


def test_the_runtime_image_serves_a_mesh_as_a_pod_of_the_real_node_through_its_service(node, tmp_path):
    """The image under the kubelet and runc with the CPU overlay's container as written: its args
    (supervisor, tritonserver), the non-root user, dropped capabilities, RuntimeDefault seccomp,
    the /dev/shm emptyDir, and the startup, readiness and liveness probes; a mesh through the
    Service's virtual IP (kube-proxy), over REST and gRPC."""
    ns = namespace(node, "cpu")
    rendered = node.stack.kubectl("kustomize", str(REPO / "k8s" / "overlays" / "cpu")).stdout
    objects = [o for o in yaml.safe_load_all(rendered) if o]
    node.stack.apply([o for o in objects if o["kind"] == "ServiceAccount"] + predictor_as_deployment(objects, node.image),
                     "-n", ns)
    [pod] = wait_for("the pod Ready on the real node", lambda: ready_pods(node, ns, "cube3d-node-test"), 300, node)
    assert pod["spec"]["nodeName"] == "node-0"
    [container] = pod["status"]["containerStatuses"]
    assert container["ready"] and container["restartCount"] == 0, container
    service = node.stack.get("service", "cube3d-node-test", ns)
    ip = service["spec"]["clusterIP"]
    for url, args in ((f"{ip}:80", ()), (f"{ip}:8001", ("--protocol", "grpc"))):
        out = generate(url, tmp_path / "mesh.glb", *args)
        assert out.returncode == 0, out.stdout + out.stderr
        mesh = (tmp_path / "mesh.glb").read_bytes()
        assert mesh[:4] == b"glTF", mesh[:16]
        print(f"a mesh of {len(mesh)} bytes through {url} (pod {pod['status']['podIP']}):\n{out.stdout}")
