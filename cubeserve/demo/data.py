"""Training tensors for the demo model, sampled once from the procedural shapes.

Sampling an SDF's surface by Newton projection costs ~0.08 s a shape on a CPU core, far more
than a training step reads, so a dataset is sampled once into tensors and cached on disk
(`ShapeSet.load_or_build`), keyed by its size and seed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from cubeserve.demo import shapes

SURFACE_POINTS = 2048  # per shape: the encoder reads a random subset each step
UNIFORM_QUERIES = 2048  # occupancy labels: uniform in the grid's box ...
NEAR_QUERIES = 2048  # ... and near the surface (jittered surface points)
NEAR_SIGMA = 0.03


@dataclass
class ShapeSet:
    prompts: list[str]
    classes: list[str]
    concepts: list[tuple[str, str, str]]
    surface: torch.Tensor  # [S, SURFACE_POINTS, 3]
    normals: torch.Tensor  # [S, SURFACE_POINTS, 3]
    queries: torch.Tensor  # [S, UNIFORM_QUERIES + NEAR_QUERIES, 3]
    labels: torch.Tensor  # [S, UNIFORM_QUERIES + NEAR_QUERIES] float 0/1
    key: str = ""  # what it was sampled from (`sampling_key`)

    def __len__(self) -> int:
        return len(self.prompts)

    @classmethod
    def build(cls, shape_list: list[shapes.Shape], seed: int = 0, progress=None) -> "ShapeSet":
        surf, nrm, qs, ls = [], [], [], []
        for i, s in enumerate(shape_list):
            p, n = shapes.surface_points(s, SURFACE_POINTS, seed=seed + 2 * i)
            q, occ = shapes.occupancy_samples(s, UNIFORM_QUERIES, NEAR_QUERIES, seed=seed + 2 * i + 1,
                                              sigma=NEAR_SIGMA)
            surf.append(p), nrm.append(n), qs.append(q), ls.append(occ.float())
            if progress:
                progress(1)
        return cls([s.prompt for s in shape_list], [s.name for s in shape_list],
                   [s.concept for s in shape_list], torch.stack(surf), torch.stack(nrm),
                   torch.stack(qs), torch.stack(ls), sampling_key(shape_list, seed))

    @classmethod
    def load_or_build(cls, path: Path, shape_list: list[shapes.Shape], seed: int, progress=None) -> "ShapeSet":
        """The cached set at `path` if it was sampled from the same shapes, else build and save."""
        path = Path(path)
        if path.is_file():
            cached = cls(**torch.load(path, weights_only=True))
            if cached.key == sampling_key(shape_list, seed):
                return cached
        out = cls.build(shape_list, seed=seed, progress=progress)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(asdict(out), tmp)
        tmp.replace(path)
        return out


def sampling_key(shape_list: list[shapes.Shape], seed: int) -> str:
    """A digest of every shape's class, parameters and prompt, the seed and the sample counts:
    a change to any of them (the shape definitions included) invalidates a cached set."""
    desc = [[s.name, s.params, s.prompt] for s in shape_list]
    desc.append([seed, SURFACE_POINTS, UNIFORM_QUERIES, NEAR_QUERIES, NEAR_SIGMA])
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()
