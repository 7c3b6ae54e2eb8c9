"""The batch's input rows: read from JSONL or Parquet (a local path or s3://), one object each,
checked here so that a bad row becomes that row's error instead of stopping the batch.

A row: `prompt` and optional `id`, `seed`, `guidance`, `top_p`, `temperature`, `resolution`,
`bbox`, `format`. Without an `id` a row is named by its place in the file (`000042`), so a rerun
of the same file finds the same ids. Ids name output files (`<out>/<id>.<format>`): letters,
digits, `.`, `_`, `-`, not starting with a dot; two rows with one id stop the batch before it
starts (which mesh would be which?).
"""

from __future__ import annotations

import io
import json
import re
from dataclasses import dataclass

import pyarrow as pa

from cubeserve import storage
from cubeserve.requests import GenerationRequest, InvalidRequest

FIELDS = ("id", "prompt", "seed", "guidance", "top_p", "temperature", "resolution", "bbox", "format")
ID_PATTERN = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$")

# The rows as they travel between the stages (typed, so that every block has one schema); `error`
# is set by the first stage that fails the row, and every later stage passes it through.
SCHEMA = pa.schema([
    ("id", pa.string()), ("prompt", pa.string()), ("seed", pa.int64()), ("guidance", pa.float64()),
    ("top_p", pa.float64()), ("temperature", pa.float64()), ("resolution", pa.int64()),
    ("bbox", pa.list_(pa.float64())), ("format", pa.string()), ("error", pa.string()),
])


class InputError(ValueError):
    """The prompts file cannot be read as a whole (not a single row's fault)."""


@dataclass
class Defaults:
    """What a row gets for a field it leaves out (the CLI's --seed, --resolution, ...)."""
    seed: int = 0
    guidance: float = 3.0
    top_p: float | None = None
    temperature: float | None = None
    resolution: int = 8
    format: str = "glb"


@dataclass
class Row:
    id: str
    prompt: str
    seed: int = 0
    guidance: float = 3.0
    top_p: float | None = None
    temperature: float | None = None
    resolution: int = 8
    bbox: list[float] | None = None
    format: str = "glb"
    error: str | None = None

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in SCHEMA.names}


def request_of(row: dict) -> GenerationRequest:
    """The request of a row as the stages carry it (SCHEMA; checked by `parse`)."""
    bbox = row["bbox"]
    return GenerationRequest(
        prompt=row["prompt"], seed=row["seed"], guidance_scale=row["guidance"], top_p=row["top_p"],
        temperature=row["temperature"], resolution=row["resolution"],
        bbox=tuple(bbox) if bbox is not None else None, format=row["format"])


def read_records(uri: str) -> list[dict]:
    """The raw records of a JSONL (.jsonl, .json, .ndjson) or Parquet (.parquet) file."""
    data = storage.read_bytes(uri)
    if data is None:
        raise InputError(f"{uri}: no such file")
    name = uri.rstrip("/").lower()
    if name.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            return pq.read_table(io.BytesIO(data)).to_pylist()
        except pa.ArrowException as exc:
            raise InputError(f"{uri}: not a readable Parquet file: {exc}") from None
    if not name.endswith((".jsonl", ".ndjson", ".json")):
        raise InputError(f"{uri}: the prompts file must be JSONL (.jsonl) or Parquet (.parquet)")
    records = []
    for number, line in enumerate(data.decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{uri}: line {number} is not JSON: {exc}") from None
        if not isinstance(record, dict):
            raise InputError(f"{uri}: line {number} is not a JSON object")
        records.append(record)
    return records


def parse(records: list[dict], defaults: Defaults | None = None) -> list[Row]:
    """Rows from raw records; a field out of range is that row's `error`, an id that repeats
    stops everything (InputError)."""
    defaults = defaults or Defaults()
    rows, seen = [], {}
    for index, record in enumerate(records):
        row = _row(index, record, defaults)
        if row.id in seen:
            raise InputError(f"rows {seen[row.id]} and {index} have the same id {row.id!r}: ids name the output files")
        seen[row.id] = index
        rows.append(row)
    return rows


def _row(index: int, record: dict, defaults: Defaults) -> Row:
    raw_id = record.get("id")
    row_id = f"{index:06d}" if raw_id is None else str(raw_id)
    prompt = record.get("prompt")
    row = Row(id=row_id, prompt=prompt if isinstance(prompt, str) else "")
    if not ID_PATTERN.match(row_id):
        # Still recorded (under a name that is safe), never written as a file.
        row.id = f"{index:06d}"
        row.error = f"id: {raw_id!r} must be 1 to 128 letters, digits, '.', '_' or '-', not starting with '.'"
        return row
    if not isinstance(prompt, str):
        row.error = "prompt: missing" if prompt is None else f"prompt: must be a string, got {prompt!r}"
        return row
    values = {name: record.get(name, getattr(defaults, name, None)) for name in FIELDS[2:]}
    if values["bbox"] is not None and not isinstance(values["bbox"], (list, tuple)):
        row.error = f"bbox: must be a list of 3 numbers, got {values['bbox']!r}"
        return row
    request = GenerationRequest(prompt=prompt, seed=values["seed"], guidance_scale=values["guidance"],
                                top_p=values["top_p"], temperature=values["temperature"],
                                resolution=values["resolution"],
                                bbox=tuple(values["bbox"]) if values["bbox"] is not None else None,
                                format=values["format"])
    try:
        request.validate(uses_bbox=True)  # whether this model takes a box, the decode stage knows
    except InvalidRequest as exc:
        row.error = _field_names(str(exc))
        return row
    row.seed, row.guidance, row.top_p, row.temperature = request.seed, float(request.guidance_scale), \
        request.top_p, request.temperature
    row.resolution, row.format = request.resolution, request.format
    row.bbox = list(request.bbox) if request.bbox is not None else None
    return row


def _field_names(message: str) -> str:
    """An InvalidRequest's message with the row's field names (`guidance`, not `guidance_scale`)."""
    return message.replace("guidance_scale:", "guidance:", 1)


def to_table(rows: list[Row]) -> pa.Table:
    return pa.Table.from_pylist([r.as_dict() for r in rows], schema=SCHEMA)
