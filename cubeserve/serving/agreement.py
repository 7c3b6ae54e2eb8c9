"""How far a shadow version's answer agrees with the served one (torch-free: the predict model
imports no torch).

* Greedy requests: the share of positions with the same shape token (1.0: identical), as the
  engine's equivalence tests compare code paths.
* Sampled requests: the volumetric IoU of the two meshes, both voxelised by ray parity on one
  grid over their joint bounding box (numpy only: trimesh's `contains` needs rtree or embree).
"""

from __future__ import annotations

import io

import numpy as np

IOU_SAMPLES = 33  # per axis: coarse, but a shadow comparison runs beside live traffic


def token_agreement(served, shadow) -> float:
    """Share of positions where the two token sequences agree (sequences of unequal length
    count the missing positions as disagreeing)."""
    a, b = np.asarray(served).reshape(-1), np.asarray(shadow).reshape(-1)
    length = max(len(a), len(b))
    if length == 0:
        return 1.0
    n = min(len(a), len(b))
    return float((a[:n] == b[:n]).sum()) / length


def read_mesh(data: bytes, file_type: str) -> tuple[np.ndarray, np.ndarray]:
    """(vertices, faces) of a GLB or OBJ file as the engine writes it; an empty scene gives none."""
    import trimesh

    loaded = trimesh.load(io.BytesIO(data), file_type=file_type, force="mesh", process=False)
    vertices = np.asarray(getattr(loaded, "vertices", np.zeros((0, 3))), np.float64).reshape(-1, 3)
    faces = np.asarray(getattr(loaded, "faces", np.zeros((0, 3))), np.int64).reshape(-1, 3)
    return vertices, faces


def mesh_iou(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray], samples: int = IOU_SAMPLES) -> float:
    """Volumetric IoU of two closed meshes (vertices, faces). Two empty meshes agree (1.0)."""
    points = [v for v, f in (a, b) if len(f)]
    if not points:
        return 1.0
    if len(points) == 1:
        return 0.0
    stacked = np.concatenate(points)
    lo, hi = float(stacked.min()), float(stacked.max())
    pad = (hi - lo) / samples
    lo, hi = lo - pad, hi + pad
    grid_a = closed_mesh_occupancy(a[0], a[1], lo, hi, samples)
    grid_b = closed_mesh_occupancy(b[0], b[1], lo, hi, samples)
    union = int((grid_a | grid_b).sum())
    return 1.0 if union == 0 else int((grid_a & grid_b).sum()) / union


def closed_mesh_occupancy(vertices: np.ndarray, faces: np.ndarray, lo: float, hi: float, n: int) -> np.ndarray:
    """Inside/outside of a closed triangle mesh at n samples per axis from lo to hi: bool [n, n, n].

    For each (x, y) column, count the triangles crossed by the ray from z = -inf up to each
    sample; an odd count is inside. Each triangle only visits the columns under its xy
    bounding box, so the cost is O(faces + samples). The columns are shifted by a tiny
    irrational fraction of a cell so no ray grazes a vertex or edge of a grid-aligned mesh
    (a marching-cubes mesh), where a crossing could be counted twice.
    """
    step = (hi - lo) / (n - 1)
    inside_counts = np.zeros((n, n, n + 1), np.int32)
    tri = np.asarray(vertices, np.float64)[np.asarray(faces, np.int64)]  # [F, 3, 3]
    if len(tri) == 0:
        return np.zeros((n, n, n), bool)
    jitter = np.array([0.000123457, 0.000271828]) * step
    xy_min, xy_max = tri[:, :, :2].min(1), tri[:, :, :2].max(1)
    first = np.ceil((xy_min - lo - jitter) / step).astype(np.int64).clip(0, n)
    last = np.floor((xy_max - lo - jitter) / step).astype(np.int64).clip(-1, n - 1)
    count = np.maximum(last - first + 1, 0)  # columns per triangle along x and y
    per_tri = count[:, 0] * count[:, 1]
    tid = np.repeat(np.arange(len(tri)), per_tri)
    k = np.arange(len(tid)) - np.repeat(np.cumsum(per_tri) - per_tri, per_tri)
    ci = first[tid, 0] + k // count[tid, 1]
    cj = first[tid, 1] + k % count[tid, 1]
    px, py = lo + ci * step + jitter[0], lo + cj * step + jitter[1]

    a, b, c = tri[tid, 0], tri[tid, 1], tri[tid, 2]

    def cross(u, v, w):  # 2-D cross product (v - u) x (w - u) with u given as (x, y)
        return (v[:, 0] - u[0]) * (w[:, 1] - u[1]) - (v[:, 1] - u[1]) * (w[:, 0] - u[0])

    area = cross((a[:, 0], a[:, 1]), b, c)
    with np.errstate(divide="ignore", invalid="ignore"):  # edge-on triangles: NaN, never a hit
        wa = cross((px, py), b, c) / area  # barycentric weights of the column in the triangle
        wb = cross((px, py), c, a) / area
        wc = 1.0 - wa - wb
        hit = (np.abs(area) > 1e-15) & (wa >= 0) & (wb >= 0) & (wc >= 0)
        z = wa * a[:, 2] + wb * b[:, 2] + wc * c[:, 2]
    zaxis = lo + np.arange(n) * step
    kz = np.searchsorted(zaxis, z[hit])  # the crossing lies below samples kz .. n-1
    np.add.at(inside_counts, (ci[hit], cj[hit], kz), 1)
    return (np.cumsum(inside_counts, axis=2)[:, :, :n] % 2) == 1
