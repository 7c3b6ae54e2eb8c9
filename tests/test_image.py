"""The runtime image (k8s/Dockerfile) built for real, and what it installs.

- The build context: every COPY of the Dockerfile finds its files through
  k8s/Dockerfile.dockerignore, and what a developer's tree holds beside the repository (venv,
  outputs, weights, bytecode) stays out. Static, by the Docker SDK's .dockerignore matcher (the
  `docker` package, which mlflow brings into the test environment).
- The build: podman builds k8s/Dockerfile, with its ignore file, from a snapshot of the working
  tree, on a Debian bookworm base made here with debootstrap and tritonserver from nvidia-pytriton
  in place of Triton's image (no registry can be pulled on these machines; tests/image_build.py
  says how and why). The image's
  files under WORKDIR are exactly what the matcher above predicts from the COPY lines, its
  config is the Dockerfile's, and a second image built FROM it, as the image's user, in an empty
  folder, imports every module each pipeline step imports and runs kfp's executor
  (`python -m kfp.dsl.executor_main --help`), as a step's pod does.
- The image's Python: the base image's Python is 3.12, the tests run 3.11. pip's resolver is run
  for both on the Dockerfile's install arguments; on every package both install they must agree
  (k8s/image-constraints.txt pins where they would not), and what only the image installs must be
  torch's CUDA stack (where the tests' torch is a CPU wheel, they install none of it).

The build needs root, podman and debootstrap (installed with apt-get when missing; .ci/run
installs them); the base is made once (about 3 minutes) and kept as a podman image, the image
(about 4 minutes on 2 cores) is kept as the runtime image `make node-test` runs, built again when
what it is built from changes. `make image-test` runs this module (marker `image`); `make test`
leaves it out.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

import image_build as ib
from cubeserve import deploy

# minutes: `make image-test` runs this module (`make test` leaves it out); the build (the first test's set-up) may take
# longer than the suite's 900 s per test while another worker runs beside it
pytestmark = [pytest.mark.image, pytest.mark.timeout(1800)]


# -- the build context (static) ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def context(tmp_path_factory):
    """(snapshot folder, the repository's files in it, the files the ignore file lets through)."""
    root = tmp_path_factory.mktemp("context")
    files = ib.snapshot_context(root)
    return root, files, ib.context_files(root, ib.dockerignore_patterns(root / "k8s" / "Dockerfile.dockerignore"))


def _under(files: set[str], source: str) -> set[str]:
    source = source.rstrip("/")
    return {f for f in files if f == source or f.startswith(f"{source}/")}


def test_every_copy_of_the_dockerfile_finds_its_files_in_the_context(context):
    """What broke the build (issue #26): `COPY kfp_pipelines` after an ignore file that did not let
    kfp_pipelines/ in. Each COPY source must reach the context, with every file the repository
    has under it."""
    root, files, kept = context
    sources = [s for srcs, _ in ib.copies() for s in srcs]
    assert sources, "the Dockerfile COPYs from the context"
    problems = []
    for source in sources:
        in_repo = _under(files, source)
        missing = sorted(in_repo - kept)
        if not in_repo:
            problems.append(f"COPY {source}: the repository has no such file or folder")
        elif missing:
            problems.append(f"COPY {source}: {len(missing)} of its {len(in_repo)} files are filtered out of the "
                            f"build context by k8s/Dockerfile.dockerignore, e.g. {missing[:3]}")
    assert not problems, "\n".join(problems)


def test_the_ignore_file_keeps_local_state_out_of_the_context(context):
    root, files, kept = context
    assert not kept & set(ib.PLANTED), sorted(kept & set(ib.PLANTED))
    # Nothing beyond what the COPY lines take (and the Dockerfile, which the builder reads).
    sources = [s for srcs, _ in ib.copies() for s in srcs]
    extra = sorted(f for f in kept if f != "k8s/Dockerfile" and not any(_under({f}, s) for s in sources))
    assert not extra, f"in the context but copied by no COPY: {extra[:10]}"


# -- the build (podman) ------------------------------------------------------------------------------------

@dataclass
class Built:
    tag: str
    id: str
    root: Path  # the snapshot it was built from


@pytest.fixture(scope="module")
def built(context, resolutions, tmp_path_factory):
    """The runtime image built from the snapshot (the one in podman's store if built from the same
    input), kept for `make node-test`."""
    ib.require_podman()
    ib.remove_stale_images("localhost/cube-serve-test", "localhost/cube-serve-test-probe")
    root, _, _ = context
    ib.runtime_image(tmp_path_factory.mktemp("image"), root)
    return Built(ib.RUNTIME_IMAGE, ib.image_id(ib.RUNTIME_IMAGE), root)


def test_the_dockerfile_builds_with_its_config(built):
    config = json.loads(ib.podman("image", "inspect", built.id).stdout)[0]["Config"]
    assert config["User"] == f"{deploy.IMAGE_UID}:{deploy.IMAGE_UID}"
    assert config["Cmd"] == deploy.server_command(deploy.IMAGE_MODEL_REPOSITORY)
    assert config["WorkingDir"] == ib.workdir()
    assert {int(p.split("/")[0]) for p in config["ExposedPorts"]} == \
        {deploy.HTTP_PORT, deploy.GRPC_PORT, deploy.METRICS_PORT}
    assert "PIP_BREAK_SYSTEM_PACKAGES=1" in config["Env"]
    # The build's pip used the host's settings through /etc/pip.conf, not the image's environment.
    assert not [e for e in config["Env"] if e.startswith("PIP_") and e != "PIP_BREAK_SYSTEM_PACKAGES=1"]


def test_no_layer_of_the_image_passes_the_limit(built):
    """The build's disk peak holds two copies of the layer being committed (image_build.py):
    torch's CUDA wheels are split across RUN lines, each its own layer, none over LAYER_LIMIT."""
    history = json.loads(ib.podman("history", "--format", "json", built.id).stdout)
    sizes = sorted((entry["size"], entry.get("created_by", "")[-100:]) for entry in history)
    image = int(ib.podman("image", "inspect", "--format", "{{.Size}}", built.id).stdout)
    assert sum(size for size, _ in sizes) >= 0.99 * image, sizes  # the history accounts for the whole image
    assert sizes[-1][0] <= ib.LAYER_LIMIT, f"a layer of {sizes[-1][0] / 1e9:.1f} GB: {sizes[-1][1]}"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_kept_image_is_built_again_only_when_what_it_is_built_from_changes(built, tmp_path):
    """`make node-test` runs the image this module built while its label still matches: a file the
    ignore file keeps out changes nothing, a source file of the context does."""
    label = ib.built_from(built.id)
    assert label == ib.build_input(ib.TRITON_BASE_TAG, built.root)
    root = shutil.copytree(built.root, tmp_path / "context")
    (root / "outputs" / "planted.glb").write_bytes(b"another mesh")  # out of the context
    assert ib.build_input(ib.TRITON_BASE_TAG, root) == label
    with (root / "cubeserve" / "__init__.py").open("a") as f:
        f.write("# a change\n")
    assert ib.build_input(ib.TRITON_BASE_TAG, root) != label


def test_the_image_holds_exactly_what_the_copies_take_from_the_context(built, context):
    """podman's own filtering (the image) against the Docker SDK's (the static tests above): the
    files under WORKDIR, less what the RUN lines made there (pip's in-tree build/ and egg-info,
    bytecode of the import check), are the context's files at the COPY lines' destinations."""
    root, _, kept = context
    expected: dict[str, Path] = {}
    for sources, dest in ib.copies():
        for source in sources:
            for f in sorted(_under(kept, source)):
                rel = f[len(source.rstrip("/")):].lstrip("/")
                if rel:  # a file under a copied folder
                    target = f"{dest.rstrip('/')}/{rel}"
                else:
                    target = f"{dest}{Path(source).name}" if dest.endswith("/") else dest
                expected[target] = root / f
    work = ib.workdir()
    mount = Path(ib.podman("image", "mount", built.id).stdout.strip())
    try:
        made = re.compile(r"^(build/|[^/]+\.egg-info/)|(^|/)__pycache__/|\.pyc$")
        actual = {}
        for path in (mount / work.lstrip("/")).rglob("*"):
            rel = str(path.relative_to(mount / work.lstrip("/")))
            if path.is_file() and not made.search(rel):
                actual[f"{work}/{rel}"] = path
        assert sorted(actual) == sorted(expected)
        differ = [p for p in expected if _sha(actual[p]) != _sha(expected[p])]
        assert not differ, differ
        assert not any(p.endswith("planted.safetensors") for p in actual)
    finally:
        ib.podman("image", "unmount", built.id, check=False)


PROBE = """FROM {image}
WORKDIR /tmp/step
RUN %s
RUN ["python3", "-m", "kfp.dsl.executor_main", "--help"]
"""

PROBE_SCRIPT = """
import importlib, json, os, sys
out = {"python": sys.version.split()[0], "uid": os.getuid(), "cwd": os.getcwd(), "modules": {}, "failed": {}}
for name in sys.argv[1:]:
    try:
        out["modules"][name] = getattr(importlib.import_module(name), "__file__", None)
    except Exception as e:
        out["failed"][name] = f"{type(e).__name__}: {e}"
import numpy
out["numpy"] = numpy.__version__
print("PROBE " + json.dumps(out), flush=True)
"""


def test_every_pipeline_steps_imports_run_in_the_image(built, tmp_path):
    """A step's pod runs the step's source with kfp's executor in this image, as its user; nothing
    is installed at start (kfp_pipelines/checkpoint_rollout.py: install_kfp_package=False)."""
    modules = sorted(ib.step_modules() | {"kfp.dsl.executor_main"})
    assert {"torch", "boto3", "cubeserve.pipeline.steps"} <= set(modules), modules
    run = json.dumps(["python3", "-c", PROBE_SCRIPT, *modules])
    out = ib.build_probe(built.id, PROBE % run, tmp_path / "probe", f"localhost/cube-serve-test-probe:{os.getpid()}")
    try:
        assert out.returncode == 0, f"the probe build failed:\n{out.stdout[-4000:]}\n{out.stderr[-3000:]}"
        [line] = [l for l in out.stdout.splitlines() if l.startswith("PROBE ")]
        probe = json.loads(line[len("PROBE "):])
        assert not probe["failed"], probe["failed"]
        assert probe["uid"] == deploy.IMAGE_UID and probe["cwd"] == "/tmp/step"
        assert int(probe["numpy"].split(".")[0]) < 2
        # The package as installed, not the sources under WORKDIR.
        ours = {m: f for m, f in probe["modules"].items() if m.split(".")[0] in ("cubeserve", "kfp_pipelines")}
        assert ours and all("-packages/" in (f or "") for f in ours.values()), ours
        assert "--executor_input" in out.stdout and "--function_to_execute" in out.stdout
    finally:
        ib.remove_image(f"localhost/cube-serve-test-probe:{os.getpid()}")


# -- the image's Python (pip's resolver) -----------------------------------------------------------------

@pytest.fixture(scope="module")
def resolutions(context, tmp_path_factory):
    """The two resolutions (about a minute and a half, mostly waiting on the index), started in
    the background when first asked for: the image's build asks first, so they run beside it."""
    [base] = [a for k, a in ib.instructions() if k == "FROM"]
    python, glibc = ib.BASE_PYTHONS.get(base, (None, None))
    root, _, kept = context
    work = tmp_path_factory.mktemp("resolve")
    for run in ("image", "tests"):  # pip writes metadata into the project's folder: a copy for each
        for rel in kept:
            (work / run / "context" / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / rel, work / run / "context" / rel)
    args = ib.pip_install_args()
    pool = ThreadPoolExecutor(2)
    image = pool.submit(ib.resolve, work / "image" / "context", args, work / "image" / "wheels", python, glibc) \
        if python else None
    tests = pool.submit(ib.resolve, work / "tests" / "context", args, work / "tests" / "wheels")
    try:
        yield base, python, args, image, tests
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def test_the_images_python_resolves_the_versions_the_tests_run(resolutions):
    """`pip install --dry-run --report` of the Dockerfile's install arguments, in the build
    context, for CPython 3.12.3 on glibc 2.39 (the base image's) and for the tests' Python."""
    from packaging.version import Version

    base, python, args, image_run, tests_run = resolutions
    assert python, f"FROM {base}: add its Python and glibc to image_build.BASE_PYTHONS"
    assert '.[gpu,pipeline,front,batch,tracing]' in args and any(a.startswith("torch==") for a in args), args
    image_report, tests_report = image_run.result(), tests_run.result()
    # The markers were evaluated for the image's Python, not the one pip ran in.
    assert image_report["environment"]["python_full_version"] == python
    image, tests = ib.resolved(image_report), ib.resolved(tests_report)

    assert Version(image["numpy"]["version"]).major < 2  # the python backend corrupts tensors with numpy 2
    [torch] = [a.split("==")[1] for a in args if a.startswith("torch==")]
    assert Version(image["torch"]["version"]).public == torch
    assert Version(tests["torch"]["version"]).public == torch
    assert image["cubeserve"]["version"] == tests["cubeserve"]["version"]

    differ = {n: (image[n]["version"], tests[n]["version"]) for n in image.keys() & tests.keys()
              if Version(image[n]["version"]).public != Version(tests[n]["version"]).public}
    assert not differ, (f"the image's Python ({python}) gets other versions than the tests' (name: (image, tests)): "
                        f"{differ}; pin them in k8s/image-constraints.txt")
    # What only the image installs: torch's own dependencies (the CUDA wheel's), nothing else.
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    reach, todo = set(), ["torch"]
    while todo:
        name = todo.pop()
        if name in reach or name not in image:
            continue
        reach.add(name)
        todo += [canonicalize_name(Requirement(r).name) for r in image[name].get("requires_dist") or []]
    only_image = sorted(set(image) - set(tests) - reach)
    assert not only_image, f"only the image's Python installs {only_image}, which the tests never import"
