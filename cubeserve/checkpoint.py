"""Checkpoints: strict safetensors loading with clear errors, version detection, parameter
counts, and deterministic random weights in the reference's exact naming.

A weights directory is laid out as a user assembles the real model:

    shape_gpt.safetensors        the dual-stream GPT (reference tensor names)
    shape_tokenizer.safetensors  the shape tokenizer
    <name>.yaml                  the reference-format config (open_model.yaml or config.yaml)
    clip/                        a transformers CLIP text model with its tokenizer

Only safetensors are read: a pickle is never unpickled. Every file is validated (headers,
names, shapes, version) before any tensor is loaded, so a bad directory fails whole.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from cubeserve.config import ModelConfig, get_config, read_yaml, write_yaml
from cubeserve.model.gpt import DualStreamGPT, decode_parameter_count
from cubeserve.model.tokenizer import ShapeTokenizer

GPT_FILE = "shape_gpt.safetensors"
TOKENIZER_FILE = "shape_tokenizer.safetensors"
CLIP_DIR = "clip"
PICKLE_SUFFIXES = {".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".pyt"}
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


class CheckpointError(ValueError):
    """A weights directory that cannot be served; the message names the file and tensor."""


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor names, shapes and dtypes from a safetensors header (8-byte LE length, JSON)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path.name}: not a safetensors file (shorter than its header)")
        if head[:2] == b"PK" or head[:1] == b"\x80":
            raise CheckpointError(
                f"{path.name}: this is a pickled PyTorch file, not safetensors; pickles are never "
                "loaded (convert it with safetensors.torch.save_file)"
            )
        (n,) = struct.unpack("<Q", head)
        if n <= 0 or n > min(size - 8, 100 * 2**20):
            raise CheckpointError(f"{path.name}: not a safetensors file (bad header length {n})")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path.name}: not a safetensors file (header is not JSON: {exc})") from exc
    # A truncated file keeps a valid header; its tensor data runs past the end.
    end = max((meta["data_offsets"][1] for name, meta in header.items() if name != "__metadata__"), default=0)
    if 8 + n + end != size:
        raise CheckpointError(f"{path.name}: truncated or padded: its header describes {8 + n + end} bytes, "
                              f"the file has {size}")
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        if meta.get("dtype") not in _DTYPES:
            raise CheckpointError(f"{path.name}: tensor {name} has unsupported dtype {meta.get('dtype')}")
        out[name] = TensorInfo(tuple(meta["shape"]), meta["dtype"])
    return out


def build_models(cfg: ModelConfig, device: torch.device | str = "meta") -> tuple[DualStreamGPT, ShapeTokenizer]:
    with torch.device(device):
        return DualStreamGPT(cfg.gpt), ShapeTokenizer(cfg.tokenizer)


def expected_tensors(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """Names a checkpoint must hold: parameters with shared ones stored once (first name)."""
    return {name: tuple(p.shape) for name, p in module.named_parameters()}


def parameter_counts(cfg: ModelConfig, single_block_mode: str = "causal") -> dict[str, int]:
    gpt, tok = build_models(cfg, "meta")
    return {
        "gpt_parameters": sum(p.numel() for p in gpt.parameters()),
        "tokenizer_parameters": sum(p.numel() for p in tok.parameters()),
        "decode_parameters": decode_parameter_count(gpt, single_block_mode),
    }


def describe(cfg: ModelConfig) -> dict:
    """What `cubeserve info` prints: sizes computed from the model built on the meta device."""
    counts = parameter_counts(cfg)
    g = cfg.gpt
    kv_bytes_per_row = 2 * 2 * g.n_layer * g.n_embd * (cfg.cond_len + cfg.num_tokens)  # bf16 K+V
    kv_bytes_per_row += 2 * 2 * g.n_single_layer * g.n_embd * cfg.num_tokens
    return {
        "config": cfg.name,
        **counts,
        "decode_bytes_bf16": 2 * counts["decode_parameters"],
        "shape_tokens": cfg.num_tokens,
        "condition_tokens": cfg.cond_len,
        "dual_blocks": g.n_layer,
        "single_blocks": g.n_single_layer,
        "width": g.n_embd,
        "heads": g.n_head,
        "codebook_size": g.shape_model_vocab_size,
        "uses_bbox": g.use_bbox,
        "kv_cache_bytes_per_object_with_guidance_bf16": 2 * kv_bytes_per_row,
    }


def version_style(use_bbox: bool) -> str:
    """The version's name as the registry records it: v0.5 added the bounding-box token."""
    return "v0.5-style" if use_bbox else "v0.1-style"


def _detected_version(gpt_header: dict, tok_header: dict) -> str:
    bbox = "bbox_proj.weight" in gpt_header
    pe = tok_header.get("decoder.positional_encodings")
    n = pe.shape[0] if pe else "?"
    return f"{version_style(bbox)} ({'bbox_proj present' if bbox else 'no bbox_proj'}), {n} shape tokens"


def _config_summary(cfg: ModelConfig) -> str:
    return f"{version_style(cfg.gpt.use_bbox)} ({'use_bbox' if cfg.gpt.use_bbox else 'no bbox'}), {cfg.num_tokens} shape tokens"


def _check_tensors(file: str, header: dict[str, TensorInfo], expected: dict[str, tuple[int, ...]]) -> list[str]:
    problems = []
    missing = sorted(set(expected) - set(header))
    unexpected = sorted(set(header) - set(expected))
    if missing:
        problems.append(f"{file}: missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        problems.append(f"{file}: unexpected tensors {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    for name in sorted(set(expected) & set(header)):
        if tuple(header[name].shape) != expected[name]:
            problems.append(f"{file}: tensor {name} has shape {list(header[name].shape)}, expected {list(expected[name])}")
    return problems


def find_config_file(weights_dir: Path) -> Path | None:
    yamls = sorted(p for p in weights_dir.glob("*.y*ml") if p.suffix in (".yaml", ".yml"))
    if len(yamls) > 1:
        preferred = [p for p in yamls if p.name == "config.yaml"]
        if preferred:
            return preferred[0]
        raise CheckpointError(f"{weights_dir}: several YAML configs {[p.name for p in yamls]}; keep one")
    return yamls[0] if yamls else None


def validate_dir(weights_dir: str | Path, config: ModelConfig | str | None = None,
                 allowed_suffixes: Collection[str] | None = None) -> tuple[ModelConfig, dict, dict]:
    """Check a weights directory without loading any tensor; returns (config, headers...).
    With `allowed_suffixes`, a file with any other suffix is refused by name."""
    weights_dir = Path(weights_dir)
    if not weights_dir.is_dir():
        raise CheckpointError(f"{weights_dir}: not a directory")
    # Every file, clip/ included: a pickle anywhere fails the directory, whatever would read it.
    for p in sorted(q for q in weights_dir.rglob("*") if q.is_file()):
        rel = p.relative_to(weights_dir).as_posix()
        if p.suffix in PICKLE_SUFFIXES:
            hint = (f" (the CLIP text model is read from {CLIP_DIR}/model.safetensors: remove {rel})"
                    if rel.startswith(CLIP_DIR + "/") else "")
            raise CheckpointError(f"{rel}: pickled weights files are never loaded; use safetensors{hint}")
        if allowed_suffixes is not None and p.suffix not in allowed_suffixes:
            raise CheckpointError(f"{rel}: unexpected file; a checkpoint holds only safetensors, "
                                  f"configs and tokenizer files ({sorted(allowed_suffixes)})")
        if p.suffix == ".safetensors" and p.parent == weights_dir and p.name not in (GPT_FILE, TOKENIZER_FILE):
            raise CheckpointError(f"{p.name}: unexpected weights file; expected only {GPT_FILE} and {TOKENIZER_FILE}")
        if p.suffix == ".safetensors" and p.parent != weights_dir:
            try:
                read_safetensors_header(p)  # a pickle behind a .safetensors name, a truncated file
            except CheckpointError as exc:
                raise CheckpointError(f"{rel}: {str(exc).split(': ', 1)[-1]}") from None
    for name in (GPT_FILE, TOKENIZER_FILE):
        if not (weights_dir / name).is_file():
            raise CheckpointError(f"{name}: missing from {weights_dir}")
    gpt_header = read_safetensors_header(weights_dir / GPT_FILE)
    tok_header = read_safetensors_header(weights_dir / TOKENIZER_FILE)

    if isinstance(config, str):
        cfg = get_config(config)
    elif config is None:
        path = find_config_file(weights_dir)
        if path is None:
            raise CheckpointError(f"{weights_dir}: no YAML config (e.g. open_model.yaml) next to the weights")
        try:
            cfg = read_yaml(path)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from exc
    else:
        cfg = config

    has_bbox = "bbox_proj.weight" in gpt_header
    pe = tok_header.get("decoder.positional_encodings")
    if has_bbox != cfg.gpt.use_bbox or (pe is not None and pe.shape[0] != cfg.num_tokens):
        raise CheckpointError(
            f"version mismatch: the weights are {_detected_version(gpt_header, tok_header)} but the "
            f"config {cfg.name!r} is {_config_summary(cfg)}; use the config that came with these weights"
        )
    gpt, tok = build_models(cfg, "meta")
    problems = _check_tensors(GPT_FILE, gpt_header, expected_tensors(gpt))
    problems += _check_tensors(TOKENIZER_FILE, tok_header, expected_tensors(tok))
    if problems:
        raise CheckpointError("; ".join(problems))
    return cfg, gpt_header, tok_header


def _load_into(module: nn.Module, path: Path, device) -> None:
    from safetensors.torch import load_file

    state = {k: v.float() for k, v in load_file(str(path), device=str(device)).items()}
    result = module.load_state_dict(state, strict=False, assign=True)
    aliases = set(module.state_dict()) - set(expected_tensors(module)) - {
        n for n, _ in module.named_buffers()}
    left = set(result.missing_keys) - aliases
    if left or result.unexpected_keys:  # validate_dir makes this unreachable; keep loading strict
        raise CheckpointError(f"{path.name}: missing {sorted(left)}, unexpected {result.unexpected_keys}")


def load_models(weights_dir: str | Path, config: ModelConfig | str | None = None,
                device: torch.device | str = "cpu", allowed_suffixes: Collection[str] | None = None,
                ) -> tuple[ModelConfig, DualStreamGPT, ShapeTokenizer]:
    """Validated (`validate_dir`), strict load of both safetensors files in fp32, with the wte
    codebook overwrite."""
    weights_dir = Path(weights_dir)
    cfg, _, _ = validate_dir(weights_dir, config, allowed_suffixes)
    gpt, tok = build_models(cfg, "meta")
    _load_into(gpt, weights_dir / GPT_FILE, device)
    _load_into(tok, weights_dir / TOKENIZER_FILE, device)
    gpt.set_codebook_embeddings(tok.bottleneck.block.normalized_codebook())
    return cfg, gpt.eval(), tok.eval()


def load_tokenizer(weights_dir: str | Path, config: ModelConfig | str | None = None,
                   device: torch.device | str = "cpu") -> tuple[ModelConfig, ShapeTokenizer]:
    """The shape tokenizer alone (validated, strict, fp32): what turns tokens into meshes, for a
    process that never decodes (the batch pipeline's geometry stage) and so needs no GPT."""
    weights_dir = Path(weights_dir)
    cfg, _, _ = validate_dir(weights_dir, config)
    _, tok = build_models(cfg, "meta")
    _load_into(tok, weights_dir / TOKENIZER_FILE, device)
    return cfg, tok.eval()


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# -- deterministic random weights -------------------------------------------------------------

@torch.no_grad()
def init_random_models(cfg: ModelConfig, seed: int = 0, device: str | torch.device = "cpu"
                       ) -> tuple[DualStreamGPT, ShapeTokenizer]:
    """Random weights with the real structure, deterministic for a seed (and device). The
    occupancy decoder is nudged so that every token sequence decodes to a closed,
    token-dependent blob."""
    torch.manual_seed(seed)
    gpt, tok = build_models(cfg, device)
    for module in (gpt, tok):
        for name, p in module.named_parameters():
            if name.endswith("norm.weight") or name.endswith("ln_f.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif p.dim() >= 2:
                p.normal_(0.0, 0.02 if module is gpt else (1.0 / p.shape[-1]) ** 0.5)
    tok.embedder.weight.normal_(0.0, 1.0)  # low frequencies: a smooth field
    tok.bottleneck.block.codebook.weight.uniform_(-1.0, 1.0)
    tok.decoder.positional_encodings.normal_(0.0, 1.0)
    tok.encoder.query.uniform_(-1.0, 1.0)

    _shape_occupancy_as_blob(tok, seed)
    gpt.set_codebook_embeddings(tok.bottleneck.block.normalized_codebook())
    return gpt.eval(), tok.eval()


@torch.no_grad()
def _shape_occupancy_as_blob(tok: ShapeTokenizer, seed: int) -> None:
    """Random occupancy fields cross zero all over the box and give torn sheets. Route a radial
    term through six hidden units of `query_in` (SiLU(s*x) + SiLU(-s*x) grows with |x|) to one
    feature that `c_head` reads, and set the head's bias so the zero level sits near radius 0.6:
    the random weights then only perturb a ball, differently for each token sequence."""
    occ = tok.occupancy_decoder
    width = occ.c_head.weight.shape[1]
    steep = 3.0
    w_in = occ.query_in.in_layer.weight
    w_in[:6].zero_()
    for axis in range(3):  # the first 3 point-embedding features are the raw coordinates
        w_in[2 * axis, axis], w_in[2 * axis + 1, axis] = steep, -steep
    radial = torch.zeros(width, device=w_in.device)
    radial[0] = 1.0
    occ.query_in.out_layer.weight[:, :6] = -radial[:, None]
    occ.c_head.weight[0] += radial
    occ.c_head.bias.zero_()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, tok.cfg.num_codes, (4, tok.cfg.num_encoder_latents), generator=g)
    on_sphere = torch.nn.functional.normalize(torch.randn(64, 3, generator=g), dim=-1) * 0.6
    dev = w_in.device
    level = tok.occupancy(on_sphere.to(dev).expand(4, -1, -1), tok.decode_tokens(ids.to(dev))).mean()
    # Rounded: the last bits of a CPU product depend on the machine's instruction set (AVX2 or
    # AVX-512 kernels sum in other orders), and these weights must come out bit-identical on
    # every machine (the reference's token facts in tests/data/reference hold their sha256).
    occ.c_head.bias.fill_(-round(float(level), 4))


def write_random_weights(cfg: ModelConfig | str, out_dir: str | Path, seed: int = 0) -> Path:
    """`cubeserve weights init`: safetensors in the reference naming, config.yaml and a tiny CLIP."""
    from cubeserve.model.text import build_tiny_clip

    cfg = get_config(cfg) if isinstance(cfg, str) else cfg
    gpt, tok = init_random_models(cfg, seed)
    out = save_checkpoint(cfg, gpt, tok, out_dir)
    build_tiny_clip(out / CLIP_DIR, hidden_size=cfg.gpt.text_model_embed_dim, seed=seed,
                    max_length=cfg.text_max_length)
    return out


def save_checkpoint(cfg: ModelConfig, gpt: DualStreamGPT, tok: ShapeTokenizer, out_dir: str | Path) -> Path:
    """The two safetensors files (fp32, parameters only, the reference's names) and config.yaml."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for module, name in ((gpt, GPT_FILE), (tok, TOKENIZER_FILE)):
        state = {k: v.detach().float().contiguous() for k, v in module.named_parameters()}
        save_file(state, str(out / name), metadata={"format": "pt"})
    write_yaml(cfg, out / "config.yaml")
    return out
