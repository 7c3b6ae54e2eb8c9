"""`cube3d-client`: generate a mesh through a cube-serve server (local Triton or KServe)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from cube3d_client.client import Cube3DClient, ServerError
from cubeserve.deploy import PREDICT_MODEL, STREAM_MODEL


def _bbox(text: str):
    parts = tuple(float(v) for v in text.split(","))
    if len(parts) != 3:
        raise argparse.ArgumentTypeError("--bbox takes X,Y,Z")
    return parts


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cube3d-client", description="Text to 3D mesh through the predict API.")
    p.add_argument("prompt")
    p.add_argument("--url", default="127.0.0.1:8000", help="host:port (REST 8000, gRPC 8001 locally)")
    p.add_argument("--protocol", choices=["http", "grpc"], default="http")
    p.add_argument("--model", default=PREDICT_MODEL)
    p.add_argument("--stream-model", default=STREAM_MODEL)
    p.add_argument("--model-version", default="")
    p.add_argument("--host", help="Host header / gRPC authority of a KServe InferenceService")
    p.add_argument("--user", help="user key of an experiment (header x-cube3d-user): one user, one arm")
    p.add_argument("--api-key", default=os.environ.get("CUBE3D_API_KEY"),
                   help="your team's key for the gateway (default $CUBE3D_API_KEY; docs/gateway/index.md)")
    p.add_argument("--ssl", action="store_true")
    p.add_argument("--out", default="output.glb", help=".glb or .obj")
    p.add_argument("--preview", help="also write a PNG preview")
    p.add_argument("--progress", action="store_true", help="progress bar from the gRPC stream")
    p.add_argument("--seed", type=int)
    p.add_argument("--guidance", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--temperature", type=float)
    p.add_argument("--resolution", type=int)
    p.add_argument("--bbox", type=_bbox)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--retries", type=int, default=3)
    p.add_argument("--trace", action="store_true",
                   help="start a W3C trace and print its id (spans to $OTEL_EXPORTER_OTLP_ENDPOINT where set; "
                        "docs/gateway/regions-models-traces.md)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    fmt = out.suffix.lstrip(".").lower() or "glb"
    client = Cube3DClient(args.url, args.protocol, model=args.model, stream_model=args.stream_model,
                          model_version=args.model_version, host=args.host, timeout=args.timeout,
                          retries=args.retries, ssl=args.ssl, user=args.user,
                          api_key=args.api_key, trace=args.trace)
    on_progress = bar = None
    if args.progress:
        from tqdm import tqdm

        bar = tqdm(desc="shape tokens", unit="tok")

        def on_progress(tokens: int) -> None:
            bar.update(tokens - bar.n)

    try:
        result = client.generate(args.prompt, seed=args.seed, guidance_scale=args.guidance, top_p=args.top_p,
                                 temperature=args.temperature, resolution=args.resolution, bbox=args.bbox,
                                 format=fmt, on_progress=on_progress)
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - a clear line, not a traceback
        print(f"error: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 3
    finally:
        if bar is not None:
            bar.close()
        client.close()
        if client.trace_id:  # also for a failed request: the trace says where it failed
            print(f"trace id: {client.trace_id}")
    result.save(out)
    if args.preview:
        Path(args.preview).write_bytes(result.preview_png())
    t = result.timings
    served_by = f" (model version {result.model_version}{', arm ' + result.arm if result.arm else ''})" \
        if result.model_version else ""
    print(f"mesh: {result.num_vertices} vertices, {result.num_faces} faces -> {out}{served_by}")
    if "message" in t:
        print(f"note: {t['message']}")
    print(f"time per output token: {t.get('time_per_token_s', 0) * 1e3:.2f} ms   "
          f"queue {t.get('queue_s', 0):.3f} s   tokens {t.get('tokens_s', 0):.3f} s   "
          f"geometry {t.get('geometry_s', 0):.3f} s   server total {t.get('total_s', 0):.3f} s   "
          f"client {result.client_seconds:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
