"""From latents to a mesh: occupancy on a grid, marching cubes, export.

The grid spans [-1.05, 1.05]^3 with 2^r + 1 samples per axis ("ij" indexing). Vertex
positions follow the reference's mapping, index / (2^r + 1) * 2.1 - 1.05 (it divides by the
sample count, not the cell count), and triangles are wound (2, 1, 0).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from cubeserve.engine import mesh_worker
from cubeserve.engine.allocator import MMAP_THRESHOLD
from cubeserve.engine.mesh_worker import MeshWorker

log = logging.getLogger(__name__)

BOUNDS = (-1.05, 1.05)
GPU_CHUNK = 100_000  # points a query of the occupancy decoder takes at once on a GPU
COARSE_RESOLUTION = 5  # coarse-to-fine starts from a 33^3 grid
MARCHING_CUBES_BACKENDS = ("auto", "skimage", "warp")


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


def grid_axis(resolution: int, device=None) -> torch.Tensor:
    return torch.linspace(BOUNDS[0], BOUNDS[1], grid_size(resolution), device=device)


def grid_points(resolution: int, device=None, axis: torch.Tensor | None = None) -> torch.Tensor:
    """All grid sample positions [n^3, 3] in "ij" order (x slowest)."""
    axis = grid_axis(resolution, device) if axis is None else axis
    return torch.stack(torch.meshgrid(axis, axis, axis, indexing="ij"), dim=-1).view(-1, 3)


def chunk_points(width: int, device: torch.device | str) -> int:
    """Points a query of the occupancy decoder takes at once: GPU_CHUNK on a GPU; on a CPU the
    most whose widest block, the MLP's hidden row (4 x width fp32), stays under glibc's mmap
    threshold (engine/allocator.py). Past it every block is mapped afresh and each of its pages
    faulted in on every query; under it the heap reuses what the query before freed. A grid took
    10 to 16 % less time than with 100,000 points (tiny, v0.1's shape; AVX-512, 2 threads), and
    much smaller chunks cost more again: each projects the latents' keys and values anew
    (BENCHMARKS.md "Geometry's query chunks")."""
    if torch.device(device).type != "cpu":
        return GPU_CHUNK
    return max(256, (MMAP_THRESHOLD - (1 << 20)) // (4 * 4 * width))


@torch.no_grad()
def _query(tokenizer, points: torch.Tensor, latents: torch.Tensor, chunk_size: int | None) -> torch.Tensor:
    """Occupancy logits [B, P] (fp32) of points [P, 3] for latents [B, N, width], in chunks
    (`chunk_points` unless told)."""
    b = latents.shape[0]
    chunk_size = chunk_size or chunk_points(latents.shape[-1], latents.device)
    out = torch.empty(b, points.shape[0], dtype=torch.float32, device=latents.device)
    for start in range(0, points.shape[0], chunk_size):
        chunk = points[start: start + chunk_size]
        out[:, start: start + chunk.shape[0]] = tokenizer.occupancy(chunk.unsqueeze(0).expand(b, -1, -1), latents)
    return out


@torch.no_grad()
def occupancy_grid(tokenizer, latents: torch.Tensor, resolution: int, chunk_size: int | None = None) -> torch.Tensor:
    """Dense occupancy logits [B, n, n, n] (fp32) for latents [B, N, width]: every sample."""
    n = grid_size(resolution)
    return _query(tokenizer, grid_points(resolution, latents.device), latents, chunk_size).view(-1, n, n, n)


@torch.no_grad()
def occupancy_grid_coarse_to_fine(tokenizer, latents: torch.Tensor, resolution: int,
                                  coarse_resolution: int = COARSE_RESOLUTION,
                                  chunk_size: int | None = None) -> torch.Tensor:
    """The dense grid's logits [n, n, n] for one object [1, N, width], evaluating only near
    the surface.

    Query every 2^(r-c)-th sample (a coarse grid that is a subset of the fine one); coarse
    cells whose corners change sign, and their neighbours, are refined: every fine sample in
    them is queried. Elsewhere a sample takes the value of its nearest coarse sample, whose
    sign is right wherever the coarse grid resolves the shape, so marching cubes finds the
    same triangles there as on the dense grid: no crossing, no triangle. Only exact values
    ever meet a zero crossing, so the mesh equals the dense one.
    """
    if latents.shape[0] != 1:
        raise ValueError("coarse-to-fine refines one object at a time")
    if coarse_resolution >= resolution:
        return occupancy_grid(tokenizer, latents, resolution, chunk_size)[0]
    dev = latents.device
    n, stride = grid_size(resolution), 2 ** (resolution - coarse_resolution)
    axis = grid_axis(resolution, dev)
    coarse_axis = axis[::stride]
    nc = coarse_axis.shape[0]
    coarse = _query(tokenizer, grid_points(0, axis=coarse_axis), latents, chunk_size).view(nc, nc, nc)

    pool = torch.nn.functional.max_pool3d
    c = coarse[None, None]
    crossing = (pool(c, 2, stride=1) >= 0) & (-pool(-c, 2, stride=1) <= 0)  # per coarse cell
    near = pool(crossing.float(), 3, stride=1, padding=1) > 0  # and its neighbours
    fine_cells = near[0, 0].repeat_interleave(stride, 0).repeat_interleave(stride, 1).repeat_interleave(stride, 2)
    padded = torch.nn.functional.pad(fine_cells.float(), (1, 1, 1, 1, 1, 1))
    refine = pool(padded[None, None], 2, stride=1)[0, 0] > 0  # samples touching a refined cell [n, n, n]

    nearest = torch.div(torch.arange(n, device=dev) + stride // 2, stride, rounding_mode="floor").clamp(max=nc - 1)
    grid = coarse[nearest][:, nearest][:, :, nearest].contiguous()
    idx = refine.nonzero()
    if idx.numel():
        points = torch.stack([axis[idx[:, 0]], axis[idx[:, 1]], axis[idx[:, 2]]], dim=-1)
        grid[idx[:, 0], idx[:, 1], idx[:, 2]] = _query(tokenizer, points, latents, chunk_size)[0]
    return grid


def marching_cubes(logits: torch.Tensor | np.ndarray, resolution: int, backend: str = "auto",
                   worker: MeshWorker | None = None) -> Mesh:
    """Surface at logit 0 of one grid [n, n, n], with the reference's vertex mapping and winding.

    backend: "skimage" (scikit-image's Lewiner, on the CPU), "warp" (NVIDIA Warp, on the
    grid's device), or "auto": Warp for a CUDA grid where Warp is installed (the `gpu` extra),
    scikit-image otherwise. Both put the vertices at the same edge crossings; on the CPU
    scikit-image is the faster (BENCHMARKS.md). `worker`: scikit-image runs in that process
    (it holds the GIL; `mesh_worker`), else in this one.
    """
    grid = logits if isinstance(logits, torch.Tensor) else torch.from_numpy(np.asarray(logits, np.float32))
    grid = grid.detach().float()
    backend = marching_cubes_backend(grid, backend)
    if not bool(torch.isfinite(grid).all()):
        return Mesh(message="the occupancy field has non-finite values; no surface extracted")
    low, high = (float(v) for v in grid.aminmax())
    if low > 0.0 or high < 0.0 or low == high:
        return Mesh(message="the occupancy field does not cross zero: the shape has no surface at this resolution")
    if backend == "warp":
        vertices, faces = _warp_surface(grid, resolution)
    else:
        grid = grid.cpu().numpy()
        vertices, faces = worker.lewiner(grid) if worker is not None else mesh_worker.lewiner(grid)
        lo, hi = BOUNDS
        vertices = vertices / grid_size(resolution) * (hi - lo) + lo
    # Both libraries wind triangles the same way; the reference reverses them.
    faces = np.ascontiguousarray(faces[:, [2, 1, 0]])
    return Mesh(vertices=vertices.astype(np.float32), faces=faces.astype(np.int64))


def marching_cubes_backend(grid: torch.Tensor, backend: str = "auto") -> str:
    """The backend `marching_cubes` uses for `grid`: "auto" resolved to "warp" or "skimage"."""
    if backend not in MARCHING_CUBES_BACKENDS:
        raise ValueError(f"backend must be one of {MARCHING_CUBES_BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "warp" if grid.is_cuda and _warp() is not None else "skimage"
    return backend


_warp_lock = threading.Lock()
_warp_module: list = []  # [warp or None], set on first use


def _warp():
    """NVIDIA Warp, initialised once, or None where it is not installed."""
    with _warp_lock:
        if not _warp_module:
            try:
                import warp

                warp.config.log_level = warp.LOG_WARNING  # no start-up banner
                warp.init()
            except ImportError:
                warp = None
            except Exception:  # installed but unusable (driver, toolkit): mesh with scikit-image
                log.warning("NVIDIA Warp failed to initialise; marching cubes uses scikit-image", exc_info=True)
                warp = None
            _warp_module.append(warp)
    return _warp_module[0]


def _warp_surface(grid: torch.Tensor, resolution: int) -> tuple[np.ndarray, np.ndarray]:
    """Warp's marching cubes on the grid's device (zero-copy), on torch's current stream."""
    wp = _warp()
    if wp is None:
        raise RuntimeError("marching cubes backend 'warp' needs NVIDIA Warp: pip install 'cubeserve[gpu]'")
    from warp.geometry import IsoSurfaceMarchingCubes

    n = grid_size(resolution)
    lo, hi = BOUNDS
    top = lo + (n - 1) / n * (hi - lo)  # the reference maps sample i to lo + i / n * (hi - lo)
    field = wp.from_torch(grid.contiguous())
    stream = wp.ScopedStream(wp.stream_from_torch(grid.device)) if grid.is_cuda else contextlib.nullcontext()
    with stream:
        verts, tris = IsoSurfaceMarchingCubes.extract(field, threshold=0.0, lower=(lo,) * 3, upper=(top,) * 3)
    return verts.numpy(), tris.numpy().reshape(-1, 3)
