"""From latents to a mesh: occupancy on a grid, marching cubes, export.

The grid spans [-1.05, 1.05]^3 with 2^r + 1 samples per axis ("ij" indexing). Vertex
positions follow the reference's mapping, index / (2^r + 1) * 2.1 - 1.05 (it divides by the
sample count, not the cell count), and triangles are wound (2, 1, 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

BOUNDS = (-1.05, 1.05)
DEFAULT_CHUNK = 100_000


@dataclass
class Mesh:
    vertices: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.float32))
    faces: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.int64))
    message: str = ""  # why the mesh is empty, when it is

    @property
    def empty(self) -> bool:
        return len(self.faces) == 0

    def export(self, file_type: str = "glb") -> bytes:
        """GLB or OBJ bytes (trimesh). An empty mesh exports as an empty scene."""
        import trimesh

        mesh = trimesh.Trimesh(vertices=self.vertices, faces=self.faces, process=False)
        data = mesh.export(file_type=file_type)
        return data.encode() if isinstance(data, str) else bytes(data)


def grid_size(resolution: int) -> int:
    return 2**resolution + 1


def grid_points(resolution: int, device=None) -> torch.Tensor:
    """All grid sample positions [n^3, 3] in "ij" order (x slowest)."""
    axis = torch.linspace(BOUNDS[0], BOUNDS[1], grid_size(resolution), device=device)
    return torch.stack(torch.meshgrid(axis, axis, axis, indexing="ij"), dim=-1).view(-1, 3)


@torch.no_grad()
def occupancy_grid(tokenizer, latents: torch.Tensor, resolution: int, chunk_size: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Occupancy logits [B, n, n, n] (fp32) for latents [B, N, width], queried in chunks."""
    n = grid_size(resolution)
    points = grid_points(resolution, latents.device)
    b = latents.shape[0]
    out = torch.empty(b, points.shape[0], dtype=torch.float32, device=latents.device)
    for start in range(0, points.shape[0], chunk_size):
        chunk = points[start: start + chunk_size]
        out[:, start: start + chunk.shape[0]] = tokenizer.occupancy(chunk.unsqueeze(0).expand(b, -1, -1), latents)
    return out.view(b, n, n, n)


def marching_cubes(logits: torch.Tensor | np.ndarray, resolution: int) -> Mesh:
    """Surface at logit 0 of one grid [n, n, n], with the reference's vertex mapping and winding."""
    from skimage import measure

    grid = logits.detach().float().cpu().numpy() if isinstance(logits, torch.Tensor) else np.asarray(logits, np.float32)
    if not np.isfinite(grid).all():
        return Mesh(message="the occupancy field has non-finite values; no surface extracted")
    if grid.min() > 0.0 or grid.max() < 0.0 or grid.min() == grid.max():
        return Mesh(message="the occupancy field does not cross zero: the shape has no surface at this resolution")
    vertices, faces, _, _ = measure.marching_cubes(grid, level=0.0, method="lewiner")
    lo, hi = BOUNDS
    vertices = vertices / grid_size(resolution) * (hi - lo) + lo
    faces = np.ascontiguousarray(faces[:, [2, 1, 0]])
    return Mesh(vertices=vertices.astype(np.float32), faces=faces.astype(np.int64))
