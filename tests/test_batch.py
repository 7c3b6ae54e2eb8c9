"""`cubeserve batch` (cubeserve/batch/): the Ray Data pipeline for real, on an embedded local Ray
started once for the module, with the shipped demo model at low resolution: meshes and the
results table, a bad row among good ones, a rerun that does nothing, a decode actor killed
mid-run, the object store (an S3 server) for input, weights and output. Then Kubernetes: the
RayJob of k8s/batch/ against KubeRay's CRD, and the Kubeflow pipeline's step driving a stand-in
RayJob (tests/kuberay_standin.py) to success and to failure under the pipeline's Role."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cubeserve.batch import results, rows
from cubeserve.batch.run import Settings, run
from cubeserve.server.local_triton import DEMO_MODEL
from guards import cannot_run

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["a round table", "a red chair", "a small boat", "a tall lamp", "a wooden stool", "a cup", "a bench",
           "a vase"]


def write_jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def settings(out, **kw) -> Settings:
    # Resolution 4 and batches of 4 rows: several tasks per stage, seconds per run.
    kw.setdefault("defaults", rows.Defaults(resolution=4))
    # float32 on every CPU (the default is bfloat16 on AMX ones), so that tokens compare exactly
    # with the in-process engine's whatever the batches held.
    return Settings(weights=str(DEMO_MODEL), out=str(out), device="cpu", dtype="float32", batch_size=4,
                    max_objects=4, **kw)


def table(out) -> list[dict]:
    return results.read(str(out)).to_pylist()


# -- rows: no Ray -----------------------------------------------------------------------------------

def test_rows_take_defaults_and_ids_and_a_bad_field_is_that_rows_error(tmp_path):
    records = [{"prompt": "a", "seed": 5}, {"id": "chair-1", "prompt": "b", "resolution": 12},
               {"prompt": "c", "guidance": -1}, {"id": "../escape", "prompt": "d"}, {"prompt": 7},
               {"prompt": "e", "top_p": 0.5, "bbox": [1, 2, 3], "format": "obj"}]
    parsed = rows.parse(records, rows.Defaults(resolution=6))
    assert [r.id for r in parsed] == ["000000", "chair-1", "000002", "000003", "000004", "000005"]
    assert (parsed[0].seed, parsed[0].resolution, parsed[0].error) == (5, 6, None)
    assert parsed[1].error == "resolution: must be an integer in [4, 9], got 12"
    assert parsed[2].error.startswith("guidance: ")
    assert parsed[3].error.startswith("id: '../escape' must be")  # never a file name
    assert parsed[4].error == "prompt: must be a string, got 7"
    assert (parsed[5].top_p, parsed[5].bbox, parsed[5].format, parsed[5].error) == (0.5, [1.0, 2.0, 3.0], "obj", None)
    assert rows.to_table(parsed).schema == rows.SCHEMA
    with pytest.raises(rows.InputError, match="the same id 'x'"):
        rows.parse([{"id": "x", "prompt": "a"}, {"id": "x", "prompt": "b"}])


def test_prompts_come_from_jsonl_or_parquet_and_a_broken_file_stops_before_anything(tmp_path):
    records = [{"id": None, "prompt": "a round table", "seed": 1}, {"id": "b", "prompt": "a chair"}]
    jsonl = write_jsonl(tmp_path / "p.jsonl", records)
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "p.parquet")
    assert [r["prompt"] for r in rows.read_records(jsonl)] == ["a round table", "a chair"]
    assert [r.id for r in rows.parse(rows.read_records(str(tmp_path / "p.parquet")))] == ["000000", "b"]
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\nnot json\n')
    with pytest.raises(rows.InputError, match="line 2 is not JSON"):
        rows.read_records(str(tmp_path / "bad.jsonl"))
    with pytest.raises(rows.InputError, match="JSONL .* or Parquet"):
        rows.read_records(_csv(tmp_path))
    with pytest.raises(rows.InputError, match="no such file"):
        rows.read_records(str(tmp_path / "missing.jsonl"))


def _csv(tmp_path) -> str:
    (tmp_path / "p.csv").write_text("prompt\na\n")
    return str(tmp_path / "p.csv")


def test_an_empty_mesh_is_its_rows_error_and_the_rows_beside_it_go_on(tmp_path):
    """The geometry stage alone (no Ray): with a checkpoint whose occupancy is "outside"
    everywhere every mesh is empty; each such row records why, a row failed earlier keeps its
    error, and a good checkpoint meshes the same tokens."""
    from cubeserve.batch.stages import DECODED, GeometryStage
    from test_analyze import empty_mesh_checkpoint

    hollow = empty_mesh_checkpoint(DEMO_MODEL, tmp_path / "hollow")
    good = rows.parse([{"prompt": "a", "resolution": 4}, {"prompt": "b", "resolution": 4}])
    batch = [{**r.as_dict(), "tokens": [7] * 32, "decode_s": 0.1} for r in good]
    batch.append({**rows.parse([{"prompt": "c", "resolution": 99}])[0].as_dict(), "id": "bad",
                  "tokens": None, "decode_s": None})
    out = GeometryStage(str(hollow))(pa.Table.from_pylist(batch, schema=DECODED)).to_pylist()
    assert [r["error"].split(":")[0] for r in out] == ["empty mesh", "empty mesh", "resolution"]
    assert all(r["mesh"] is None for r in out)
    meshed = GeometryStage(str(DEMO_MODEL), preview=True)(pa.Table.from_pylist(batch, schema=DECODED)).to_pylist()
    assert [r["error"] is None for r in meshed] == [True, True, False]
    assert meshed[0]["mesh"][:4] == b"glTF" and meshed[0]["preview_png"][:4] == b"\x89PNG"
    assert meshed[0]["faces"] > 0 and isinstance(meshed[0]["watertight"], bool)


def test_weights_that_cannot_load_stop_the_batch_before_ray_starts(tmp_path, monkeypatch):
    from cubeserve.batch import run as run_mod
    from cubeserve.checkpoint import CheckpointError

    monkeypatch.setattr(run_mod, "start_ray", lambda s: pytest.fail("Ray started"))
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a cup"}])
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError):
        run(prompts, Settings(weights=str(tmp_path / "empty"), out=str(tmp_path / "out")), progress=False)
    with pytest.raises(ValueError, match="decode-actors must be at least 1"):
        Settings(weights="w", out="o", decode_actors=0)


# -- the pipeline on a local Ray --------------------------------------------------------------------

@pytest.fixture(scope="module")
def object_store(tmp_path_factory):
    """An S3 server (rclone serve s3) whose credentials are in this process's environment before
    Ray starts, so that every Ray worker has them too, as a RayJob's pods get them from a Secret."""
    try:
        from kfp_pipelines.local_services import ObjectStore, rclone_executable

        rclone_executable()
    except (ImportError, RuntimeError) as exc:
        cannot_run(f"no S3 server for the batch tests: {exc}")
    with ObjectStore(tmp_path_factory.mktemp("s3") / "data") as s3:
        s3.create_bucket("batch")
        saved = {k: os.environ.get(k) for k in s3.env()}
        os.environ.update(s3.env())
        try:
            yield s3
        finally:
            for k, v in saved.items():
                os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture(scope="module")
def local_ray(object_store):
    """One embedded Ray for the module, as `cubeserve batch` starts it (run() leaves a Ray it did
    not start running)."""
    try:
        import ray
    except ImportError:
        cannot_run("ray is not installed: pip install -e '.[test]'")
    from cubeserve.batch.run import start_ray

    started, seconds = start_ray(Settings(weights="", out="", decode_actors=1, geometry_actors=1))
    assert started
    yield seconds
    ray.shutdown()


def test_the_local_ray_listens_on_loopback_only_and_has_no_dashboard(local_ray):
    import psutil
    import ray

    ours = {p.pid for p in psutil.Process().children(recursive=True)} | {os.getpid()}
    listening = [c.laddr for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.pid in ours]
    assert listening and all(a.ip in ("127.0.0.1", "::ffff:127.0.0.1") for a in listening), listening
    assert ray.nodes()[0]["NodeManagerAddress"] == "127.0.0.1"
    # No dashboard: nothing on its port (Ray keeps a head process with no web server, --minimal
    # --disable-frontend, for its internal usage-stats module).
    assert 8265 not in [a.port for a in listening]


@pytest.fixture(scope="module")
def first_batch(local_ray, tmp_path_factory):
    """Eight prompts (one as OBJ, one named) and two bad rows, into a local folder."""
    tmp = tmp_path_factory.mktemp("batch")
    records = [{"prompt": p, "seed": i} for i, p in enumerate(PROMPTS)]
    records[1]["format"] = "obj"
    records[2]["id"] = "boat"
    records.insert(3, {"prompt": "too fine", "resolution": 12})
    records.append({"id": "nothing"})
    prompts = write_jsonl(tmp / "prompts.jsonl", records)
    seen = []
    summary = run(prompts, settings(tmp / "out", preview=True), progress=False, on_record=seen.append)
    return tmp, prompts, summary, seen


def test_a_batch_writes_each_mesh_and_records_every_row_once_bad_rows_included(first_batch):
    tmp, _, summary, seen = first_batch
    out = tmp / "out"
    assert (summary.done, summary.failed, summary.skipped, summary.total) == (8, 2, 0, 10)
    records = {r["id"]: r for r in table(out)}
    assert len(table(out)) == 10 and len(records) == 10 and len(seen) == 10
    assert records["000003"]["error"] == "resolution: must be an integer in [4, 9], got 12"
    assert records["nothing"]["error"] == "prompt: missing"
    done = [r for r in records.values() if r["error"] is None]
    for r in done:
        path = out / f"{r['id']}.{r['format']}"
        assert r["mesh_uri"] == str(path) and path.stat().st_size > 0
        assert (out / f"{r['id']}.png").read_bytes()[:4] == b"\x89PNG"
        assert len(r["tokens"]) == 32 and r["faces"] > 0 and r["vertices"] > 0
        assert r["decode_s"] > 0 and r["geometry_s"] > 0 and r["write_s"] >= 0
        assert r["resolution"] == 4 and r["watertight"] in (True, False)
    assert records["000001"]["format"] == "obj" and (out / "000001.obj").read_text().lstrip().startswith(("v ", "#"))
    assert (out / "boat.glb").read_bytes()[:4] == b"glTF"
    assert not (out / "000003.glb").exists() and not list(out.glob("nothing.*"))
    # The rows' decoding was continuous: rows of one task shared the engine's slots.
    assert {r["run_id"] for r in records.values()} == {records["boat"]["run_id"]}
    assert "done 8, failed 2, skipped 0" in summary.text() and "objects/s" in summary.text()


def test_the_batch_tokens_are_the_engines(first_batch):
    """The same greedy tokens as the in-process engine: the pipeline changes where, not what."""
    from cubeserve.engine import Engine
    from cubeserve.requests import GenerationRequest

    tmp, _, _, _ = first_batch
    records = {r["id"]: r for r in table(tmp / "out")}
    engine = Engine.from_dir(DEMO_MODEL, device="cpu", dtype="float32")
    tokens = engine.generate_tokens([GenerationRequest(prompt=PROMPTS[0], seed=0, resolution=4),
                                     GenerationRequest(prompt=PROMPTS[2], seed=2, resolution=4)]).tolist()
    assert [records["000000"]["tokens"], records["boat"]["tokens"]] == tokens


def _first_output(first_batch, tmp_path) -> Path:
    """A copy of the first batch's output folder, for a test that writes to it: the tests that
    read the first batch's own see it as that run left it, in any order."""
    return Path(shutil.copytree(first_batch[0] / "out", tmp_path / "out", copy_function=shutil.copy2))


def test_a_rerun_into_the_same_output_does_nothing(first_batch, tmp_path):
    _, prompts, _, _ = first_batch
    out = _first_output(first_batch, tmp_path)
    parts = sorted((out / "results").iterdir())
    mtimes = {p: p.stat().st_mtime_ns for p in out.iterdir()}
    summary = run(prompts, settings(out, preview=True), progress=False)
    assert (summary.done, summary.failed, summary.skipped) == (0, 0, 10)
    assert sorted((out / "results").iterdir()) == parts
    assert {p: p.stat().st_mtime_ns for p in out.iterdir()} == mtimes


def test_retry_failed_runs_only_the_failed_rows_and_their_new_record_wins(first_batch, capsys, tmp_path):
    import re

    _, prompts, _, _ = first_batch
    tmp = tmp_path
    _first_output(first_batch, tmp_path)
    fixed = tmp / "fixed.jsonl"
    lines = [json.loads(x) for x in Path(prompts).read_text().splitlines()]
    lines[3]["resolution"] = 4  # the bad resolution, corrected
    write_jsonl(fixed, lines)
    summary = run(str(fixed), settings(tmp / "out", retry_failed=True), progress=True)
    # The progress bar: rows done of the rows to do, elapsed < left, the rate.
    assert re.search(r"2/2 \[\d\d:\d\d<\d\d:\d\d, +[\d.]+(obj/s|s/obj)\]", capsys.readouterr().err)
    assert (summary.done, summary.failed, summary.skipped) == (1, 1, 8)
    latest = results.latest(results.read(str(tmp / "out")))
    assert latest["000003"]["error"] is None and (tmp / "out" / "000003.glb").exists()
    assert latest["nothing"]["error"] == "prompt: missing"
    assert len(results.read(str(tmp / "out"))) == 12  # the first run's 10, then these 2


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class _DiesHoldingItsFirstBatch:
    """A DecodeStage whose process SIGKILLs itself once, the first time one of its kind has
    decoded a batch and not yet handed it on (a marker file says it happened, and which pid).
    The kill used to come from the driver at the first record, but the decode actor can have
    finished every batch by then (decode runs ahead of geometry), so the test sometimes had
    nothing to kill; from inside, the actor dies holding a batch, with the rest still to decode."""

    marker = ""

    def __call__(self, batch):
        out = super().__call__(batch)
        try:
            fd = os.open(self.marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except FileExistsError:
            return out
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)


def test_a_decode_actor_killed_mid_run_is_replaced_and_no_row_is_lost_or_recorded_twice(local_ray, tmp_path,
                                                                                       monkeypatch):
    """The decode actor's process is killed (SIGKILL) holding its first decoded batch, with most
    rows still to decode: Ray Data restarts the actor and retries the batch it held; the run
    ends with every row recorded exactly once and every mesh written."""
    import sys

    import ray.cloudpickle

    from cubeserve.batch import stages

    n = 24
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": PROMPTS[i % 8], "seed": i} for i in range(n)])
    dying = type("DecodeStage", (_DiesHoldingItsFirstBatch, stages.DecodeStage), {"marker": str(tmp_path / "killed")})
    dying.__module__ = __name__
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this file
    monkeypatch.setattr(stages, "DecodeStage", dying)  # what build_dataset maps the batches with
    try:
        summary = run(prompts, settings(tmp_path / "out"), progress=False)
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    killed = int((tmp_path / "killed").read_text())
    recorded = [r["id"] for r in table(tmp_path / "out")]
    assert sorted(recorded) == [f"{i:06d}" for i in range(n)]  # each once
    assert summary.done == n and summary.failed == 0
    assert len(list((tmp_path / "out").glob("*.glb"))) == n
    assert not _alive(killed)  # the replacement, a new process, decoded the batch it held and the rest


def test_the_object_store_holds_the_prompts_the_weights_by_version_and_the_output(local_ray, object_store, tmp_path):
    """`cubeserve batch s3://.../p.parquet --version 3 --model-store s3://... --out s3://...`: the
    weights of version 3 as the pipeline packages them, every worker downloading them itself, and
    leaving no copy behind on its disk once loaded."""
    import tempfile

    from cubeserve import cli, storage
    from cubeserve.deploy import STREAM_MODEL

    def downloaded() -> set[Path]:  # the workers' temporary directory is this process's (Ray's workers inherit it)
        return set(Path(tempfile.gettempdir()).glob("cubeserve-weights-*"))

    before = downloaded()

    store = "s3://batch/models"
    storage.upload_dir(DEMO_MODEL, f"{store}/3/{STREAM_MODEL}/3/weights")
    buf = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist([{"prompt": p, "id": f"p{i}"} for i, p in enumerate(PROMPTS[:3])]), buf)
    storage.write_bytes("s3://batch/in/p.parquet", buf.getvalue().to_pybytes())
    code = cli.main(["batch", "s3://batch/in/p.parquet", "--version", "3", "--model-store", store,
                     "--out", "s3://batch/out", "--device", "cpu", "--resolution", "4", "--no-progress"])
    assert code == 0
    assert [r["id"] for r in sorted(results.read("s3://batch/out").to_pylist(), key=lambda r: r["id"])] == ["p0", "p1", "p2"]
    assert storage.read_bytes("s3://batch/out/p1.glb")[:4] == b"glTF"
    # A bad row fails the command (exit 3) after the good ones are written.
    storage.write_bytes("s3://batch/in/q.jsonl", b'{"prompt": "a cup", "id": "q0"}\n{"prompt": "x", "seed": -1}\n')
    assert cli.main(["batch", "s3://batch/in/q.jsonl", "--version", "3", "--model-store", store, "--out",
                     "s3://batch/out", "--device", "cpu", "--resolution", "4", "--no-progress"]) == 3
    assert storage.exists("s3://batch/out/q0.glb")
    assert downloaded() <= before


def test_a_version_is_batch_decoded_quantized_as_it_is_served(tmp_path, monkeypatch, capsys):
    """`--version N` of a version packaged int8 decodes int8 (its own version.json, as the server
    reads it), not the unquantized default; another --quantization, or a version packaged with
    another recipe of int8, is refused by name. Ray is not needed to tell: the pipeline's
    settings are caught where `run` would take them."""
    from cubeserve import cli
    from cubeserve.batch import run as run_mod
    from cubeserve.serving.repository import VERSION_SETTINGS, build_version_repository

    store = tmp_path / "store"
    build_version_repository(DEMO_MODEL, 4, store / "4", "cpu", quantization="int8")
    build_version_repository(DEMO_MODEL, 5, store / "5", "cpu")
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a cup"}])
    seen = []

    class Done:
        failed, text = 0, staticmethod(lambda: "done")

    monkeypatch.setattr(run_mod, "run", lambda path, settings, progress: seen.append(settings) or Done())

    def batch(version, *more):
        return cli.main(["batch", str(prompts), "--version", str(version), "--model-store", str(store),
                         "--out", str(tmp_path / "out"), *more])

    assert batch(4) == 0 and batch(5) == 0
    assert [(s.quantization, s.weights) for s in seen] == [
        ("int8", f"{store}/4/cube3d_stream/4/weights/"), ("none", f"{store}/5/cube3d_stream/5/weights/")]
    capsys.readouterr()
    assert batch(4, "--quantization", "int4") == 2
    assert "--quantization int4: version 4 is packaged as int8" in capsys.readouterr().err
    (store / "4" / "cube3d_stream" / "4" / VERSION_SETTINGS).write_text(
        json.dumps({"quantization": "int8", "quantization_recipe": "r0 int8 per tensor"}))
    assert batch(4) == 2
    assert "quantization_recipe: this version was packaged with int8 as 'r0 int8 per tensor'" in capsys.readouterr().err
    assert len(seen) == 2


def test_a_batch_repeated_by_a_retry_is_recorded_once_and_a_lost_row_is_an_error(tmp_path, monkeypatch):
    """The driver's side of exactly-once, without Ray: records of a batch that comes back twice
    (a task retried after its outputs were taken) are dropped, and a row that never comes back
    fails the run instead of passing unnoticed."""
    from cubeserve.batch import run as run_mod
    from cubeserve.batch.stages import WRITTEN

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in PROMPTS[:4]])
    parsed = rows.parse(rows.read_records(prompts))
    written = pa.Table.from_pylist([{**r.as_dict(), "tokens": [1] * 32, "decode_s": 0.1, "vertices": 3, "faces": 1,
                                     "watertight": False, "geometry_s": 0.1, "mesh_uri": "m", "preview_uri": None,
                                     "write_s": 0.0} for r in parsed], schema=WRITTEN)

    class Replayed:
        def __init__(self, batches):
            self.batches = batches

        def iter_batches(self, **kw):
            return iter(self.batches)

    monkeypatch.setattr(run_mod, "start_ray", lambda s: (False, 0.0))
    monkeypatch.setattr(run_mod, "build_dataset", lambda t, s: Replayed([written.slice(0, 2), written.slice(0, 3),
                                                                         written.slice(3)]))
    summary = run_mod.run(prompts, settings(tmp_path / "out"), progress=False)
    assert (summary.done, summary.repeats_dropped) == (4, 2)
    assert sorted(r["id"] for r in table(tmp_path / "out")) == [r.id for r in parsed]
    monkeypatch.setattr(run_mod, "build_dataset", lambda t, s: Replayed([written.slice(0, 3)]))
    with pytest.raises(RuntimeError, match="1 rows came back from no stage"):
        run_mod.run(prompts, settings(tmp_path / "out2"), progress=False)


# -- Kubernetes: the RayJob and the Kubeflow pipeline ---------------------------------------------

# The arguments k8s/batch/rayjob.yaml was made with (cubeserve.batch.kuberay.rayjob).
EXAMPLE = dict(name="cube3d-batch", image="registry.example.com/cube-serve",
               prompts="s3://replace-me-model-bucket/batches/catalogue.jsonl",
               out="s3://replace-me-model-bucket/batches/catalogue/", version=1,
               model_store="s3://replace-me-model-bucket/cube3d", workers=2)


def test_the_rayjob_of_k8s_batch_is_the_builders_and_conforms_to_kuberays_crd():
    import yaml

    from cubeserve.batch.kuberay import rayjob
    from k8s_validation import _rendered
    from kuberay_standin import schema_errors, validation_error

    shipped = yaml.safe_load((REPO / "k8s" / "batch" / "rayjob.yaml").read_text())
    assert shipped == rayjob(**EXAMPLE)
    [rendered] = [o for o in yaml.safe_load_all(_rendered(str(REPO / "k8s" / "batch"))) if o]
    variants = [shipped, rendered, rayjob(**{**EXAMPLE, "version": None, "weights": "s3://b/ckpt/"}),
                rayjob(**{**EXAMPLE, "gpus_per_worker": 2, "worker_cpu": "8", "preview": True})]
    for obj in variants:
        assert schema_errors(obj) == [] and validation_error(obj) is None
    # kustomize set the image's tag in both pod templates.
    cluster = rendered["spec"]["rayClusterSpec"]
    images = [cluster["headGroupSpec"]["template"]["spec"]["containers"][0]["image"],
              cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["image"]]
    assert images == ["registry.example.com/cube-serve:0.1.0"] * 2
    assert cluster["rayVersion"] == __import__("ray").__version__  # the Ray the image installs
    assert f'batch = ["ray[data]=={cluster["rayVersion"]}"' in (REPO / "pyproject.toml").read_text()
    gpu = variants[3]["spec"]
    assert gpu["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["limits"][
        "nvidia.com/gpu"] == "2"
    assert "--device cuda --decode-actors 4" in gpu["entrypoint"] and "--preview" in gpu["entrypoint"]
    assert "--decode-cpus 3" in shipped["spec"]["entrypoint"]  # 4 cores: 3 decode, 1 geometry
    # The schema is strict: a misspelt field or a wrong type is an error.
    broken = rayjob(**EXAMPLE)
    broken["spec"]["shutdownAfterJobFinish"] = True
    broken["spec"]["backoffLimit"] = "0"
    assert len(schema_errors(broken)) == 2


def test_the_entrypoint_is_the_cli_the_tests_run():
    """Every option the RayJob passes exists in `cubeserve batch` and parses."""
    import shlex

    from cubeserve.batch.kuberay import rayjob
    from cubeserve.cli import build_parser

    argv = shlex.split(rayjob(**EXAMPLE)["spec"]["entrypoint"])
    assert argv[:2] == ["cubeserve", "batch"]
    args = build_parser().parse_args(argv[1:])
    assert (args.address, args.version, args.model_store, args.decode_actors, args.decode_cpus) == \
        ("auto", 1, EXAMPLE["model_store"], 2, 3)


@pytest.fixture(scope="module")
def compiled_batch(tmp_path_factory):
    import yaml

    from kfp_pipelines import batch_generate
    from kfp_pipelines.compile import compile_to

    path = compile_to("ghcr.io/example/cube-serve:1.2.3", tmp_path_factory.mktemp("kfp") / "b.yaml",
                      batch_generate.build)
    spec, platform = list(yaml.safe_load_all(path.read_text()))
    return spec, platform


def test_the_batch_pipeline_compiles_with_its_step_in_the_image(compiled_batch):
    from kfp_pipelines import batch_generate

    spec, platform = compiled_batch
    (executor,) = spec["deploymentSpec"]["executors"].values()
    assert executor["container"]["image"] == "ghcr.io/example/cube-serve:1.2.3"
    assert "pip install" not in json.dumps(executor)  # nothing installed at start
    (task,) = spec["root"]["dag"]["tasks"].values()
    assert task["cachingOptions"] == {} or task["cachingOptions"].get("enableCache") is not True
    assert task["retryPolicy"]["maxRetryCount"] == 2
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert set(params) == {"prompts", "out", "weights", "version", "model_store", "workers", "worker_cpu",
                           "worker_memory", "gpus_per_worker", "resolution", "preview", "namespace"}
    assert all(p.get("description") for p in params.values()), "every parameter is described"
    assert spec["pipelineInfo"]["name"] == batch_generate.PIPELINE_NAME
    with pytest.raises(ValueError, match="image must name"):
        batch_generate.build("registry.example.com/cube-serve:0.1.0")


def batch_role_rules() -> list[dict]:
    import yaml

    from k8s_validation import _rendered

    objects = [o for o in yaml.safe_load_all(_rendered(str(REPO / "k8s" / "pipeline"))) if o]
    return next(o for o in objects if o["kind"] == "Role" and o["metadata"]["name"] == "cube-serve-batch")["rules"]


@pytest.fixture
def kuberay(tmp_path, monkeypatch):
    """make(job_results, rules=the pipeline's Role): the stand-in, KUBECONFIG pointing at it, and
    the step polling every 10 ms."""
    from cubeserve.pipeline import batch as step_module
    from kuberay_standin import KubeRayStandIn

    made = []

    def make(job_results=("SUCCEEDED",), rules=None, **kw):
        stub = KubeRayStandIn(rules=batch_role_rules() if rules is None else rules, job_results=job_results, **kw)
        made.append(stub)
        monkeypatch.setenv("KUBECONFIG", str(stub.kubeconfig(tmp_path / f"kubeconfig-{len(made)}")))
        return stub

    monkeypatch.setattr(step_module, "POLL_S", 0.01)
    yield make
    for stub in made:
        stub.close()


def run_step(**overrides):
    """The pipeline's step function as its pod runs it."""
    from kfp_pipelines.batch_generate import batch_generate

    args = dict(prompts="s3://b/p.jsonl", out="s3://b/out/", weights="", version=3, model_store="s3://b/models",
                image="ghcr.io/example/cube-serve:1.2.3", workers=2, worker_cpu="4", worker_memory="16Gi",
                gpus_per_worker=0, resolution=6, preview=False, namespace="", pipeline_run_id="8f4c1b2e-77aa-4e0d")
    return batch_generate(**{**args, **overrides})


def assert_only_the_role(stub, every_rule=True):
    from k8s_validation import rbac_allows

    assert stub.authorized and all(allowed for _, allowed in stub.authorized), stub.authorized
    if every_rule:
        used = [attrs for attrs, _ in stub.authorized]
        for rule in stub.rules:
            for verb in rule["verbs"]:
                assert any(rbac_allows([{**rule, "verbs": [verb]}], *a[:4]) for a in used), (rule, verb)


def test_the_step_creates_the_rayjob_and_succeeds_when_kuberay_reports_it_complete(kuberay, capsys):
    stub = kuberay(("SUCCEEDED",))
    status = run_step()
    assert status == {"jobId": "cube3d-batch-8f4c1b2e-77aa-4e0d-0", "jobStatus": "SUCCEEDED",
                      "jobDeploymentStatus": "Complete", "rayClusterName": "cube3d-batch-8f4c1b2e-77aa-4e0d-abc0"}
    (created,) = stub.created  # the stand-in checked it against the CRD
    assert created["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"] == \
        "ghcr.io/example/cube-serve:1.2.3"
    assert "--version 3 --model-store s3://b/models" in created["spec"]["entrypoint"]
    out = capsys.readouterr().out
    for phase in ("(new)", "Initializing", "Running, jobStatus PENDING", "Running, jobStatus RUNNING", "Complete"):
        assert phase in out
    assert_only_the_role(stub)  # create and get on rayjobs, nothing else


def test_the_step_fails_when_the_job_fails(kuberay):
    from cubeserve.pipeline.batch import BatchJobFailed

    stub = kuberay(("FAILED",), message="Job entrypoint command failed with exit code 3")
    with pytest.raises(BatchJobFailed, match=r"Failed \(AppFailed\): Job entrypoint command failed with exit code 3"):
        run_step()
    assert_only_the_role(stub)


def test_a_stopped_job_is_complete_but_not_a_success(kuberay):
    """KubeRay writes Complete for STOPPED as for SUCCEEDED (rayjob_controller.go L343-348)."""
    from cubeserve.pipeline.batch import BatchJobFailed

    kuberay(("STOPPED",))
    with pytest.raises(BatchJobFailed, match=r"Complete \(job STOPPED\)"):
        run_step()


def test_retrying_is_not_an_end_and_a_retried_step_waits_for_the_same_job(kuberay):
    """With backoffLimit 1 the first attempt's failure is written as Retrying and the job starts
    again: the step waits through it. A step run again for the same pipeline run (a retried
    pod) finds its RayJob (409 on create) and waits for it instead of starting a second batch."""
    from cubeserve.batch.kuberay import rayjob
    from cubeserve.pipeline.batch import job_name, run_rayjob

    stub = kuberay(("FAILED", "SUCCEEDED"))
    manifest = rayjob(job_name("run-1"), "img", "s3://b/p.jsonl", "s3://b/out/", weights="s3://b/w/")
    manifest["spec"]["backoffLimit"] = 1
    seen = []
    status = run_rayjob(manifest, say=seen.append)
    assert status["jobDeploymentStatus"] == "Complete" and (status["failed"], status["succeeded"]) == (1, 1)
    assert any("Retrying" in line for line in seen)
    again = []
    assert run_rayjob(manifest, say=again.append)["jobStatus"] == "SUCCEEDED"
    assert "exists" in again[0] and len(stub.created) == 1


def test_a_rayjob_kuberay_refuses_fails_the_step_and_names_are_kept_valid(kuberay):
    from cubeserve.batch.kuberay import rayjob
    from cubeserve.pipeline.batch import MAX_NAME, BatchJobFailed, job_name, run_rayjob

    kuberay()
    long_name = "x" * (MAX_NAME + 1)
    with pytest.raises(BatchJobFailed, match="ValidationFailed: .*no more than 47 characters"):
        run_rayjob(rayjob(long_name, "img", "s3://b/p", "s3://b/o/", weights="s3://b/w/"), say=lambda s: None)
    name = job_name("Run_ID-" + "a" * 80)
    assert len(name) <= MAX_NAME and name.startswith("cube3d-batch-run") and "_" not in name


def test_without_the_batch_role_the_step_is_refused(kuberay):
    """Under the checkpoint pipeline's Role alone the API server refuses the create (403)."""
    import yaml
    from kubernetes.client.exceptions import ApiException

    from k8s_validation import _rendered

    objects = [o for o in yaml.safe_load_all(_rendered(str(REPO / "k8s" / "pipeline"))) if o]
    rollout_rules = next(o for o in objects if o["metadata"]["name"] == "cube-serve-rollout" and o["kind"] == "Role")
    stub = kuberay(rules=rollout_rules["rules"])
    with pytest.raises(ApiException) as refused:
        run_step()
    assert refused.value.status == 403 and not stub.created


# -- a row failing in each stage: the stages in this process, no Ray --------------------------------

@pytest.fixture(scope="module")
def stages_in_process():
    """The pipeline's stages as the actors hold them, built once: the decode stage with one slot,
    so that a failure injected for one row's admission or decode step meets that row alone."""
    from cubeserve.batch.stages import DecodeStage, GeometryStage

    return (DecodeStage(str(DEMO_MODEL), device="cpu", dtype="float32", max_objects=1),
            GeometryStage(str(DEMO_MODEL)))


FAILING_ROW = "bad"


def run_failing_one_row(tmp_path, monkeypatch, stages) -> tuple:
    """`run` over four rows (FAILING_ROW second, its resolution 5 and the others' 4), batches of
    four taken through the real stages in this process in the order Ray Data chains them; returns
    the run's summary and the results table's records by id."""
    from cubeserve.batch import run as run_mod
    from cubeserve.batch.stages import write_outputs

    decode, geometry = stages
    out = tmp_path / "out"
    records = [{"id": "good-0", "prompt": PROMPTS[0]}, {"id": FAILING_ROW, "prompt": PROMPTS[1], "resolution": 5},
               {"id": "good-1", "prompt": PROMPTS[2]}, {"id": "good-2", "prompt": PROMPTS[3]}]
    prompts = write_jsonl(tmp_path / "p.jsonl", records)

    class InProcess:
        def __init__(self, table, s):
            self.table, self.out = table, s.out
            self.size = s.batch_size

        def iter_batches(self, **kw):
            for i in range(0, self.table.num_rows, self.size):
                yield write_outputs(geometry(decode(self.table.slice(i, self.size))), self.out)

    monkeypatch.setattr(run_mod, "start_ray", lambda s: (False, 0.0))
    monkeypatch.setattr(run_mod, "build_dataset", InProcess)
    summary = run_mod.run(prompts, settings(out), progress=False)
    recorded = {r["id"]: r for r in table(out)}
    assert sorted(recorded) == sorted(r["id"] for r in records)  # each row once, the failed one too
    return summary, recorded


def assert_only_the_failing_row_failed(summary, recorded, error: str, out) -> dict:
    assert (summary.done, summary.failed) == (3, 1), summary.text()
    assert summary.errors == {FAILING_ROW: recorded[FAILING_ROW]["error"]}
    bad = recorded[FAILING_ROW]
    assert bad["error"] is not None and bad["error"].startswith(error), bad["error"]
    assert bad["mesh_uri"] is None
    assert bad["write_s"] is None or error.startswith("write: ")  # timed when a write was tried
    assert not (out / f"{FAILING_ROW}.glb").is_file()
    for row_id in ("good-0", "good-1", "good-2"):
        good = recorded[row_id]
        assert good["error"] is None and good["faces"] > 0, good
        assert good["mesh_uri"] == str(out / f"{row_id}.glb")
        assert (out / f"{row_id}.glb").read_bytes()[:4] == b"glTF"
    return bad


def test_a_rows_failed_admission_is_its_error_and_the_rows_beside_it_go_on(tmp_path, monkeypatch,
                                                                          stages_in_process):
    runner = stages_in_process[0].runner
    admit = runner.admit

    def failing_admit(requests):
        if any(r.resolution == 5 for r in requests):
            raise RuntimeError("injected: out of memory in CLIP")
        return admit(requests)

    monkeypatch.setattr(runner, "admit", failing_admit)
    summary, recorded = run_failing_one_row(tmp_path, monkeypatch, stages_in_process)
    bad = assert_only_the_failing_row_failed(summary, recorded, "decode: injected: out of memory in CLIP",
                                             tmp_path / "out")
    assert bad["tokens"] is None and bad["decode_s"] is None


def test_a_rows_failed_decode_step_is_its_error_and_the_rows_beside_it_go_on(tmp_path, monkeypatch,
                                                                            stages_in_process):
    runner = stages_in_process[0].runner
    admit, step = runner.admit, runner.step
    in_slot = []  # the request admitted last: one slot, so the one being decoded

    def admit_and_note(requests):
        in_slot[:] = requests
        return admit(requests)

    def failing_step(*args, **kwargs):
        if any(r.resolution == 5 for r in in_slot):
            raise RuntimeError("injected: a kernel failed")
        return step(*args, **kwargs)

    monkeypatch.setattr(runner, "admit", admit_and_note)
    monkeypatch.setattr(runner, "step", failing_step)
    summary, recorded = run_failing_one_row(tmp_path, monkeypatch, stages_in_process)
    bad = assert_only_the_failing_row_failed(summary, recorded, "decode: injected: a kernel failed", tmp_path / "out")
    assert bad["tokens"] is None and bad["decode_s"] is None
    assert runner.free_slots == [0]  # the failed row's slot was released


def test_a_rows_failed_geometry_is_its_error_and_the_rows_beside_it_go_on(tmp_path, monkeypatch,
                                                                         stages_in_process):
    geometry = stages_in_process[1]
    tokens_to_meshes = geometry.tokens_to_meshes

    def failing(tokens, resolutions, **kwargs):
        if resolutions == [5]:
            raise RuntimeError("injected: marching cubes failed")
        return tokens_to_meshes(tokens, resolutions, **kwargs)

    monkeypatch.setattr(geometry, "tokens_to_meshes", failing)
    summary, recorded = run_failing_one_row(tmp_path, monkeypatch, stages_in_process)
    bad = assert_only_the_failing_row_failed(summary, recorded, "geometry: injected: marching cubes failed",
                                             tmp_path / "out")
    assert len(bad["tokens"]) > 0 and bad["faces"] is None  # decoded, not meshed


def test_a_rows_failed_mesh_write_is_its_error_and_the_rows_beside_it_are_written(tmp_path, monkeypatch,
                                                                                 stages_in_process):
    """A real failure of the store: a directory where the row's mesh file goes, so that the
    rename that replaces the file fails (storage.write_bytes)."""
    (tmp_path / "out" / f"{FAILING_ROW}.glb" / "in-the-way").mkdir(parents=True)
    summary, recorded = run_failing_one_row(tmp_path, monkeypatch, stages_in_process)
    bad = assert_only_the_failing_row_failed(summary, recorded, "write: ", tmp_path / "out")
    assert "Is a directory" in bad["error"] or "Directory not empty" in bad["error"], bad["error"]
    assert bad["faces"] > 0  # meshed, not written
