"""Validate, evaluate, gate, package and register a checkpoint (roll-out: serving.py).

Each step takes and returns plain values (paths, numbers, JSON-able dicts) so that a KFP
component can pass them between pods, and a failure raises with a message that says which
file or threshold failed: KFP shows it as the step's error and runs nothing after it.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import os
import shutil
import struct
import time
from pathlib import Path

from cubeserve.checkpoint import (PICKLE_SUFFIXES, CheckpointError, load_models, read_safetensors_header, sha256_file, validate_dir)
from cubeserve.config import to_yaml_dict
from cubeserve.deploy import PREDICT_MODEL, STREAM_MODEL

# The only files a checkpoint may hold: tensors as safetensors, configs and tokenizer files as
# text. Anything else (a pickle above all) is refused by name before anything is read.
ALLOWED_SUFFIXES = {".safetensors", ".yaml", ".yml", ".json", ".txt", ".model", ".md"}
DEFAULT_PROMPTS = ("a red chair", "a wooden table", "a small boat")


class GateFailed(ValueError):
    """An evaluation metric is outside its threshold; nothing was packaged or registered."""


# -- 1. validate -------------------------------------------------------------------------------

def local_checkpoint(checkpoint: str) -> str:
    """A local directory holding the checkpoint. An object-store URI (s3://, gs://, file://...:
    any filesystem fsspec knows, with its package installed, e.g. s3fs or gcsfs) is copied once
    into a cache directory named after the URI, so that every step of a run reads the same
    files; a local path is returned as it is."""
    if "://" not in checkpoint:
        return checkpoint
    import tempfile

    import fsspec

    fs, path = fsspec.core.url_to_fs(checkpoint)
    if not fs.isdir(path):
        raise CheckpointError(f"{checkpoint}: no such directory in the object store")
    cache = Path(tempfile.gettempdir()) / f"cubeserve-checkpoint-{hashlib.sha256(checkpoint.encode()).hexdigest()[:16]}"
    if not cache.is_dir():
        partial = cache.with_name(cache.name + f".partial-{os.getpid()}")
        fs.get(path.rstrip("/") + "/", str(partial), recursive=True)
        partial.rename(cache)
    return str(cache)


def checkpoint_files(checkpoint: str | Path) -> list[Path]:
    root = Path(checkpoint)
    return sorted(p for p in root.rglob("*") if p.is_file())


def checkpoint_digest(file_sha256: dict[str, str]) -> str:
    """One digest for the whole checkpoint: sha256 over the sorted `path sha256` lines, so the
    same files give the same digest wherever the directory lives."""
    lines = "".join(f"{name} {digest}\n" for name, digest in sorted(file_sha256.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


def _check_complete(path: Path, rel: str) -> None:
    """A truncated safetensors file keeps a valid header; its tensor data runs past the end."""
    size = path.stat().st_size
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    end = max((meta["data_offsets"][1] for name, meta in header.items() if name != "__metadata__"), default=0)
    if 8 + n + end != size:
        raise CheckpointError(f"{rel}: truncated or padded: its header describes {8 + n + end} bytes, "
                              f"the file has {size}")


def validate_checkpoint(checkpoint: str) -> dict:
    """Files, headers, version and a strict load; returns what the registry records.

    Raises CheckpointError naming the file for a pickle (by suffix or content), a truncated
    file, unexpected files, or weights that do not match the config (e.g. v0.5 with v0.1)."""
    root = Path(local_checkpoint(checkpoint))
    if not root.is_dir():
        raise CheckpointError(f"{checkpoint}: not a directory")
    files = checkpoint_files(root)
    for p in files:
        rel = p.relative_to(root).as_posix()
        if p.suffix in PICKLE_SUFFIXES:
            raise CheckpointError(f"{rel}: pickled weights files are never loaded; use safetensors")
        if p.suffix not in ALLOWED_SUFFIXES:
            raise CheckpointError(f"{rel}: unexpected file; a checkpoint holds only safetensors, "
                                  f"configs and tokenizer files ({sorted(ALLOWED_SUFFIXES)})")
        if p.suffix == ".safetensors":
            try:
                read_safetensors_header(p)  # refuses a pickle behind a .safetensors name
            except CheckpointError as exc:
                raise CheckpointError(f"{rel}: {str(exc).split(': ', 1)[-1]}") from None
            _check_complete(p, rel)
    # Names, shapes and the version, then a strict load of every tensor (CheckpointError names
    # the file); the CLIP folder is loaded by the evaluation.
    cfg, gpt_header, _ = validate_dir(root)
    load_models(root, device="cpu")
    file_sha256 = {p.relative_to(root).as_posix(): sha256_file(p) for p in files}
    return {
        "config_name": cfg.name,
        "config": to_yaml_dict(cfg),
        # The same words as cubeserve.checkpoint's version detection.
        "version": "v0.5-style" if "bbox_proj.weight" in gpt_header else "v0.1-style",
        "num_tokens": cfg.num_tokens,
        "files_sha256": file_sha256,
        "sha256": checkpoint_digest(file_sha256),
    }


# -- 2. evaluate -------------------------------------------------------------------------------

def _token_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions where two sets of token sequences agree (0 when the lengths differ)."""
    same = total = 0
    for x, y in zip(a, b):
        total += max(len(x), len(y))
        same += sum(i == j for i, j in zip(x, y)) if len(x) == len(y) else 0
    return same / total if total else 0.0


def evaluate_checkpoint(checkpoint: str, prompts: list[str], resolution: int = 5, device: str = "cpu",
                        champion_weights: str = "", heldout_shapes: int = 0) -> dict:
    """Meshes for fixed prompts (greedy, seed 0): validity, timings, agreement with the champion;
    with `heldout_shapes` > 0, also the demo benchmark (`cubeserve.demo.evaluate`): mean IoU of
    generated and of tokenizer-reconstructed meshes against held-out procedural shapes (-1
    when not run). Only models trained on those shapes score well on it.

    Returns {"metrics": {...}, "html": report}. Metrics are per run, not per prompt, so that
    the gate and the registry compare like with like."""
    import torch
    import trimesh

    from cubeserve.engine import Engine, GenerationRequest
    from cubeserve.preview import render_preview

    torch.manual_seed(0)
    engine = Engine.from_dir(local_checkpoint(checkpoint), device=device)
    requests = [GenerationRequest(prompt=p, seed=0, resolution=resolution) for p in prompts]
    t0 = time.perf_counter()
    results = engine.generate(requests)
    elapsed = time.perf_counter() - t0
    tokens = [r.tokens for r in results]
    rows, valid, watertight = [], 0, 0
    for r in results:
        mesh = trimesh.Trimesh(vertices=r.mesh.vertices, faces=r.mesh.faces, process=False)
        ok = not r.mesh.empty
        tight = ok and bool(mesh.is_watertight)
        valid, watertight = valid + ok, watertight + tight
        png = render_preview(r.mesh.vertices, r.mesh.faces, size=256, message=r.mesh.message)
        rows.append((r.request.prompt, len(r.mesh.vertices), len(r.mesh.faces), tight, png))
    n = len(results)
    metrics = {
        "prompts": n,
        "valid_share": valid / n,
        "watertight_share": watertight / n,
        # One decode step produces one token for every object of the batch.
        "time_per_output_token_s": results[0].timings["time_per_token_s"],
        "time_per_object_s": elapsed / n,
        "token_agreement": -1.0,  # no champion to compare with
        "shape_iou": -1.0,
        "shape_reconstruction_iou": -1.0,
    }
    if heldout_shapes > 0:
        from cubeserve.demo.evaluate import evaluate_engine

        summary = evaluate_engine(engine, n=heldout_shapes, resolution=resolution).summary
        metrics["shape_iou"] = summary["generation_iou"]
        metrics["shape_reconstruction_iou"] = summary["reconstruction_iou"]
    if champion_weights:
        champion = Engine.from_dir(champion_weights, device=device)
        theirs = champion.generate_tokens([GenerationRequest(prompt=p, seed=0) for p in prompts]).tolist()
        metrics["token_agreement"] = _token_agreement(tokens, theirs)
        del champion
    return {"metrics": metrics, "html": _report(checkpoint, metrics, rows, resolution, device)}


def _report(checkpoint: str, metrics: dict, rows: list, resolution: int, device: str) -> str:
    """A self-contained HTML page (KFP's HTML viewer shows it): metrics and previews inline."""
    metric_rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{v:.4g}</td></tr>" for k, v in metrics.items())
    meshes = "".join(
        f"<figure><img src='data:image/png;base64,{base64.b64encode(png).decode()}' width=256>"
        f"<figcaption>{html.escape(prompt)}: {nv} vertices, {nf} faces"
        f"{', watertight' if tight else ''}</figcaption></figure>"
        for prompt, nv, nf, tight, png in rows)
    return (f"<html><body style='font-family:sans-serif'><h2>cube3d evaluation</h2>"
            f"<p>{html.escape(checkpoint)} on {html.escape(device)}, resolution {resolution}, greedy, seed 0"
            f"</p><table border=1 cellpadding=4>{metric_rows}</table>"
            f"<div style='display:flex;flex-wrap:wrap'>{meshes}</div></body></html>")


# -- 3. gate -----------------------------------------------------------------------------------

def gate(metrics: dict, min_valid_share: float, min_watertight_share: float,
         min_token_agreement: float, max_time_per_output_token_s: float, min_shape_iou: float = 0.0) -> str:
    """Raise GateFailed listing every threshold missed; a passing summary otherwise.
    Token agreement is only checked against an existing champion (it is -1 without one);
    a shape-IoU threshold requires the held-out shape benchmark to have run."""
    failures = []
    if min_shape_iou > 0 and metrics.get("shape_iou", -1.0) < min_shape_iou:
        measured = metrics.get("shape_iou", -1.0)
        failures.append(f"shape_iou {measured:.3f} < {min_shape_iou}" if measured >= 0 else
                        f"shape_iou not measured (heldout_shapes = 0) but min_shape_iou = {min_shape_iou}")
    if metrics["valid_share"] < min_valid_share:
        failures.append(f"valid_share {metrics['valid_share']:.3f} < {min_valid_share}")
    if metrics["watertight_share"] < min_watertight_share:
        failures.append(f"watertight_share {metrics['watertight_share']:.3f} < {min_watertight_share}")
    if metrics["token_agreement"] >= 0 and metrics["token_agreement"] < min_token_agreement:
        failures.append(f"token_agreement {metrics['token_agreement']:.3f} < {min_token_agreement}")
    if metrics["time_per_output_token_s"] > max_time_per_output_token_s:
        failures.append(f"time_per_output_token_s {metrics['time_per_output_token_s']:.4g} > "
                        f"{max_time_per_output_token_s}")
    if failures:
        raise GateFailed("gate failed: " + "; ".join(failures))
    return "gate passed: " + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items())


# -- 4. package --------------------------------------------------------------------------------

def template_repository() -> Path:
    """triton_models/ of this checkout (editable install), or of the runtime image."""
    from cubeserve.deploy import IMAGE_MODEL_REPOSITORY
    from cubeserve.serving.local_triton import MODEL_REPOSITORY

    return MODEL_REPOSITORY if MODEL_REPOSITORY.is_dir() else Path(IMAGE_MODEL_REPOSITORY)


def store_versions(store: str | Path) -> list[int]:
    """Version directories present in the model store (either model)."""
    found = set()
    for model in (PREDICT_MODEL, STREAM_MODEL):
        d = Path(store) / model
        if d.is_dir():
            found |= {int(p.name) for p in d.iterdir() if p.is_dir() and p.name.isdigit()}
    return sorted(found)


def package(checkpoint: str, store: str, files_sha256: dict, min_version: int = 1) -> int:
    """Write `cube3d/<N>/` and `cube3d_stream/<N>/{model.py,weights/}` into the model store,
    N the next free version (at least `min_version`). Each version directory is assembled
    under a hidden name and renamed into place, so a server never sees half a version; the
    copied weights are checked against the validated digests."""
    store_path, template = Path(store), template_repository()
    version = max([min_version - 1, *store_versions(store_path)]) + 1
    staged = []
    for model in (STREAM_MODEL, PREDICT_MODEL):
        (store_path / model).mkdir(parents=True, exist_ok=True)
        config = store_path / model / "config.pbtxt"
        if not config.exists():  # the first version brings the model's config
            shutil.copy2(template / model / "config.pbtxt", config)
        tmp = store_path / model / f".{version}.partial"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        shutil.copy2(template / model / "1" / "model.py", tmp / "model.py")
        staged.append((tmp, store_path / model / str(version)))
    weights = staged[0][0] / "weights"
    shutil.copytree(local_checkpoint(checkpoint), weights)
    for rel, digest in files_sha256.items():
        if sha256_file(weights / rel) != digest:
            raise CheckpointError(f"{rel}: changed while it was copied into the model store")
    for tmp, final in staged:
        os.replace(tmp, final)
    return version


# -- 5. register -------------------------------------------------------------------------------

def _integral(obj):
    if isinstance(obj, float) and obj.is_integer():
        return int(obj)
    if isinstance(obj, dict):
        return {k: _integral(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_integral(v) for v in obj]
    return obj


def register(registry_uri: str, model_name: str, store: str, triton_version: int, validation: dict,
             metrics: dict, source_uri: str, run_id: str) -> str:
    """A new registry version for the packaged Triton version, tagged, aliased `challenger`.
    A checkpoint already registered (same sha256) returns its version instead."""
    from cubeserve.registry import CHALLENGER, ModelRegistry

    registry = ModelRegistry(registry_uri, model_name)
    validation = _integral(validation)  # KFP passes dicts as protobuf Structs: every number a float
    existing = registry.find_by_sha256(validation["sha256"])
    if existing is not None:
        return existing.version
    version = registry.create(
        source=str(Path(store).resolve() / STREAM_MODEL / str(triton_version)),
        description=f"{source_uri} ({validation['version']}, config {validation['config_name']})",
        tags={
            "sha256": validation["sha256"],
            "files_sha256": json.dumps(validation["files_sha256"], sort_keys=True),
            "config": json.dumps(validation["config"], sort_keys=True),
            "config_name": validation["config_name"],
            "checkpoint_version": validation["version"],
            "metrics": json.dumps(metrics, sort_keys=True),
            **{f"metric.{k}": f"{v:.6g}" for k, v in metrics.items()},
            "source_uri": source_uri,
            "pipeline_run_id": run_id,
            "model_store": str(Path(store).resolve()),
            "triton_version": str(triton_version),
        })
    registry.set_alias(CHALLENGER, version.version)
    return version.version
