#!/usr/bin/env python3
"""Builds the Go programs the end-to-end tests run, from Go modules only, with the machine's Go, in
named groups, one per make target that builds one:

    control-plane  kube-apiserver, kube-controller-manager, kube-scheduler, etcd, KWOK and KServe's
                   controller manager (one per KServe release kept): `make control-plane`, which
                   `make cluster-test` runs first (tests/test_cluster.py)
    trace-backend  Jaeger v2: `make trace-backend`, which `make gateway-e2e-test` runs first
    autoscaling    KEDA's operator and metrics adapter, Knative Serving's controller and webhook:
                   `make autoscaling`, which `make autoscaling-test` runs first (tests/test_keda.py,
                   tests/test_knative.py)
    node           a real node: kubelet and kube-proxy, containerd (with its runc shim and ctr), runc
                   and the CNI plugins: `make node`, which `make node-test` runs first
                   (tests/test_node.py)

    python3 cluster/build.py control-plane   # a group (no argument: control-plane)
    python3 cluster/build.py kubernetes kwok # some components; `kserve` is every KServe release,
                                             # `kserve-v0.15.2` one of them
    python3 cluster/build.py --check trace-backend  # exit 1 if anything named is not built

A test needing these programs asks `required(group)` what to check, so the tests, the check and the
make targets share one definition of each group (tests/test_ci_targets.py holds the targets to it).

Each component is a wrapper module in cluster/go/<name>-<version>/ (go.mod and go.sum pin every
module; a `tool` line names each command). Binaries land in the cache folder
$CUBESERVE_CONTROL_PLANE_CACHE (default $XDG_CACHE_HOME/cube-serve/control-plane, else
~/.cache/cube-serve/control-plane), under <name>-<version>/bin/, with what the stack needs beside
them under share/ (KWOK's stages, KServe's CRDs, configuration and webhook manifests, taken from
the same module zips). A component whose stamp matches its wrapper, the Go version and the build
settings is skipped, so a second run does nothing. Go's module and build caches are
$GOMODCACHE / $GOCACHE where set (a machine's warm caches are reused), else <cache>/go/.
Nothing here is committed but the wrappers and this script.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

WRAPPERS = Path(__file__).resolve().parent / "go"
CACHE_ENV = "CUBESERVE_CONTROL_PLANE_CACHE"
# Parallel compile jobs (go build -p). Each job of the Kubernetes build can take 1 GB and more:
# 2 keeps the peak near 2 GB on a 2-core machine, and more cores would not help a 2-core one.
JOBS_ENV = "CUBESERVE_CONTROL_PLANE_JOBS"
# Bumped when what a build produces changes without the wrapper changing (flags, assets, patches).
BUILD_FORMAT = 1


def _k8s_ldflags(version: str) -> list[str]:
    # What Kubernetes' own build (hack/lib/version.sh) stamps: `--version`, /version and the
    # component-base version checks (e.g. the minimum compatibility version) read these.
    minor = version.lstrip("v").split(".")[1]
    flags = []
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [f"-X {pkg}.gitVersion={version}", f"-X {pkg}.gitMajor=1", f"-X {pkg}.gitMinor={minor}",
                  f"-X {pkg}.gitTreeState=clean", f"-X {pkg}.buildDate=1970-01-01T00:00:00Z"]
    return flags


@dataclass(frozen=True)
class Patch:
    """One edit to a module's sources before the build: `old` must occur exactly once in `path`."""
    path: str  # relative to the module's root
    old: str
    new: str


@dataclass(frozen=True)
class Spec:
    commands: dict[str, str]  # binary name -> package
    ldflags: object = None  # version -> list of -X flags
    module: str = ""  # the module whose zip holds the assets / the patched files
    group: str = "control-plane"  # the make target that builds it (GROUPS)
    wrapper: str = ""  # the wrapper it builds from when it is another component's (default: its own name)
    patches: tuple[Patch, ...] = ()  # edits to `module`'s sources (built from a patched copy)
    tags: tuple[str, ...] = ()  # build tags; any tag here means cgo (runc's seccomp)


# KServe's manager binds its webhook server to every interface (cmd/manager/main.go passes only a
# port to webhook.NewServer); the stack binds nothing but 127.0.0.1.
_WEBHOOK_SERVER = "webhook.NewServer(webhook.Options{"
_KSERVE_LOOPBACK = Patch("cmd/manager/main.go", _WEBHOOK_SERVER,
                         _WEBHOOK_SERVER + '\n\t\t\tHost: "127.0.0.1", // cube-serve: loopback only')
# The kubelet sets vm.overcommit_memory, kernel.panic, kernel.panic_on_oops and more for the whole
# machine (pkg/kubelet/cm/container_manager_linux.go, setupKernelTunables), or with
# protectKernelDefaults refuses to start where they differ. A test node must leave the machine's
# kernel settings alone: this kubelet only logs the difference (KernelTunableWarn).
_KUBELET_KEEPS_SYSCTLS = Patch("pkg/kubelet/cm/container_manager_linux.go", "b := KernelTunableModify",
                               "b := KernelTunableWarn // cube-serve: never rewrite the machine's kernel settings")

# KEDA's metrics adapter serves its own /metrics on every interface (cmd/adapter/main.go,
# RunMetricsServer: ":<port>", no flag for the host); every other listener of KEDA takes a flag.
_KEDA_ADAPTER_LOOPBACK = Patch("cmd/adapter/main.go", 'metricsBindAddress := fmt.Sprintf(":%v", metricsAPIServerPort)',
                               'metricsBindAddress := fmt.Sprintf("127.0.0.1:%v", metricsAPIServerPort) // cube-serve: loopback only')

# Knative Serving's controller and webhook listen through knative.dev/pkg, on every interface and
# with no flag for the host: the profiling server (observability/runtime/pprof.go
# NewProfilingServer, ":"+$PROFILING_PORT, listening even with profiling off), the health probes
# (injection/health_check.go ServeHealthProbes, ":8080", a constant) and the admission webhook
# (webhook/webhook.go Run, ":"+$WEBHOOK_PORT). So SPECS["knative-serving"] patches knative.dev/pkg
# (its `module`; its assets come from knative.dev/serving, networking and caching, read by
# _knative_assets): every listener on 127.0.0.1, and the probes' port from $PROBES_PORT where set
# (a fixed 8080 could be taken), the others' ports from the environment as they are
# (tests/knative_stack.py). The Prometheus exporter takes METRICS_PROMETHEUS_HOST and is off by
# default (observability/metrics/config.go DefaultConfig: protocol "none").
_KNATIVE_PPROF_LOOPBACK = Patch("observability/runtime/pprof.go", 'Addr:    ":" + port,',
                                'Addr:    "127.0.0.1:" + port, // cube-serve: loopback only')
_KNATIVE_PROBES_OS = Patch("injection/health_check.go", '\t"net/http"\n\t"strconv"', '\t"net/http"\n\t"os"\n\t"strconv"')
_KNATIVE_PROBES_LOOPBACK = Patch(
    "injection/health_check.go", 'Addr: ":" + strconv.Itoa(port)}',
    'Addr: "127.0.0.1:" + strconv.Itoa(port)} // cube-serve: loopback only\n'
    '\tif p, err := strconv.Atoi(os.Getenv("PROBES_PORT")); err == nil { // cube-serve: a free port\n'
    '\t\tserver.Addr = "127.0.0.1:" + strconv.Itoa(p)\n\t}')
_KNATIVE_WEBHOOK_LOOPBACK = Patch("webhook/webhook.go", 'Addr:              fmt.Sprint(":", wh.Options.Port),',
                                  'Addr:              fmt.Sprint("127.0.0.1:", wh.Options.Port), // cube-serve: loopback only')

SPECS = {
    "kubernetes": Spec({"kube-apiserver": "k8s.io/kubernetes/cmd/kube-apiserver",
                        "kube-controller-manager": "k8s.io/kubernetes/cmd/kube-controller-manager",
                        "kube-scheduler": "k8s.io/kubernetes/cmd/kube-scheduler"}, _k8s_ldflags),
    "etcd": Spec({"etcd": "go.etcd.io/etcd/server/v3"},
                 lambda v: [f"-X go.etcd.io/etcd/api/v3/version.GitSHA={v}"]),
    "kwok": Spec({"kwok": "sigs.k8s.io/kwok/cmd/kwok"}, module="sigs.k8s.io/kwok"),
    "kserve": Spec({"manager": "github.com/kserve/kserve/cmd/manager"}, module="github.com/kserve/kserve",
                   patches=(_KSERVE_LOOPBACK,)),
    # Not the control plane: the trace backend of the gateway's end-to-end tests (make trace-backend).
    "jaeger": Spec({"jaeger": "github.com/jaegertracing/jaeger/cmd/jaeger"}, group="trace-backend"),
    # The real node (make node): the same k8s.io/kubernetes as the control plane, patched.
    "kubernetes-node": Spec({"kubelet": "k8s.io/kubernetes/cmd/kubelet", "kube-proxy": "k8s.io/kubernetes/cmd/kube-proxy"},
                            _k8s_ldflags, module="k8s.io/kubernetes", group="node", wrapper="kubernetes",
                            patches=(_KUBELET_KEEPS_SYSCTLS,)),
    "containerd": Spec({"containerd": "github.com/containerd/containerd/v2/cmd/containerd",
                        "containerd-shim-runc-v2": "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2",
                        "ctr": "github.com/containerd/containerd/v2/cmd/ctr"},
                       lambda v: [f"-X github.com/containerd/containerd/v2/version.Version={v}"], group="node"),
    # runc's own Makefile builds with cgo and the tags "seccomp urfave_cli_no_docs libpathrs";
    # libpathrs is a Rust library no package here provides (runc falls back to its Go pathrs-lite).
    "runc": Spec({"runc": "github.com/opencontainers/runc"}, group="node", tags=("seccomp", "urfave_cli_no_docs")),
    "cni-plugins": Spec({plugin.rpartition("/")[2]: f"github.com/containernetworking/plugins/plugins/{plugin}"
                         for plugin in ("main/bridge", "ipam/host-local", "main/loopback", "meta/portmap")},
                        lambda v: [f"-X github.com/containernetworking/plugins/pkg/utils/buildversion.BuildVersion={v}"],
                        group="node"),
    # The autoscaling controllers (make autoscaling): KEDA's operator and metrics adapter; the HPA
    # that KEDA makes runs in the control plane's kube-controller-manager.
    "keda": Spec({"keda-operator": "github.com/kedacore/keda/v2/cmd/operator",
                  "keda-adapter": "github.com/kedacore/keda/v2/cmd/adapter"},
                 lambda v: [f"-X github.com/kedacore/keda/v2/version.Version={v}"],
                 module="github.com/kedacore/keda/v2", group="autoscaling", patches=(_KEDA_ADAPTER_LOOPBACK,)),
    # Knative Serving v0.48.1 (the release KServe v0.20.0 pins): its controller and webhook, for the
    # Serverless mode (tests/test_knative.py); not its autoscaler or activator.
    "knative-serving": Spec({"controller": "knative.dev/serving/cmd/controller",
                             "webhook": "knative.dev/serving/cmd/webhook"},
                            module="knative.dev/pkg", group="autoscaling",
                            patches=(_KNATIVE_PPROF_LOOPBACK, _KNATIVE_PROBES_OS, _KNATIVE_PROBES_LOOPBACK,
                                     _KNATIVE_WEBHOOK_LOOPBACK)),
}
GROUPS = tuple(dict.fromkeys(spec.group for spec in SPECS.values()))  # control-plane, trace-backend, ...
DEFAULT_GROUP = "control-plane"


@dataclass(frozen=True)
class Component:
    name: str  # a key of SPECS: kubernetes, etcd, kwok, kserve, ...
    version: str  # v1.36.3, ...

    @property
    def key(self) -> str:
        return f"{self.name}-{self.version}"

    @property
    def wrapper(self) -> Path:
        return WRAPPERS / f"{self.spec.wrapper or self.name}-{self.version}"

    @property
    def spec(self) -> Spec:
        return SPECS[self.name]

    @property
    def home(self) -> Path:
        return cache_root() / self.key

    def binary(self, command: str) -> Path:
        return self.home / "bin" / command

    @property
    def share(self) -> Path:
        return self.home / "share"


def cache_root() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return base / "cube-serve" / "control-plane"


def components() -> list[Component]:
    """What the wrappers in cluster/go/ build, as <name>-<version> (KServe: one per release kept; the
    kubernetes wrapper: the control plane and the node)."""
    found = []
    for path in sorted(WRAPPERS.glob("*/go.mod")):
        wrapper, _, version = path.parent.name.rpartition("-v")
        if wrapper not in SPECS:
            raise SystemExit(f"{path.parent}: no build spec for {wrapper!r} in cluster/build.py")
        found += [Component(name, "v" + version) for name, spec in SPECS.items() if (spec.wrapper or name) == wrapper]
    return found


def component(name: str, version: str | None = None) -> Component:
    """The component `name` (at `version`, needed where several are kept)."""
    matches = [c for c in components() if c.name == name and version in (None, c.version)]
    if len(matches) != 1:
        raise KeyError(f"{name} {version or ''}: {len(matches)} wrappers in {WRAPPERS}")
    return matches[0]


def kserve_releases() -> list[str]:
    """The KServe releases whose manager is built, newest first."""
    key = lambda v: tuple(int(p) for p in v.lstrip("v").split("."))  # noqa: E731
    return sorted((c.version for c in components() if c.name == "kserve"), key=key, reverse=True)


def go_env(jobs: int | None = None) -> dict[str, str]:
    env = dict(os.environ)
    root = cache_root() / "go"
    env.setdefault("GOMODCACHE", str(root / "mod"))
    env.setdefault("GOCACHE", str(root / "build"))
    # The machine's Go (docs/development.md: Go is a test dependency); a wrapper needing a newer one fails
    # with Go's own message instead of fetching a toolchain.
    env.setdefault("GOTOOLCHAIN", "local")
    env["CGO_ENABLED"] = "0"  # static binaries, no C toolchain needed (but for a Spec with tags)
    jobs = jobs or int(os.environ.get(JOBS_ENV) or 2)
    # -mod=readonly: go.mod and go.sum are the pins; a build never edits them.
    env["GOFLAGS"] = f"-p={jobs} -trimpath -buildvcs=false -mod=readonly"
    return env


def go_version(env: dict[str, str]) -> str:
    return subprocess.run(["go", "env", "GOVERSION"], env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


def _stamp(comp: Component, env: dict[str, str]) -> str:
    digest = hashlib.sha256()
    for name in ("go.mod", "go.sum"):
        path = comp.wrapper / name
        digest.update(path.read_bytes() if path.exists() else b"")
    spec = comp.spec
    digest.update(json.dumps([BUILD_FORMAT, go_version(env), spec.commands,
                              spec.ldflags(comp.version) if spec.ldflags else [], spec.tags,
                              [[p.path, p.old, p.new] for p in spec.patches]]).encode())
    return digest.hexdigest()


def is_built(comp: Component, env: dict[str, str] | None = None) -> bool:
    stamp = comp.home / "built.json"
    if not stamp.exists() or not all(comp.binary(c).exists() for c in comp.spec.commands):
        return False
    return json.loads(stamp.read_text()).get("stamp") == _stamp(comp, env or go_env())


class PeakMemory:
    """The largest total resident memory of a process and its descendants, sampled every 0.2 s
    (the go command runs the compiler and linker as children)."""

    def __init__(self, pid: int):
        self.pid, self.peak_kib, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _tree(self) -> int:
        children: dict[int, list[int]] = {}
        rss: dict[int, int] = {}
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/status") as f:
                    fields = dict(line.split(":", 1) for line in f if ":" in line)
            except OSError:
                continue
            pid = int(entry.name)
            children.setdefault(int(fields["PPid"]), []).append(pid)
            rss[pid] = int(fields.get("VmRSS", "0 kB").split()[0])
        total, todo = 0, [self.pid]
        while todo:
            pid = todo.pop()
            total += rss.get(pid, 0)
            todo += children.get(pid, [])
        return total

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.peak_kib = max(self.peak_kib, self._tree())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak_kib // 1024


def _run(cmd: list[str], cwd: Path, env: dict[str, str], log: Path) -> tuple[float, int]:
    """Runs a go command, its output to `log`; returns (seconds, peak MiB of its process tree)."""
    start = time.monotonic()
    with open(log, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        memory = PeakMemory(proc.pid)
        code = proc.wait()
        peak = memory.stop()
    if code:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise SystemExit(f"{' '.join(cmd[:3])} failed in {cwd} (exit {code}); the end of {log}:\n{tail}")
    return time.monotonic() - start, peak


def _module_dir(comp: Component, env: dict[str, str]) -> Path:
    """Where the module zip of comp.spec.module (at the wrapper's version) is unpacked."""
    out = subprocess.run(["go", "mod", "download", "-json", comp.spec.module], cwd=comp.wrapper, env=env,
                         check=True, capture_output=True, text=True).stdout
    return Path(json.loads(out)["Dir"])


def _patched_modfile(comp: Component, module: Path) -> Path:
    """A copy of the wrapper's go.mod (for -modfile) that replaces comp.spec.module with a copy of its
    Go sources carrying comp.spec.patches. `go build -overlay` may not replace files in the module
    cache, hence the copy; its dependencies stay the wrapper's."""
    source = comp.home / "src"
    for path in module.rglob("*.go"):
        if not path.name.endswith("_test.go") and "testdata" not in path.parts:
            target = source / path.relative_to(module)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)  # not copy(): the module cache's files are read-only
    for name in ("go.mod", "LICENSE"):
        shutil.copyfile(module / name, source / name)
    for patch in comp.spec.patches:
        path = source / patch.path
        text = path.read_text()
        if text.count(patch.old) != 1:
            raise SystemExit(f"{path}: expected {patch.old!r} once, to patch it ({comp.key})")
        path.write_text(text.replace(patch.old, patch.new))
    modfile = comp.home / "go.mod"
    modfile.write_text((comp.wrapper / "go.mod").read_text() +
                       f"\n// cluster/build.py: {comp.spec.module}'s sources with the patches of SPECS[{comp.name!r}]\n"
                       f"replace {comp.spec.module} => {source}\n")
    shutil.copyfile(comp.wrapper / "go.sum", comp.home / "go.sum")
    return modfile


def _kwok_assets(comp: Component, module: Path) -> None:
    # The kwok binary embeds no stages (kwokctl passes them): these are kwokctl's defaults, the
    # "fast" ones (a scheduled pod is Running and Ready at once, a deleted one goes at once).
    stages = ["node/fast/node-initialize.yaml", "node/heartbeat-with-lease/node-heartbeat-with-lease.yaml",
              "pod/fast/pod-ready.yaml", "pod/fast/pod-complete.yaml", "pod/fast/pod-delete.yaml"]
    text = "---\n".join((module / "kustomize" / "stage" / s).read_text() for s in stages)
    (comp.share / "stages.yaml").write_text(text)


def _kserve_assets(comp: Component, module: Path) -> None:
    # The release's own CRDs (config/crd/full/, with its subfolders), its inferenceservice-config
    # ConfigMap and its webhook configurations, from the module zip the manager was built from.
    crds = comp.share / "crd"
    crds.mkdir(parents=True)
    for path in sorted((module / "config" / "crd" / "full").rglob("*.yaml")):
        if path.name.startswith("serving.kserve.io_"):
            shutil.copyfile(path, crds / path.name)
    shutil.copyfile(module / "config" / "configmap" / "inferenceservice.yaml", comp.share / "inferenceservice-config.yaml")
    shutil.copyfile(module / "config" / "webhook" / "manifests.yaml", comp.share / "webhook-manifests.yaml")


def _keda_assets(comp: Component, module: Path) -> None:
    # Every CRD of the release (the operator watches ScaledJobs, the trigger authentications and the
    # CloudEventSources too, and fails to start without them), from the module zip it was built from.
    crds = comp.share / "crd"
    crds.mkdir(parents=True)
    for path in sorted((module / "config" / "crd" / "bases").glob("*.yaml")):
        shutil.copyfile(path, crds / path.name)


def _knative_assets(comp: Component, module: Path) -> None:
    # `module` is knative.dev/pkg (the patched one); the CRDs and ConfigMaps are knative.dev/serving's
    # (config/core/: 300-resources/ the CRDs, configmaps/ the config-* ConfigMaps, webhooks/ the
    # webhook configurations) and, where Knative's repository links them from knative.dev/networking
    # and knative.dev/caching (a module zip keeps no links), those modules' config/ (the KIngress,
    # ServerlessService, Certificate and ClusterDomainClaim CRDs, config-network; the Image CRD,
    # whose informer the revision reconciler starts): all at the wrapper's versions.
    modules = ("knative.dev/serving", "knative.dev/networking", "knative.dev/caching")
    out = subprocess.run(["go", "mod", "download", "-json", *modules],
                         cwd=comp.wrapper, env=go_env(), check=True, capture_output=True, text=True).stdout
    dirs = {m["Path"]: Path(m["Dir"]) for m in json.loads("[" + out.replace("}\n{", "},\n{") + "]")}
    serving, networking, caching = (dirs[m] / "config" for m in modules)
    serving = serving / "core"
    for folder in ("crd", "config"):
        (comp.share / folder).mkdir(parents=True, exist_ok=True)
    for path in [*(serving / "300-resources").glob("*.yaml"), *networking.glob("*.yaml"), *caching.glob("*.yaml"),
                 *(serving / "configmaps").glob("*.yaml"), *(serving / "webhooks").glob("*.yaml")]:
        crd = path.parent.name in ("300-resources", "config") and path.name != "config-network.yaml"
        shutil.copyfile(path, comp.share / ("crd" if crd else "config") / path.name)


def _cgo_env(comp: Component, env: dict[str, str]) -> dict[str, str]:
    # runc's seccomp tag links libseccomp (Debian: libseccomp-dev at build time, libseccomp2 to run).
    if "seccomp" in comp.spec.tags and subprocess.run(["pkg-config", "--exists", "libseccomp"]).returncode:
        raise SystemExit(f"{comp.key}: libseccomp's headers are missing (Debian: apt-get install libseccomp-dev)")
    return {**env, "CGO_ENABLED": "1"}


def build(comp: Component, env: dict[str, str], say=print) -> dict:
    """Builds one component (skipped when built); returns what was measured."""
    if is_built(comp, env):
        say(f"{comp.key}: built ({comp.home})")
        return {"component": comp.key, "skipped": True}
    if not comp.wrapper.joinpath("go.sum").exists():
        raise SystemExit(f"{comp.wrapper}: no go.sum")
    home = comp.home
    shutil.rmtree(home, ignore_errors=True)
    (home / "logs").mkdir(parents=True)
    comp.share.mkdir()
    log = home / "logs" / "build.log"
    say(f"{comp.key}: downloading modules (log: {log})")
    download_s, download_mib = _run(["go", "mod", "download"], comp.wrapper, env, log)
    args = ["go", "build", "-ldflags", " ".join(["-s", "-w", *(comp.spec.ldflags(comp.version) if comp.spec.ldflags else [])])]
    module = _module_dir(comp, env) if comp.spec.module else None
    if comp.spec.patches:
        args.append(f"-modfile={_patched_modfile(comp, module)}")
    if comp.spec.tags:
        env = _cgo_env(comp, env)
        args.append(f"-tags={','.join(comp.spec.tags)}")
    if comp.name == "kwok":
        _kwok_assets(comp, module)
    if comp.name == "kserve":
        _kserve_assets(comp, module)
    if comp.name == "keda":
        _keda_assets(comp, module)
    if comp.name == "knative-serving":
        _knative_assets(comp, module)
    say(f"{comp.key}: compiling {', '.join(comp.spec.commands)}")
    staging = Path(tempfile.mkdtemp(dir=home))
    build_s, build_mib = 0.0, 0
    for command, package in comp.spec.commands.items():
        seconds, peak = _run([*args, "-o", str(staging / command), package], comp.wrapper, env, log)
        build_s, build_mib = build_s + seconds, max(build_mib, peak)
    staging.rename(home / "bin")
    result = {"component": comp.key, "download_s": round(download_s, 1), "build_s": round(build_s, 1),
              "peak_mib": max(download_mib, build_mib), "go": go_version(env),
              "sizes_mib": {c: round(comp.binary(c).stat().st_size / 2**20, 1) for c in comp.spec.commands}}
    (home / "built.json").write_text(json.dumps({"stamp": _stamp(comp, env), **result}, indent=1))
    say(f"{comp.key}: download {download_s:.0f} s, compile {build_s:.0f} s, peak memory {result['peak_mib']} MiB")
    return result


def required(group: str, kserve_release: str | None = None) -> list[Component]:
    """The components of `group` (GROUPS); with `kserve_release`, that KServe release's manager only."""
    if group not in GROUPS:
        raise KeyError(f"no group {group!r}; groups: {', '.join(GROUPS)}")
    return [c for c in components() if c.spec.group == group
            and (c.name != "kserve" or kserve_release in (None, c.version))]


def select(names: list[str]) -> list[Component]:
    """Components by group, name or <name>-<version>; none named: the default group."""
    every = components()
    names = names or [DEFAULT_GROUP]
    chosen = [c for c in every if c.spec.group in names or c.name in names or c.key in names]
    unknown = set(names) - set(GROUPS) - {c.name for c in every} - {c.key for c in every}
    if unknown:
        raise SystemExit(f"unknown component(s) {sorted(unknown)}; groups: {', '.join(GROUPS)}; "
                         f"components: {', '.join(c.key for c in every)}")
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("components", nargs="*", help=f"a group ({', '.join(GROUPS)}), a component "
                        f"({', '.join(SPECS)}) or NAME-VERSION (default: {DEFAULT_GROUP})")
    parser.add_argument("--check", action="store_true", help="build nothing; exit 1 if a component is not built")
    parser.add_argument("--drop-build-cache", action="store_true",
                        help="then empty Go's build cache (a run that builds each program once: CI)")
    args = parser.parse_args(argv)
    env = go_env()
    chosen = select(args.components)
    if args.check:
        missing = [c.key for c in chosen if not is_built(c, env)]
        print(f"not built: {', '.join(missing)}" if missing else f"built, in {cache_root()}")
        return 1 if missing else 0
    if shutil.which("go") is None:
        raise SystemExit("no `go` on PATH: the cluster tests build their control plane with Go (docs/development.md, "
                         "\"Cluster tests\")")
    start = time.monotonic()
    results = [build(c, env) for c in chosen]
    built = [r for r in results if not r.get("skipped")]
    if built:
        print(f"built {len(built)} component(s) in {time.monotonic() - start:.0f} s, peak memory "
              f"{max(r['peak_mib'] for r in built)} MiB ({go_version(env)}, GOFLAGS={env['GOFLAGS']}); in {cache_root()}")
    if args.drop_build_cache:
        # The binaries are in the cache folder; the compiled packages (12 GB for every group) only
        # speed up a rebuild.
        subprocess.run(["go", "clean", "-cache"], env=env, check=True)
        print(f"emptied Go's build cache, {env['GOCACHE']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
