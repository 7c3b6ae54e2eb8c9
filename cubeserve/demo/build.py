"""The demo model's whole recipe: shapes -> tokenizer -> GPT -> checkpoint -> evaluation -> card.

`cubeserve train tokenizer|gpt|all` and `make demo-model` call these. The work directory keeps
the sampled dataset, the tiny CLIP and both stages' resumable states; the output directory
is a checkpoint like a real one (two safetensors files, config.yaml, clip/) plus
MODEL_CARD.md and evaluation.json.
"""

from __future__ import annotations

import json
import platform
import shutil
import time
from dataclasses import asdict
from pathlib import Path

import torch

from cubeserve.checkpoint import CLIP_DIR, save_checkpoint
from cubeserve.config import DEMO, ModelConfig
from cubeserve.demo import train
from cubeserve.demo.evaluate import HELDOUT_SHAPES, Evaluation, evaluate_dir

TRAINING_SHAPES = 1536
CARD_FILE = "MODEL_CARD.md"
EVALUATION_FILE = "evaluation.json"


def text_encoder(cfg: ModelConfig, work_dir: Path, seed: int):
    """The frozen tiny CLIP the GPT is conditioned on, built once into the work directory."""
    from cubeserve.model.text import TextEncoder, build_tiny_clip

    clip_dir = Path(work_dir) / CLIP_DIR
    if not (clip_dir / "config.json").is_file():
        build_tiny_clip(clip_dir, hidden_size=cfg.gpt.text_model_embed_dim, seed=seed,
                        max_length=cfg.text_max_length)
    return TextEncoder(clip_dir)


def run_tokenizer_stage(work_dir: Path, cfg: ModelConfig = DEMO, seed: int = 0, n_shapes: int = TRAINING_SHAPES,
                        settings: train.TokenizerTraining = train.TokenizerTraining(), show_progress: bool = True):
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    data = train.load_dataset(work_dir, n_shapes, seed, show_progress)
    return train.train_tokenizer(cfg, data, work_dir, settings, seed=seed, show_progress=show_progress)


def load_trained_tokenizer(work_dir: Path, cfg: ModelConfig = DEMO):
    state_path = Path(work_dir) / train.TOKENIZER_STATE
    if not state_path.is_file():
        raise FileNotFoundError(f"{state_path}: no tokenizer state; run `cubeserve train tokenizer` first")
    tok = train.ShapeTokenizer(cfg.tokenizer)
    tok.load_state_dict(torch.load(state_path, weights_only=True)["model"])
    return tok.eval()


def run_gpt_stage(work_dir: Path, cfg: ModelConfig = DEMO, seed: int = 0, n_shapes: int = TRAINING_SHAPES,
                  settings: train.GPTTraining = train.GPTTraining(), show_progress: bool = True):
    work_dir = Path(work_dir)
    tok = load_trained_tokenizer(work_dir, cfg)
    data = train.load_dataset(work_dir, n_shapes, seed, show_progress)
    return tok, train.train_gpt(cfg, tok, text_encoder(cfg, work_dir, seed), data, work_dir, settings,
                                seed=seed, show_progress=show_progress)


def export(work_dir: Path, out_dir: Path, cfg: ModelConfig, gpt, tok) -> Path:
    out_dir = Path(out_dir)
    save_checkpoint(cfg, gpt, tok, out_dir)
    if (out_dir / CLIP_DIR).exists():
        shutil.rmtree(out_dir / CLIP_DIR)
    shutil.copytree(Path(work_dir) / CLIP_DIR, out_dir / CLIP_DIR)
    return out_dir


def write_card(out_dir: Path, cfg: ModelConfig, evaluation: Evaluation, record: dict) -> None:
    """MODEL_CARD.md (how the model was made, what it scores) and evaluation.json."""
    out_dir = Path(out_dir)
    (out_dir / EVALUATION_FILE).write_text(json.dumps(dict(evaluation.to_dict(), training=record), indent=2))
    t, g = cfg.tokenizer, cfg.gpt
    s = evaluation.summary
    card = f"""# cube-serve demo model

A tiny Cube 3D-architecture model trained from scratch on procedural shapes (spheres, boxes,
cylinders, cones, tori, capsules, tables, mugs, chairs) by `cubeserve train all` (`make demo-model`).
Same module classes, tensor names and file layout as the real checkpoints: it loads, validates
and serves exactly like one. It knows only these shapes and only prompts worded like the
training prompts ("a small ball", "a tall thin cylinder", "a round coffee table", ...).

## Architecture
- Shape tokenizer: {t.num_encoder_latents} tokens, {t.num_codes} codes of dim {t.embed_dim}, width {t.width},
  {t.num_encoder_layers} encoder layers (cross-attention at {list(t.encoder_cross_attention_levels)}),
  {t.num_decoder_layers} decoder layers, {t.num_freqs} Fourier frequencies.
- GPT: {g.n_layer} dual-stream blocks + {g.n_single_layer} single, width {g.n_embd}, {g.n_head} heads;
  conditioned on a frozen tiny CLIP text model (byte-level, hidden {g.text_model_embed_dim}, random weights, seed
  {record['seed']}).

## Training
{record['training_shapes']} shapes (`cubeserve.demo.shapes.sample_shapes(seed={record['seed']})`).
Tokenizer: {record['tokenizer']['steps']} steps, batch {record['tokenizer']['batch']}; GPT: {record['gpt']['steps']}
steps, batch {record['gpt']['batch']}. Wall time on {record['machine']}: dataset {record['seconds']['dataset']:.0f} s,
tokenizer {record['seconds']['tokenizer']:.0f} s, GPT {record['seconds']['gpt']:.0f} s.
Settings: `{json.dumps({'tokenizer': record['tokenizer'], 'gpt': record['gpt']})}`

## Evaluation
{len(evaluation.scores)} held-out shapes (`heldout_shapes(0)`: parameter draws training never sees; the
same prompt vocabulary), greedy decoding with guidance 3.0, meshes and IoU grids at resolution
{evaluation.resolution}. Generation IoU: the generated mesh against the shape its prompt was written
from. Reconstruction IoU: the shape's surface points through the tokenizer alone. Chamfer:
mean nearest-surface distance both ways (grid box [-1.05, 1.05]^3).

{evaluation.markdown_table()}

Targets: mean generation IoU >= 0.7, reconstruction IoU >= 0.85
({'met' if s['generation_iou'] >= 0.7 and s['reconstruction_iou'] >= 0.85 else 'NOT met'}).
"""
    (out_dir / CARD_FILE).write_text(card)


def build_demo_model(work_dir: Path, out_dir: Path, cfg: ModelConfig = DEMO, seed: int = 0,
                     n_shapes: int = TRAINING_SHAPES,
                     tokenizer_settings: train.TokenizerTraining = train.TokenizerTraining(),
                     gpt_settings: train.GPTTraining = train.GPTTraining(), show_progress: bool = True,
                     eval_shapes: int = HELDOUT_SHAPES, log=print) -> Evaluation:
    torch.set_num_threads(max(1, torch.get_num_threads()))
    seconds = {}
    t0 = time.perf_counter()
    train.load_dataset(Path(work_dir), n_shapes, seed, show_progress)
    seconds["dataset"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    run_tokenizer_stage(work_dir, cfg, seed, n_shapes, tokenizer_settings, show_progress)
    seconds["tokenizer"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    tok, gpt = run_gpt_stage(work_dir, cfg, seed, n_shapes, gpt_settings, show_progress)
    seconds["gpt"] = time.perf_counter() - t0
    export(work_dir, out_dir, cfg, gpt, tok)
    evaluation = evaluate_dir(out_dir, n=eval_shapes)
    record = dict(seed=seed, training_shapes=n_shapes, tokenizer=asdict(tokenizer_settings), gpt=asdict(gpt_settings),
                  seconds=seconds, machine=f"{platform.processor() or platform.machine()}, "
                                            f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    write_card(out_dir, cfg, evaluation, record)
    log(evaluation.markdown_table())
    return evaluation
