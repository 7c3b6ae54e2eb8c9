"""Held-out evaluation of a checkpoint against procedural ground truth.

For each held-out shape (`shapes.heldout_shapes`: streams training never draws):
* generation: its prompt through the serving engine (greedy, default guidance) to a mesh,
  scored against the shape the prompt was written from: volumetric IoU (the mesh voxelised)
  and Chamfer distance between surface samples;
* reconstruction: its surface points through the tokenizer alone (encode -> tokens ->
  decode), the decoded occupancy scored by IoU.
Any checkpoint of the model family can be scored (the pipeline's evaluate step reuses this);
only a model trained on these shapes scores well.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from cubeserve.demo import metrics, shapes

HELDOUT_SHAPES = 45  # 5 per class
RESOLUTION = 6  # meshes and IoU grids: 65^3 samples over [-1.05, 1.05]^3
SURFACE_POINTS = 2048


@dataclass
class ShapeScore:
    prompt: str
    cls: str
    generation_iou: float
    reconstruction_iou: float
    chamfer: float


@dataclass
class Evaluation:
    scores: list[ShapeScore]
    resolution: int
    per_class: dict[str, dict[str, float]] = field(default_factory=dict)

    def __post_init__(self):
        for name in dict.fromkeys(s.cls for s in self.scores):
            rows = [s for s in self.scores if s.cls == name]
            self.per_class[name] = {k: sum(getattr(r, k) for r in rows) / len(rows)
                                    for k in ("generation_iou", "reconstruction_iou", "chamfer")}

    def mean(self, key: str) -> float:
        return sum(getattr(s, key) for s in self.scores) / len(self.scores)

    @property
    def summary(self) -> dict[str, float]:
        return {k: self.mean(k) for k in ("generation_iou", "reconstruction_iou", "chamfer")}

    def to_dict(self) -> dict:
        return dict(summary=self.summary, resolution=self.resolution, per_class=self.per_class,
                    scores=[asdict(s) for s in self.scores])

    def markdown_table(self) -> str:
        lines = ["| class | generation IoU | reconstruction IoU | Chamfer |", "|---|---|---|---|"]
        for name, v in self.per_class.items():
            lines.append(f"| {name} | {v['generation_iou']:.3f} | {v['reconstruction_iou']:.3f} | {v['chamfer']:.4f} |")
        s = self.summary
        lines.append(f"| **mean** | **{s['generation_iou']:.3f}** | **{s['reconstruction_iou']:.3f}** | "
                     f"**{s['chamfer']:.4f}** |")
        return "\n".join(lines)


@torch.no_grad()
def evaluate_engine(engine, n: int = HELDOUT_SHAPES, resolution: int = RESOLUTION, seed: int = 0,
                    batch: int = 16) -> Evaluation:
    from cubeserve.engine import GenerationRequest

    held = shapes.heldout_shapes(seed, n=n)
    tok = engine.tokenizer
    scores = []
    for start in range(0, len(held), batch):
        group = held[start: start + batch]
        results = engine.generate([GenerationRequest(prompt=s.prompt, resolution=resolution) for s in group])
        for i, (s, result) in enumerate(zip(group, results)):
            points, normals = shapes.surface_points(s, SURFACE_POINTS, seed=start + i)
            ids = tok.encode(points[None].to(engine.device), normals[None].to(engine.device))
            recon = metrics.field_iou(metrics.tokenizer_occupancy(tok, tok.decode_tokens(ids)), s.occupancy,
                                      resolution)
            mesh = result.mesh
            if mesh.empty:
                gen_iou, chamfer = 0.0, float("inf")
            else:
                gen_iou = metrics.mesh_iou(mesh, s.occupancy, resolution, mesh_resolution=resolution)
                verts = metrics.undo_reference_vertex_mapping(mesh.vertices, resolution)
                chamfer = metrics.chamfer_distance(metrics.mesh_surface_points(verts, mesh.faces, SURFACE_POINTS),
                                                   points)
            scores.append(ShapeScore(s.prompt, s.name, gen_iou, recon, chamfer))
    return Evaluation(scores, resolution)


def evaluate_dir(weights_dir: str | Path, n: int = HELDOUT_SHAPES, resolution: int = RESOLUTION,
                 device: str = "cpu") -> Evaluation:
    from cubeserve.engine import Engine

    return evaluate_engine(Engine.from_dir(weights_dir, device=device), n=n, resolution=resolution)
