"""A real node for the node tests (tests/test_node.py, `make node-test`): containerd with runc and
the CNI plugins, the kubelet and kube-proxy, joined to tests/cluster_stack.py's control plane, all
from the binaries cluster/build.py builds (`make node`).

Everything runs inside the network and mount namespace that tests/netns.py made for the test run:
the control plane binds that namespace's 127.0.0.1; one end of a veth pair (NODE_ADDRESS) holds the
default route, so the kubelet finds its node address the way it does on a machine and kube-proxy's
rules see a routed packet; pods get addresses on a bridge (POD_SUBNET) inside it. Nothing touches
the machine's interfaces.

The machine's kernel settings are never changed: the kubelet is built with a patch that only logs
the settings it would rewrite (cluster/build.py, _KUBELET_KEEPS_SYSCTLS), kube-proxy is told to
leave conntrack and route_localnet alone, and containerd keeps pods' oom_score_adj at or above its
own (this machine's root may not lower it). Pods' cgroups live under CGROUP_ROOT-<pid> in every
cgroup v1 hierarchy, removed with their processes when the node stops.

Images come from podman (`podman save` -> `ctr images import`), as a cluster without a registry
gets them; the pause image is built here from k8s.io/kubernetes' own build/pause/linux/pause.c,
KServe's storage initializer from the release's python/storage-initializer and its kserve-storage.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import yaml

import cluster_stack as cs
from image_build import RUNTIME_IMAGE  # k8s/Dockerfile FROM the Triton base, as `make image-test` builds it

build = cs.build

NODE_NAME = "node-0"
NODE_ADDRESS = "192.0.2.10/24"  # RFC 5737 TEST-NET-1, on a veth inside the namespace
POD_SUBNET = "10.88.0.0/24"
BRIDGE = "cni0"
CGROUP_ROOT = "cube-serve-node"
PAUSE_IMAGE = "localhost/cube-serve/pause:3.10.2"  # k8s' build/pause Makefile TAG at v1.36.3
CGROUP_V1 = Path("/sys/fs/cgroup")


def binary(component: str, command: str) -> str:
    comp = build.component(component)
    if not build.is_built(comp):
        raise cs.StackError(f"{comp.key} is not built: run `make node` (cluster/build.py node)")
    return str(comp.binary(command))


def run(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    if args[:2] == ("podman", "build"):
        import image_build as ib

        result = ib.podman_build(list(args[2:]), capture_output=True, text=True, timeout=timeout, **kw)
    else:
        result = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, **kw)
    if result.returncode:
        raise cs.StackError(f"{' '.join(args[:4])} failed ({result.returncode}): {result.stderr}{result.stdout}")
    return result


# -- images ---------------------------------------------------------------------------------------

def pause_image(workdir: Path) -> str:
    """PAUSE_IMAGE in podman's store, built as k8s.io/kubernetes' build/pause does (a static C
    program, user 65535, its entrypoint), from the source at the control plane's version."""
    import image_build as ib

    if ib.image_exists(PAUSE_IMAGE):
        return PAUSE_IMAGE
    comp = build.component("kubernetes-node")
    source = json.loads(run("go", "mod", "download", "-json", "k8s.io/kubernetes", cwd=comp.wrapper,
                            env=build.go_env()).stdout)["Dir"]
    workdir.mkdir(parents=True, exist_ok=True)
    # The Makefile's CFLAGS: -Os -Wall -Werror -static -DVERSION=v$(TAG)-$(REV)
    run("gcc", "-Os", "-Wall", "-Werror", "-static", "-DVERSION=v3.10.2-cube-serve", "-o", str(workdir / "pause"),
        str(Path(source) / "build" / "pause" / "linux" / "pause.c"))
    (workdir / "Containerfile").write_text("FROM scratch\nADD pause /pause\nUSER 65535:65535\nENTRYPOINT [\"/pause\"]\n")
    run("podman", "build", *ib.BUILD_FLAGS, "-f", str(workdir / "Containerfile"), "-t", PAUSE_IMAGE, str(workdir))
    return PAUSE_IMAGE




def storage_initializer_ref(release: str) -> str:
    """The storage initializer image of KServe `release`, as its chart installs it
    (charts/kserve-resources/values.yaml: kserve/storage-initializer, the tag the release's
    version), so the pods' init container is never pulled (IfNotPresent)."""
    return f"docker.io/kserve/storage-initializer:{release}"


# python/storage-initializer.Dockerfile at the release, on the same Python (3.11, bookworm) with the
# same steps that matter to a download: the release's kserve-storage in a virtual environment,
# KServe's own entrypoint script, user kserve (1000) owning /mnt, WORKDIR /work. Left out: the
# optional extras (confidential serving, HDFS with Kerberos) and the licence report.
_STORAGE_INITIALIZER = """FROM {base}
RUN python3 -m venv /prod_venv && /prod_venv/bin/pip install --no-cache-dir "kserve-storage=={version}"
ENV VIRTUAL_ENV=/prod_venv PATH=/prod_venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
RUN useradd kserve -m -u 1000 -d /home/kserve
COPY initializer-entrypoint /storage-initializer/scripts/initializer-entrypoint
RUN chmod +x /storage-initializer/scripts/initializer-entrypoint && mkdir /work && chown -R kserve:kserve /mnt
WORKDIR /work
USER 1000
ENTRYPOINT ["/storage-initializer/scripts/initializer-entrypoint"]
"""


def storage_initializer_image(workdir: Path, release: str) -> str:
    """storage_initializer_ref(release) in podman's store, built from the release's own source:
    the Go module the KServe manager is built from carries python/storage-initializer too."""
    import image_build as ib

    ref = storage_initializer_ref(release)
    if ib.image_exists(ref):
        return ref
    comp = build.component("kserve", release)
    source = Path(json.loads(run("go", "mod", "download", "-json", "github.com/kserve/kserve", cwd=comp.wrapper,
                                 env=build.go_env()).stdout)["Dir"])
    workdir.mkdir(parents=True, exist_ok=True)
    shutil.copy(source / "python" / "storage-initializer" / "scripts" / "initializer-entrypoint", workdir)
    (workdir / "Containerfile").write_text(_STORAGE_INITIALIZER.format(base=ib.ensure_base(workdir / "base"),
                                                                       version=release.lstrip("v")))
    conf, mounts = ib.pip_conf_and_mounts(ib.host_pip_config())  # pip as the host's, as for the runtime image
    (workdir / "pip.conf").write_text(conf)
    volumes = [f"--volume={workdir / 'pip.conf'}:/etc/pip.conf:ro", *(f"--volume={p}:{p}:ro" for p in mounts)]
    run("podman", "build", *ib.BUILD_FLAGS, *volumes, "-f", str(workdir / "Containerfile"), "-t", ref, str(workdir),
        timeout=1800)
    return ref


def build_images(workdir: Path, say=print) -> None:
    """The pause image, KServe's storage initializer and the runtime image (k8s/Dockerfile FROM the
    Triton base, RUNTIME_IMAGE: `make image-test` leaves it built). Outside the tests' network
    namespace (`make node-test` runs this first): the images' pip installs reach the package
    index, which nothing inside the namespace can."""
    import image_build as ib

    ib.require_podman()
    t0 = time.monotonic()
    pause_image(workdir / "pause")
    storage_initializer_image(workdir / "storage-initializer", cs.build.kserve_releases()[0])
    built = ib.runtime_image(workdir)
    say(f"{RUNTIME_IMAGE} ({'built' if built else 'built already, from the same input'}), {PAUSE_IMAGE} and "
        f"KServe's storage initializer ready in {time.monotonic() - t0:.0f} s")


# -- the node -------------------------------------------------------------------------------------

class Node:
    """containerd, the kubelet and kube-proxy of one node (NODE_NAME) of `stack`, under `root`."""

    def __init__(self, stack: cs.Stack, root: Path):
        self.stack, self.root = stack, root
        self.containerd_dir = root / "containerd"
        self.socket = self.containerd_dir / "containerd.sock"
        self.cgroup_root = f"{CGROUP_ROOT}-{os.getpid()}"
        self.ports = {name: cs.free_port() for name in ("kubelet", "kubelet-healthz", "proxy-healthz", "proxy-metrics")}

    # -- start ----------------------------------------------------------------------------------

    def start(self) -> "Node":
        t0 = time.monotonic()
        self._network()
        self._cni()
        self._containerd()
        self._kubelet()
        self._kube_proxy()
        self.stack._wait(f"node {NODE_NAME} Ready", lambda: self._ready(), 120)
        self.stack.timings["node"] = time.monotonic() - t0
        self.stack.say(f"node {NODE_NAME} ready in {self.stack.timings['node']:.1f} s")
        return self

    def _ready(self) -> bool:
        node = self.stack.get("node", NODE_NAME, check=False)
        return bool(node) and any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"]["conditions"])

    def _network(self) -> None:
        # The node's own address and default route, on a veth whose peer goes nowhere: what the kubelet reads
        # for the node's InternalIP, and where locally made packets to a Service's IP are routed
        # before kube-proxy's DNAT sends them to a pod on the bridge.
        run("ip", "link", "add", "node0", "type", "veth", "peer", "name", "node0-peer")  # no dummy module here
        run("ip", "addr", "add", NODE_ADDRESS, "dev", "node0")
        run("ip", "link", "set", "node0-peer", "up")
        run("ip", "link", "set", "node0", "up")
        run("ip", "route", "add", "default", "dev", "node0")

    def _cni(self) -> None:
        self.cni_bin = Path(binary("cni-plugins", "bridge")).parent
        self.cni_conf = self.root / "cni" / "net.d"
        self.cni_conf.mkdir(parents=True)
        # No ipMasq: pods' traffic never leaves the namespace; hairpinMode: a pod may reach itself
        # through its Service.
        conf = {"cniVersion": "1.0.0", "name": "cube-serve-node", "plugins": [
            {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": False, "hairpinMode": True,
             "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_SUBNET}]], "routes": [{"dst": "0.0.0.0/0"}],
                      "dataDir": str(self.root / "cni" / "ipam")}},
            {"type": "portmap", "capabilities": {"portMappings": True}}]}
        (self.cni_conf / "10-cube-serve.conflist").write_text(json.dumps(conf, indent=1))

    def _containerd(self) -> None:
        d = self.containerd_dir
        d.mkdir(parents=True)
        runc = binary("runc", "runc")
        config = f"""version = 3
root = "{d / 'root'}"
state = "{d / 'state'}"
# NRI would listen on /var/run/nri; the node needs none of its plugins.
disabled_plugins = ["io.containerd.nri.v1.nri"]
[grpc]
  address = "{self.socket}"
[ttrpc]
  address = "{self.socket}.ttrpc"
[debug]
  address = "{d / 'debug.sock'}"
[plugins.'io.containerd.internal.v1.opt']
  path = "{d / 'opt'}"
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{PAUSE_IMAGE}"
[plugins.'io.containerd.cri.v1.runtime']
  # Pods' network namespace files under state, not /var/run/netns of the machine.
  netns_mounts_under_state_dir = true
  # root here lacks CAP_SYS_RESOURCE: a pod's oom_score_adj (the pause container's -998) may not
  # go below containerd's own; restricted, it is raised to containerd's instead of failing.
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
      BinaryName = "{runc}"
      SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["{self.cni_bin}"]
    conf_dir = "{self.cni_conf}"
"""
        (d / "config.toml").write_text(config)
        self.stack._start("containerd", [binary("containerd", "containerd"), f"--config={d / 'config.toml'}"],
                          env={"PATH": f"{Path(runc).parent}{os.pathsep}{os.environ['PATH']}"})
        self.stack._wait("containerd", lambda: self.ctr("version", check=False).returncode == 0, 60)

    def ctr(self, *args: str, check: bool = True, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
        result = subprocess.run([binary("containerd", "ctr"), f"--address={self.socket}", "--namespace=k8s.io", *args],
                                capture_output=True, text=True, timeout=timeout, **kw)
        if check and result.returncode:
            raise cs.StackError(f"ctr {' '.join(args)} failed ({result.returncode}): {result.stderr}")
        return result

    def load_image(self, ref: str) -> float:
        """Copies `ref` from podman's store into containerd's k8s.io namespace (the CRI's);
        returns the seconds it took."""
        t0 = time.monotonic()
        # podman writes the whole archive to a temporary directory before it streams it (10 GB for
        # the runtime image): that goes beside containerd's root, on the disk the node has and gone
        # with it, not in the machine's /var/tmp.
        tmp = self.root / "podman-tmp"
        tmp.mkdir(exist_ok=True)
        with open(tmp.with_suffix(".log"), "w+") as log:
            save = subprocess.Popen(["podman", "save", "--format", "oci-archive", ref], stdout=subprocess.PIPE,
                                    stderr=log, env={**os.environ, "TMPDIR": str(tmp)})
            try:
                # The layers' blobs go once unpacked: the runtime image is 7 GB, unpacked as well.
                imported = self.ctr("images", "import", "--snapshotter=overlayfs", "--local",
                                    "--discard-unpacked-layers", "-", stdin=save.stdout, timeout=1200, check=False)
            finally:
                save.stdout.close()
                code = save.wait(60)
                shutil.rmtree(tmp, ignore_errors=True)
            if code or imported.returncode:
                log.seek(0)
                free = shutil.disk_usage(self.root).free / 2**30
                raise cs.StackError(f"{ref} not moved into containerd: podman save exited {code} "
                                    f"({log.read()[-2000:].strip()}); ctr images import exited "
                                    f"{imported.returncode} ({imported.stderr[-2000:].strip()}); "
                                    f"{free:.1f} GiB free where containerd and podman's copy are")
        return time.monotonic() - t0

    def _kubelet(self) -> None:
        p, d = self.stack.pki, self.root / "kubelet"
        d.mkdir(parents=True)
        for controller in self._cgroup_controllers():  # the kubelet wants its cgroup root to exist
            (CGROUP_V1 / controller / self.cgroup_root).mkdir(exist_ok=True)
        kubeconfig = cs.kubeconfig(d / "kubelet.kubeconfig", self.stack.server, p.ca_file,
                                   cs.cert_user(*p.issue("kubelet", f"system:node:{NODE_NAME}", "system:nodes")))
        cert, key = p.issue("kubelet-serving", f"system:node:{NODE_NAME}", server=True, hosts=("127.0.0.1",))
        (d / "resolv.conf").write_text("")  # pods get no DNS server of the machine's
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "address": "127.0.0.1", "port": self.ports["kubelet"], "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": self.ports["kubelet-healthz"],
            "tlsCertFile": str(cert), "tlsPrivateKeyFile": str(key),
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                               "x509": {"clientCAFile": str(p.ca_file)}},
            "authorization": {"mode": "AlwaysAllow"},
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            # cgroup v1 (this machine's hybrid mount), no systemd.
            "cgroupDriver": "cgroupfs", "failCgroupV1": False, "cgroupRoot": f"/{self.cgroup_root}",
            "failSwapOn": False, "protectKernelDefaults": False,
            "resolvConf": str(d / "resolv.conf"), "podLogsDir": str(self.root / "pod-logs"),
            # The test's images are imported, never pulled: none may be collected as unused.
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
            "shutdownGracePeriod": "0s", "rotateCertificates": False, "serializeImagePulls": False,
        }
        (d / "config.yaml").write_text(yaml.safe_dump(config))
        # The Node object first, as a provisioner may make it: the kubelet's CSINode set-up retries
        # for about 17 s and then only after two minutes, while this kubelet registers about 20 s
        # after its start (its first stats collection takes 10 s here), and the node stays
        # NotReady ("failed to initialize CSINode") until that late retry. The kubelet takes
        # the existing object over (labels, addresses, capacity, conditions).
        self.stack.kubectl("create", "-f", "-", input=json.dumps({
            "apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE_NAME, "labels": {"kubernetes.io/hostname": NODE_NAME}}}))
        self.kubelet_args = [binary("kubernetes-node", "kubelet"), f"--config={d / 'config.yaml'}",
                             f"--kubeconfig={kubeconfig}", f"--root-dir={d / 'root'}",
                             f"--hostname-override={NODE_NAME}", "--v=2"]
        self._start_kubelet()

    def _start_kubelet(self) -> None:
        self.stack._start("kubelet", self.kubelet_args)
        self.stack._wait("the kubelet's /healthz", lambda: self.stack._get(
            f"http://127.0.0.1:{self.ports['kubelet-healthz']}/healthz") == "ok", 90)

    def kill_kubelet(self) -> None:
        """SIGKILL to the kubelet (its pods run on under their shims)."""
        [(name, proc)] = [(n, p) for n, p in self.stack.processes if n == "kubelet"]
        proc.kill()
        proc.wait(10)
        self.stack.processes.remove((name, proc))

    def restart_kubelet(self) -> None:
        self._start_kubelet()
        self.stack._wait(f"node {NODE_NAME} Ready again", self._ready, 120)

    def container_log(self, pod: dict, container: str) -> str:
        """A container's log as the kubelet writes it (CRI format), read on the node: `kubectl logs`
        would have the API server dial the kubelet by the node's name, which no DNS here resolves."""
        meta = pod["metadata"]
        folder = self.root / "pod-logs" / f"{meta['namespace']}_{meta['name']}_{meta['uid']}" / container
        return "".join(path.read_text() for path in sorted(folder.glob("*.log")))

    def pod_processes(self, needle: bytes) -> list[int]:
        """PIDs of the node's pods' processes (in its cgroups) whose command line holds `needle`."""
        found = []
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit() and needle in _cmdline(int(proc.name)):
                try:
                    if self.cgroup_root in (proc / "cgroup").read_text():
                        found.append(int(proc.name))
                except OSError:
                    pass
        return found

    def _kube_proxy(self) -> None:
        p, d = self.stack.pki, self.root / "kube-proxy"
        d.mkdir(parents=True)
        kubeconfig = cs.kubeconfig(d / "kube-proxy.kubeconfig", self.stack.server, p.ca_file,
                                   cs.cert_user(*p.issue("kube-proxy", "system:kube-proxy")))
        config = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(kubeconfig)}, "hostnameOverride": NODE_NAME,
            "mode": "iptables", "clusterCIDR": POD_SUBNET,
            "bindAddress": "127.0.0.1",
            "healthzBindAddress": f"127.0.0.1:{self.ports['proxy-healthz']}",
            "metricsBindAddress": f"127.0.0.1:{self.ports['proxy-metrics']}",
            # Zeros: kube-proxy leaves the machine-wide conntrack settings as they are.
            "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
            # No NodePorts on 127.0.0.1: they would need route_localnet.
            "iptables": {"localhostNodePorts": False},
        }
        (d / "config.yaml").write_text(yaml.safe_dump(config))
        self.stack._start("kube-proxy", [binary("kubernetes-node", "kube-proxy"), f"--config={d / 'config.yaml'}", "--v=2"])
        self.stack._wait("kube-proxy's /healthz", lambda: "lastUpdated" in self.stack._get(
            f"http://127.0.0.1:{self.ports['proxy-healthz']}/healthz"), 90)

    # -- stop -----------------------------------------------------------------------------------

    @staticmethod
    def _cgroup_controllers() -> list[str]:
        # Every hierarchy of the hybrid mount, the cgroup2 one ("unified") too: runc places each
        # container there as well.
        return sorted(p.name for p in CGROUP_V1.iterdir()
                      if p.is_dir() and not p.is_symlink() and (p / "cgroup.procs").exists())

    def stop(self) -> None:
        """The kubelet and kube-proxy, then every process of the node's pods (by the PIDs in its
        cgroups) and containerd's shims, then containerd; the cgroups and mounts they leave."""
        for name, proc in list(self.stack.processes):
            if name in ("kubelet", "kube-proxy") and proc.poll() is None:
                proc.terminate()
                proc.wait(15)
        shim = binary("containerd", "containerd-shim-runc-v2")  # each shim is told our socket (-address)
        for _ in range(3):
            pids = {int(pid) for controller in self._cgroup_controllers()
                    for path in (CGROUP_V1 / controller / self.cgroup_root).rglob("cgroup.procs")
                    for pid in path.read_text().split()}
            pids |= {pid for pid in _processes_of(shim) if str(self.socket).encode() in _cmdline(pid)}
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if not pids:
                break
            time.sleep(0.5)
        for name, proc in list(self.stack.processes):
            if name == "containerd" and proc.poll() is None:
                proc.terminate()
                proc.wait(15)
        for controller in self._cgroup_controllers():
            top = CGROUP_V1 / controller / self.cgroup_root
            for path in sorted(top.rglob("*"), key=lambda p: len(p.parts), reverse=True) if top.exists() else ():
                if path.is_dir():
                    path.rmdir()
            if top.exists():
                top.rmdir()
        mounts = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
        for mount in sorted((m for m in mounts if m.startswith(str(self.root))), key=len, reverse=True):
            subprocess.run(["umount", "-l", mount], capture_output=True)
        shutil.rmtree(self.containerd_dir, ignore_errors=True)  # the unpacked images: 7 GB


def _processes_of(executable: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and os.readlink(proc / "exe") == executable:
                found.append(int(proc.name))
        except OSError:
            pass
    return found


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


if __name__ == "__main__":  # python3 tests/node_stack.py images  (make node-test)
    import sys
    import tempfile

    if sys.argv[1:] != ["images"]:
        raise SystemExit("usage: python3 tests/node_stack.py images")
    with tempfile.TemporaryDirectory(prefix="cube-serve-node-images-") as folder:
        build_images(Path(folder))
