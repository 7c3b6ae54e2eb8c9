"""The numerics harness: how closely a numerics mode (a compute dtype, a weight quantization)
decodes like the float32 oracle on the same weights.

Per prompt, greedy (the oracle's path is then one sequence):
- teacher-forced top-1 agreement: fed the oracle's tokens, the share of positions where the
  mode's guided logits pick the oracle's next token (by position too: errors grow along the
  sequence as the cache fills);
- KL(oracle || mode) of the guided next-token distributions along that path (nats, mean over
  positions);
- first divergence: the first position where the mode's own free-running greedy decoding
  leaves the oracle's (N when it never does);
- the objects: volume IoU of the two occupancy fields on the engine's grid (each decoded by
  its own side's shape tokenizer) and the Chamfer distance between the two meshes.

A mode is an `Engine` (`EngineDecoder`), or anything with the `Decoder` shape: the benchmark
(bench/numerics.py) runs the reference's own bf16 autocast through it, the bar a mode meets.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from cubeserve.demo import metrics
from cubeserve.engine import geometry
from cubeserve.requests import GenerationRequest

# Prompts of the demo model's shape families (cubeserve/demo/shapes.py): on the demo model a
# mode is compared where its margins are those of a trained model.
PROMPTS = ("a ball", "a large cubic block", "a little tall thin cylinder", "a little tall pointy cone",
           "a big hoop", "a capsule", "a big dining table", "a large tall mug", "a low-backed chair",
           "a tube", "a donut", "a small tall pill", "a little coffee table", "a high-backed chair",
           "a drum", "a large coin")
RESOLUTION = 6  # grid for IoU and meshes: 65^3 samples


class Decoder(Protocol):
    """What the harness needs of a mode: greedy tokens and guided logits, optionally teacher
    forced, and the shape tokenizer that turns its tokens into objects."""

    tokenizer: torch.nn.Module

    def tokens_and_logits(self, requests: list[GenerationRequest],
                          force: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class EngineDecoder:
    engine: object  # cubeserve.engine.Engine

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def tokens_and_logits(self, requests, force=None):
        tokens, logits = self.engine.generate_tokens(requests, return_logits=True, force=force)
        return tokens.cpu(), logits.float().cpu()


@dataclass(frozen=True)
class PromptScore:
    prompt: str
    agreement: float  # teacher-forced top-1 agreement with the oracle's tokens
    kl: float  # mean KL(oracle || mode), nats per position
    first_divergence: int  # of free-running greedy decoding; N if none
    iou: float  # volume IoU of the two objects' occupancy
    chamfer: float  # between the two meshes (nan when either is empty)


@dataclass(frozen=True)
class Report:
    mode: str
    tokens: int  # N
    prompts: list[PromptScore]
    agreement_by_quarter: list[float]  # teacher-forced agreement over each quarter of the positions

    @property
    def agreement(self) -> float:
        return statistics.fmean(p.agreement for p in self.prompts)

    @property
    def kl(self) -> float:
        return statistics.fmean(p.kl for p in self.prompts)

    @property
    def first_divergence_median(self) -> float:
        return statistics.median(p.first_divergence for p in self.prompts)

    @property
    def identical(self) -> int:
        """Prompts whose free-running greedy tokens equal the oracle's."""
        return sum(p.first_divergence == self.tokens for p in self.prompts)

    @property
    def iou(self) -> float:
        return statistics.fmean(p.iou for p in self.prompts)

    @property
    def chamfer(self) -> float:
        values = [p.chamfer for p in self.prompts if p.chamfer == p.chamfer]
        return statistics.fmean(values) if values else float("nan")

    def summary(self) -> dict:
        return {"mode": self.mode, "prompts": len(self.prompts), "tokens": self.tokens,
                "agreement": self.agreement, "agreement_by_quarter": self.agreement_by_quarter,
                "kl": self.kl, "first_divergence_median": self.first_divergence_median,
                "identical": self.identical, "iou": self.iou, "chamfer": self.chamfer}

    def to_dict(self) -> dict:
        return {**self.summary(), "per_prompt": [dataclasses.asdict(p) for p in self.prompts]}


def requests_for(prompts=PROMPTS, guidance_scale: float = 3.0) -> list[GenerationRequest]:
    return [GenerationRequest(prompt=p, guidance_scale=guidance_scale) for p in prompts]


@dataclass
class Oracle:
    """The float32 oracle's greedy decoding of a prompt set, computed once for every mode."""

    requests: list[GenerationRequest]
    tokens: torch.Tensor  # [B, N]
    logits: torch.Tensor  # guided, [B, N, codes]
    tokenizer: torch.nn.Module
    resolution: int = RESOLUTION
    _objects: dict = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, decoder: Decoder, requests: list[GenerationRequest], resolution: int = RESOLUTION) -> "Oracle":
        tokens, logits = decoder.tokens_and_logits(requests)
        return cls(requests, tokens, logits, decoder.tokenizer, resolution)

    def object(self, i: int) -> tuple[torch.Tensor, geometry.Mesh]:
        if i not in self._objects:
            self._objects[i] = decode_object(self.tokenizer, self.tokens[i], self.resolution)
        return self._objects[i]


def decode_object(tokenizer, tokens: torch.Tensor, resolution: int) -> tuple[torch.Tensor, geometry.Mesh]:
    """One token sequence's occupancy on the engine's grid (bool, logit > 0: the sign marching
    cubes uses) and its mesh."""
    device = next(tokenizer.parameters()).device
    latents = tokenizer.decode_tokens(tokens[None].to(device))
    grid = geometry.occupancy_grid(tokenizer, latents, resolution)[0].float().cpu()
    return grid > 0, geometry.marching_cubes(grid, resolution)


def first_divergence(a: torch.Tensor, b: torch.Tensor) -> int:
    """The first position where two token sequences differ; their length if none."""
    differ = (a != b).nonzero()
    return int(differ[0]) if len(differ) else len(a)


def kl_per_position(oracle_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """KL(softmax(oracle) || softmax(mode)) per position, nats."""
    p = F.log_softmax(oracle_logits.float(), dim=-1)
    q = F.log_softmax(logits.float(), dim=-1)
    return (p.exp() * (p - q)).sum(dim=-1)


@torch.no_grad()
def compare(oracle: Oracle, decoder: Decoder, mode: str, chamfer_points: int = 4096) -> Report:
    forced_tokens, forced_logits = decoder.tokens_and_logits(oracle.requests, force=oracle.tokens)
    free_tokens, _ = decoder.tokens_and_logits(oracle.requests)
    hits = (forced_logits.argmax(dim=-1) == oracle.tokens).float()  # [B, N]
    n = oracle.tokens.shape[1]
    quarters = [hits[:, q * n // 4: max((q + 1) * n // 4, q * n // 4 + 1)].mean().item() for q in range(4)]
    kls = kl_per_position(oracle.logits, forced_logits).mean(dim=1)
    scores = []
    for i, request in enumerate(oracle.requests):
        grid_a, mesh_a = oracle.object(i)
        grid_b, mesh_b = decode_object(decoder.tokenizer, free_tokens[i], oracle.resolution)
        chamfer = float("nan")
        if not (mesh_a.empty or mesh_b.empty):
            chamfer = metrics.chamfer_distance(metrics.mesh_surface_points(mesh_a.vertices, mesh_a.faces, chamfer_points),
                                               metrics.mesh_surface_points(mesh_b.vertices, mesh_b.faces, chamfer_points))
        scores.append(PromptScore(request.prompt, hits[i].mean().item(), kls[i].item(),
                                  first_divergence(oracle.tokens[i], free_tokens[i]),
                                  metrics.iou(grid_a, grid_b), chamfer))
    return Report(mode, n, scores, quarters)
