"""k8s/Dockerfile built for real, for tests/test_image.py and tests/node_stack.py: Debian's podman
(no daemon), as root, on a base made here, since no registry's images can be pulled on these
machines.

- The base: a Debian bookworm root filesystem with python3, python3-venv and python3-pip
  (`debootstrap --variant=minbase`, from the mirror the host's apt uses), imported with `podman
  import` as BASE_TAG and kept between runs; TRITON_BASE_TAG adds tritonserver and its python
  backend from the tests' nvidia-pytriton. `podman build --from TRITON_BASE_TAG` puts it in place
  of the Dockerfile's FROM image (Triton's), without editing the Dockerfile.
- `podman build --isolation=chroot`: podman's OCI runtime cannot start containers on these
  machines (`podman run`: "setrlimit RLIMIT_NOFILE: Operation not permitted"); chroot isolation
  runs the RUN lines without one.
- pip inside the build uses the host's pip settings (`pip config list`, which includes the PIP_*
  variables): they are written to a pip.conf mounted read-only at /etc/pip.conf (a site-wide
  config file: https://pip.pypa.io/en/stable/topics/configuration/#location), and every local
  path they name (CA bundle, constraints, find-links directories, file:// indexes and the
  directories their pages link into) is mounted read-only at the same path. So torch comes from
  the same wheel as the host's, and pip trusts what the host's pip trusts. Nothing of this
  machine is written here: all of it is read at test time. (The mount points stay in the test
  image as empty files and folders: /etc/pip.conf, /opt/wheels, ...)
- The runtime image is built with `--layers=true`, each RUN line committed as its own layer:
  podman commits a layer by writing a tar of it and then the new layer beside the container's
  copy, and keeps each step's container until the build ends, so the build's disk peak is about
  twice the image plus twice its largest layer: 16 GB for the 7 GB image, measured. As one layer
  (`--layers=false`) it took 25 GB, and failed a CI machine for space; k8s/Dockerfile splits
  torch's CUDA wheels so that no layer passes LAYER_LIMIT. A rebuild
  after a code change reuses the layers up to torch's. The one runtime image (RUNTIME_IMAGE) is
  kept for the node tests and replaced when what it is built from changes; the layers only the
  replaced one used are removed with it. Other builds here (the bases, probes) are small and keep
  no layer cache (`--layers=false`). podman's default storage (overlay, as root) is used: it
  works on these machines, and the bases stay in it between runs.

Nothing here runs a container; the built image is checked by building a second image FROM it
whose RUN lines do the checking (the output of RUN lines is in the build's output).
"""

from __future__ import annotations

import ast
import configparser
import hashlib
import inspect
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urljoin, urlparse

from guards import cannot_run

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "k8s" / "Dockerfile"
IGNORE_FILE = REPO / "k8s" / "Dockerfile.dockerignore"  # BuildKit's and podman's <Dockerfile>.dockerignore

BASE_TAG = "localhost/cube-serve-test-base:bookworm"
BASE_SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-venv", "python3-pip")
# Stored as a label on the base: a base made by another recipe is made again.
BASE_RECIPE = f"debootstrap --variant=minbase --include={','.join(BASE_PACKAGES)} {BASE_SUITE}"
BASE_LABEL = "io.cube-serve.test-base-recipe"

INSTALL = ("apt-get update -qq && DEBIAN_FRONTEND=noninteractive "
           "apt-get install -y -qq podman debootstrap")
# Flags of every build here: no registry is reachable (the base is local), no OCI runtime.
BUILD_FLAGS = ["--isolation=chroot", "--pull=never", "--layers=false"]
RUNTIME_BUILD_FLAGS = [*BUILD_FLAGS[:-1], "--layers=true"]
# The runtime image's largest layer, in bytes: its commit writes two copies of it at the build's
# peak (test_image.py holds every layer under it).
LAYER_LIMIT = 2 * 10**9
# podman re-executes itself from a sealed memfd copy of its binary (containers/storage's
# unshare.c); the kernel can refuse the seal with EBUSY while pages of the copy are still pinned,
# and the build's RUN step fails with this line (once in a cold run of .ci/run, the same build
# fine the next time). A build failing so is run once more (podman_build).
TRANSIENT_BUILD_ERROR = "sealing memfd copy"


def podman_build(args: list[str], **kw) -> subprocess.CompletedProcess:
    """`podman build ARGS` (subprocess.run's keywords), run again once if it failed on
    TRANSIENT_BUILD_ERROR (its output captured, or written to the file given as stdout)."""
    for attempt in (1, 2):
        if "stdout" in kw and hasattr(kw["stdout"], "seek"):
            kw["stdout"].seek(0)
            kw["stdout"].truncate()
        result = subprocess.run(["podman", "build", *args], **kw)
        if result.returncode == 0 or attempt == 2:
            return result
        output = (result.stdout or "") + (result.stderr or "") if kw.get("capture_output") else \
            Path(kw["stdout"].name).read_text(errors="replace") if "stdout" in kw else ""
        if TRANSIENT_BUILD_ERROR not in output:
            return result
        print(f"podman build failed on {TRANSIENT_BUILD_ERROR!r} (the kernel's EBUSY): building again", flush=True)
    raise AssertionError("unreachable")


# -- tools --------------------------------------------------------------------------------------------

def require_podman() -> None:
    """podman and debootstrap, installed with apt-get when missing (as root, as CI runs);
    otherwise the test cannot run (guards.cannot_run: a skip with the reason, a failure in CI)."""
    if os.geteuid() != 0:
        cannot_run("building k8s/Dockerfile needs root (podman build --isolation=chroot, debootstrap, "
                   f"and apt-get to install them: {INSTALL}); not root here")
    if not (shutil.which("podman") and shutil.which("debootstrap")) and shutil.which("apt-get"):
        subprocess.run(["bash", "-c", INSTALL], check=False, capture_output=True, timeout=1200)
    if not (shutil.which("podman") and shutil.which("debootstrap")):
        cannot_run(f"podman and debootstrap are not installed and apt-get could not install them ({INSTALL})")
    info = subprocess.run(["podman", "info", "--format", "{{.Store.GraphDriverName}}"], capture_output=True,
                          text=True, timeout=300)
    assert info.returncode == 0, f"podman does not work here: {info.stderr[-2000:]}"


def podman(*args: str, timeout: float = 300, check: bool = True, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, **kw)
    if check:
        assert out.returncode == 0, f"podman {' '.join(args[:3])} ...: {out.stderr[-3000:]}"
    return out


def image_exists(ref: str) -> bool:
    return podman("image", "exists", ref, check=False).returncode == 0


def image_id(ref: str) -> str:
    return podman("image", "inspect", "--format", "{{.Id}}", ref).stdout.strip()


def remove_image(ref: str) -> None:
    podman("rmi", "--force", ref, check=False)


def remove_stale_images(*repositories: str) -> None:
    """Images `REPOSITORY:<pid>` left by a test session that was killed (its process is gone)."""
    listed = podman("images", "--format", "{{.Repository}}:{{.Tag}}", check=False).stdout.split()
    for ref in listed:
        repository, _, tag = ref.rpartition(":")
        if repository in repositories and tag.isdigit() and not Path(f"/proc/{tag}").exists():
            remove_image(ref)


# -- the base -----------------------------------------------------------------------------------------

def apt_mirror() -> str:
    """The host's Debian mirror (its apt sources, one-line or deb822 format), for debootstrap; the
    Debian default where none is found."""
    texts = []
    for path in [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*"))]:
        if path.suffix in (".list", ".sources") and path.is_file():
            texts.append(path.read_text(errors="replace"))
    for text in texts:
        for line in text.splitlines():
            words = line.split("#", 1)[0].split()
            uris = [w for w in words[1:] if re.match(r"https?://", w)] if words[:1] == ["deb"] else \
                words[1:] if words[:1] == ["URIs:"] else []
            for uri in uris:
                if "security" not in uri and "ports" not in uri:
                    return uri
    return "http://deb.debian.org/debian"


def _mounts_under(path: Path) -> list[str]:
    """Mount points at or under `path` (debootstrap mounts /proc and /sys in its target, and
    unmounts them on exit, which a killed debootstrap does not reach)."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == str(path) or point.startswith(f"{path}/"):
            found.append(point)
    return sorted(found, key=len, reverse=True)


def _remove_rootfs(rootfs: Path) -> None:
    for point in _mounts_under(rootfs):
        subprocess.run(["umount", "-l", point], check=False, capture_output=True)
    left = _mounts_under(rootfs)
    assert not left, f"{rootfs} still has mounts {left}: not removed"
    shutil.rmtree(rootfs, ignore_errors=True)


def ensure_base(workdir: Path) -> str:
    """BASE_TAG, made once (a few minutes, ~300 MB) and reused while its recipe label matches."""
    stale = None
    if image_exists(BASE_TAG):
        labels = podman("image", "inspect", "--format", "{{json .Labels}}", BASE_TAG).stdout
        if BASE_RECIPE in labels:
            return BASE_TAG
        stale = image_id(BASE_TAG)
    rootfs = workdir / "rootfs"
    try:
        out = subprocess.run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}",
                              BASE_SUITE, str(rootfs), apt_mirror()], capture_output=True, text=True,
                             timeout=1800)
        assert out.returncode == 0, f"debootstrap failed: {out.stdout[-2000:]}{out.stderr[-2000:]}"
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
        imported = subprocess.run(["podman", "import", "--change", f"LABEL {BASE_LABEL}=\"{BASE_RECIPE}\"",
                                   "-", BASE_TAG], stdin=tar.stdout, capture_output=True, text=True, timeout=900)
        tar.stdout.close()
        assert tar.wait(timeout=900) == 0 and imported.returncode == 0, f"podman import: {imported.stderr[-2000:]}"
    finally:
        if rootfs.exists():
            _remove_rootfs(rootfs)
    if stale:  # the base of an older recipe, untagged now
        remove_image(stale)
    return BASE_TAG


# The node tests run the image (tests/test_node.py): there the base must also serve. This one adds
# to BASE_TAG the Triton the tests run (the nvidia-pytriton wheel's tritonserver and python backend,
# this Python's stub beside it, libpython for the stub) where Triton's image has its own:
# `tritonserver` on PATH and /opt/tritonserver/backends, Triton's default backend directory.
TRITON_BASE_TAG = "localhost/cube-serve-test-base:bookworm-triton"
TRITON_BASE_LABEL = "io.cube-serve.test-triton-base-recipe"
_TRITON_BASE = """FROM {base}
RUN apt-get update -qq && version=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])') \\
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "libpython$version" \\
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m pip install --no-cache-dir --no-deps --break-system-packages "nvidia-pytriton=={pytriton}" \\
    && home=$(python3 -c 'import importlib.util as u; print(u.find_spec("pytriton").submodule_search_locations[0])')/tritonserver \\
    && version=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])') \\
    && cp "$home/python_backend_stubs/$version/triton_python_backend_stub" "$home/backends/python/" \\
    && mkdir -p /opt/tritonserver && ln -s "$home/backends" /opt/tritonserver/backends \\
    && ln -s "$home/bin/tritonserver" /usr/local/bin/tritonserver
LABEL {label}="nvidia-pytriton=={pytriton}"
"""


def ensure_triton_base(workdir: Path) -> str:
    """TRITON_BASE_TAG on BASE_TAG, made once and reused while it carries the tests' nvidia-pytriton."""
    from importlib.metadata import version

    pytriton = version("nvidia-pytriton")
    if image_exists(TRITON_BASE_TAG) and f"nvidia-pytriton=={pytriton}" in podman(
            "image", "inspect", "--format", "{{json .Labels}}", TRITON_BASE_TAG).stdout:
        return TRITON_BASE_TAG
    base = ensure_base(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "Containerfile").write_text(_TRITON_BASE.format(base=base, pytriton=pytriton, label=TRITON_BASE_LABEL))
    conf, mounts = pip_conf_and_mounts(host_pip_config())
    (workdir / "pip.conf").write_text(conf)
    volumes = [f"--volume={workdir / 'pip.conf'}:/etc/pip.conf:ro", *(f"--volume={p}:{p}:ro" for p in mounts)]
    out = podman_build([*BUILD_FLAGS, *volumes, "-f", str(workdir / "Containerfile"), "-t", TRITON_BASE_TAG,
                        str(workdir)], capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, f"the Triton base did not build:\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
    return TRITON_BASE_TAG


# -- the host's pip settings ----------------------------------------------------------------------------

def host_pip_config() -> dict[str, dict[str, str]]:
    """`pip config list` of the tests' interpreter as {section: {key: value}}, the PIP_*
    variables (":env:") folded into [global] over the files' values, as pip ranks them
    (https://pip.pypa.io/en/stable/topics/configuration/#precedence-override-order)."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                         check=True, timeout=120)
    sections: dict[str, dict[str, str]] = {}
    env: dict[str, str] = {}
    for line in out.stdout.splitlines():
        name, sep, value = line.partition("=")
        if not sep or "." not in name:
            continue
        section, key = name.rsplit(".", 1)
        value = ast.literal_eval(value)
        (env if section == ":env:" else sections.setdefault(section, {}))[key] = value
    sections.setdefault("global", {}).update(env)
    for section, values in sections.items():  # a PIP_ variable beats every file's section
        if section != "global":
            for key in env:
                values.pop(key, None)
    for var in ("REQUESTS_CA_BUNDLE", "SSL_CERT_FILE"):  # a CA bundle given to pip this way
        if "cert" not in sections["global"] and os.environ.get(var):
            sections["global"]["cert"] = os.environ[var]
    return sections


def _local_path(token: str) -> Path | None:
    if token.startswith("file://"):
        return Path(unquote(urlparse(token).path))
    if token.startswith("/"):
        return Path(token)
    return None


def _linked_dirs(index: Path) -> set[Path]:
    """The local directories that the pages of a file:// simple index (PEP 503) link into,
    e.g. simple/<name>/index.html -> ../../files/<wheel>."""
    dirs = set()
    for page in [index / "index.html", *index.glob("*/index.html")]:
        if not page.is_file():
            continue
        base = page.resolve().as_uri()
        for href in re.findall(r'href="([^"#]+)', page.read_text(errors="replace")):
            target = urljoin(base, href)
            if target.startswith("file://"):
                dirs.add(Path(unquote(urlparse(target).path)).parent)
    return dirs


def pip_conf_and_mounts(sections: dict[str, dict[str, str]]) -> tuple[str, list[Path]]:
    """A pip.conf with the host's settings, and every existing local path they name (for
    `-v PATH:PATH:ro`), nested paths folded into their parent."""
    parser = configparser.ConfigParser(interpolation=None)
    paths: set[Path] = set()
    for section, values in sections.items():
        parser[section] = values
        for value in values.values():
            for token in str(value).split():
                path = _local_path(token)
                if path is not None and path.exists():
                    paths.add(path)
                    if path.is_dir():
                        paths |= {d for d in _linked_dirs(path) if d.is_dir()}
    folded = sorted(p for p in paths if not any(q != p and q in p.parents for q in paths))
    from io import StringIO

    text = StringIO()
    parser.write(text)
    return text.getvalue(), folded


# -- the build ------------------------------------------------------------------------------------------

def build_image(tag: str, base: str, workdir: Path, log: Path, context: Path = REPO,
                labels: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`podman build -f k8s/Dockerfile` with `context` (the repository root, or a snapshot of it)
    as context, which podman filters by k8s/Dockerfile.dockerignore, FROM `base`, with the host's
    pip settings and `labels`."""
    conf, mounts = pip_conf_and_mounts(host_pip_config())
    (workdir / "pip.conf").write_text(conf)
    volumes = [f"--volume={workdir / 'pip.conf'}:/etc/pip.conf:ro"]
    volumes += [f"--volume={p}:{p}:ro" for p in mounts]
    label_flags = [f"--label={k}={v}" for k, v in (labels or {}).items()]
    with log.open("w") as f:
        return podman_build([*RUNTIME_BUILD_FLAGS, "--from", base, "-f", str(context / DOCKERFILE.relative_to(REPO)),
                             "-t", tag, *label_flags, *volumes, str(context)],
                            stdout=f, stderr=subprocess.STDOUT, text=True, timeout=2400)


# The runtime image the tests build from k8s/Dockerfile FROM the Triton base: `make image-test` builds
# it (tests/test_image.py), `make node-test` runs it as KServe's pods (tests/node_stack.py) and
# finds it built while its inputs are the same. Not `latest`: the pods' IfNotPresent never pulls it.
RUNTIME_IMAGE = "localhost/cube-serve-runtime:current"
BUILD_INPUT_LABEL = "io.cube-serve.build-input"


def build_input(base: str, context: Path) -> str:
    """A digest of what an image built from `context` FROM `base` is made of: the base image's
    ID, the Dockerfile and every file the ignore file lets into the context, by content. (Not the
    host's pip settings: a change of those alone reuses the image.)"""
    digest = hashlib.sha256(image_id(base).encode() + b"\0" + (context / DOCKERFILE.relative_to(REPO)).read_bytes())
    for rel in sorted(context_files(context, dockerignore_patterns(context / IGNORE_FILE.relative_to(REPO)))):
        digest.update(f"\0{rel}\0".encode() + hashlib.sha256((context / rel).read_bytes()).digest())
    return digest.hexdigest()


def built_from(ref: str) -> str:
    """The build_input an image was labelled with ("" if none)."""
    return podman("image", "inspect", "--format", f'{{{{index .Labels "{BUILD_INPUT_LABEL}"}}}}', ref).stdout.strip()


def runtime_image(workdir: Path, context: Path = REPO) -> bool:
    """RUNTIME_IMAGE built from `context` (the repository, or a snapshot of it) FROM the Triton
    base, unless the one in podman's store was built from the same input; False if it was reused.
    The image it replaces is removed (each is about 7 GB)."""
    base = ensure_triton_base(workdir / "base")
    wanted = build_input(base, context)
    old = image_id(RUNTIME_IMAGE) if image_exists(RUNTIME_IMAGE) else None
    if old and built_from(RUNTIME_IMAGE) == wanted:
        return False
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "build.log"
    result = build_image(RUNTIME_IMAGE, base, workdir, log, context, labels={BUILD_INPUT_LABEL: wanted})
    assert result.returncode == 0, f"podman build -f k8s/Dockerfile failed:\n{log.read_text()[-5000:]}"
    if old and old != image_id(RUNTIME_IMAGE):
        remove_image(old)
        # The old build's cached layers that the new one did not reuse: untagged, no children.
        podman("image", "prune", "--force", check=False)
    return True


def build_probe(image: str, containerfile: str, workdir: Path, tag: str) -> subprocess.CompletedProcess:
    """A second image FROM `image` whose RUN lines check it; their output is in stdout."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "Containerfile").write_text(containerfile.replace("{image}", image))
    return podman_build([*BUILD_FLAGS, "-f", str(workdir / "Containerfile"), "-t", tag, str(workdir)],
                        capture_output=True, text=True, timeout=900)


def dockerignore_patterns(path: Path = IGNORE_FILE) -> list[str]:
    """The ignore file's patterns as the Docker SDK reads a .dockerignore (blank lines and
    comments dropped; docker/api/build.py)."""
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.strip().startswith("#")]


def context_files(root: Path, patterns: list[str]) -> set[str]:
    """The files of `root` that a build context filtered by `patterns` holds, by the Docker SDK's
    matcher (docker.utils.build.PatternMatcher, "heavily based on" moby's pkg/fileutils). Checked
    against podman's own filtering by tests/test_image.py."""
    from docker.utils.build import exclude_paths

    kept = exclude_paths(str(root), list(patterns), dockerfile="k8s/Dockerfile")
    return {p for p in kept if (root / p).is_file()}


# -- what the steps import --------------------------------------------------------------------------------

def step_modules() -> set[str]:
    """Every module the pipeline's steps import, including the imports inside functions of the
    cubeserve modules they call (imports are lazy there, so importing a module alone proves little).
    The steps run as KFP lightweight components: only the step function's source goes into the pod
    (kfp_pipelines/checkpoint_rollout.py, `install_kfp_package=False`)."""
    from kfp_pipelines import checkpoint_rollout

    names = set()
    sources = [inspect.getsource(f) for f in checkpoint_rollout.STEPS]
    modules = ["cubeserve/pipeline/steps.py", "cubeserve/pipeline/serving.py", "cubeserve/pipeline/leases.py",
               "cubeserve/registry.py",
               "cubeserve/storage.py", "cubeserve/serving/repository.py"]
    modules += [str(p.relative_to(REPO)) for p in sorted((REPO / "cubeserve" / "rollout").glob("*.py"))]
    for module in modules:
        sources.append((REPO / module).read_text())
    for source in sources:
        for node in ast.walk(ast.parse(inspect.cleandoc(source) if source.startswith(" ") else source)):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
    return {n for n in names if n != "__future__"}


# -- the Dockerfile ---------------------------------------------------------------------------------------

def instructions() -> list[tuple[str, str]]:
    from k8s_validation import dockerfile_instructions

    return dockerfile_instructions(DOCKERFILE)


def copies() -> list[tuple[list[str], str]]:
    """(sources, destination in the image) of every COPY, destinations made absolute by WORKDIR."""
    import shlex

    out, workdir = [], "/"
    for keyword, arguments in instructions():
        if keyword == "WORKDIR":
            workdir = str(Path(workdir, arguments))
        elif keyword == "COPY":
            *sources, dest = [a for a in shlex.split(arguments) if not a.startswith("--")]
            out.append((sources, str(Path(workdir, dest))) if not dest.endswith("/")
                       else (sources, str(Path(workdir, dest)) + "/"))
    return out


def workdir() -> str:
    return [a for k, a in instructions() if k == "WORKDIR"][-1]


def pip_install_args() -> list[str]:
    """The arguments of the Dockerfile's `pip install`s, in order, as one install (ARG defaults
    filled in; --no-cache-dir dropped), relative to WORKDIR as written."""
    import shlex

    steps = instructions()
    args = dict(a.split("=", 1) for k, a in steps if k == "ARG" and "=" in a)
    out = []
    for keyword, arguments in steps:
        if keyword != "RUN":
            continue
        for command in arguments.split("&&"):
            words = shlex.split(re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], command))
            if words[:4] == ["python3", "-m", "pip", "install"]:
                out += [w for w in words[4:] if w != "--no-cache-dir"]
    return out


# -- a snapshot of the build context ----------------------------------------------------------------------

# What a developer's tree holds beside the repository's files, which the ignore file must keep out
# of the image: the venv, outputs, weights written into the model repository, another checkpoint,
# bytecode, egg-info, the MLflow database.
PLANTED = (".venv/bin/planted", "outputs/planted.glb", "triton_models/cube3d/1/weights/planted.safetensors",
           "triton_models/cube3d_stream/1/weights/planted.safetensors", "models/other/planted.safetensors",
           "cubeserve/__pycache__/planted.cpython-311.pyc", "cubeserve/planted.pyc",
           "client/cube3d_client.egg-info/PKG-INFO", "mlflow.db")


def snapshot_context(dst: Path) -> set[str]:
    """The repository's files (tracked, and untracked ones git does not ignore) copied to `dst`,
    plus PLANTED: the build's context, fixed while the tree is being edited. Returns the
    repository's files (relative paths)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True, timeout=120).stdout.decode().split("\0")
    files = set()
    for rel in filter(None, listed):
        src = REPO / rel
        if src.is_file() and not src.is_symlink():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
            files.add(rel)
    for rel in PLANTED:
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        (dst / rel).write_bytes(b"planted by tests/test_image.py\n")
    return files


# -- pip's resolver for another Python ----------------------------------------------------------------------

# The Python and glibc of the Dockerfile's base image: Triton's 26.07 container is Ubuntu 24.04 with
# its python3 (NVIDIA's Triton release notes, 26.07: "Ubuntu 24.04 including Python 3.12"), and
# Ubuntu 24.04 ships Python 3.12.3 and glibc 2.39 (packages.ubuntu.com, noble: python3.12, libc6).
BASE_PYTHONS = {"nvcr.io/nvidia/tritonserver:26.07-py3": ("3.12.3", (2, 39))}

# pip evaluates environment markers (`; python_version < "3.12"`) against the interpreter it runs
# in, even with --python-version (pypa/pip#10050, closed as not planned); pex works around it the same
# way for its foreign-platform resolves (pex-tool/pex#1366): the marker environment is replaced with
# the target's before pip runs. --python-version handles wheel tags and Requires-Python.
_PIP_FOR = """
import sys
from pip._vendor.packaging import markers
_env = dict(markers.default_environment())
_env.update(python_version=".".join(sys.argv[1].split(".")[:2]), python_full_version=sys.argv[1],
            implementation_version=sys.argv[1])
markers.default_environment = lambda: dict(_env)
from pip._internal.cli.main import main
sys.exit(main(sys.argv[2:]))
"""


def _manylinux(glibc: tuple[int, int], arch: str = "x86_64") -> list[str]:
    """--platform values for a glibc: every manylinux_2_Y with Y <= its minor (PEP 600), newest first,
    and the legacy aliases (PEP 599/571/513), which pip does not derive from manylinux_2_Y."""
    major, minor = glibc
    tags = [f"manylinux_{major}_{y}_{arch}" for y in range(minor, 4, -1)]
    return tags + [f"manylinux2014_{arch}", f"manylinux2010_{arch}", f"manylinux1_{arch}"]


def resolve(context: Path, args: list[str], wheels: Path, python: str | None = None,
            glibc: tuple[int, int] | None = None, attempts: int = 6) -> dict:
    """pip's installation report (`pip install --dry-run --report`) for `args` run in `context`,
    for the tests' interpreter (python=None) or for CPython `python` on manylinux for `glibc`.
    Wheels only (pip allows no sdists for another Python); a dependency published only as an sdist
    is built here into `wheels` and must come out pure Python (py3-none-any), or this fails."""
    import json

    wheels.mkdir(parents=True, exist_ok=True)
    report = wheels.parent / f"report-{python or 'tests'}.json"
    if python:
        target = ["--python-version", python, "--implementation", "cp"]
        target += [f"--platform={p}" for p in _manylinux(glibc)]
        pip = [sys.executable, "-c", _PIP_FOR, python]
    else:
        target, pip = [], [sys.executable, "-m", "pip"]
    built: set[str] = set()
    for _ in range(attempts):
        out = subprocess.run([*pip, "install", "--dry-run", "--ignore-installed", "--only-binary=:all:", "--quiet",
                              "--find-links", str(wheels), "--report", str(report), *target, *args],
                             cwd=context, capture_output=True, text=True, timeout=1200)
        if out.returncode == 0:
            return json.loads(report.read_text())
        missing = re.findall(r"No matching distribution found for (\S+)", out.stderr)
        assert missing and missing[0] not in built, out.stderr[-3000:]
        before = set(wheels.iterdir())
        made = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(wheels),
                               missing[0]], cwd=wheels, capture_output=True, text=True, timeout=1200)
        assert made.returncode == 0, f"{missing[0]}: no wheel, and building one failed: {made.stderr[-2000:]}"
        new = [p.name for p in set(wheels.iterdir()) - before]
        assert new and all(n.endswith("-none-any.whl") for n in new), \
            f"{missing[0]} has no wheel for {python or 'this Python'}; built from source it is not pure Python: {new}"
        built.add(missing[0])
    raise AssertionError(f"pip did not resolve {args} in {attempts} attempts")


def resolved(report: dict) -> dict[str, dict]:
    """{canonical name: the report's metadata} of what the report installs."""
    from packaging.utils import canonicalize_name

    return {canonicalize_name(i["metadata"]["name"]): i["metadata"] for i in report["install"]}
