"""`cubeserve` command line: generate in process, inspect configs, write random weights."""

from __future__ import annotations

import argparse
import errno
import json
import logging
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

from cubeserve import deploy
from cubeserve.config import QUANTIZATIONS


def _bbox(text: str) -> tuple[float, float, float]:
    try:
        parts = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--bbox takes X,Y,Z numbers, got {text!r}") from None
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"--bbox takes exactly 3 numbers X,Y,Z, got {text!r}")
    return parts


def cmd_generate(args) -> int:
    from cubeserve.engine import Engine, GenerationRequest

    out = Path(args.out)
    fmt = args.format or (out.suffix.lstrip(".").lower() if out.suffix else "glb")
    request = GenerationRequest(
        prompt=args.prompt, seed=args.seed, guidance_scale=args.guidance, top_p=args.top_p,
        temperature=args.temperature, resolution=args.resolution, bbox=args.bbox, format=fmt,
    )
    t0 = time.perf_counter()
    engine = Engine.from_dir(args.weights, device=args.device, dtype=args.dtype,
                             single_block_mode=args.single_block, quantization=args.quantization,
                             decode_window=args.decode_window)
    load_s = time.perf_counter() - t0
    result = engine.generate([request])[0]
    if result.mesh.empty:
        print(f"no mesh: {result.mesh.message}", file=sys.stderr)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(result.mesh_bytes())
    if args.save_tokens:
        Path(args.save_tokens).write_text(json.dumps(result.tokens))
    if args.preview:
        from cubeserve.preview import render_preview

        mesh = result.mesh
        Path(args.preview).write_bytes(render_preview(mesh.vertices, mesh.faces, message=mesh.message))
    n = len(result.tokens)
    dtype = str(engine.dtype).removeprefix("torch.")
    quantized = f"  weights: {engine.quantization}" if engine.quantization != "none" else ""
    print(f"prompt: {args.prompt!r}  device: {engine.device}  dtype: {dtype}{quantized}  tokens: {n}")
    t = result.stages
    print(f"time per output token: {t.time_per_token_s * 1e3:.2f} ms")
    print(f"stages: load {load_s:.3f} s  tokens {t.tokens_s:.3f} s  geometry {t.geometry_s:.3f} s")
    print(f"mesh: {len(result.mesh.vertices)} vertices, {len(result.mesh.faces)} faces -> {out}")
    return 0 if not result.mesh.empty else 3


# The request fields `cubeserve window-check` sets, by the option that sets them.
_WINDOW_CHECK_OPTIONS = {"prompt": "--prompts-file", "seed": "--seed", "guidance_scale": "--guidance",
                         "top_p": "--top-p"}


def _windows(text: str) -> list[int]:
    from cubeserve.config import DECODE_WINDOWS

    windows = []
    for part in text.split(","):
        try:
            w = int(part.strip())
        except ValueError:
            w = None
        if w not in DECODE_WINDOWS:
            raise ValueError(f"--windows: each window must be an integer in {DECODE_WINDOWS.start}.."
                             f"{DECODE_WINDOWS.stop - 1} (1: one token per forward), comma-separated, got {part!r}")
        windows.append(w)
    return windows


def cmd_window_check(args) -> int:
    """Window decoding measured on a weights directory, windows side by side (engine/window_check.py),
    and the decode_window worth setting in its version.json."""
    import torch

    from cubeserve.engine import Engine, GenerationRequest
    from cubeserve.engine import window_check as wc
    from cubeserve.hardware import cpu_isa, hardware
    from cubeserve.requests import InvalidRequest

    windows = wc.windows_of(_windows(args.windows))
    for option, value in (("--prompts", args.prompts), ("--in-flight", args.in_flight),
                          ("--cpu-threads", args.cpu_threads)):
        if value is not None and value < 1:
            raise ValueError(f"{option}: must be an integer of at least 1, got {value}")
    if not Path(args.weights).is_dir():
        raise ValueError(f"--weights {args.weights}: no such directory (a weights directory: safetensors, "
                         "config YAML, clip/)")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {args.device}: no CUDA device is visible to PyTorch here; use --device cpu")
    if args.prompts_file:
        prompts = wc.read_prompts(args.prompts_file)[:args.prompts]
    else:
        prompts = wc.default_prompts(args.prompts or wc.DEFAULT_PROMPTS)
    requests = [GenerationRequest(p, seed=args.seed + i, guidance_scale=args.guidance, top_p=args.top_p)
                for i, p in enumerate(prompts)]
    for i, r in enumerate(requests):
        try:
            r.validate(uses_bbox=False)
        except InvalidRequest as exc:
            where = f" (line {i + 1} with a prompt)" if exc.field == "prompt" else ""
            raise ValueError(f"{_WINDOW_CHECK_OPTIONS.get(exc.field, exc.field)}{where}: "
                             f"{str(exc).removeprefix(exc.field + ': ')}") from None
    engine = Engine.from_dir(args.weights, device=args.device, dtype=args.dtype, quantization=args.quantization,
                             cpu_threads=args.cpu_threads)
    dtype = str(engine.dtype).removeprefix("torch.")
    if engine.device.type == "cuda":
        machine = f"{hardware(engine.device)} (CUDA)"
    else:
        machine = (f"{hardware(engine.device)}; ISA: {' '.join(cpu_isa()) or 'no AVX2'}; "
                   f"PyTorch threads: {engine.cpu_threads.threads}")
    sampling = "greedy" if args.top_p is None else f"top-p {args.top_p:g}, seeds {args.seed}..{args.seed + len(prompts) - 1}"
    print(f"weights: {args.weights} (config {engine.cfg.name}, {engine.cfg.num_tokens} tokens an object)")
    print(f"device: {engine.device}, {dtype}"
          f"{'' if engine.quantization == 'none' else f', weights {engine.quantization}'}; {machine}")
    print(f"decoding: {sampling}, guidance {args.guidance:g}, {len(prompts)} prompts, {args.in_flight} in flight, "
          f"windows {','.join(map(str, windows))}", flush=True)

    def progress(done: int, groups: int) -> None:
        if sys.stderr.isatty():
            print(f"\rgroup {done}/{groups}", end="\n" if done == groups else "", file=sys.stderr, flush=True)

    figures = wc.measure(engine, requests, windows, args.in_flight, progress=progress)
    recommendation = wc.recommend(figures)
    print("\n".join(wc.table(figures)))
    print(recommendation.line)
    if args.json:
        report = {"weights": str(args.weights), "config": engine.cfg.name, "tokens": engine.cfg.num_tokens,
                  "device": str(engine.device), "dtype": dtype, "quantization": engine.quantization,
                  "hardware": hardware(engine.device), "cpu_isa": cpu_isa(),
                  "cpu_threads": engine.cpu_threads.threads, "torch": torch.__version__,
                  "sampling": {"top_p": args.top_p, "seed": args.seed, "guidance": args.guidance},
                  "prompts": len(prompts), "in_flight": args.in_flight, "margin": wc.MARGIN,
                  "windows": [f.as_dict() for f in figures],
                  "recommendation": {"decode_window": recommendation.window, "line": recommendation.line}}
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def cmd_batch(args) -> int:
    """A prompts file through the Ray Data pipeline (cubeserve/batch/); exit 3 when a row failed."""
    from cubeserve.batch import rows
    from cubeserve.batch.run import Settings, run
    from cubeserve.engine.fast_paths import check_recipe
    from cubeserve.serving.repository import stored_version

    if (args.weights is None) == (args.version is None):
        raise ValueError("give either --weights DIR or --version N (with --model-store)")
    weights, quantization = args.weights, args.quantization or "none"
    if args.version is not None:
        if not args.model_store:
            raise ValueError("--version N takes the weights from the model store: give --model-store URI")
        # Version N as the pipeline packaged it (cubeserve.pipeline.steps.package), quantized as
        # it is served.
        weights, packaged = stored_version(args.model_store, args.version)
        quantization = packaged.get("quantization", "none")
        if args.quantization not in (None, quantization):
            raise ValueError(f"--quantization {args.quantization}: version {args.version} is packaged as "
                             f"{quantization}; leave --quantization out to decode it as it is served")
        check_recipe(quantization, packaged.get("quantization_recipe"))
    defaults = rows.Defaults(seed=args.seed, guidance=args.guidance, top_p=args.top_p,
                             temperature=args.temperature, resolution=args.resolution, format=args.format)
    settings = Settings(weights=weights, out=args.out, device=args.device, dtype=args.compute_dtype,
                        quantization=quantization,
                        decode_actors=args.decode_actors, decode_cpus=args.decode_cpus,
                        geometry_actors=args.geometry_actors, max_objects=args.max_objects,
                        batch_size=args.batch_size, preview=args.preview, retry_failed=args.retry_failed,
                        address=args.address, defaults=defaults)
    summary = run(args.prompts, settings, progress=not args.no_progress)
    print(summary.text())
    return 3 if summary.failed else 0


def cmd_info(args) -> int:
    from cubeserve.checkpoint import describe
    from cubeserve.config import get_config

    info = describe(get_config(args.config))
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        for k, v in info.items():
            print(f"{k:48s} {v:,}" if isinstance(v, int) and not isinstance(v, bool) else f"{k:48s} {v}")
    return 0


def cmd_weights_init(args) -> int:
    from cubeserve.checkpoint import write_random_weights

    out = write_random_weights(args.config, args.out, seed=args.seed)
    print(f"wrote random {args.config} weights (seed {args.seed}) to {out}")
    return 0


def cmd_weights_check(args) -> int:
    from cubeserve.checkpoint import validate_dir

    cfg, _, _ = validate_dir(args.weights)
    print(f"{args.weights}: valid {cfg.name} checkpoint ({cfg.num_tokens} shape tokens, bbox={cfg.gpt.use_bbox})")
    return 0


def cmd_serve(args) -> int:
    from cubeserve.server.local_triton import MODEL_REPOSITORY, LocalTriton, ensure_demo_weights

    repo = Path(args.model_repository) if args.model_repository else MODEL_REPOSITORY
    # Supervised: a python backend stub that dies (e.g. killed for memory) restarts the server.
    # The admin APIs' key (docs/security.md): $CUBE3D_ADMIN_KEY, else a new one for this start,
    # which the supervisor writes where only this user can read it, for as long as the server runs.
    key_file = Path(tempfile.gettempdir()) / f"cubeserve-admin-key-{args.http_port}"
    server = LocalTriton(repo, args.http_port, args.grpc_port, args.metrics_port, verbose=True, supervised=True,
                         admin_key_file=key_file)
    busy = _ports_in_use(server)
    if busy:
        print(busy, file=sys.stderr)
        return 2
    ensure_demo_weights(repo)
    if not any(Path("/dev").glob("nvidia[0-9]*")):  # tritonserver looks for a GPU and says so
        print("No NVIDIA GPU here: the models run on the CPU, and tritonserver's CUDA, NVML and DCGM lines "
              "below are expected (docs/troubleshooting.md).", file=sys.stderr)
    try:
        server.start(timeout=args.timeout)
    except RuntimeError as exc:  # its log is above; a port taken since the check above says so there
        print(f"error: the server did not start: {exc}", file=sys.stderr)
        return 1
    try:
        _wait_then_stop(server, f"tritonserver (supervisor pid {server.process.pid}) ready: REST {server.http_url}, "
                                f"gRPC {server.grpc_url}, metrics {server.metrics_url}; admin APIs need the header "
                                f"{deploy.ADMIN_HEADER} with the key in {key_file}; Ctrl-C stops it")
    finally:
        key_file.unlink(missing_ok=True)  # the supervisor's to remove; gone also if it was killed
    return 0


def _in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Something listens on host:port (a socket in TIME_WAIT does not count: the servers reuse it)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def _ports_in_use(server) -> str | None:
    """One line naming the ports `server` (a LocalTriton) needs that something already listens
    on, and the flag (and `make serve` variable) that moves each; None when all are free.
    Checked before anything starts: a taken port would otherwise end in a traceback."""
    ports = [(server.http_port, "REST", "--http-port", "PORT"),
             (server.grpc_port, "gRPC", "--grpc-port", "GRPC_PORT"),
             (server.metrics_port, "metrics", "--metrics-port", "METRICS_PORT"),
             # tritonserver's own endpoints behind the front ends: fixed with the default ports
             (server.triton_http_port, "tritonserver's REST, fixed while --http-port is the default",
              "--http-port", "PORT"),
             (server.triton_grpc_port, "tritonserver's gRPC, fixed while --grpc-port is the default",
              "--grpc-port", "GRPC_PORT")]
    busy = [f"{port} ({what}: change it with {flag}, or make serve {var}=...)"
            for port, what, flag, var in ports if _in_use(port)]
    if not busy:
        return None
    return (f"error: {'port' if len(busy) == 1 else 'ports'} in use on 127.0.0.1: {', '.join(busy)}; "
            "stop what listens there (another `cubeserve serve`?) or choose another port")


def cmd_demo(args) -> int:
    """Start the local Triton server, generate through the client, write the mesh and a PNG,
    print the timings, stop the server."""
    from cube3d_client import Cube3DClient
    from cubeserve.server.local_triton import MODEL_REPOSITORY, LocalTriton, ensure_demo_weights, free_port

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    ensure_demo_weights(MODEL_REPOSITORY)
    server = LocalTriton(MODEL_REPOSITORY, free_port(), free_port(), free_port(),
                         log_path=out.parent / "tritonserver.log")
    t0 = time.perf_counter()
    server.start()
    print(f"tritonserver ready on 127.0.0.1 in {time.perf_counter() - t0:.1f} s "
          f"(log: {server.log_path})", flush=True)
    try:
        with Cube3DClient(server.http_url, "http", timeout=600) as client:
            result = client.generate(args.prompt, seed=args.seed, resolution=args.resolution)
    finally:
        server.stop()
    result.save(out)
    preview = out.with_suffix(".png")
    preview.write_bytes(result.preview_png())
    t = result.timings
    print(f"prompt: {args.prompt!r} -> {out} ({result.num_vertices} vertices, {result.num_faces} faces), {preview}")
    print(f"time per output token {t['time_per_token_s'] * 1e3:.2f} ms | queue {t['queue_s']:.3f} s | "
          f"tokens {t['tokens_s']:.3f} s | geometry {t['geometry_s']:.3f} s | server {t['total_s']:.3f} s | "
          f"round trip {result.client_seconds:.3f} s")
    return 0


def _wait_then_stop(child, ready: str) -> None:
    """Say `ready`, then wait for `child` (its .process, .stop()) until it ends, Ctrl-C or SIGTERM:
    SIGTERM (kill, a process manager) stops it too, as Ctrl-C does, instead of leaving it running
    without its parent. The handler is in place before `ready` is printed: a script that stops
    the command as soon as it reads the line gets the same clean stop."""
    def stop(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut the cleanup below
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    print(ready, flush=True)
    try:
        child.process.wait()
    except KeyboardInterrupt:
        pass
    finally:
        child.stop()


def cmd_gateway(args) -> int:
    """Render the gateway file as Envoy's configuration, validate it, run Envoy (docs/gateway/index.md)."""
    from cubeserve.gateway import config as gateway_config
    from cubeserve.gateway.envoy import Gateway, validate, write

    if args.new_key:
        print(gateway_config.new_key())
        return 0
    if not args.config:
        raise ValueError("cubeserve gateway: give --config FILE (or --new-key)")
    cfg = gateway_config.load(args.config)
    if args.check:
        with tempfile.TemporaryDirectory() as folder:
            validate(cfg, write(cfg, Path(folder)))
        print(f"{args.config}: valid; Envoy accepts the rendered configuration")
        return 0
    gateway = Gateway(cfg, concurrency=args.concurrency).start()
    backends = ", ".join(f"{host}:{port}" for host, port in cfg.backends)
    _wait_then_stop(gateway, f"gateway on {gateway.url} (Envoy pid {gateway.process.pid}, admin and stats "
                             f"{gateway.admin_url}) -> {backends}; tenants {', '.join(cfg.tenant_ids)}; an object "
                             f"costs {cfg.tokens_per_object} shape tokens ({cfg.model}); servers meter these tenants "
                             f"when started with CUBE3D_TENANTS={','.join(cfg.tenant_ids)} "
                             f"CUBE3D_MODELS={','.join(m.name for m in cfg.models)}; Ctrl-C stops it")
    return 0


def cmd_usage(args) -> int:
    from cubeserve.gateway import usage

    try:
        rows = usage.usage(args.prometheus, args.since)
    except (OSError, RuntimeError) as exc:  # unreachable, or a refused query
        print(f"error: Prometheus at {args.prometheus}: {exc}", file=sys.stderr)
        return 2
    print(usage.as_csv(rows) if args.csv else usage.as_table(rows), end="\n" if not args.csv else "")
    return 0


def _train_settings(args):
    from dataclasses import replace

    from cubeserve.demo import train

    tok, gpt = train.TokenizerTraining(), train.GPTTraining()
    if getattr(args, "tokenizer_steps", None):
        tok = replace(tok, steps=args.tokenizer_steps)
    if getattr(args, "gpt_steps", None):
        gpt = replace(gpt, steps=args.gpt_steps)
    return tok, gpt


def cmd_train(args) -> int:
    from cubeserve.config import get_config
    from cubeserve.demo import build

    for name in ("shapes", "tokenizer_steps", "gpt_steps", "eval_shapes"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    cfg = get_config(args.config)
    tok_settings, gpt_settings = _train_settings(args)
    common = dict(cfg=cfg, seed=args.seed, n_shapes=args.shapes or build.TRAINING_SHAPES,
                  show_progress=not args.no_progress)
    if args.stage == "tokenizer":
        build.run_tokenizer_stage(args.work_dir, settings=tok_settings, **common)
    elif args.stage == "gpt":
        tok, gpt = build.run_gpt_stage(args.work_dir, settings=gpt_settings, **common)
        build.export(args.work_dir, args.out, cfg, gpt, tok)
        print(f"checkpoint written to {args.out} (evaluate it with `cubeserve evaluate {args.out}`)")
    else:
        build.build_demo_model(args.work_dir, args.out, tokenizer_settings=tok_settings,
                               gpt_settings=gpt_settings, eval_shapes=args.eval_shapes, **common)
        print(f"checkpoint, {build.CARD_FILE} and {build.EVALUATION_FILE} written to {args.out}")
    return 0


def cmd_evaluate(args) -> int:
    from cubeserve.demo.evaluate import evaluate_dir

    evaluation = evaluate_dir(args.weights, n=args.shapes, resolution=args.resolution, device=args.device)
    print(json.dumps(evaluation.to_dict(), indent=2) if args.json else evaluation.markdown_table())
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cubeserve", description="Serve Cube 3D text-to-3D models.")
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="prompt -> mesh, in process")
    g.add_argument("prompt")
    g.add_argument("--weights", required=True, help="weights directory (safetensors, YAML config, clip/)")
    g.add_argument("--out", default="output.glb", help="output mesh (.glb or .obj)")
    g.add_argument("--format", choices=["glb", "obj"])
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--guidance", type=float, default=3.0, help="classifier-free guidance scale (>= 0)")
    g.add_argument("--top-p", type=float, default=None, help="sample from the top-p set, (0, 1]")
    g.add_argument("--temperature", type=float, default=None, help="sampling temperature (> 0)")
    g.add_argument("--resolution", type=int, default=8, help="grid 2^r + 1 per axis, r in [4, 9]")
    g.add_argument("--bbox", type=_bbox, default=None, help="object size X,Y,Z (v0.5-style models)")
    g.add_argument("--single-block", choices=["reference", "causal"], default="reference")
    g.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    g.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="compute dtype (default: bfloat16 on CUDA and on CPUs with native bf16 "
                        "(AMX, AVX-512 BF16), float32 elsewhere)")
    g.add_argument("--quantization", choices=QUANTIZATIONS, default="none",
                   help="the GPT's weights as int8 (per channel) or int4 (grouped), weight-only, or fp8 "
                        "(per row, weights and activations; native on CUDA >= 8.9)")
    g.add_argument("--decode-window", type=int, default=1,
                   help="positions per decode forward (window decoding, the same tokens in fewer forwards "
                        "where its guesses hold), 1..64; 1: one token per forward")
    g.add_argument("--save-tokens", help="write the shape token ids as a JSON list")
    g.add_argument("--preview", help="write a PNG preview of the mesh")
    g.set_defaults(func=cmd_generate)

    wk = sub.add_parser("window-check", help="measure window decoding on a weights directory: tokens per "
                                             "forward and decode time per window, and the decode_window to set")
    wk.add_argument("--weights", required=True,
                    help="the weights directory to measure, as generate takes (safetensors, YAML config, clip/)")
    wk.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    wk.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                    help="compute dtype (default: as generate: bfloat16 on CUDA and on CPUs with native "
                         "bf16, float32 elsewhere)")
    wk.add_argument("--quantization", choices=QUANTIZATIONS, default="none",
                    help="the GPT's weights as the version serves them (as generate)")
    wk.add_argument("--windows", default="1,4,8,16",
                    help="decode windows to try, comma-separated, each 1..64; window 1 is always measured")
    wk.add_argument("--prompts", type=int, default=None,
                    help="objects to decode (default 32 of the demo data's prompts; with --prompts-file: "
                         "its first N lines, default all)")
    wk.add_argument("--prompts-file", help="a text file of prompts, one a line")
    wk.add_argument("--in-flight", type=int, default=1,
                    help="objects decoding together, as your server's load (default 1)")
    wk.add_argument("--top-p", type=float, default=None,
                    help="sample from the top-p set, (0, 1], instead of greedy decoding")
    wk.add_argument("--seed", type=int, default=0, help="the first prompt's seed, the next +1 (default 0)")
    wk.add_argument("--guidance", type=float, default=3.0,
                    help="classifier-free guidance scale (>= 0), as your requests use (default 3)")
    wk.add_argument("--cpu-threads", type=int, default=None,
                    help="PyTorch CPU threads (default: as the server decides)")
    wk.add_argument("--json", help="also write the figures to this JSON file")
    wk.set_defaults(func=cmd_window_check)

    b = sub.add_parser("batch", help="a prompts file (JSONL or Parquet) -> meshes and a results table, on Ray")
    b.add_argument("prompts", help="JSONL or Parquet, local or s3://: one object per row (prompt, optional id, "
                                   "seed, guidance, top_p, temperature, resolution, bbox, format)")
    b.add_argument("--weights", help="weights directory, local or s3://")
    b.add_argument("--version", type=int, help="model store version N instead of --weights")
    b.add_argument("--model-store", help="the model store of --version (as the pipeline's model_store)")
    b.add_argument("--out", required=True, help="where <id>.<format> and results/ go, local or s3://")
    b.add_argument("--address", help="a running Ray cluster (auto: the one this node belongs to); "
                                     "default: an embedded Ray on this machine")
    b.add_argument("--device", default="auto", help="the decode actors' device: cpu, cuda or auto")
    b.add_argument("--dtype", dest="compute_dtype", choices=["float32", "bfloat16"], default=None,
                   help="default: bfloat16 on CUDA and on CPUs with native bf16, float32 elsewhere")
    b.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                   help="the GPT's weights as int8, int4 or fp8 (as generate); with --version, the "
                        "version's own")
    b.add_argument("--decode-actors", type=int, default=1, help="engines (one GPU each on CUDA)")
    b.add_argument("--decode-cpus", type=int, default=1, help="CPU threads per decode actor (CPU decoding)")
    b.add_argument("--geometry-actors", type=int, default=1, help="most CPU actors for marching cubes")
    b.add_argument("--max-objects", type=int, default=8, help="objects decoding together per actor")
    b.add_argument("--batch-size", type=int, default=16, help="rows per decode task")
    b.add_argument("--preview", action="store_true", help="also write <id>.png")
    b.add_argument("--retry-failed", action="store_true", help="run the rows an earlier run failed again")
    b.add_argument("--no-progress", action="store_true")
    b.add_argument("--seed", type=int, default=0, help="for rows without one (as every option below)")
    b.add_argument("--guidance", type=float, default=3.0)
    b.add_argument("--top-p", type=float, default=None)
    b.add_argument("--temperature", type=float, default=None)
    b.add_argument("--resolution", type=int, default=8)
    b.add_argument("--format", choices=["glb", "obj"], default="glb")
    b.set_defaults(func=cmd_batch)

    i = sub.add_parser("info", help="sizes of a config, from the model built on the meta device")
    i.add_argument("--config", default="v0.1")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_info)

    w = sub.add_parser("weights", help="weights directories")
    wsub = w.add_subparsers(dest="weights_command", required=True)
    wi = wsub.add_parser("init", help="write deterministic random weights in the reference naming")
    wi.add_argument("--config", default="tiny")
    wi.add_argument("--seed", type=int, default=0)
    wi.add_argument("--out", required=True)
    wi.set_defaults(func=cmd_weights_init)
    wc = wsub.add_parser("check", help="validate a weights directory without loading it")
    wc.add_argument("weights")
    wc.set_defaults(func=cmd_weights_check)

    s = sub.add_parser("serve", help="run the local Triton server on 127.0.0.1 with triton_models/")
    s.add_argument("--model-repository")
    s.add_argument("--http-port", type=int, default=deploy.HTTP_PORT)
    s.add_argument("--grpc-port", type=int, default=deploy.GRPC_PORT)
    s.add_argument("--metrics-port", type=int, default=deploy.METRICS_PORT)
    s.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for readiness")
    s.set_defaults(func=cmd_serve)

    d = sub.add_parser("demo", help="local Triton server + client: prompt -> outputs/demo.glb and .png")
    d.add_argument("--prompt", default="a round table")
    d.add_argument("--out", default="outputs/demo.glb")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--resolution", type=int, default=6)
    d.set_defaults(func=cmd_demo)

    gw = sub.add_parser("gateway", help="Envoy on 127.0.0.1 in front of predict-API servers: API keys, "
                                        "per-tenant quotas in shape tokens, balancing (docs/gateway/index.md)")
    gw.add_argument("--config", help="the gateway file (examples/gateway.yaml)")
    gw.add_argument("--check", action="store_true", help="render and validate with Envoy, do not run")
    gw.add_argument("--new-key", action="store_true", help="print a new random API key for a tenant")
    gw.add_argument("--concurrency", type=int, default=2, help="Envoy worker threads")
    gw.set_defaults(func=cmd_gateway)

    u = sub.add_parser("usage", help="per-tenant usage (requests, objects, shape tokens, engine seconds) "
                                     "from Prometheus")
    u.add_argument("--prometheus", required=True, help="Prometheus URL, e.g. http://127.0.0.1:9090")
    u.add_argument("--since", default="24h", help="window, a Prometheus duration (24h, 7d)")
    u.add_argument("--csv", action="store_true", help="CSV instead of a table")
    u.set_defaults(func=cmd_usage)

    t = sub.add_parser("train", help="train the demo model on procedural shapes (CPU, minutes)")
    t.add_argument("stage", choices=["tokenizer", "gpt", "all"],
                   help="tokenizer, then gpt (exports the checkpoint); all = both + evaluation + model card")
    t.add_argument("--config", default="demo")
    t.add_argument("--work-dir", default="outputs/demo-train",
                   help="dataset cache, tiny CLIP and resumable training states")
    t.add_argument("--out", default="outputs/demo-model", help="checkpoint directory written by gpt / all")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--shapes", type=int, default=None, help="training shapes (default: the recipe's)")
    t.add_argument("--tokenizer-steps", type=int)
    t.add_argument("--gpt-steps", type=int)
    t.add_argument("--eval-shapes", type=int, default=45, help="held-out shapes scored for the card (all)")
    t.add_argument("--no-progress", action="store_true")
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("evaluate", help="held-out IoU / Chamfer of a checkpoint against procedural shapes")
    e.add_argument("weights")
    e.add_argument("--shapes", type=int, default=45)
    e.add_argument("--resolution", type=int, default=6)
    e.add_argument("--device", default="cpu")
    e.add_argument("--json", action="store_true")
    e.set_defaults(func=cmd_evaluate)

    from cubeserve.rollout import add_rollout_parser

    add_rollout_parser(sub)  # canary / promote / rollback / ab on KServe (k8s/)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from cubeserve.checkpoint import CheckpointError

    try:
        return args.func(args)
    except (CheckpointError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
