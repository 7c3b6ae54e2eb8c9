"""The three stages of the batch pipeline, each a callable that Ray Data maps over batches of
rows (Arrow tables: rows.SCHEMA, then what each stage adds: DECODED, MESHED, WRITTEN):

    DecodeStage     actor: one Engine per actor; the batch's rows decode together in the engine's
                    DecodeRunner slots, a row joining as another leaves (continuous batching);
                    CUDA graphs on a GPU as the server captures them        -> tokens, decode_s
    GeometryStage   actor on CPU: the shape tokenizer alone (no GPT, no CLIP); tokens -> occupancy
                    grid -> marching cubes -> GLB/OBJ bytes (+ PNG preview)  -> vertices, faces, ...
    write_outputs   task: the files to <out>/<id>.<format> (and <id>.png)    -> mesh_uri, write_s

A row that fails in a stage gets its `error` there and passes through the later ones untouched,
so one bad row never takes its batch down. An exception that escapes a stage (a process that
dies) is Ray's to handle: the actor is restarted and the whole batch is retried.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import tempfile
import time
from collections.abc import Iterator

import pyarrow as pa

from cubeserve.batch.rows import SCHEMA as ROWS

log = logging.getLogger(__name__)

DECODED = pa.schema([*ROWS, ("tokens", pa.list_(pa.int64())), ("decode_s", pa.float64())])
MESHED = pa.schema([*DECODED, ("mesh", pa.binary()), ("preview_png", pa.binary()), ("vertices", pa.int64()),
                    ("faces", pa.int64()), ("watertight", pa.bool_()), ("geometry_s", pa.float64())])
WRITTEN = pa.schema([*(f for f in MESHED if f.name not in ("mesh", "preview_png")), ("mesh_uri", pa.string()),
                     ("preview_uri", pa.string()), ("write_s", pa.float64())])

@contextlib.contextmanager
def local_weights(uri: str) -> Iterator[str]:
    """A local directory holding the weights at `uri`, for loading them: an object-store URI is
    downloaded into a temporary directory (on a cluster no two nodes share a disk), removed once
    the stage has loaded them. Kept for the worker's life, every worker process that started would
    leave a copy of the checkpoint on its node's disk."""
    from cubeserve import storage

    local = storage.local_path(uri)
    if local is not None:
        yield str(local)
        return
    with tempfile.TemporaryDirectory(prefix="cubeserve-weights-") as tmp:
        storage.download_dir(uri, tmp)
        yield tmp


def _passing(rows: list[dict]) -> list[dict]:
    """The rows that no earlier stage failed."""
    return [r for r in rows if r["error"] is None]


class DecodeStage:
    """Prompts -> shape tokens, on one Engine (GPU or CPU slot) per actor."""

    def __init__(self, weights: str, device: str = "cpu", dtype: str | None = None, max_objects: int = 8,
                 cpu_threads: int | None = None, quantization: str = "none"):
        from cubeserve.engine import Engine
        from cubeserve.engine.engine import resolve_device
        from cubeserve.engine.scheduler import GRAPH_BUCKETS

        device = resolve_device(device)
        with local_weights(weights) as path:  # everything is read here; nothing later opens the files
            self.engine = Engine.from_dir(path, device=device, dtype=dtype, cpu_threads=cpu_threads,
                                          quantization=quantization)  # dtype None: the engine's default_dtype
        # On CUDA the step is captured as graphs, in the buckets the server's scheduler uses.
        graphs = self.engine.device.type == "cuda"
        self.runner = self.engine.decode_runner(max_objects, graph_buckets=GRAPH_BUCKETS if graphs else None)

    def __call__(self, batch: pa.Table) -> pa.Table:
        from cubeserve.batch.rows import request_of
        from cubeserve.requests import InvalidRequest

        rows = [{**r, "tokens": None, "decode_s": None} for r in batch.to_pylist()]
        waiting = collections.deque()
        for row in _passing(rows):
            request = request_of(row)
            try:
                self.engine.validate([request])  # what only the model knows: does it take a box?
                waiting.append((row, request))
            except InvalidRequest as exc:
                row["error"] = str(exc)
        runner, in_slot = self.runner, {}
        while waiting or in_slot:
            free = runner.free_slots
            if waiting and free:
                admitted = [waiting.popleft() for _ in range(min(len(free), len(waiting)))]
                try:
                    slots = runner.admit([r for _, r in admitted])
                except Exception as exc:  # e.g. out of memory in CLIP: these rows fail, the rest go on
                    log.exception("admission failed")
                    for row, _ in admitted:
                        row["error"] = f"decode: {exc}"
                    continue
                now = time.perf_counter()
                in_slot.update({s: (row, now) for s, (row, _) in zip(slots, admitted)})
            try:
                finished = runner.step().finished
            except Exception as exc:  # the objects in flight fail, the batch goes on
                log.exception("decode step failed")
                for s, (row, _) in in_slot.items():
                    runner.release(s)
                    row["error"] = f"decode: {exc}"
                in_slot.clear()
                continue
            for s in finished:
                row, started = in_slot.pop(s)
                row["tokens"] = runner.tokens_of(s).tolist()
                row["decode_s"] = time.perf_counter() - started
                runner.release(s)
        return pa.Table.from_pylist(rows, schema=DECODED)


class GeometryStage:
    """Shape tokens -> mesh file bytes on the CPU, with the engine's own tokens -> mesh code
    (`Engine.tokens_to_meshes`) run on the shape tokenizer alone."""

    def __init__(self, weights: str, preview: bool = False, cpu_threads: int | None = None):
        import torch

        from cubeserve.checkpoint import load_tokenizer
        from cubeserve.engine import fast_paths

        if cpu_threads:
            torch.set_num_threads(cpu_threads)
        with local_weights(weights) as path:
            self.cfg, self.tokenizer = load_tokenizer(path)
        fast_paths.stream(self.tokenizer)  # the CPU products the engine gives its tokenizer
        self.device = torch.device("cpu")
        self.preview = preview

    def tokens_to_meshes(self, *args, **kwargs):
        from cubeserve.engine import Engine

        return Engine.tokens_to_meshes(self, *args, **kwargs)  # it reads only .tokenizer and .device

    def __call__(self, batch: pa.Table) -> pa.Table:
        import torch

        rows = [{**r, "mesh": None, "preview_png": None, "vertices": None, "faces": None, "watertight": None,
                 "geometry_s": None} for r in batch.to_pylist()]
        for row in _passing(rows):
            started = time.perf_counter()
            try:
                tokens = torch.tensor([row["tokens"]], dtype=torch.int64)
                mesh = self.tokens_to_meshes(tokens, [row["resolution"]], mesh_worker=None)[0]
                if mesh.empty:
                    row["error"] = f"empty mesh: {mesh.message}"
                else:
                    row["mesh"] = mesh.export(row["format"])
                    row["vertices"], row["faces"] = len(mesh.vertices), len(mesh.faces)
                    row["watertight"] = _watertight(mesh)
                    if self.preview:
                        from cubeserve.preview import render_preview

                        row["preview_png"] = render_preview(mesh.vertices, mesh.faces)
            except Exception as exc:  # this row fails; the batch goes on
                log.exception("geometry failed")
                row["error"] = f"geometry: {exc}"
            row["geometry_s"] = time.perf_counter() - started
        return pa.Table.from_pylist(rows, schema=MESHED)


def _watertight(mesh) -> bool:
    import trimesh

    return bool(trimesh.Trimesh(vertices=mesh.vertices, faces=mesh.faces, process=True).is_watertight)


def write_outputs(batch: pa.Table, out: str) -> pa.Table:
    """The mesh (and preview) files of a batch's rows; what goes on is each row's record, without
    the bytes."""
    from cubeserve import storage

    rows = batch.to_pylist()
    for row in rows:
        mesh, preview = row.pop("mesh"), row.pop("preview_png")
        row["mesh_uri"] = row["preview_uri"] = row["write_s"] = None
        if row["error"] is not None:
            continue
        started = time.perf_counter()
        try:
            uri = storage.join(out, f"{row['id']}.{row['format']}")
            storage.write_bytes(uri, mesh, "model/gltf-binary" if row["format"] == "glb" else "text/plain")
            row["mesh_uri"] = uri
            if preview is not None:
                row["preview_uri"] = storage.join(out, f"{row['id']}.png")
                storage.write_bytes(row["preview_uri"], preview, "image/png")
        except Exception as exc:  # e.g. the store refused: this row fails, the others are written
            row["error"] = f"write: {exc}"
        row["write_s"] = time.perf_counter() - started
    return pa.Table.from_pylist(rows, schema=WRITTEN)
