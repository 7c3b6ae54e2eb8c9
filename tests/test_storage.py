"""cubeserve.storage against a real S3 server (rclone serve s3, kfp_pipelines/local_services.py), the version
repository builder, and the path a checkpoint version takes in a cluster: built, uploaded to
`s3://<bucket>/cube3d/7/`, downloaded by KServe's own storage initializer code as its container
runs it, served by tritonserver with the ServingRuntime's arguments, called through the predict
API."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from cube3d_client import Cube3DClient
from cubeserve import deploy, storage
from cubeserve.server.local_triton import DEMO_MODEL, LocalTriton, free_port, tritonserver_home
from cubeserve.serving.repository import build_version_repository
from cubeserve.storage import StorageError
from kfp_pipelines.local_services import ObjectStore
from serving_helpers import metrics

BUCKET = "models"
S3_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL",
                "AWS_DEFAULT_REGION", "S3_VERIFY_SSL", "S3_USER_VIRTUAL_BUCKET", "AWS_CA_BUNDLE")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    with ObjectStore(tmp_path_factory.mktemp("object_store") / "data") as s3:
        s3.create_bucket(BUCKET)
        yield s3


@pytest.fixture
def s3env(store, monkeypatch):
    """The process environment as KServe's S3 Secret sets it for the storage initializer."""
    for name in S3_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in store.env().items():
        monkeypatch.setenv(name, value)
    return store


def tree(root: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under root."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def make_files(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def kserve_download(store: ObjectStore, uri: str, out_dir: Path) -> subprocess.CompletedProcess:
    """KServe's storage initializer code (kserve-storage), in a process of its own with only the
    S3 variables of the storage-initializer container."""
    return subprocess.run(
        [sys.executable, "-c", "import sys; from kserve_storage import Storage; Storage.download(sys.argv[1], sys.argv[2])",
         uri, str(out_dir)],
        env=store.env(), capture_output=True, text=True, timeout=120)


# -- URIs ---------------------------------------------------------------------------------------

def test_join_and_as_dir():
    assert storage.join("s3://b/cube3d", "7") == "s3://b/cube3d/7"
    assert storage.join("s3://b/cube3d/", "/7/", "weights/config.yaml") == "s3://b/cube3d/7/weights/config.yaml"
    assert storage.join("s3://b", "m") == "s3://b/m"
    assert storage.join("file:///srv/store", "7") == "file:///srv/store/7"
    assert storage.join("/", "srv") == "/srv"
    assert storage.join("relative/dir", "7") == "relative/dir/7"
    assert storage.as_dir(storage.join("s3://b/cube3d", "7")) == "s3://b/cube3d/7/"
    assert storage.as_dir("s3://b/cube3d/7//") == "s3://b/cube3d/7/"
    with pytest.raises(StorageError, match=r"s3://b/m: refusing to join the path segment '\.\.'"):
        storage.join("s3://b/m", "../other")


@pytest.mark.parametrize("uri", ["gs://bucket/m", "https://example.com/m", "pvc://claim/m"])
def test_an_unsupported_scheme_names_the_supported_ones(uri, tmp_path):
    for call in (lambda: storage.join(uri, "1"), lambda: storage.read_text(uri), lambda: storage.exists(uri),
                 lambda: storage.download_dir(uri, tmp_path), lambda: storage.upload_dir(tmp_path, uri)):
        with pytest.raises(StorageError) as err:
            call()
        assert str(err.value).startswith(f"{uri}: the URI scheme {uri.split(':')[0]}:// is not supported; use s3://")
        assert "file:///" in str(err.value)


def test_uris_that_name_no_bucket_or_no_absolute_path_are_refused():
    with pytest.raises(StorageError, match=r"^s3:///m: no bucket name"):
        storage.exists("s3:///m")
    with pytest.raises(StorageError, match=r"^file://relative/m: a file:// URI needs an absolute path"):
        storage.exists("file://relative/m")


# -- round trips --------------------------------------------------------------------------------

FILES = {"config.yaml": b"name: demo\n", "weights/shape_gpt.safetensors": os.urandom(70_000),
         "weights/.hidden": b"kept", "weights/empty.txt": b"", "clip/deep/er/vocab.json": b"{}"}


def test_s3_round_trip_of_a_directory_and_of_text(s3env, tmp_path):
    source = make_files(tmp_path / "source", FILES)
    uri = f"s3://{BUCKET}/roundtrip/ckpt"
    assert not storage.exists(uri)
    others = storage.list_dirs(f"s3://{BUCKET}")  # the module's other tests' folders, if any ran first
    assert storage.upload_dir(source, uri) == sorted(FILES)
    assert storage.exists(uri) and storage.exists(uri + "/") and storage.exists(storage.join(uri, "config.yaml"))
    assert not storage.exists(storage.join(uri, "config.yam"))  # a prefix of a key is not an object
    assert storage.download_dir(uri, tmp_path / "copy") == sorted(FILES)
    assert tree(tmp_path / "copy") == tree(source)  # every file, hidden and empty ones too
    assert storage.list_dirs(uri) == ["clip", "weights"]
    assert storage.list_dirs(f"s3://{BUCKET}/roundtrip") == ["ckpt"]
    assert storage.list_dirs(f"s3://{BUCKET}") == sorted({*others, "roundtrip"})
    assert storage.list_dirs(f"s3://{BUCKET}/absent") == []

    marker = storage.join(uri, "state", "champion.json")
    assert storage.read_text(marker) is None
    storage.write_text(marker, json.dumps({"version": 7, "name": "würfel"}))
    assert json.loads(storage.read_text(marker)) == {"version": 7, "name": "würfel"}
    storage.write_text(marker, "replaced")
    assert storage.read_text(marker) == "replaced"
    # What the store holds is what was written: read back with rclone's own view of the data.
    assert (s3env.data_dir / BUCKET / "roundtrip/ckpt/state/champion.json").read_text() == "replaced"
    assert storage.exists(f"s3://{BUCKET}") and not storage.exists("s3://no-such-bucket-here")


@pytest.mark.parametrize("style", ["path", "file_uri"])
def test_local_paths_and_file_uris_take_the_same_calls(tmp_path, style):
    source = make_files(tmp_path / "source", FILES)
    base = tmp_path / "store"
    uri = str(base / "ckpt") if style == "path" else (base / "ckpt").as_uri()
    assert not storage.exists(uri)
    assert storage.upload_dir(source, uri) == sorted(FILES)
    assert tree(base / "ckpt") == tree(source)
    assert storage.download_dir(uri, tmp_path / "copy") == sorted(FILES)
    assert tree(tmp_path / "copy") == tree(source)
    assert storage.list_dirs(uri) == ["clip", "weights"] and storage.list_dirs(storage.join(uri, "nope")) == []
    text_uri = storage.join(uri, "state.json")
    assert storage.read_text(text_uri) is None
    storage.write_text(text_uri, "{}")
    assert storage.read_text(text_uri) == "{}" and storage.exists(text_uri)
    with pytest.raises(StorageError, match="nothing to download: no such directory"):
        storage.download_dir(storage.join(uri, "nope"), tmp_path / "none")


def test_download_of_a_version_never_takes_a_sibling_whose_name_starts_alike(s3env, tmp_path):
    for version in ("1", "10"):
        storage.upload_dir(make_files(tmp_path / version, {f"only-in-{version}.txt": version.encode()}),
                           f"s3://{BUCKET}/siblings/{version}")
    for uri in (f"s3://{BUCKET}/siblings/1", f"s3://{BUCKET}/siblings/1/"):
        out = tmp_path / f"out-{len(uri)}"
        assert storage.download_dir(uri, out) == ["only-in-1.txt"]
        assert tree(out).keys() == {"only-in-1.txt"}


# -- KServe's storage initializer and the trailing slash ----------------------------------------

def test_kserve_storage_initializer_needs_the_trailing_slash(store, tmp_path):
    """kserve_storage lists with the storageUri's path as a bare prefix (`Prefix=m/1`) and strips
    it from each key: without the slash, version 10 comes along (into `0/...`). This is why a
    storageUri of a version directory is `<base>/<V>/` (storage.as_dir)."""
    client = store.client()
    for version in ("1", "10"):
        client.put_object(Bucket=BUCKET, Key=f"hazard/cube3d/{version}/cube3d/config.pbtxt", Body=version.encode())
    bare, slashed = tmp_path / "bare", tmp_path / "slashed"
    bare.mkdir(), slashed.mkdir()
    proc = kserve_download(store, f"s3://{BUCKET}/hazard/cube3d/1", bare)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(tree(bare)) == ["0/cube3d/config.pbtxt", "cube3d/config.pbtxt"]  # the hazard
    proc = kserve_download(store, storage.as_dir(f"s3://{BUCKET}/hazard/cube3d/1"), slashed)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(tree(slashed)) == ["cube3d/config.pbtxt"]
    assert (slashed / "cube3d/config.pbtxt").read_text() == "1"


# -- errors -------------------------------------------------------------------------------------

@pytest.mark.parametrize("missing", ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"])
def test_missing_credentials_name_the_variables(s3env, monkeypatch, missing):
    monkeypatch.delenv(missing)
    uri = f"s3://{BUCKET}/x"
    with pytest.raises(StorageError) as err:
        storage.read_text(uri)
    assert str(err.value).startswith(f"{uri}: no S3 credentials: set {missing}")


def test_a_wrong_secret_is_a_signature_mismatch(s3env, monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    uri = f"s3://{BUCKET}/x"
    for call in (lambda: storage.read_text(uri), lambda: storage.upload_dir(make_files(tmp_path, {"a": b"a"}), uri),
                 lambda: storage.list_dirs(uri)):
        with pytest.raises(StorageError) as err:
            call()
        assert str(err.value).startswith(f"{uri}: the S3 endpoint {s3env.endpoint} refused the credentials")
        assert "(SignatureDoesNotMatch); AWS_SECRET_ACCESS_KEY is wrong for AWS_ACCESS_KEY_ID" in str(err.value)


def test_an_unknown_access_key_is_named(s3env, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody")
    with pytest.raises(StorageError, match=r"does not know the access key AWS_ACCESS_KEY_ID 'nobody' "
                                           r"\(InvalidAccessKeyId\)"):
        storage.exists(f"s3://{BUCKET}/x")


def test_an_unreachable_endpoint_is_named(s3env, monkeypatch):
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    uri = f"s3://{BUCKET}/x"
    start = time.monotonic()
    with pytest.raises(StorageError) as err:
        storage.read_text(uri)
    assert str(err.value).startswith(f"{uri}: cannot reach the S3 endpoint {endpoint} (AWS_ENDPOINT_URL)")
    assert time.monotonic() - start < 30


def test_a_missing_bucket_is_named(s3env, tmp_path):
    uri = "s3://no-such-bucket/cube3d/7/"
    source = make_files(tmp_path / "source", {"a": b"a"})
    for used, call in ((uri, lambda: storage.download_dir(uri, tmp_path / "out")),
                       (uri + "x", lambda: storage.read_text(uri + "x")),
                       (uri + "x", lambda: storage.write_text(uri + "x", "x")),
                       (uri, lambda: storage.list_dirs(uri)),
                       (uri, lambda: storage.exists(uri)),
                       (uri, lambda: storage.upload_dir(source, uri))):
        with pytest.raises(StorageError) as err:
            call()
        assert str(err.value) == (f"{used}: no such bucket 'no-such-bucket' at {s3env.endpoint} (NoSuchBucket); "
                                  f"create it or fix the URI")


def test_downloading_an_empty_or_missing_prefix_is_refused(s3env, tmp_path):
    uri = f"s3://{BUCKET}/never/uploaded/3/"
    with pytest.raises(StorageError) as err:
        storage.download_dir(uri, tmp_path / "out")
    assert str(err.value) == (f"{uri}: nothing to download: no objects under s3://{BUCKET}/never/uploaded/3/ "
                              f"at {s3env.endpoint}")
    assert not (tmp_path / "out").exists()


def test_nothing_is_skipped_silently_on_upload(s3env, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(StorageError, match="holds no files; nothing to upload to s3://"):
        storage.upload_dir(tmp_path / "empty", f"s3://{BUCKET}/u")
    with pytest.raises(StorageError, match="not a directory; nothing to upload"):
        storage.upload_dir(tmp_path / "absent", f"s3://{BUCKET}/u")
    source = make_files(tmp_path / "src", {"a.txt": b"a"})
    (source / "dangling").symlink_to(tmp_path / "gone")
    with pytest.raises(StorageError, match=r"dangling: not a regular file .*refusing to skip it"):
        storage.upload_dir(source, f"s3://{BUCKET}/u")


def test_objects_and_directories_are_not_confused(s3env):
    with pytest.raises(StorageError, match="names a directory"):
        storage.read_text(f"s3://{BUCKET}/a/dir/")
    with pytest.raises(StorageError, match="names a directory"):
        storage.write_text(f"s3://{BUCKET}", "x")


# -- the version repository ---------------------------------------------------------------------

def test_version_repository_layout_and_instance_kinds(tmp_path):
    cpu = build_version_repository(DEMO_MODEL, 3, tmp_path / "cpu", "cpu")
    files = tree(cpu)
    assert {"cube3d/config.pbtxt", "cube3d/3/model.py", "cube3d_stream/config.pbtxt",
            "cube3d_stream/3/model.py", "cube3d_stream/3/version.json"} <= files.keys()
    weights = {k.removeprefix("cube3d_stream/3/weights/"): v for k, v in files.items() if "/weights/" in k}
    assert weights == tree(DEMO_MODEL)
    assert len(files) == 5 + len(weights)  # nothing else: no __pycache__, no version 1
    for model in ("cube3d", "cube3d_stream"):
        assert "instance_group [ { count: 1 kind: KIND_CPU } ]" in (cpu / model / "config.pbtxt").read_text()
    gpu = build_version_repository(DEMO_MODEL, 3, tmp_path / "gpu", "gpu")
    stream = (gpu / "cube3d_stream" / "config.pbtxt").read_text()
    assert "instance_group [ { count: 1 kind: KIND_GPU gpus: [ 0 ] } ]" in stream
    assert "KIND_CPU } ]" not in stream
    # The predict model forwards over BLS and imports no torch: it stays on the CPU.
    assert "instance_group [ { count: 1 kind: KIND_CPU } ]" in (gpu / "cube3d" / "config.pbtxt").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cpu", "gpu"]  # no staging directory left


@pytest.mark.parametrize("kwargs,error,message", [
    ({"instance_kind": "tpu"}, ValueError, "instance_kind: must be one of ['cpu', 'gpu'], got 'tpu'"),
    ({"instance_kind": "GPU"}, ValueError, "instance_kind: must be one of ['cpu', 'gpu'], got 'GPU'"),
    ({"version": 0}, ValueError, "version: must be an integer >= 1 (a Triton model version), got 0"),
    ({"version": "7"}, ValueError, "version: must be an integer >= 1 (a Triton model version), got '7'"),
])
def test_version_repository_refuses_bad_arguments(tmp_path, kwargs, error, message):
    args = {"weights_dir": DEMO_MODEL, "version": 7, "target_dir": tmp_path / "repo", "instance_kind": "cpu", **kwargs}
    with pytest.raises(error) as err:
        build_version_repository(**args)
    assert str(err.value) == message
    assert not (tmp_path / "repo").exists()


def test_version_repository_refuses_an_existing_target_and_empty_files(tmp_path):
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError, match="taken exists"):
        build_version_repository(DEMO_MODEL, 1, tmp_path / "taken", "cpu")
    weights = make_files(tmp_path / "weights", {"config.yaml": b"x", "notes.md": b""})
    with pytest.raises(ValueError, match=r"zero-byte files \['notes.md'\]: KServe's storage initializer skips"):
        build_version_repository(weights, 1, tmp_path / "repo", "cpu")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken", "weights"]


# -- end to end: object store -> storage initializer -> ServingRuntime's tritonserver -----------

class ServingRuntimeTriton(LocalTriton):
    """tritonserver with exactly the ServingRuntime's arguments (cubeserve.deploy.tritonserver_args),
    under the supervisor with `--on-fault exit`, as the container runs it. What differs, and why:
    - the ports are free ports instead of 8000-8002, 8010 and 8011, which other servers on this
      machine may hold (the flags are the same ones, with other numbers);
    - --metrics-address is 127.0.0.1, and so are the front ends' addresses: the pod listens on
      all of its interfaces, a test binds nothing beyond this machine;
    - --backend-directory names the backends of the nvidia-pytriton wheel, which the runtime
      image has at Triton's default path."""

    def __init__(self, model_store: Path, log_path: Path):
        super().__init__(model_store, free_port(), free_port(), free_port(), log_path=log_path,
                         supervised=True, on_fault="exit")

    def runtime_args(self) -> list[str]:
        ports = {f"--http-port={deploy.TRITON_HTTP_PORT}": f"--http-port={self.triton_http_port}",
                 f"--grpc-port={deploy.TRITON_GRPC_PORT}": f"--grpc-port={self.triton_grpc_port}",
                 f"--metrics-port={deploy.METRICS_PORT}": f"--metrics-port={self.metrics_port}",
                 "--metrics-address=0.0.0.0": "--metrics-address=127.0.0.1"}
        args = deploy.tritonserver_args(str(self.model_repository))
        assert set(ports) <= set(args), args
        return [ports.get(arg, arg) for arg in args]

    def server_command(self) -> list[str]:
        home = tritonserver_home()
        return [str(home / "bin" / "tritonserver"), *self.runtime_args(),
                f"--backend-directory={home / 'backends'}"]


def test_a_version_in_object_storage_is_served_as_kserve_serves_it(store, s3env, tmp_path):
    built = build_version_repository(DEMO_MODEL, 7, tmp_path / "built", "cpu")
    uri = f"s3://{BUCKET}/cube3d/7/"
    storage.upload_dir(built, uri)
    assert storage.list_dirs(f"s3://{BUCKET}/cube3d") == ["7"]

    mnt_models = tmp_path / "mnt-models"  # /mnt/models of the predictor pod
    mnt_models.mkdir()
    proc = kserve_download(store, uri, mnt_models)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert tree(mnt_models) == tree(built)  # a complete repository, byte for byte

    with ServingRuntimeTriton(mnt_models, tmp_path / "tritonserver.log") as triton:
        command = triton.command()
        assert command[command.index("--") + 1:][1:len(triton.runtime_args()) + 1] == triton.runtime_args()
        with Cube3DClient(triton.http_url, "http") as client:
            result = client.generate("a small ball", seed=0, resolution=4)
        assert result.num_faces > 0 and len(result.mesh) > 0
        assert result.model_version == "7"
        request = urllib.request.Request(f"http://{triton.http_url}/v2/repository/index", data=b"{}", method="POST",
                                         headers=triton.admin_headers)
        with urllib.request.urlopen(request, timeout=10) as reply:
            index = json.loads(reply.read())
        assert sorted((m["name"], m.get("version"), m.get("state")) for m in index) == [
            ("cube3d", "7", "READY"), ("cube3d_stream", "7", "READY")]
        assert metrics(triton)["cube3d_objects_completed_total/v7"] == 1
