"""Metrics for reconstructions and generations against procedural ground truth.

* Volumetric IoU of occupancy on the engine's grid over [-1.05, 1.05]^3 (`resolution` r means
  2^r + 1 samples per axis, as in `cubeserve.engine.geometry`).
* IoU of a mesh against an SDF. The mesh is voxelised by ray parity along z (numpy only:
  trimesh's `contains` needs rtree or embree, which are not installed). Marching-cubes meshes
  of a field inside the grid are closed, which parity needs.
* Symmetric Chamfer distance between point sets (chunked torch.cdist).

An occupancy function maps points [P, 3] to a bool tensor [P] (True inside), e.g.
`Shape.occupancy` or `tokenizer_occupancy(...)`.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from cubeserve.engine import geometry
from cubeserve.serving.agreement import closed_mesh_occupancy

Occupancy = Callable[[torch.Tensor], torch.Tensor]


def iou(a, b) -> float:
    """IoU of two bool grids (numpy or torch, same shape). Two empty grids count as equal (1)."""
    a = torch.as_tensor(np.asarray(a) if not isinstance(a, torch.Tensor) else a).bool()
    b = torch.as_tensor(np.asarray(b) if not isinstance(b, torch.Tensor) else b).bool()
    if a.shape != b.shape:
        raise ValueError(f"grids differ in shape: {tuple(a.shape)} vs {tuple(b.shape)}")
    union = (a | b).sum().item()
    return 1.0 if union == 0 else (a & b).sum().item() / union


@torch.no_grad()
def occupancy_on_grid(occ: Occupancy, resolution: int = 6, chunk: int = 65_536, device=None) -> torch.Tensor:
    """occ evaluated on the engine's grid: bool [n, n, n], n = 2^resolution + 1 ("ij" order)."""
    pts = geometry.grid_points(resolution, device)
    out = torch.cat([occ(pts[i: i + chunk]).bool().cpu() for i in range(0, len(pts), chunk)])
    n = geometry.grid_size(resolution)
    return out.view(n, n, n)


def field_iou(occ_a: Occupancy, occ_b: Occupancy, resolution: int = 6) -> float:
    """Volumetric IoU of two occupancy functions on the grid."""
    return iou(occupancy_on_grid(occ_a, resolution), occupancy_on_grid(occ_b, resolution))


def tokenizer_occupancy(tokenizer, latents: torch.Tensor) -> Occupancy:
    """The occupancy function of one object's latents [1, N, width]: logit > 0 is inside (the
    sign the engine's marching cubes uses)."""
    def occ(points: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return tokenizer.occupancy(points.to(latents.device)[None], latents)[0] > 0
    return occ


def undo_reference_vertex_mapping(vertices: np.ndarray, resolution: int) -> np.ndarray:
    """Engine meshes place grid index i at i / n * 2.1 - 1.05 (the reference divides by the
    sample count n, not n - 1), i.e. shrunk by (n - 1) / n towards -1.05: up to one cell off at
    +1.05. This maps such vertices back to where the occupancy field puts them."""
    lo, hi = geometry.BOUNDS
    n = geometry.grid_size(resolution)
    return (np.asarray(vertices, np.float64) - lo) * n / (n - 1) + lo


def mesh_occupancy_grid(vertices: np.ndarray, faces: np.ndarray, resolution: int = 6) -> np.ndarray:
    """Inside/outside of a closed triangle mesh at the engine grid's samples: bool [n, n, n]
    (see `cubeserve.serving.agreement.closed_mesh_occupancy`)."""
    lo, hi = geometry.BOUNDS
    return closed_mesh_occupancy(vertices, faces, lo, hi, geometry.grid_size(resolution))


def mesh_iou(mesh, occ: Occupancy, resolution: int = 6, mesh_resolution: int | None = None) -> float:
    """IoU of a mesh (`geometry.Mesh` or anything with .vertices/.faces) against an occupancy
    function (e.g. `shape.occupancy`). Pass `mesh_resolution` for a mesh from the engine's
    marching cubes at that resolution, to undo the reference's vertex mapping first."""
    verts = mesh.vertices if mesh_resolution is None else undo_reference_vertex_mapping(mesh.vertices, mesh_resolution)
    return iou(mesh_occupancy_grid(verts, mesh.faces, resolution), occupancy_on_grid(occ, resolution))


def mesh_surface_points(vertices: np.ndarray, faces: np.ndarray, n: int, seed: int = 0) -> torch.Tensor:
    """n points uniform on a triangle mesh's surface (area-weighted), [n, 3] float32."""
    rng = np.random.default_rng(seed)
    tri = np.asarray(vertices, np.float64)[np.asarray(faces, np.int64)]
    area = 0.5 * np.linalg.norm(np.cross(tri[:, 1] - tri[:, 0], tri[:, 2] - tri[:, 0]), axis=1)
    pick = rng.choice(len(tri), size=n, p=area / area.sum())
    u, v = rng.random(n), rng.random(n)
    flip = u + v > 1  # fold the unit square onto the triangle
    u, v = np.where(flip, 1 - u, u), np.where(flip, 1 - v, v)
    t = tri[pick]
    pts = t[:, 0] + u[:, None] * (t[:, 1] - t[:, 0]) + v[:, None] * (t[:, 2] - t[:, 0])
    return torch.from_numpy(pts.astype(np.float32))


@torch.no_grad()
def _nearest(a: torch.Tensor, b: torch.Tensor, chunk: int) -> torch.Tensor:
    """Distance from each point of a to its nearest point of b, chunked over a. cdist's
    matrix-product shortcut is off: it leaves ~1e-4 of rounding where the distance is 0."""
    mode = "donot_use_mm_for_euclid_dist"
    return torch.cat([torch.cdist(a[i: i + chunk], b, compute_mode=mode).min(dim=1).values
                      for i in range(0, len(a), chunk)])


def chamfer_distance(a: torch.Tensor, b: torch.Tensor, chunk: int = 4096, squared: bool = False) -> float:
    """Symmetric Chamfer distance between point sets [Pa, 3] and [Pb, 3]: mean nearest-neighbour
    distance from a to b plus from b to a (squared distances if `squared`, as some papers use)."""
    a, b = a.float(), b.float()
    da, db = _nearest(a, b, chunk), _nearest(b, a, chunk)
    if squared:
        da, db = da.square(), db.square()
    return float(da.mean() + db.mean())
