"""Model configurations: the published Cube 3D versions, small test configs, and the
reference-format YAML reader/writer.

Field names follow the reference YAML (`gpt_model:` / `shape_model:` sections) so that a
user's `open_model.yaml` reads directly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import yaml

# Quantization of the GPT's products (engine/fast_paths.py): weight-only int8/int4, and fp8
# (e4m3 weights and activations, per-row scales): torch-free here so the CLI and the serving
# config can name the choices without importing the engine.
QUANTIZATIONS = ("none", "int8", "int4", "fp8")

# Window (Jacobi) decoding (engine/window.py): positions one decode forward runs per object, a
# version's own engine setting `decode_window` (its version.json); 1 is one token per forward.
DECODE_WINDOW_SETTING = "decode_window"
DECODE_WINDOWS = range(1, 65)


def check_decode_window(value) -> int:
    """`value` if it is an allowed decode window, else ValueError naming the setting and the range."""
    if isinstance(value, bool) or not isinstance(value, int) or value not in DECODE_WINDOWS:
        raise ValueError(f"{DECODE_WINDOW_SETTING}: must be an integer in {DECODE_WINDOWS.start}.."
                         f"{DECODE_WINDOWS.stop - 1} (1 = off, one token per forward), got {value!r}")
    return value


def decode_window_of(settings: dict) -> int:
    """A version's decode window from its packaged settings (version.json); 1 where unset."""
    return check_decode_window(settings.get(DECODE_WINDOW_SETTING, 1))


@dataclass(frozen=True)
class GPTConfig:
    """The dual-stream decoder (`gpt_model` section)."""

    n_layer: int = 23  # dual-stream blocks; the last one has no condition query
    n_single_layer: int = 1
    n_head: int = 12
    n_embd: int = 1536
    bias: bool = True
    eps: float = 1e-6
    # Not stored in the checkpoint; the reference dataclass defaults to 1000, which is wrong.
    rope_theta: float = 10000.0
    shape_model_vocab_size: int = 16384
    shape_model_embed_dim: int = 32
    text_model_embed_dim: int = 768
    encoder_with_cls_token: bool = True
    use_bbox: bool = False

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def vocab_size(self) -> int:  # codes + BOS, EOS, PAD
        return self.shape_model_vocab_size + 3

    @property
    def bos_id(self) -> int:
        return self.shape_model_vocab_size

    @property
    def eos_id(self) -> int:
        return self.shape_model_vocab_size + 1

    @property
    def pad_id(self) -> int:
        return self.shape_model_vocab_size + 2


@dataclass(frozen=True)
class TokenizerConfig:
    """The shape tokenizer (`shape_model` section)."""

    num_encoder_latents: int = 512  # N, the number of shape tokens per object
    embed_dim: int = 32  # VQ code dimension
    width: int = 768
    num_heads: int = 12
    out_dim: int = 1
    eps: float = 1e-6
    num_freqs: int = 128
    point_feats: int = 3  # surface normals
    embed_point_feats: bool = False
    num_encoder_layers: int = 13
    encoder_cross_attention_levels: tuple[int, ...] = (0, 2, 4, 8)
    num_decoder_layers: int = 24
    encoder_with_cls_token: bool = True
    num_codes: int = 16384


@dataclass(frozen=True)
class ModelConfig:
    name: str
    gpt: GPTConfig
    tokenizer: TokenizerConfig
    text_model: str = "openai/clip-vit-large-patch14"
    text_max_length: int = 77

    @property
    def num_tokens(self) -> int:
        return self.tokenizer.num_encoder_latents

    @property
    def cond_len(self) -> int:
        """Condition tokens: CLIP positions, plus one bounding-box token where the model has one."""
        return self.text_max_length + (1 if self.gpt.use_bbox else 0)

    def __post_init__(self) -> None:
        g, t = self.gpt, self.tokenizer
        problems = []
        if g.n_embd % g.n_head:
            problems.append(f"gpt_model.n_embd {g.n_embd} is not a multiple of n_head {g.n_head}")
        if g.head_dim % 2:
            problems.append("gpt_model head_dim must be even (RoPE pairs)")
        if t.width % t.num_heads:
            problems.append(f"shape_model.width {t.width} is not a multiple of num_heads {t.num_heads}")
        if g.shape_model_vocab_size != t.num_codes:
            problems.append(
                f"gpt_model.shape_model_vocab_size {g.shape_model_vocab_size} != shape_model.num_codes {t.num_codes}"
            )
        if g.shape_model_embed_dim != t.embed_dim:
            problems.append(
                f"gpt_model.shape_model_embed_dim {g.shape_model_embed_dim} != shape_model.embed_dim {t.embed_dim}"
            )
        if g.n_layer < 1:
            problems.append("gpt_model.n_layer must be at least 1")
        if any(not 0 <= lvl < t.num_encoder_layers for lvl in t.encoder_cross_attention_levels):
            problems.append("shape_model.encoder_cross_attention_levels must index encoder layers")
        if problems:
            raise ValueError(f"invalid config {self.name!r}: " + "; ".join(problems))


V0_1 = ModelConfig(name="v0.1", gpt=GPTConfig(), tokenizer=TokenizerConfig())
V0_5 = ModelConfig(
    name="v0.5",
    gpt=GPTConfig(use_bbox=True),
    tokenizer=TokenizerConfig(num_encoder_latents=1024),
)

# Small enough for a test suite on two CPU cores, yet every code path of the real model:
# several ordinary dual blocks plus the last (query-less condition) one, a single block,
# cross- and self-attention encoder layers, a codebook smaller than the GPT width.
_TINY_GPT = GPTConfig(
    n_layer=3, n_single_layer=1, n_head=2, n_embd=64,
    shape_model_vocab_size=64, shape_model_embed_dim=8, text_model_embed_dim=32,
)
_TINY_TOKENIZER = TokenizerConfig(
    num_encoder_latents=32, embed_dim=8, width=64, num_heads=2, num_freqs=8,
    num_encoder_layers=3, encoder_cross_attention_levels=(0, 2), num_decoder_layers=2,
    num_codes=64,
)
TINY = ModelConfig(name="tiny", gpt=_TINY_GPT, tokenizer=_TINY_TOKENIZER, text_model="clip")
TINY_BBOX = ModelConfig(
    name="tiny-bbox",
    gpt=dataclasses.replace(_TINY_GPT, use_bbox=True),
    tokenizer=dataclasses.replace(_TINY_TOKENIZER, num_encoder_latents=48),
    text_model="clip",
)
# The CPU benchmark shape named in the speed issue (width 512, 6 dual layers, 8 heads).
BENCH_MID = ModelConfig(
    name="mid",
    gpt=GPTConfig(n_layer=6, n_single_layer=1, n_head=8, n_embd=512, text_model_embed_dim=32),
    tokenizer=dataclasses.replace(_TINY_TOKENIZER, num_encoder_latents=512, num_codes=16384,
                                  embed_dim=32),
    text_model="clip",
)

# The demo model trained on procedural shapes (`cubeserve train`, cubeserve/demo): small enough
# to train on two CPU cores in under 30 minutes, large enough to tell a mug from a chair.
DEMO = ModelConfig(
    name="demo",
    gpt=GPTConfig(n_layer=3, n_single_layer=1, n_head=4, n_embd=96,
                  shape_model_vocab_size=512, shape_model_embed_dim=16, text_model_embed_dim=64),
    tokenizer=TokenizerConfig(
        num_encoder_latents=32, embed_dim=16, width=64, num_heads=2, num_freqs=16,
        num_encoder_layers=3, encoder_cross_attention_levels=(0, 2), num_decoder_layers=3,
        num_codes=512,
    ),
    text_model="clip",
)

PRESETS: dict[str, ModelConfig] = {c.name: c for c in (V0_1, V0_5, TINY, TINY_BBOX, BENCH_MID, DEMO)}


def get_config(name_or_path: str | Path) -> ModelConfig:
    """A preset by name (`v0.1`, `v0.5`, `tiny`, ...) or a reference-format YAML file."""
    if str(name_or_path) in PRESETS:
        return PRESETS[str(name_or_path)]
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return read_yaml(path)
    raise ValueError(
        f"unknown config {str(name_or_path)!r}: use one of {sorted(PRESETS)} or a path to a YAML file"
    )


def _from_section(cls, section: dict, where: str):
    known = {f.name for f in dataclasses.fields(cls)}
    values = {}
    for key, value in (section or {}).items():
        if key not in known:
            continue  # reference keys that do not change inference (checkpoint_path, ...)
        if isinstance(value, list):
            value = tuple(value)
        values[key] = value
    try:
        return cls(**values)
    except TypeError as exc:  # pragma: no cover - dataclass init only fails on bad keys
        raise ValueError(f"{where}: {exc}") from exc


def read_yaml(path: str | Path) -> ModelConfig:
    """Read a config in the reference's YAML layout (`gpt_model`, `shape_model`, text model)."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"{path.name}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict) or "gpt_model" not in data or "shape_model" not in data:
        raise ValueError(f"{path.name}: expected the sections 'gpt_model' and 'shape_model'")
    if (data["gpt_model"] or {}).get("use_pooled_text_embed"):
        # The reference's option to condition on CLIP's pooled embedding (one token): this
        # engine conditions on the hidden states only, so such a model would give wrong shapes.
        raise ValueError(f"{path.name}: gpt_model.use_pooled_text_embed: true is not supported")
    gpt = _from_section(GPTConfig, data["gpt_model"], f"{path.name}: gpt_model")
    tok = _from_section(TokenizerConfig, data["shape_model"], f"{path.name}: shape_model")
    # YAML 1.1 reads "1e-6" as a string; accept it as the reference's files spell it.
    gpt = dataclasses.replace(gpt, eps=float(gpt.eps), rope_theta=float(gpt.rope_theta))
    tok = dataclasses.replace(tok, eps=float(tok.eps))
    name = str(data.get("name", path.stem))
    text_model = str(data.get("text_model_pretrained_model_name_or_path", "openai/clip-vit-large-patch14"))
    return ModelConfig(name=name, gpt=gpt, tokenizer=tok, text_model=text_model)


def to_yaml_dict(cfg: ModelConfig) -> dict:
    def section(obj):
        out = dataclasses.asdict(obj)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}

    return {
        "name": cfg.name,
        "gpt_model": section(cfg.gpt),
        "shape_model": section(cfg.tokenizer),
        "text_model_pretrained_model_name_or_path": cfg.text_model,
    }


def write_yaml(cfg: ModelConfig, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_yaml_dict(cfg), sort_keys=False))
