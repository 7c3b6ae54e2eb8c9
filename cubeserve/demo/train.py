"""Training the demo model: the shape tokenizer, then the dual-stream GPT on its tokens.

Both stages train the serving modules unchanged (`ShapeTokenizer`, `DualStreamGPT`), so their
state dicts are the reference checkpoint format and the result loads like a real checkpoint.
Training adds only what inference lacks:

* Tokenizer: a straight-through spherical VQ (`SphericalVQ.quantize` returns argmin ids; here
  the same quantisation passes the decoder's gradient to the encoder as if it were the
  identity), codebook and commitment losses, and restarts of codes nobody used for a while.
  The first `continuous_fraction` of the steps skip quantisation (the encoder and decoders
  learn shapes first), then the codebook starts from encoder outputs and VQ is on.
* GPT: teacher forcing over [condition ; BOS, t_0 .. t_{N-2}] -> t_0 .. t_{N-1}, shape-token
  embeddings computed as the loader overwrites them (`shape_proj` of the tokenizer's
  normalised codebook), the single block in the serving engine's mode, and the prompt
  replaced by "" for a fraction of the rows so that classifier-free guidance has an
  unconditional model to push away from.

Each stage is a fixed number of steps with a seeded generator, checkpointed (model,
optimiser, generator, step) every `save_every` steps into the work directory: a run that is
stopped resumes where it was and ends with the same weights as an uninterrupted one (on the
same machine and thread count: CPU summation order depends on both).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from cubeserve.config import ModelConfig
from cubeserve.demo import shapes
from cubeserve.demo.data import ShapeSet
from cubeserve.model.gpt import DualStreamGPT
from cubeserve.model.layers import linear, rms_norm_noaffine
from cubeserve.model.tokenizer import ShapeTokenizer

TOKENIZER_STATE = "tokenizer.state.pt"
GPT_STATE = "gpt.state.pt"
DATASET_FILE = "dataset.pt"
SINGLE_BLOCK_MODE = "reference"  # the serving default; the GPT learns under the mask it runs with


@dataclass(frozen=True)
class TokenizerTraining:
    steps: int = 5500
    batch: int = 16
    encoder_points: int = 512  # surface points the encoder reads per shape and step
    queries: int = 1024  # occupancy labels per shape and step
    lr: float = 1e-3
    warmup: int = 100
    continuous_fraction: float = 0.3
    commit_weight: float = 0.25
    restart_every: int = 100
    max_frequency: float = 16.0  # the point embedder's initial frequencies span 1 .. this
    save_every: int = 500


@dataclass(frozen=True)
class GPTTraining:
    steps: int = 2000
    batch: int = 16
    lr: float = 1e-3
    warmup: int = 100
    uncond_fraction: float = 0.1  # rows trained with the empty prompt (for guidance)
    save_every: int = 500


def _lr_at(step: int, total: int, base: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of the base rate."""
    if step < warmup:
        return base * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return base * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def recipe_key(*parts) -> str:
    """A digest of everything a training state depends on (config, settings, seed, data)."""
    text = json.dumps([asdict(p) if is_dataclass(p) else p for p in parts], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


class _Checkpointed:
    """Model + AdamW + generator + step, saved atomically and resumed from `path`; a state
    written for another recipe (`recipe_key`) is refused, never silently continued."""

    def __init__(self, path: Path, model: torch.nn.Module, lr: float, seed: int, recipe: str,
                 extra: dict | None = None):
        self.path = path
        self.model = model
        self.recipe = recipe
        self.opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        self.gen = torch.Generator().manual_seed(seed)
        self.step = 0
        self.extra = extra or {}
        if path.is_file():
            state = torch.load(path, weights_only=True)
            if state.get("recipe") != recipe:
                raise ValueError(f"{path}: a training state for another config, settings, seed or dataset; "
                                 "use another --work-dir or delete it to start over")
            model.load_state_dict(state["model"])
            self.opt.load_state_dict(state["opt"])
            self.gen.set_state(state["gen"])
            self.step = int(state["step"])
            self.extra.update(state["extra"])

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        torch.save(dict(model=self.model.state_dict(), opt=self.opt.state_dict(), gen=self.gen.get_state(),
                        step=self.step, extra=self.extra, recipe=self.recipe), tmp)
        tmp.replace(self.path)

    def set_lr(self, lr: float) -> None:
        for group in self.opt.param_groups:
            group["lr"] = lr


def _progress(total: int, initial: int, desc: str, enabled: bool):
    import sys

    from tqdm import tqdm

    # On a terminal the bar redraws in place; in a log file every redraw is a line: fewer there.
    interval = 0.1 if sys.stderr.isatty() else 30.0
    return tqdm(total=total, initial=initial, desc=desc, disable=not enabled, dynamic_ncols=True,
                mininterval=interval)


# -- dataset --------------------------------------------------------------------------------------

def training_shapes(n: int, seed: int) -> list[shapes.Shape]:
    return shapes.sample_shapes(n, seed=seed)


def load_dataset(work_dir: Path, n: int, seed: int, show_progress: bool = True) -> ShapeSet:
    shape_list = training_shapes(n, seed)
    with _progress(n, 0, "sampling shapes", show_progress) as bar:
        return ShapeSet.load_or_build(Path(work_dir) / DATASET_FILE, shape_list, seed, progress=bar.update)


# -- tokenizer ------------------------------------------------------------------------------------

def init_tokenizer(cfg: ModelConfig, seed: int, max_frequency: float, sharpness: float = 4.0) -> ShapeTokenizer:
    """PyTorch's default initialisation, except what decides how soon training gets going
    (measured on two CPU cores: held-out IoU after 3 minutes 0.46 -> 0.54 with the anchors):

    * the point embedder's frequencies spread from 1 to `max_frequency` radians per unit
      (N(0, 1) alone is too smooth for table legs);
    * each encoder query starts as the embedding of an anchor point in the box, and the first
      cross-attention compares queries and points through one projection (c_q = sharpness *
      c_k), so latent i starts as a pooling of the surface near anchor i. With learned
      queries that start random, every latent pools the whole surface alike, and the decoder
      sees the same summary 32 times.
    """
    torch.manual_seed(seed)
    tok = ShapeTokenizer(cfg.tokenizer)
    t = cfg.tokenizer
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        freqs = torch.logspace(0, math.log10(max_frequency), t.num_freqs)
        tok.embedder.weight.copy_(torch.randn(3, t.num_freqs, generator=g) * freqs)
        anchors = torch.rand(t.num_encoder_latents, 3, generator=g) * 1.6 - 0.8
        no_normals = torch.zeros(len(anchors), t.point_feats)
        queries = tok.encoder.feat_in(torch.cat([tok.embedder(anchors), no_normals], dim=-1))
        tok.encoder.query[tok.encoder.cls:] = queries
        tok.encoder.query[: tok.encoder.cls] = queries.mean(0)
        first = tok.encoder.blocks[0].attn
        first.c_q.weight.copy_(first.c_k.weight * sharpness)
        first.c_q.bias.copy_(first.c_k.bias * sharpness)
    return tok


def _quantize_straight_through(tok: ShapeTokenizer, z: torch.Tensor, quantize: bool):
    """Encoder latents -> (decoder input, ids or None, VQ loss terms). Same arithmetic as
    SphericalVQ.quantize + lookup, so decoding the ids at serving time gives these latents."""
    vq = tok.bottleneck.block
    z_e = rms_norm_noaffine(vq.project_in(z.float()), eps=1e-5)
    if not quantize:
        return vq.project_out(z_e), None, z_e.new_zeros(()), z_e.new_zeros(())
    codebook = vq.normalized_codebook()
    with torch.no_grad():
        ids = torch.cdist(z_e.reshape(-1, z_e.shape[-1]), codebook).argmin(1).view(z.shape[:-1])
    z_q = codebook[ids]
    codebook_loss = F.mse_loss(z_q, z_e.detach())
    commit_loss = F.mse_loss(z_e, z_q.detach())
    z_st = z_e + (z_q - z_e).detach()  # value z_q, gradient of the identity to z_e
    return vq.project_out(z_st), ids, codebook_loss, commit_loss


@torch.no_grad()
def _reseed_codes(tok: ShapeTokenizer, codes: torch.Tensor, z: torch.Tensor, gen: torch.Generator) -> None:
    """Point `codes` at random recent encoder outputs. Works in the raw codebook's space by
    inverting the affine (cb_weight, cb_bias); the RMS normalisation makes scale irrelevant."""
    vq = tok.bottleneck.block
    z_e = rms_norm_noaffine(vq.project_in(z.float()), eps=1e-5).reshape(-1, vq.codebook.weight.shape[1])
    pick = z_e[torch.randint(len(z_e), (len(codes),), generator=gen)]
    vq.codebook.weight[codes] = (pick - vq.cb_bias) / vq.cb_weight.clamp_min(1e-3)


def train_tokenizer(cfg: ModelConfig, data: ShapeSet, work_dir: Path, settings: TokenizerTraining = TokenizerTraining(),
                    seed: int = 0, show_progress: bool = True, log: Callable[[str], None] = print,
                    stop_at: int | None = None) -> ShapeTokenizer:
    """Train (or resume) to `settings.steps`; `stop_at` ends early as an interrupted run would."""
    s = settings
    tok = init_tokenizer(cfg, seed, s.max_frequency)
    num_codes = cfg.tokenizer.num_codes
    run = _Checkpointed(Path(work_dir) / TOKENIZER_STATE, tok, s.lr, seed,
                        recipe_key(cfg.tokenizer, s, seed, data.key), extra={"usage": torch.zeros(num_codes)})
    vq_start = int(s.continuous_fraction * s.steps)
    n_shapes, n_surface, n_queries = len(data), data.surface.shape[1], data.queries.shape[1]
    tok.train()
    with _progress(s.steps, run.step, "tokenizer", show_progress) as bar:
        while run.step < min(s.steps, stop_at or s.steps):
            g = run.gen
            idx = torch.randint(n_shapes, (s.batch,), generator=g)
            sp = torch.randint(n_surface, (s.encoder_points,), generator=g)
            qp = torch.randint(n_queries, (s.queries,), generator=g)
            quantize = run.step >= vq_start
            z = tok.encoder(data.surface[idx][:, sp], data.normals[idx][:, sp])
            if run.step == vq_start:  # the codebook starts where the encoder's outputs are
                _reseed_codes(tok, torch.arange(num_codes), z, g)
            x, ids, cb_loss, commit = _quantize_straight_through(tok, z, quantize)
            logits = tok.occupancy_decoder(data.queries[idx][:, qp], tok.decoder(x))
            bce = F.binary_cross_entropy_with_logits(logits, data.labels[idx][:, qp])
            loss = bce + cb_loss + s.commit_weight * commit
            run.set_lr(_lr_at(run.step, s.steps, s.lr, s.warmup))
            run.opt.zero_grad(set_to_none=True)
            loss.backward()
            run.opt.step()
            run.step += 1
            usage = run.extra["usage"]
            if ids is not None:
                usage += torch.bincount(ids.flatten(), minlength=num_codes).float()
                if (run.step - vq_start) % s.restart_every == 0:
                    dead = (usage == 0).nonzero().flatten()
                    if len(dead):
                        _reseed_codes(tok, dead, z, g)
                    bar.set_postfix(bce=f"{bce.item():.3f}", codes=int((usage > 0).sum()), refreshed=len(dead))
                    usage.zero_()
            elif run.step % 50 == 0:
                bar.set_postfix(bce=f"{bce.item():.3f}", vq="off")
            bar.update(1)
            if run.step % s.save_every == 0 or run.step in (s.steps, stop_at):
                run.save()
    log(f"tokenizer: step {run.step} of {s.steps}; state in {run.path}")
    return tok.eval()


# -- GPT ------------------------------------------------------------------------------------------

@torch.no_grad()
def tokenize_dataset(tok: ShapeTokenizer, data: ShapeSet, batch: int = 64) -> torch.Tensor:
    """Every shape's token ids [S, N] through the serving path (`ShapeTokenizer.encode`) from
    all of its surface points."""
    tok.eval()
    return torch.cat([tok.encode(data.surface[i: i + batch], data.normals[i: i + batch])
                      for i in range(0, len(data), batch)])


def shape_token_table(gpt: DualStreamGPT, codebook: torch.Tensor) -> torch.Tensor:
    """The input embedding table as the loader builds it: rows 0..codes-1 = shape_proj of the
    tokenizer's normalised codebook (differentiable in shape_proj), then BOS, EOS, PAD."""
    return torch.cat([linear(gpt.shape_proj, codebook), gpt.transformer.wte.weight[codebook.shape[0]:]])


def gpt_loss(gpt: DualStreamGPT, codebook: torch.Tensor, text_hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of next-token prediction over the codes (the engine never samples BOS,
    EOS or PAD), teacher-forced."""
    cfg = gpt.cfg
    bos = torch.full((ids.shape[0], 1), cfg.bos_id, dtype=ids.dtype)
    inputs = F.embedding(torch.cat([bos, ids[:, :-1]], dim=1), shape_token_table(gpt, codebook))
    logits = gpt(inputs, gpt.condition(text_hidden), SINGLE_BLOCK_MODE)[..., : cfg.shape_model_vocab_size]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1))


def init_gpt(cfg: ModelConfig, seed: int) -> DualStreamGPT:
    torch.manual_seed(seed)
    return DualStreamGPT(cfg.gpt)


def train_gpt(cfg: ModelConfig, tok: ShapeTokenizer, text_encoder, data: ShapeSet, work_dir: Path,
              settings: GPTTraining = GPTTraining(), seed: int = 0, show_progress: bool = True,
              log: Callable[[str], None] = print, stop_at: int | None = None) -> DualStreamGPT:
    """Train (or resume) to `settings.steps`; `stop_at` ends early as an interrupted run would."""
    s = settings
    ids = tokenize_dataset(tok, data)
    with torch.no_grad():
        codebook = tok.bottleneck.block.normalized_codebook()
    prompts = sorted(set(data.prompts))
    prompt_index = torch.tensor([prompts.index(p) for p in data.prompts])
    hidden = text_encoder(prompts + [""])  # the frozen text model runs once per distinct prompt
    uncond = len(prompts)
    log(f"gpt: {len(data)} shapes tokenised, {len(prompts)} distinct prompts, "
        f"{len(torch.unique(ids))} codes in use")

    gpt = init_gpt(cfg, seed)
    run = _Checkpointed(Path(work_dir) / GPT_STATE, gpt, s.lr, seed,
                        recipe_key(cfg.gpt, s, seed, data.key, ids.tolist()))
    gpt.train()
    with _progress(s.steps, run.step, "gpt", show_progress) as bar:
        while run.step < min(s.steps, stop_at or s.steps):
            g = run.gen
            idx = torch.randint(len(data), (s.batch,), generator=g)
            drop = torch.rand(s.batch, generator=g) < s.uncond_fraction
            rows = torch.where(drop, uncond, prompt_index[idx])
            loss = gpt_loss(gpt, codebook, hidden[rows], ids[idx])
            run.set_lr(_lr_at(run.step, s.steps, s.lr, s.warmup))
            run.opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(gpt.parameters(), 1.0)
            run.opt.step()
            run.step += 1
            if run.step % 20 == 0:
                bar.set_postfix(loss=f"{loss.item():.3f}")
            bar.update(1)
            if run.step % s.save_every == 0 or run.step in (s.steps, stop_at):
                run.save()
    log(f"gpt: step {run.step} of {s.steps}; state in {run.path}")
    gpt.eval()
    gpt.set_codebook_embeddings(codebook)  # what the loader writes; stored for a faithful file
    return gpt
