"""Exploration: training the ShapeTokenizer on procedural shapes (functions, no CLI yet).

Status: NOT yet a working trainer. Measured on 2 CPU cores: 857 steps in 240 s reached a
held-out reconstruction IoU of 0.14 (target 0.85): the encoder output barely varies between
shapes, so the decoder learns an average blob (also without the VQ). Nothing imports this
module; it is kept as the starting point for the demo-model issue.

The model is the serving ShapeTokenizer unchanged, so its state dict is in the checkpoint
format. Only training adds things the inference path lacks:
* a straight-through VQ: `SphericalVQ.quantize` returns argmin ids (no gradient), so the
  forward here recomputes the same quantisation and passes the decoder's gradient to the
  encoder as if quantisation were the identity;
* codebook and commitment losses (VQ-VAE): codes move towards encoder outputs, encoder
  outputs stay near their codes;
* restarts of codes nobody used for a while (onto recent encoder outputs), against collapse.
Decoding trained tokens with `decode_tokens` gives exactly the latents the training forward
used, because both go through `c_out(normalized_codebook()[ids])`.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.nn.functional as F

from cubeserve.config import TINY, TokenizerConfig
from cubeserve.demo import metrics, shapes
from cubeserve.model.layers import linear, rms_norm_noaffine
from cubeserve.model.tokenizer import ShapeTokenizer

# A little wider than TINY's tokenizer: more latents and codes to describe a shape.
DEMO_TOKENIZER = dataclasses.replace(
    TINY.tokenizer, num_encoder_latents=64, embed_dim=16, width=128, num_heads=4, num_freqs=16,
    num_encoder_layers=3, encoder_cross_attention_levels=(0, 2), num_decoder_layers=3, num_codes=256,
)


@dataclasses.dataclass
class ShapeBatchData:
    """Precomputed tensors for a list of shapes (sampling the SDFs once, not every step)."""
    surface: torch.Tensor  # [S, P, 3]
    normals: torch.Tensor  # [S, P, 3]
    queries: torch.Tensor  # [S, Q, 3]
    labels: torch.Tensor  # [S, Q] float 0/1


def precompute(shape_list, n_surface: int = 2048, n_uniform: int = 2048, n_near: int = 2048, seed: int = 0):
    surf, nrm, qs, ls = [], [], [], []
    for i, s in enumerate(shape_list):
        p, n = shapes.surface_points(s, n_surface, seed=seed + 2 * i)
        q, occ = shapes.occupancy_samples(s, n_uniform, n_near, seed=seed + 2 * i + 1)
        surf.append(p), nrm.append(n), qs.append(q), ls.append(occ.float())
    return ShapeBatchData(torch.stack(surf), torch.stack(nrm), torch.stack(qs), torch.stack(ls))


def vq_straight_through(tok: ShapeTokenizer, z: torch.Tensor):
    """Encoder latents [B, N, W] -> (decoder input [B, N, W], ids [B, N], codebook loss,
    commitment loss). Same arithmetic as SphericalVQ.quantize + lookup."""
    vq = tok.bottleneck.block
    z_e = rms_norm_noaffine(linear(vq.c_in, z.float()).float(), eps=1e-5)
    codebook = vq.normalized_codebook()
    with torch.no_grad():
        ids = torch.cdist(z_e.reshape(-1, z_e.shape[-1]), codebook).argmin(1).view(z.shape[:-1])
    z_q = codebook[ids]
    codebook_loss = F.mse_loss(z_q, z_e.detach())
    commit_loss = F.mse_loss(z_e, z_q.detach())
    z_st = z_e + (z_q - z_e).detach()  # value z_q, gradient of the identity to z_e
    return linear(vq.c_out, z_st), ids, codebook_loss, commit_loss


def forward_loss(tok: ShapeTokenizer, surface, normals, queries, labels, commit_weight: float = 0.25):
    z = tok.encoder(surface, normals)
    x, ids, cb_loss, commit = vq_straight_through(tok, z)
    logits = tok.occupancy_decoder(queries, tok.decoder(x))
    bce = F.binary_cross_entropy_with_logits(logits, labels)
    parts = dict(bce=bce.item(), cb=cb_loss.item(), commit=commit.item())
    return bce + cb_loss + commit_weight * commit, parts, ids, z


@torch.no_grad()
def restart_dead_codes(tok: ShapeTokenizer, usage: torch.Tensor, z: torch.Tensor) -> int:
    """Codes unused since the last call are re-initialised from random encoder outputs.
    Works in the raw codebook's space by inverting the affine (cb_weight, cb_bias); the RMS
    normalisation makes the scale irrelevant."""
    vq = tok.bottleneck.block
    dead = (usage == 0).nonzero().flatten()
    if len(dead) == 0:
        return 0
    z_e = rms_norm_noaffine(linear(vq.c_in, z.float()), eps=1e-5).reshape(-1, vq.codebook.weight.shape[1])
    pick = z_e[torch.randint(len(z_e), (len(dead),))]
    vq.codebook.weight[dead] = (pick - vq.cb_bias) / vq.cb_weight.clamp_min(1e-3)
    return len(dead)


@torch.no_grad()
def reconstruction_iou(tok: ShapeTokenizer, shape_list, data: ShapeBatchData, resolution: int = 5) -> list[float]:
    """Tokenise each shape (encode -> ids -> decode_tokens, the serving path) and compare the
    decoded occupancy with the true one on the grid."""
    tok.eval()
    out = []
    for i, s in enumerate(shape_list):
        ids = tok.encode(data.surface[i: i + 1], data.normals[i: i + 1])
        latents = tok.decode_tokens(ids)
        out.append(metrics.field_iou(metrics.tokenizer_occupancy(tok, latents), s.occupancy, resolution))
    tok.train()
    return out


def train_tokenizer(cfg: TokenizerConfig = DEMO_TOKENIZER, n_train: int = 256, minutes: float = 3.0,
                    batch: int = 16, n_enc_points: int = 1024, n_queries: int = 2048, lr: float = 1e-3,
                    seed: int = 0, embed_scale: float = 1.0, log=print):
    torch.manual_seed(seed)
    t0 = time.time()
    train_shapes = shapes.sample_shapes(n_train, seed=seed)
    held = shapes.heldout_shapes(seed, n=18)
    train_data = precompute(train_shapes, seed=seed)
    held_data = precompute(held, seed=seed + 10_000)
    log(f"data: {n_train} train + {len(held)} held-out shapes in {time.time() - t0:.1f}s")

    tok = ShapeTokenizer(cfg)
    with torch.no_grad():
        # The Fourier weights start N(0, 1): frequencies so low that, at first, every shape's
        # encoding is nearly the same and the decoder learns a mean shape. A scale of ~4 made the
        # encoder's outputs differ between shapes after ~200 steps in a quick probe (1 did not in 600).
        tok.embedder.weight.mul_(embed_scale)
    # PyTorch's default initialisation (the random-weights helper is tuned to draw blobs).
    opt = torch.optim.AdamW(tok.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    usage = torch.zeros(cfg.num_codes)
    t1, step, deadline = time.time(), 0, time.time() + minutes * 60
    while time.time() < deadline:
        idx = torch.randint(n_train, (batch,), generator=g)
        sp = torch.randint(train_data.surface.shape[1], (n_enc_points,), generator=g)
        qp = torch.randint(train_data.queries.shape[1], (n_queries,), generator=g)
        loss, parts, ids, z = forward_loss(tok, train_data.surface[idx][:, sp], train_data.normals[idx][:, sp],
                                           train_data.queries[idx][:, qp], train_data.labels[idx][:, qp])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        usage += torch.bincount(ids.flatten(), minlength=cfg.num_codes).float()
        step += 1
        if step % 100 == 0:
            restarted = restart_dead_codes(tok, usage, z)
            used = int((usage > 0).sum())
            usage.zero_()
            log(f"step {step} {time.time() - t1:.0f}s loss {loss.item():.4f} {parts} "
                f"codes used {used} restarted {restarted}")
    train_time = time.time() - t1
    ious = reconstruction_iou(tok, held, held_data)
    train_ious = reconstruction_iou(tok, train_shapes[:18], train_data)
    log(f"trained {step} steps in {train_time:.0f}s; held-out recon IoU mean {sum(ious) / len(ious):.3f} "
        f"(min {min(ious):.3f}); train recon IoU mean {sum(train_ious) / len(train_ious):.3f}")
    per_class = {}
    for s, v in zip(held, ious):
        per_class.setdefault(s.name, []).append(v)
    log("held-out per class: " + ", ".join(f"{k} {sum(v) / len(v):.2f}" for k, v in per_class.items()))
    return tok, ious
