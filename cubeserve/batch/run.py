"""`cubeserve batch`: the rows of a prompts file through the three stages (stages.py) as one
streaming Ray Data pipeline, on an embedded local Ray or a running cluster.

    rows (driver) -> DecodeStage actors -> GeometryStage actors -> write_outputs tasks -> driver
                                                                        records -> results table

Ray Data streams: while one batch decodes, the batch before it is in geometry and the one before
that is being written, and records reach the driver (progress bar, results table) as each batch
finishes. Fault tolerance: rows already on record are skipped before Ray starts (a rerun of a
finished batch starts nothing); a row's own failure is recorded and the rest go on (stages.py);
a worker process that dies is replaced by Ray Data (its actors restart and their tasks are
retried: `max_restarts` and `max_task_retries` are -1 for an actor pool), and since a retried
batch comes back whole, the driver keeps the first record of an id and drops any repeat, so
every row is recorded exactly once.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

from cubeserve.batch import results, rows as rows_mod

log = logging.getLogger(__name__)

# The embedded Ray's shared-memory object store: the batch's objects are small (token lists,
# mesh files), and a machine's default (30 % of memory) would take much from the workers.
LOCAL_OBJECT_STORE_BYTES = 512 * 2**20


@dataclass
class Settings:
    weights: str  # a checkpoint directory, local or an object-store URI (each worker downloads it)
    out: str  # where meshes and results/ go: a local path or s3://
    device: str = "auto"  # the decode actors' device: cpu, cuda or auto
    dtype: str | None = None  # default: the engine's (bfloat16 on CUDA and CPUs with native bf16)
    quantization: str = "none"  # the GPT's weights: none | int8 | int4 | fp8 (config.QUANTIZATIONS)
    decode_actors: int = 1  # one Engine each (one GPU each on CUDA)
    decode_cpus: int = 1  # CPU slots (and PyTorch threads) per decode actor
    geometry_actors: int = 1  # CPU actors with the shape tokenizer
    max_objects: int = 8  # objects in flight per decode actor (its DecodeRunner slots)
    batch_size: int = 16  # rows per decode task (the unit that a dead actor's retry redoes)
    preview: bool = False  # also <id>.png
    retry_failed: bool = False  # run the rows that failed in an earlier run again
    address: str | None = None  # a running Ray cluster ("auto" on its nodes); None: embedded local Ray
    defaults: rows_mod.Defaults = field(default_factory=rows_mod.Defaults)

    def __post_init__(self):
        for name in ("decode_actors", "decode_cpus", "geometry_actors", "max_objects", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")


@dataclass
class Summary:
    total: int = 0  # rows in the file
    done: int = 0
    failed: int = 0
    skipped: int = 0  # on record from an earlier run
    repeats_dropped: int = 0  # records of a retried batch that had been recorded already
    seconds: float = 0.0  # Ray start to the last record
    ray_start_s: float = 0.0
    stage_s: dict[str, float] = field(default_factory=dict)  # summed over the rows done
    errors: dict[str, str] = field(default_factory=dict)  # id -> error, this run's

    @property
    def objects_per_s(self) -> float:
        return self.done / self.seconds if self.seconds else 0.0

    def text(self) -> str:
        lines = [f"done {self.done}, failed {self.failed}, skipped {self.skipped} (already on record) "
                 f"of {self.total} rows in {self.seconds:.1f} s: {self.objects_per_s:.2f} objects/s "
                 f"(Ray start-up {self.ray_start_s:.1f} s)"]
        if self.done:
            lines.append("time per object: " + ", ".join(
                f"{k.removesuffix('_s')} {v / self.done:.3f} s" for k, v in self.stage_s.items()))
        for row_id, error in list(self.errors.items())[:10]:
            lines.append(f"failed {row_id}: {error}")
        if len(self.errors) > 10:
            lines.append(f"... and {len(self.errors) - 10} more failures (the results table has them all)")
        return "\n".join(lines)


def check_weights(uri: str) -> None:
    """Refuse weights that cannot load before any worker tries (a worker whose Engine fails to
    load would be restarted, again and again): a local folder is validated (file headers only),
    an object-store one must hold something (each worker validates what it downloads)."""
    from cubeserve import storage
    from cubeserve.checkpoint import validate_dir

    local = storage.local_path(uri)
    if local is not None:
        validate_dir(local)
    elif not storage.exists(uri):
        raise storage.StorageError(f"{uri}: no weights there (nothing under this prefix)")


def start_ray(settings: Settings) -> tuple[bool, float]:
    """Connect to the cluster at `address`, or start an embedded Ray on this machine alone: no
    dashboard, node address 127.0.0.1, its CPU slots enough for every actor of the pipeline (they
    are time-shared where the cores are fewer). Returns (started here, seconds)."""
    import ray

    t0 = time.perf_counter()
    if ray.is_initialized():
        return False, 0.0
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no reporting home from a batch job
    if settings.address:
        ray.init(address=settings.address, log_to_driver=False, logging_level=logging.WARNING)
        return True, time.perf_counter() - t0
    # Ray binds a node's services to its routable address, unless clusters are off (its macOS
    # and Windows default): then to 127.0.0.1. The variable is read at import (here, maybe
    # already done) and by every process Ray starts (from the environment).
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray._private.ray_constants.ENABLE_RAY_CLUSTER = False
    slots = settings.decode_actors * settings.decode_cpus + settings.geometry_actors
    ray.init(num_cpus=max(os.cpu_count() or 1, slots), include_dashboard=False,
             object_store_memory=LOCAL_OBJECT_STORE_BYTES,
             log_to_driver=False, logging_level=logging.WARNING)
    return True, time.perf_counter() - t0


def _decode_device(settings: Settings) -> str:
    if settings.device != "auto":
        return settings.device.split(":")[0]
    if settings.address:  # the workers' devices, not this process's: ask the cluster
        import ray

        return "cuda" if ray.cluster_resources().get("GPU", 0) >= 1 else "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def build_dataset(table, settings: Settings):
    """The pipeline over `table` (rows.SCHEMA), not yet running."""
    import ray
    from ray.data import ActorPoolStrategy

    from cubeserve.batch.stages import DecodeStage, GeometryStage, write_outputs

    size = settings.batch_size
    blocks = [table.slice(i, size) for i in range(0, table.num_rows, size)]
    device = _decode_device(settings)
    gpu = device == "cuda"
    ds = ray.data.from_arrow(blocks)
    ds = ds.map_batches(
        DecodeStage, batch_size=size, batch_format="pyarrow",
        fn_constructor_kwargs=dict(weights=settings.weights, device="cuda" if gpu else "cpu", dtype=settings.dtype,
                                   quantization=settings.quantization,
                                   max_objects=settings.max_objects,
                                   cpu_threads=None if gpu else settings.decode_cpus),
        compute=ActorPoolStrategy(size=settings.decode_actors),
        num_cpus=settings.decode_cpus, num_gpus=1 if gpu else 0)
    ds = ds.map_batches(
        GeometryStage, batch_size=None, batch_format="pyarrow",
        fn_constructor_kwargs=dict(weights=settings.weights, preview=settings.preview, cpu_threads=1),
        compute=ActorPoolStrategy(min_size=1, max_size=settings.geometry_actors), num_cpus=1)
    # Writing waits on the store, not the CPU: no CPU slot, so it never waits for one.
    return ds.map_batches(write_outputs, batch_size=None, batch_format="pyarrow", fn_kwargs=dict(out=settings.out),
                          num_cpus=0)


def run(prompts: str, settings: Settings, progress: bool = True,
        on_record: Callable[[dict], None] | None = None) -> Summary:
    """Run the batch; `on_record(record)` is called on the driver as each row's record arrives."""
    check_weights(settings.weights)
    all_rows = rows_mod.parse(rows_mod.read_records(prompts), settings.defaults)
    skip = results.recorded(settings.out, settings.retry_failed)
    pending = [r for r in all_rows if r.id not in skip]
    summary = Summary(total=len(all_rows), skipped=len(all_rows) - len(pending),
                      stage_s={"decode_s": 0.0, "geometry_s": 0.0, "write_s": 0.0})
    if not pending:
        return summary
    try:
        import ray
    except ImportError:  # not in the base install: the `batch` extra
        raise ValueError("cubeserve batch runs on Ray Data: pip install 'cubeserve[batch]'") from None

    started, summary.ray_start_s = start_ray(settings)
    ray.data.DataContext.get_current().enable_progress_bars = False  # ours has the rows/s and ETA
    logging.getLogger("ray.data").setLevel(logging.WARNING)  # the progress bar and summary say it
    writer = results.Writer(settings.out)
    bar = _bar(len(pending), progress)
    seen: set[str] = set()
    t0 = time.perf_counter()
    try:
        for batch in build_dataset(rows_mod.to_table(pending), settings).iter_batches(batch_size=None,
                                                                                      batch_format="pyarrow"):
            records = []
            for record in batch.to_pylist():
                if record["id"] in seen:
                    summary.repeats_dropped += 1
                    continue
                seen.add(record["id"])
                records.append(record)
                if record["error"] is None:
                    summary.done += 1
                    for stage in summary.stage_s:
                        summary.stage_s[stage] += record[stage] or 0.0
                else:
                    summary.failed += 1
                    summary.errors[record["id"]] = record["error"]
            writer.add(records)
            bar.update(len(records))
            if on_record is not None:
                for record in records:
                    on_record(record)
    finally:
        writer.close()
        bar.close()
        summary.seconds = time.perf_counter() - t0
        if started:
            ray.shutdown()
    lost = {r.id for r in pending} - seen
    if lost:  # Ray Data retries what a dead worker held; a row missing here is a bug, not bad luck
        raise RuntimeError(f"{len(lost)} rows came back from no stage: {sorted(lost)[:10]}")
    return summary


def _bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="obj", desc="batch", disable=not enabled, file=sys.stderr, smoothing=0.1)
