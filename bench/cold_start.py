"""A replica's cold start, split into what a scale-out (or a scale from zero) waits for
(docs/deploy/autoscaling.md):

  download      KServe's storage initializer code (kserve_storage.Storage.download, in a process of
                its own as the init container runs it) from an S3 server on the loopback
                (`rclone serve s3`): the version's weights directory
  load          Engine.from_dir on the serving device and dtype: weights read, models built
  graphs        the scheduler started: its decode CUDA graphs captured (CUDA only; none on a CPU)
  first object  the first request through the scheduler (resolution 5), beside the second one's time
  server ready  tritonserver under cubeserve's supervisor with that version in its repository,
                from start to ready (both models loaded: its own load, the stubs, the front ends)

for the shipped demo model and a random checkpoint of a real preset's size (v0.1 by default).

    python -m bench.cold_start [--configs demo,v0.1] [--json out.json] [--no-markdown]
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The objects timed are small (marching cubes at 2^5 per side): what the first one costs beyond the
# second is the warm-up, not the geometry.
RESOLUTION = 5


def _size_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def download(weights: Path, work: Path) -> tuple[float, Path]:
    """Seconds KServe's storage code takes to copy `weights` out of a local S3 server, and where."""
    from kfp_pipelines.local_services import ObjectStore

    with ObjectStore(work / "s3") as store:
        bucket = store.create_bucket("cube3d")
        client = store.client()
        for f in sorted(p for p in weights.rglob("*") if p.is_file()):
            client.upload_file(str(f), bucket, f"cube3d/1/weights/{f.relative_to(weights)}")
        out = work / "mnt-models"
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import sys; from kserve_storage import Storage; "
                        "Storage.download(sys.argv[1], sys.argv[2])", "s3://cube3d/cube3d/1/", str(out)],
                       env=store.env(), check=True, capture_output=True, timeout=1800)
        return time.perf_counter() - started, out / "weights"


def engine_phases(weights: Path, device) -> dict:
    from cubeserve.engine import Engine, GenerationRequest
    from cubeserve.engine.scheduler import Scheduler

    started = time.perf_counter()
    engine = Engine.from_dir(weights, device=device)
    loaded = time.perf_counter()
    with Scheduler(engine) as scheduler:  # captures its graphs on CUDA
        ready = time.perf_counter()
        first = time.perf_counter()
        scheduler.generate(GenerationRequest(prompt="a small ball", seed=0, resolution=RESOLUTION))
        second = time.perf_counter()
        scheduler.generate(GenerationRequest(prompt="a small ball", seed=1, resolution=RESOLUTION))
        done = time.perf_counter()
    return {"load_s": loaded - started, "graphs_s": ready - loaded, "first_object_s": second - first,
            "second_object_s": done - second, "dtype": str(engine.dtype).removeprefix("torch.")}


def server_ready(weights: Path, work: Path) -> float | None:
    """Start -> ready of a local server with this version (None where tritonserver is missing)."""
    try:
        from cubeserve.server.local_triton import LocalTriton, copy_model_repository, free_port
    except ImportError:
        return None
    from cubeserve import deploy

    repo = copy_model_repository(work / "models")
    shutil.copytree(weights, repo / deploy.STREAM_MODEL / "1" / "weights")
    server = LocalTriton(repo, free_port(), free_port(), free_port(), log_path=work / "server.log")
    started = time.perf_counter()
    try:
        server.start(timeout=1800)
        return time.perf_counter() - started
    finally:
        server.stop()


def measure(config: str, work: Path, device) -> dict:
    from cubeserve.checkpoint import write_random_weights

    if config == "demo":
        weights = REPO / "models" / "demo"
    else:
        weights = write_random_weights(config, work / "source")
    row = {"config": config, "weights_mb": round(_size_mb(weights), 1)}
    try:
        row["download_s"], weights = download(weights, work)
    except (ImportError, FileNotFoundError, RuntimeError) as exc:  # no rclone / kserve-storage here
        row["download_s"], row["download_skipped"] = None, f"{type(exc).__name__}: {exc}"
    row.update(engine_phases(weights, device))
    row["server_ready_s"] = server_ready(weights, work) if device.type == "cpu" else None
    return row


def markdown_lines(header: dict, rows: list[dict]) -> list[str]:
    def fmt(value):
        return "n/a" if value is None else f"{value:.1f}"

    lines = [f"Measured {header['date']} on {header['hardware']}, torch {header['torch']}.", "",
             "| checkpoint | weights MB | download s | load s | graphs s | first object s | second object s | server ready s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        name = "demo model" if r["config"] == "demo" else f"{r['config']} (random weights, {r['dtype']})"
        lines.append(f"| {name} | {r['weights_mb']:.0f} | {fmt(r['download_s'])} | {fmt(r['load_s'])} | "
                     f"{fmt(r['graphs_s'])} | {fmt(r['first_object_s'])} | {fmt(r['second_object_s'])} | "
                     f"{fmt(r['server_ready_s'])} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    import torch

    from bench.common import hardware

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="demo,v0.1", help="demo and/or presets (default %(default)s)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--no-markdown", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    header = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
              "hardware": hardware(device), "torch": torch.__version__}
    rows = []
    for config in args.configs.split(","):
        with tempfile.TemporaryDirectory(prefix="cube3d-cold-") as tmp:
            rows.append(measure(config, Path(tmp), device))
            print(json.dumps(rows[-1]), flush=True)
    lines = markdown_lines(header, rows)
    print("\n".join(lines))
    if args.json:
        args.json.write_text(json.dumps({"header": header, "rows": rows}, indent=2) + "\n")
    if not args.no_markdown:
        from bench.__main__ import update_markdown

        section = "cold-start" if device.type == "cpu" else "cold-start-gpu"
        update_markdown(section, ["### A replica's cold start (`python -m bench.cold_start`)", "", *lines])
    return 0


if __name__ == "__main__":
    sys.exit(main())
