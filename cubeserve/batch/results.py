"""The results table: one record per row of the batch, at `<out>/results/` as Parquet part files
(one table: `pandas.read_parquet(dir)` or `pyarrow.dataset` read them together).

Parts are written while the batch runs, every few seconds or rows (`Writer`), so a batch that
stops half way has its finished rows on record, and a rerun into the same output skips them
(`recorded`). A record is written only once its mesh file is, and ids are unique in a run, so
every row is on record exactly once per run; across runs the newest record of an id wins
(`latest`): a row retried with --retry-failed replaces its failure.
"""

from __future__ import annotations

import io
import secrets
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from cubeserve import storage
from cubeserve.batch.rows import SCHEMA as ROW_SCHEMA

RESULTS_DIR = "results"
SCHEMA = pa.schema([
    *[f for f in ROW_SCHEMA if f.name != "error"],
    ("tokens", pa.list_(pa.int64())),
    ("vertices", pa.int64()), ("faces", pa.int64()), ("watertight", pa.bool_()),
    ("mesh_uri", pa.string()), ("preview_uri", pa.string()),
    # seconds per stage: decoding (admitted -> last token), tokens -> mesh bytes, writing the files
    ("decode_s", pa.float64()), ("geometry_s", pa.float64()), ("write_s", pa.float64()),
    ("error", pa.string()),  # null: done
    ("run_id", pa.string()), ("finished_at", pa.timestamp("ms", tz="UTC")),
])


def results_uri(out: str) -> str:
    return storage.join(out, RESULTS_DIR)


def read(out: str) -> pa.Table:
    """Every record of every run into `out` (an empty table when there is none)."""
    uri = results_uri(out)
    if not storage.exists(uri):
        return SCHEMA.empty_table()
    with tempfile.TemporaryDirectory() as tmp:
        local = storage.local_path(uri)
        if local is None:  # an object store: its parts, here
            local = Path(tmp)
            storage.download_dir(uri, local)
        parts = sorted(local.glob("*.parquet"))
        tables = [pq.read_table(p).cast(SCHEMA) for p in parts]
    return pa.concat_tables(tables) if tables else SCHEMA.empty_table()


def latest(table: pa.Table) -> dict[str, dict]:
    """id -> its newest record."""
    records = {}
    for record in sorted(table.to_pylist(), key=lambda r: r["finished_at"]):
        records[record["id"]] = record
    return records


def recorded(out: str, retry_failed: bool = False) -> set[str]:
    """The ids a rerun skips: done ones, and failed ones unless `retry_failed`."""
    return {i for i, r in latest(read(out)).items() if r["error"] is None or not retry_failed}


class Writer:
    """Appends records to the table as part files: one every `every_s` seconds or `every_rows`
    records, whichever comes first, and the rest at `close`."""

    def __init__(self, out: str, every_s: float = 5.0, every_rows: int = 64):
        self.uri = results_uri(out)
        self.run_id = time.strftime("%Y%m%dT%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)
        self.every_s, self.every_rows = every_s, every_rows
        self.pending: list[dict] = []
        self.parts = 0
        self.last = time.monotonic()

    def add(self, records: list[dict]) -> None:
        now = pa.scalar(time.time_ns() // 1_000_000, pa.timestamp("ms", tz="UTC")).as_py()
        self.pending += [{**{f.name: r.get(f.name) for f in SCHEMA}, "run_id": self.run_id, "finished_at": now}
                         for r in records]
        if len(self.pending) >= self.every_rows or time.monotonic() - self.last >= self.every_s:
            self.flush()

    def flush(self) -> None:
        self.last = time.monotonic()
        if not self.pending:
            return
        buf = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(self.pending, schema=SCHEMA), buf)
        storage.write_bytes(storage.join(self.uri, f"part-{self.run_id}-{self.parts:05d}.parquet"), buf.getvalue())
        self.parts += 1
        self.pending = []

    def close(self) -> None:
        self.flush()
