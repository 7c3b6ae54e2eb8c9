"""The shape tokenizer (a 1-D VQ-VAE over surface points), with the reference's names.

tokens -> codebook lookup -> latent decoder -> latents; (points, latents) -> occupancy
logits. The encoder (surface points with normals -> tokens) is here too, for strict
loading and for turning meshes back into tokens in evaluations.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from cubeserve.config import TokenizerConfig
from cubeserve.model.layers import (
    GeluMLP, RMSNorm, attention, layer_norm, linear, merge_heads, split_heads,
)


class PointEmbedder(nn.Module):
    """Phase-modulated Fourier features: [x, cos(xW) + cos(x*pi/2 + carrier), sin(...) + sin(...)]."""

    def __init__(self, num_freqs: int):
        super().__init__()
        self.num_freqs = num_freqs
        self.weight = nn.Parameter(torch.randn(3, num_freqs))
        self.out_dim = 3 + 2 * 3 * num_freqs

    def carrier(self, device) -> torch.Tensor:
        # Fixed, not in the checkpoint: computed on use so meta-device construction is harmless.
        n = self.num_freqs
        lin = torch.linspace(0, 1, n, device=device)
        return ((n / 8) ** torch.linspace(1, 0, n, device=device) + lin) * 2 * math.pi

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.float().unsqueeze(-1)  # [..., 3, 1]
        fm = (m * self.weight.float()).flatten(-2)  # coordinate-major [..., 3*F]
        pm = (m * (0.5 * math.pi) + self.carrier(x.device)).flatten(-2)
        return torch.cat([x.float(), fm.cos() + pm.cos(), fm.sin() + pm.sin()], dim=-1)


class MLPEmbedder(nn.Module):
    def __init__(self, in_dim: int, width: int):
        super().__init__()
        self.in_layer = nn.Linear(in_dim, width)
        self.out_layer = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(self.out_layer, torch.nn.functional.silu(linear(self.in_layer, x)))


class SelfAttention(nn.Module):
    def __init__(self, width: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.c_qk = nn.Linear(width, 2 * width)
        self.c_v = nn.Linear(width, width)
        self.c_proj = nn.Linear(width, width)
        self.q_norm = RMSNorm(width // num_heads)
        self.k_norm = RMSNorm(width // num_heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = linear(self.c_qk, x).chunk(2, dim=-1)
        q = self.q_norm(split_heads(q, self.num_heads))
        k = self.k_norm(split_heads(k, self.num_heads))
        v = split_heads(linear(self.c_v, x), self.num_heads)
        return linear(self.c_proj, merge_heads(attention(q, k, v)))


class CrossAttention(nn.Module):
    def __init__(self, width: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.c_q = nn.Linear(width, width)
        self.c_k = nn.Linear(width, width)
        self.c_v = nn.Linear(width, width)
        self.c_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        q = split_heads(linear(self.c_q, x), self.num_heads)
        k = split_heads(linear(self.c_k, ctx), self.num_heads)
        v = split_heads(linear(self.c_v, ctx), self.num_heads)
        return linear(self.c_proj, merge_heads(attention(q, k, v)))


class SelfAttentionLayer(nn.Module):
    """Pre-LN (no affine) bidirectional self-attention + GELU MLP; no RoPE, no mask."""

    def __init__(self, width: int, num_heads: int, eps: float):
        super().__init__()
        self.eps = eps
        self.attn = SelfAttention(width, num_heads)
        self.mlp = GeluMLP(width, 4 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(layer_norm(x, self.eps))
        return x + self.mlp(layer_norm(x, self.eps))


class CrossAttentionLayer(nn.Module):
    """x += attn(LN(x), LN(ctx)); x += MLP(LN(x))."""

    def __init__(self, width: int, num_heads: int, eps: float):
        super().__init__()
        self.eps = eps
        self.attn = CrossAttention(width, num_heads)
        self.mlp = GeluMLP(width, 4 * width)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(layer_norm(x, self.eps), layer_norm(ctx, self.eps))
        return x + self.mlp(layer_norm(x, self.eps))


class Encoder(nn.Module):
    def __init__(self, cfg: TokenizerConfig, embedder: PointEmbedder):
        super().__init__()
        self.embedder = embedder  # shared with the occupancy decoder (one tensor on disk)
        self.cls = 1 if cfg.encoder_with_cls_token else 0
        self.query = nn.Parameter(torch.empty(self.cls + cfg.num_encoder_latents, cfg.width).uniform_(-1, 1))
        in_dim = embedder.out_dim * 2 if cfg.embed_point_feats else embedder.out_dim + cfg.point_feats
        self.embed_point_feats = cfg.embed_point_feats
        self.feat_in = MLPEmbedder(in_dim, cfg.width)
        self.blocks = nn.ModuleList(
            CrossAttentionLayer(cfg.width, cfg.num_heads, cfg.eps)
            if i in cfg.encoder_cross_attention_levels
            else SelfAttentionLayer(cfg.width, cfg.num_heads, cfg.eps)
            for i in range(cfg.num_encoder_layers)
        )
        self.ln_f = nn.LayerNorm(cfg.width, eps=cfg.eps)

    def forward(self, points: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """points, feats (normals) [B, P, 3] -> latents [B, N, width] (class token dropped)."""
        data = self.embedder(points)
        feats = self.embedder(feats) if self.embed_point_feats else feats.float()
        data = self.feat_in(torch.cat([data, feats], dim=-1))
        h = self.query.float().unsqueeze(0).expand(points.shape[0], -1, -1)
        for block in self.blocks:
            h = block(h, data) if isinstance(block, CrossAttentionLayer) else block(h)
        h = torch.nn.functional.layer_norm(h.float(), (h.shape[-1],), self.ln_f.weight.float(),
                                           self.ln_f.bias.float(), self.ln_f.eps)
        return h[:, self.cls:]


class SphericalVQ(nn.Module):
    """`bottleneck.block`: codes live on the unit-RMS sphere after an affine map."""

    def __init__(self, cfg: TokenizerConfig):
        super().__init__()
        self.codebook = nn.Embedding(cfg.num_codes, cfg.embed_dim)
        if cfg.width != cfg.embed_dim:
            self.c_in = nn.Linear(cfg.width, cfg.embed_dim)
            self.c_x = nn.Linear(cfg.width, cfg.embed_dim)  # stored by the reference, unused at inference
            self.c_out = nn.Linear(cfg.embed_dim, cfg.width)
        else:
            # As the reference: a width equal to the code dimension needs no projections, and
            # its checkpoints hold no c_in / c_x / c_out tensors.
            self.c_in = self.c_x = self.c_out = nn.Identity()
        # The reference's RMSNorm(elementwise_affine=False) still multiplies by its weight, a
        # frozen parameter (ones unless a checkpoint says otherwise): so does this one.
        self.norm = RMSNorm(cfg.embed_dim)
        self.norm.weight.requires_grad_(False)
        self.cb_weight = nn.Parameter(torch.ones(cfg.embed_dim))
        self.cb_bias = nn.Parameter(torch.zeros(cfg.embed_dim))

    def normalized_codebook(self) -> torch.Tensor:
        """RMSNorm(codebook * cb_weight + cb_bias) in fp32, times the norm's stored weight (also
        the GPT's wte rows)."""
        cb = self.codebook.weight.float() * self.cb_weight.float() + self.cb_bias.float()
        return self.norm(cb)

    def project_in(self, z: torch.Tensor) -> torch.Tensor:
        """c_in: encoder width -> code dimension (the identity where they are equal)."""
        return z if isinstance(self.c_in, nn.Identity) else linear(self.c_in, z)

    def project_out(self, z: torch.Tensor) -> torch.Tensor:
        """c_out: code dimension -> decoder width (the identity where they are equal)."""
        return z if isinstance(self.c_out, nn.Identity) else linear(self.c_out, z)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return self.project_out(self.normalized_codebook()[ids])

    def quantize(self, z: torch.Tensor) -> torch.Tensor:
        """Encoder latents [B, N, width] -> nearest code ids [B, N]."""
        z_e = self.norm(self.project_in(z.float()).float())
        codebook = self.normalized_codebook()
        d = torch.cdist(z_e.reshape(-1, z_e.shape[-1]), codebook)
        return d.argmin(dim=1).view(z.shape[:-1])


class Bottleneck(nn.Module):
    def __init__(self, cfg: TokenizerConfig):
        super().__init__()
        self.block = SphericalVQ(cfg)


class LatentDecoder(nn.Module):
    def __init__(self, cfg: TokenizerConfig):
        super().__init__()
        self.positional_encodings = nn.Parameter(torch.randn(cfg.num_encoder_latents, cfg.width))
        self.blocks = nn.ModuleList(
            SelfAttentionLayer(cfg.width, cfg.num_heads, cfg.eps) for _ in range(cfg.num_decoder_layers)
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = z.float() + self.positional_encodings[: z.shape[1]].float()
        for block in self.blocks:
            h = block(h)
        return h  # no final norm


class OccupancyDecoder(nn.Module):
    def __init__(self, cfg: TokenizerConfig, embedder: PointEmbedder):
        super().__init__()
        self.embedder = embedder
        self.query_in = MLPEmbedder(embedder.out_dim, cfg.width)
        self.attn_out = CrossAttentionLayer(cfg.width, cfg.num_heads, cfg.eps)
        self.ln_f = nn.LayerNorm(cfg.width, eps=cfg.eps)
        self.c_head = nn.Linear(cfg.width, cfg.out_dim)

    def forward(self, points: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        """points [B, P, 3], latents [B, N, width] -> occupancy logits [B, P] (fp32)."""
        x = self.query_in(self.embedder(points))
        x = self.attn_out(x, latents)
        x = torch.nn.functional.layer_norm(x.float(), (x.shape[-1],), self.ln_f.weight.float(),
                                           self.ln_f.bias.float(), self.ln_f.eps)
        return linear(self.c_head, x).float().squeeze(-1)


class ShapeTokenizer(nn.Module):
    def __init__(self, cfg: TokenizerConfig):
        super().__init__()
        self.cfg = cfg
        self.embedder = PointEmbedder(cfg.num_freqs)
        self.encoder = Encoder(cfg, self.embedder)
        self.bottleneck = Bottleneck(cfg)
        self.decoder = LatentDecoder(cfg)
        self.occupancy_decoder = OccupancyDecoder(cfg, self.embedder)

    @torch.no_grad()
    def decode_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """Shape token ids [B, N] -> latents [B, N, width]; ids are clamped to valid codes."""
        ids = ids.clamp(0, self.cfg.num_codes - 1)
        return self.decoder(self.bottleneck.block.lookup(ids))

    @torch.no_grad()
    def occupancy(self, points: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        return self.occupancy_decoder(points, latents)

    @torch.no_grad()
    def encode(self, points: torch.Tensor, normals: torch.Tensor) -> torch.Tensor:
        """Surface points and normals [B, P, 3] -> shape token ids [B, N]."""
        return self.bottleneck.block.quantize(self.encoder(points, normals))
