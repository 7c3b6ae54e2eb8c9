"""The demo dataset (procedural shapes, prompts) and its metrics (IoU, Chamfer)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from cubeserve.demo import shapes as S
from cubeserve.demo.metrics import (
    chamfer_distance, field_iou, iou, mesh_iou, mesh_occupancy_grid, mesh_surface_points,
    occupancy_on_grid,
)
from cubeserve.engine import geometry


def _p(*xyz):
    return torch.tensor([xyz], dtype=torch.float32)


@pytest.mark.parametrize("sdf, point, expected", [
    (S.sphere_sdf(1.0), (0, 0, 0), -1.0),
    (S.sphere_sdf(1.0), (0, 2, 0), 1.0),
    (S.box_sdf((1, 1, 1)), (0.5, 0, 0), -0.5),
    (S.box_sdf((1, 1, 1)), (2, 0, 0), 1.0),
    (S.box_sdf((1, 1, 1)), (2, 2, 0), math.sqrt(2)),  # nearest point is an edge: exact, not a bound
    (S.cylinder_sdf(1, 1), (0, 0, 0), -1.0),
    (S.cylinder_sdf(1, 1), (0, 3, 0), 2.0),
    (S.cylinder_sdf(1, 1), (2, 2, 0), math.sqrt(2)),
    (S.cone_sdf(1, 1), (0, -2, 0), 1.0),
    (S.cone_sdf(1, 1), (0, 1.5, 0), 0.5),  # above the apex
    (S.torus_sdf(1, 0.25), (0, 0, 1), -0.25),
    (S.torus_sdf(1, 0.25), (0, 0, 0), 0.75),  # the hole
    (S.capsule_sdf(0.5, 1), (0, 2, 0), 0.5),
    (S.capsule_sdf(0.5, 1), (0, 0, 0), -0.5),
    (S.cup_sdf(1, 1, 0.1), (0, 0, 0), 0.9),  # the cavity is outside; nearest is the bottom
])
def test_local_sdf_values(sdf, point, expected):
    assert sdf(_p(*point)).item() == pytest.approx(expected, abs=1e-5)


def test_primitive_sdfs_are_distances():
    """For primitives |sdf| is the distance to the surface: compare with dense surface samples."""
    for shape in S.sample_shapes(6, seed=1):  # sphere, box, cylinder, cone, torus, capsule
        surf, _ = S.surface_points(shape, 20_000, seed=0)
        q = torch.rand(300, 3, generator=torch.Generator().manual_seed(0)) * 2 - 1
        nearest = torch.cdist(q, surf).min(1).values
        # dense samples over-estimate the distance by at most their spacing (~0.02 here)
        assert (shape.sdf(q).abs() - nearest).abs().max() < 0.03, shape.name


def test_world_signs():
    lo_corner = torch.tensor(np.array(np.meshgrid([-1.04, 1.04], [-1.04, 1.04], [-1.04, 1.04])).reshape(3, -1).T,
                             dtype=torch.float32)
    for shape in S.sample_shapes(27, seed=2):
        assert not shape.occupancy(lo_corner).any(), shape.name
        if shape.name in ("sphere", "capsule", "box"):
            assert shape.occupancy(_p(0, 0, 0)).item(), shape.name
        if shape.name == "torus":
            assert not shape.occupancy(_p(0, 0, 0)).item()
        if shape.name == "table":  # legs at the corners, upright, centred: top inside, under it empty
            pr = shape.params
            y_top = pr["scale"] * (pr["height"] - pr["top_t"] / 2 - pr["height"] / 2)
            assert shape.occupancy(_p(0, y_top, 0)).item()
            assert not shape.occupancy(_p(0, y_top - 0.1, 0)).item()


def test_determinism_and_streams():
    a, b = S.sample_shapes(9, seed=3), S.sample_shapes(9, seed=3)
    assert [s.prompt for s in a] == [s.prompt for s in b] and [s.params for s in a] == [s.params for s in b]
    pts = torch.rand(500, 3) * 2 - 1
    assert all(torch.equal(x.sdf(pts), y.sdf(pts)) for x, y in zip(a, b))
    assert [s.params for s in S.sample_shapes(4, seed=3)] == [s.params for s in a[:4]]  # a prefix
    assert [s.params for s in S.sample_shapes(9, seed=4)] != [s.params for s in a]
    assert [s.name for s in a] == list(S.CLASSES)
    assert {s.name for s in S.sample_shapes(6, seed=0, classes=["mug", "torus"])} == {"mug", "torus"}
    with pytest.raises(ValueError):
        S.sample_shapes(1, classes=["teapot"])
    held = S.heldout_shapes(0)
    assert [s.params for s in held] == [s.params for s in S.heldout_shapes(0)]
    train = [s.params for seed in range(3) for s in S.sample_shapes(45, seed=seed)]
    assert not any(h.params in train for h in held)


def test_surface_points_and_normals():
    for shape in S.sample_shapes(9, seed=5):
        p, n = S.surface_points(shape, 1024, seed=1)
        assert p.shape == n.shape == (1024, 3)
        assert shape.sdf(p).abs().max() < 1e-4, shape.name
        assert torch.allclose(n.norm(dim=-1), torch.ones(1024), atol=1e-5)
        assert (shape.sdf(p + 2e-3 * n) > 0).all() and (shape.sdf(p - 2e-3 * n) < 0).all(), shape.name
        p2, _ = S.surface_points(shape, 1024, seed=1)
        assert torch.equal(p, p2)


def test_shapes_fit_in_the_unit_cube():
    for shape in S.sample_shapes(36, seed=6):
        p, _ = S.surface_points(shape, 2000, seed=0)
        assert p.abs().max() <= S.MAX_SIZE + 1e-4, shape.name
        # `size` bounds the half-extent; the corner box is loose by <= sqrt(2) (round tops, mugs)
        assert p.abs().max() >= 0.7 * shape.params["size"], shape.name


def _extents(shape):
    p, _ = S.surface_points(shape, 3000, seed=0)
    ext = p.max(0).values - p.min(0).values
    return ext[1].item(), max(ext[0].item(), ext[2].item())  # height (y up), width


def test_prompts_follow_parameters():
    seen = set()
    for shape in S.sample_shapes(36, seed=7, classes=["cylinder", "box", "cone"]):
        height, width = _extents(shape)
        words = shape.prompt.split()
        if "tall" in words:
            seen.add("tall")
            assert height > width, shape.prompt
        if "flat" in words or "disc" in words:
            seen.add("flat")
            assert height < 0.6 * width, shape.prompt
        if shape.params["variant"] == "lying":  # "lying on its side" or "a log"
            seen.add("lying")
            assert height < 0.7 * width, shape.prompt
    assert seen == {"tall", "flat", "lying"}  # every case was exercised
    for shape in S.sample_shapes(40, seed=8, classes=["sphere", "torus", "table"]):
        words = shape.prompt.split()
        if {"small", "little"} & set(words):
            assert shape.params["size"] <= 0.62
        elif {"large", "big"} & set(words):
            assert shape.params["size"] >= 0.88
        else:
            assert 0.73 <= shape.params["size"] <= 0.77
        if "thin" in words:
            assert shape.params["minor"] < 0.2
        if "coffee" in words:
            assert shape.params["height"] < 0.6
    assert all(s.prompt.startswith("a ") for s in S.sample_shapes(18, seed=9))


def test_a_prompt_pins_down_its_shape():
    """Every prompt belongs to exactly one (class, variant, size level), every variant is drawn,
    and two shapes of one prompt differ only by the jitter (high IoU), unlike two concepts."""
    concept_of = {}
    sample = S.sample_shapes(600, seed=0)
    for shape in sample:
        assert concept_of.setdefault(shape.prompt, shape.concept) == shape.concept, shape.prompt
    assert {c[:2] for c in concept_of.values()} == {(n, v.key) for n in S.CLASSES for v in S.variants(n)}
    by_prompt = {}
    for shape in sample:
        by_prompt.setdefault(shape.prompt, []).append(shape)
    twins = [v[:2] for v in by_prompt.values() if len(v) >= 2 and v[0].name in ("box", "cone", "mug")][:6]
    assert len(twins) == 6
    for a, b in twins:  # thin plates (table tops) are far more sensitive: see the model card
        assert field_iou(a.occupancy, b.occupancy, 6) > 0.75, a.prompt
    cube = S.canonical_shape("box", "cube")
    slab = S.canonical_shape("box", "flat")
    assert cube.prompt == "a cube" and field_iou(cube.occupancy, slab.occupancy, 5) < 0.4


def test_occupancy_samples_labels():
    shape = S.sample_shapes(8, seed=0)[-1]  # a mug
    pts, occ = S.occupancy_samples(shape, 2000, 2000, seed=0)
    assert pts.shape == (4000, 3) and occ.dtype == torch.bool
    assert torch.equal(occ, shape.sdf(pts) < 0)
    assert 0.05 < occ[2000:].float().mean() < 0.95  # near-surface points straddle the surface


def test_iou_of_fields():
    shape = S.sample_shapes(2, seed=0)[1]  # a box
    assert field_iou(shape.occupancy, shape.occupancy, resolution=5) == 1.0
    scores = [field_iou(shape.occupancy, lambda p, d=d: shape.occupancy(p - torch.tensor([d, 0.0, 0.0])), 5)
              for d in (0.05, 0.1, 0.2, 0.4)]
    assert all(1.0 > x > y for x, y in zip(scores, scores[1:])), scores
    assert iou(np.zeros((3, 3)), np.zeros((3, 3))) == 1.0
    grid = occupancy_on_grid(shape.occupancy, 4)
    assert grid.shape == (17, 17, 17) and grid.dtype == torch.bool


def test_mesh_occupancy_matches_a_box():
    import trimesh

    box = trimesh.creation.box(extents=(1.0, 0.6, 1.4))
    sdf = S.box_sdf((0.5, 0.3, 0.7))
    expected = occupancy_on_grid(lambda p: sdf(p) < 0, 5)
    assert iou(mesh_occupancy_grid(box.vertices, box.faces, 5), expected) == 1.0


def test_mesh_iou_of_marching_cubes():
    """A mesh from the engine's marching cubes of the true field scores ~1 once the reference's
    vertex mapping (index / n, not / (n - 1)) is undone, and clearly less without."""
    for shape in S.sample_shapes(5, seed=0)[3:]:  # cone, torus
        r = 5
        n = geometry.grid_size(r)
        mesh = geometry.marching_cubes(-shape.sdf(geometry.grid_points(r)).view(n, n, n), r)
        assert mesh_iou(mesh, shape.occupancy, resolution=r, mesh_resolution=r) > 0.99
        assert mesh_iou(mesh, shape.occupancy, resolution=r) < 0.95


def test_chamfer():
    a = torch.rand(500, 3, generator=torch.Generator().manual_seed(0))
    assert chamfer_distance(a, a, chunk=64) == 0.0
    shifted = a + torch.tensor([0.01, 0.0, 0.0])
    d = chamfer_distance(a, shifted, chunk=64)
    assert 0.0 < d <= 0.02 + 1e-6
    assert chamfer_distance(shifted, a) == pytest.approx(d, abs=1e-7)
    far = chamfer_distance(a, a + 1.0)
    assert far > d
    mesh_pts = mesh_surface_points(np.array([[0, 0, 0], [1, 0, 0], [0, 1, 0]], float), np.array([[0, 1, 2]]), 200)
    assert (mesh_pts[:, 2] == 0).all() and (mesh_pts[:, :2].sum(1) <= 1 + 1e-6).all()
