"""Run the checkpoint pipeline on this machine with kfp.local: no cluster, every step a
subprocess in this Python environment, the registry (sqlite) and the model store on disk.

    python -m kfp_pipelines.run_local --checkpoint DIR --store DIR [--triton-url 127.0.0.1:8000]

Without --triton-url a tritonserver (explicit model control, 127.0.0.1, free ports) is started
on the store for the roll-out and stopped at the end (its log: STORE-pipeline/tritonserver.log); the store's config.pbtxt keeps the
served version, so `cubeserve`-style servers started on the store later serve the champion.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path


def run(checkpoint: str, store: str, registry_uri: str = "", triton_url: str = "", **params) -> dict:
    """One pipeline run; returns the registry's versions afterwards. Raises RuntimeError when
    a step fails (kfp.local logs the step's error)."""
    from kfp import local

    from cubeserve.registry import embedded_uri
    from kfp_pipelines.checkpoint_rollout import checkpoint_rollout

    store_path = Path(store).resolve()
    store_path.mkdir(parents=True, exist_ok=True)
    # The registry and the step outputs (metrics, HTML report, one folder per run) live beside
    # the store, not in it: a Triton model repository should hold models only.
    state = state_dir(store_path)
    registry_uri = registry_uri or embedded_uri(state / "registry")
    # The steps name the runtime image, which SubprocessRunner ignores (and warns about).
    warnings.filterwarnings("ignore", message="You may be attemping to run a task that uses custom")
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(state / "runs"),
               raise_on_error=True)
    server = None
    if not triton_url:
        server = start_server(store_path)
        triton_url = server.http_url
    try:
        checkpoint_rollout(checkpoint=str(Path(checkpoint).resolve()), store=str(store_path),
                                  registry_uri=registry_uri, triton_url=triton_url, **params)
    finally:
        if server is not None:
            server.stop()
    return summary(registry_uri)


def summary(registry_uri: str, model_name: str = "cube3d") -> dict:
    """The registry after a run: every version with its aliases and roll-out decision."""
    from cubeserve.registry import ModelRegistry

    versions = ModelRegistry(registry_uri, model_name).versions()
    return {"registry_uri": registry_uri, "versions": [
        {"version": v.version, "aliases": list(v.aliases), "triton_version": v.tags.get("triton_version"),
         "sha256": v.tags.get("sha256"), "decision": v.tags.get("rollout.decision"),
         "reason": v.tags.get("rollout.reason")} for v in versions]}


def state_dir(store: Path) -> Path:
    """`<store>-pipeline/`: registry/mlflow.db, runs/<run>/<step>/..., tritonserver.log."""
    return store.parent / f"{store.name}-pipeline"


def start_server(store: Path):
    """A local tritonserver on the store, serving what its config.pbtxt names (if anything)."""
    from cubeserve.serving.local_triton import LocalTriton, free_port

    loaded = [f"--load-model={m}" for m in ("cube3d_stream", "cube3d")
              if (store / m / "config.pbtxt").exists() and any(p.name.isdigit() for p in (store / m).iterdir())]
    server = LocalTriton(store, free_port(), free_port(), free_port(), log_path=state_dir(store) / "tritonserver.log",
                         extra_args=("--model-control-mode=explicit", *loaded))
    return server.start()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory (safetensors + config)")
    parser.add_argument("--store", required=True, help="model store: a Triton model repository")
    parser.add_argument("--registry-uri", default="",
                        help="MLflow URI (default: sqlite in STORE-pipeline/registry)")
    parser.add_argument("--triton-url", default="", help="REST host:port of a server with explicit model "
                                                         "control (default: start one on the store)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--resolution", type=int, default=5)
    parser.add_argument("--max-time-per-output-token-s", type=float, default=1.0)
    parser.add_argument("--min-token-agreement", type=float, default=0.0)
    parser.add_argument("--heldout-shapes", type=int, default=0,
                        help="score generations against this many held-out procedural shapes (demo benchmark)")
    parser.add_argument("--min-shape-iou", type=float, default=0.0, help="gate on that benchmark's mean IoU")
    parser.add_argument("--canary-percent", type=int, default=10)
    parser.add_argument("--soak-requests", type=int, default=2)
    args = parser.parse_args(argv)
    outputs = run(args.checkpoint, args.store, args.registry_uri, args.triton_url, device=args.device,
                  resolution=args.resolution, max_time_per_output_token_s=args.max_time_per_output_token_s,
                  min_token_agreement=args.min_token_agreement, heldout_shapes=args.heldout_shapes,
                  min_shape_iou=args.min_shape_iou, canary_percent=args.canary_percent,
                  soak_requests=args.soak_requests)
    print(json.dumps(outputs, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
