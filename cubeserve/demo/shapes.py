"""Procedural shapes with signed distance functions and prompts that describe them.

Every shape is a `Shape`: a class name, its sampled parameters, a prompt that names every free
parameter (class, variant, size level; the rest is small jitter), and an SDF (torch, vectorised
over [..., 3] points, negative inside). Occupancy is `sdf < 0`.

Conventions:
* +y is up (glTF, as Cube's meshes): revolved shapes (cylinder, cone, capsule, mug) have their
  axis along y unless the prompt says "lying", and "tall", "flat", "low" refer to the y extent.
* Every shape is centred and scaled so its bounding box fits inside [-size, size]^3 with
  size <= 0.95, inside the model's grid [-1.05, 1.05]^3 with a margin for marching cubes.
* Primitive SDFs are exact distances. Compositions (table, mug, chair) are unions (min) of
  exact parts: the sign is exact everywhere and the distance is exact outside, but inside
  overlapping parts it is only a bound. Rigid motions and uniform scaling keep distances exact.
* Sampling is deterministic: shape i of `sample_shapes(n, seed)` draws from its own stream
  seeded by (seed, i), so a longer list extends a shorter one, and `heldout_shapes` draws
  from streams that training never uses.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

SDF = Callable[[torch.Tensor], torch.Tensor]
MAX_SIZE = 0.95  # largest half-extent after normalisation
_HELDOUT_SALT = 0x5EED_CAFE  # extra seed word: held-out streams never coincide with training ones


# -- exact SDFs in a local frame (axis along y) ---------------------------------------------------

def _length(v: torch.Tensor) -> torch.Tensor:
    # sqrt with a tiny floor: a finite gradient at 0 if anyone differentiates through it.
    return (v * v).sum(-1).clamp_min(1e-30).sqrt()


def sphere_sdf(r: float) -> SDF:
    return lambda p: _length(p) - r


def box_sdf(half: tuple[float, float, float]) -> SDF:
    b = torch.tensor(half, dtype=torch.float32)

    def sdf(p):
        q = p.abs() - b.to(p)
        outside = _length(q.clamp_min(0.0))
        inside = q.max(dim=-1).values.clamp_max(0.0)
        return outside + inside
    return sdf


def _segment_distance_2d(px, py, a, b):
    """Distance from points (px, py) to the segment a-b (2-tuples of floats)."""
    ax, ay = a
    bx, by = b
    dx, dy = bx - ax, by - ay
    h = (((px - ax) * dx + (py - ay) * dy) / (dx * dx + dy * dy)).clamp(0.0, 1.0)
    ex, ey = px - ax - dx * h, py - ay - dy * h
    return (ex * ex + ey * ey).clamp_min(1e-30).sqrt()


def revolved_polygon_sdf(profile: list[tuple[float, float]]) -> SDF:
    """Exact SDF of a solid of revolution about the y axis.

    `profile` is a closed polygon in the (radius, y) half-plane, radius >= 0. By symmetry the
    3-D distance equals the 2-D distance from (|p_xz|, p_y) to the polygon's edges, except edges
    lying on the axis (radius 0 at both ends), which are not surfaces. Inside/outside is the
    even-odd crossing test.
    """
    edges = list(zip(profile, profile[1:] + profile[:1]))
    surface = [(a, b) for a, b in edges if not (a[0] == 0.0 and b[0] == 0.0)]

    def sdf(p):
        q = (p[..., 0] ** 2 + p[..., 2] ** 2).clamp_min(1e-30).sqrt()
        y = p[..., 1]
        dist = torch.stack([_segment_distance_2d(q, y, a, b) for a, b in surface]).min(0).values
        inside = torch.zeros_like(q, dtype=torch.bool)
        for (ax, ay), (bx, by) in edges:
            if ay == by:
                continue  # a horizontal edge never crosses a horizontal ray
            spans = (ay > y) != (by > y)
            x_cross = ax + (y - ay) * (bx - ax) / (by - ay)
            inside ^= spans & (q < x_cross)
        return torch.where(inside, -dist, dist)
    return sdf


def cylinder_sdf(r: float, half_h: float) -> SDF:
    return revolved_polygon_sdf([(0.0, -half_h), (r, -half_h), (r, half_h), (0.0, half_h)])


def cone_sdf(r: float, half_h: float) -> SDF:
    """Base of radius r at y = -half_h, apex at y = +half_h."""
    return revolved_polygon_sdf([(0.0, -half_h), (r, -half_h), (0.0, half_h)])


def cup_sdf(r: float, half_h: float, wall: float) -> SDF:
    """An open-topped cylinder with a bottom of thickness `wall`."""
    return revolved_polygon_sdf([(0.0, -half_h), (r, -half_h), (r, half_h), (r - wall, half_h),
                                 (r - wall, -half_h + wall), (0.0, -half_h + wall)])


def torus_sdf(major: float, minor: float) -> SDF:
    """Ring in the xz plane (axis y)."""
    def sdf(p):
        ring = (p[..., 0] ** 2 + p[..., 2] ** 2).clamp_min(1e-30).sqrt() - major
        return (ring * ring + p[..., 1] ** 2).clamp_min(1e-30).sqrt() - minor
    return sdf


def capsule_sdf(r: float, half_h: float) -> SDF:
    """Segment from y = -half_h to +half_h, radius r."""
    def sdf(p):
        on_axis = torch.zeros_like(p)
        on_axis[..., 1] = p[..., 1].clamp(-half_h, half_h)
        return _length(p - on_axis) - r
    return sdf


def moved(sdf: SDF, offset=(0.0, 0.0, 0.0), rotation: np.ndarray | None = None) -> SDF:
    """The SDF of the part rotated (about its origin) then translated by offset: still exact."""
    t = torch.tensor(offset, dtype=torch.float32)
    rot = None if rotation is None else torch.tensor(rotation, dtype=torch.float32)

    def out(p):
        local = p - t.to(p)
        if rot is not None:
            local = local @ rot.to(p)  # R^T (p - t), written for row vectors
        return sdf(local)
    return out


def union(*parts: SDF) -> SDF:
    return lambda p: torch.stack([f(p) for f in parts]).min(0).values


def _rot_y(a: float) -> np.ndarray:
    c, s = math.cos(a), math.sin(a)
    return np.array([[c, 0.0, s], [0.0, 1.0, 0.0], [-s, 0.0, c]])


def _rot_x(a: float) -> np.ndarray:
    c, s = math.cos(a), math.sin(a)
    return np.array([[1.0, 0.0, 0.0], [0.0, c, -s], [0.0, s, c]])


def _rot_z(a: float) -> np.ndarray:
    c, s = math.cos(a), math.sin(a)
    return np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])


# -- the record -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    name: str  # the class: "sphere", "table", ...
    params: dict  # sampled parameters in the shape's local units, plus "size", "variant", "yaw"
    prompt: str
    sdf: SDF = field(repr=False, compare=False)  # world frame, [..., 3] -> [...], negative inside

    @property
    def concept(self) -> tuple[str, str, str]:
        """(class, variant, size level): what the prompt pins down; instances of one concept
        differ only by the small jitter."""
        return self.name, self.params["variant"], self.params["size_level"]

    def occupancy(self, points: torch.Tensor) -> torch.Tensor:
        return self.sdf(points) < 0


# -- what a prompt describes --------------------------------------------------------------------------
# Every free parameter is named by the prompt: a class has a few variants (proportions, and for
# some an orientation), each with canonical local parameters, and every shape has one of three
# size levels. A shape draws its variant and size level, then jitters each parameter a little
# (JITTER, relative; SIZE_JITTER, absolute) and its yaw (YAW_JITTER, radians). So a prompt fixes
# the shape up to that jitter, which is what lets a generated shape be scored against the shape
# its prompt describes.

JITTER = 0.02
SIZE_JITTER = 0.01
YAW_JITTER = 0.05
SIZE_LEVELS = {"small": 0.6, "medium": 0.75, "large": 0.9}  # half-extent of the bounding box
_SIZE_WORDS = {"small": ("small", "little"), "medium": ("",), "large": ("large", "big")}


@dataclass(frozen=True)
class Variant:
    key: str
    phrases: tuple[str, ...]  # the prompt's wordings (synonyms), after the size word
    params: dict  # canonical local parameters; floats are jittered, the rest kept
    lying: bool = False  # the axis along x instead of y ("lying on its side")


def _box_parts(p):
    h = (p["hx"], p["hy"], p["hz"])
    return box_sdf(h), tuple(-v for v in h), h


def _revolved_parts(sdf_of):
    def parts(p):
        r, hh = p["r"], p["half_h"]
        return sdf_of(r, hh), (-r, -hh, -r), (r, hh, r)
    return parts


def _torus_parts(p):
    minor, e = p["minor"], 1.0 + p["minor"]
    return torus_sdf(1.0, minor), (-e, -minor, -e), (e, minor, e)


def _capsule_parts(p):
    r, e = p["r"], p["half_h"] + p["r"]
    return capsule_sdf(r, p["half_h"]), (-r, -e, -r), (r, e, r)


def _legs(xs, zs, y_lo, y_hi, thick, round_legs):
    """Four legs from y_lo to y_hi at (+-xs, +-zs)."""
    half = (y_hi - y_lo) / 2
    leg = cylinder_sdf(thick, half) if round_legs else box_sdf((thick, half, thick))
    mid = (y_lo + y_hi) / 2
    return [moved(leg, (sx * xs, mid, sz * zs)) for sx in (-1, 1) for sz in (-1, 1)]


def _table_parts(p):
    w, height, top_t, leg_t = p["w"], p["height"], p["top_t"], p["leg_t"]
    if p["round"]:
        d = w
        top = moved(cylinder_sdf(w, top_t / 2), (0.0, height - top_t / 2, 0.0))
        legs = _legs(w * 0.6, w * 0.6, 0.0, height - top_t, leg_t, True)  # well inside the disc
    else:
        d = p["d"]
        top = moved(box_sdf((w, top_t / 2, d)), (0.0, height - top_t / 2, 0.0))
        legs = _legs(w - leg_t - 0.03, d - leg_t - 0.03, 0.0, height - top_t, leg_t, False)
    return union(top, *legs), (-w, 0.0, -d), (w, height, d)


def _mug_parts(p):
    r, half_h, wall = p["r"], p["half_h"], p["wall"]
    body = cup_sdf(r, half_h, wall)
    h_major, h_minor = p["handle"] * half_h, p["handle_t"]
    # A ring in the xy plane (axis z) centred on the wall at +x; the part inside the body's radius
    # is cut off so the handle never pokes into the cavity.
    ring = moved(torus_sdf(h_major, h_minor), (r, 0.0, 0.0), _rot_x(math.pi / 2))

    def handle(q):  # intersection (max) of the ring with the outside of the body's cylinder
        return torch.maximum(ring(q), r - (q[..., 0] ** 2 + q[..., 2] ** 2).clamp_min(1e-30).sqrt())
    reach = r + h_major + h_minor
    return union(body, handle), (-r, -half_h, -r), (reach, half_h, r)


def _chair_parts(p):
    w, d, seat_h, seat_t = p["w"], p["d"], p["seat_h"], p["seat_t"]
    back_h, back_t, leg_t = p["back_h"], p["back_t"], p["leg_t"]
    seat = moved(box_sdf((w, seat_t / 2, d)), (0.0, seat_h - seat_t / 2, 0.0))
    back = moved(box_sdf((w, back_h / 2, back_t / 2)), (0.0, seat_h + back_h / 2, -d + back_t / 2))
    legs = _legs(w - leg_t, d - leg_t, 0.0, seat_h - seat_t, leg_t, False)
    return union(seat, back, *legs), (-w, 0.0, -d), (w, seat_h + back_h, d)


def _v(key, phrases, lying=False, **params):
    return Variant(key, tuple(phrases), params, lying)


# Chunky, toy-like furniture: plates and walls at least ~4 cells thick on the resolution-6 grid,
# so that a one-cell error does not decide a shape's IoU (thin parts are measured by Chamfer).
_TABLE = dict(w=1.0, d=0.7, top_t=0.16, leg_t=0.09)
_CHAIR = dict(w=0.5, d=0.5, seat_h=0.75, seat_t=0.14, back_t=0.12, leg_t=0.07)
_MUG = dict(wall=0.13, handle=0.55, handle_t=0.09)

# class -> (local SDF and bounding box from parameters, variants, revolved about y)
_CLASSES: dict[str, tuple[Callable, tuple[Variant, ...], bool]] = {
    "sphere": (lambda p: (sphere_sdf(1.0), (-1, -1, -1), (1, 1, 1)),
               (_v("plain", ["ball", "sphere", "orb"]),), True),
    "box": (_box_parts, (
        _v("cube", ["cube", "cubic block"], hx=1.0, hy=1.0, hz=1.0),
        _v("plain", ["box", "crate", "block"], hx=1.0, hy=0.7, hz=0.8),
        _v("flat", ["flat box", "slab", "flat slab"], hx=1.0, hy=0.2, hz=0.8),
        _v("tall", ["tall box", "pillar", "tall block"], hx=0.4, hy=1.0, hz=0.4),
        _v("long", ["long box", "beam", "brick"], hx=1.0, hy=0.3, hz=0.35),
    ), False),
    "cylinder": (_revolved_parts(cylinder_sdf), (
        _v("tall thin", ["tall thin cylinder", "pole"], r=0.3, half_h=1.0),
        _v("tall", ["tall cylinder", "column", "tube"], r=0.6, half_h=1.0),
        _v("plain", ["cylinder", "can"], r=1.0, half_h=1.0),
        _v("short", ["short cylinder", "drum"], r=1.0, half_h=0.5),
        _v("flat", ["flat disc", "disc", "coin"], r=1.0, half_h=0.15),
        _v("lying", ["cylinder lying on its side", "log"], lying=True, r=0.6, half_h=1.0),
    ), True),
    "cone": (_revolved_parts(cone_sdf), (
        _v("tall", ["tall pointy cone", "spike"], r=0.45, half_h=1.0),
        _v("plain", ["cone"], r=1.0, half_h=1.0),
        _v("flat", ["flat cone", "low cone"], r=1.0, half_h=0.4),
    ), True),
    "torus": (_torus_parts, (
        _v("thin", ["thin ring", "hoop"], minor=0.18),
        _v("plain", ["donut", "torus", "ring"], minor=0.35),
        _v("fat", ["fat donut", "thick ring"], minor=0.55),
    ), True),
    "capsule": (_capsule_parts, (
        _v("plain", ["capsule", "pill"], r=0.5, half_h=0.4),
        _v("tall", ["tall capsule", "tall pill"], r=0.35, half_h=0.9),
        _v("lying", ["capsule lying on its side", "lying pill"], lying=True, r=0.45, half_h=0.7),
    ), True),
    "table": (_table_parts, (
        _v("plain", ["table", "dining table"], round=False, height=1.0, **_TABLE),
        _v("coffee", ["coffee table", "low table"], round=False, height=0.45, **_TABLE),
        _v("bar", ["bar table", "tall table"], round=False, height=1.5, **_TABLE),
        _v("round", ["round table"], round=True, height=1.0, **_TABLE),
        _v("round coffee", ["round coffee table"], round=True, height=0.45, **_TABLE),
    ), False),
    "mug": (_mug_parts, (
        _v("tall", ["tall mug"], r=0.45, half_h=0.8, **_MUG),
        _v("plain", ["mug", "coffee mug", "cup with a handle"], r=0.55, half_h=0.55, **_MUG),
        _v("wide", ["wide mug"], r=0.7, half_h=0.4, **_MUG),
    ), False),
    "chair": (_chair_parts, (
        _v("low-backed", ["low-backed chair"], back_h=0.45, **_CHAIR),
        _v("plain", ["chair", "wooden chair"], back_h=0.8, **_CHAIR),
        _v("high-backed", ["high-backed chair"], back_h=1.2, **_CHAIR),
    ), False),
}
CLASSES: tuple[str, ...] = tuple(_CLASSES)


def variants(name: str) -> tuple[Variant, ...]:
    return _CLASSES[name][1]


def _place(local: SDF, lo, hi, size: float, rot: np.ndarray) -> tuple[SDF, float]:
    """Rotate, then centre and scale so the bounding box of the rotated local box fits
    [-size, size]^3 (exact for boxes; for a yawed round part only an upper bound)."""
    corners = np.array([[x, y, z] for x in (lo[0], hi[0]) for y in (lo[1], hi[1]) for z in (lo[2], hi[2])])
    moved_corners = corners @ rot.T
    c_lo, c_hi = moved_corners.min(0), moved_corners.max(0)
    centre, half = (c_lo + c_hi) / 2, float((c_hi - c_lo).max() / 2)
    s = size / half
    rot_t = torch.tensor(rot, dtype=torch.float32)
    shift = torch.tensor(-centre * s, dtype=torch.float32)

    def sdf(p):
        local_p = ((p - shift.to(p)) / s) @ rot_t.to(p)  # x_local = R^T (x - t) / s
        return local(local_p) * s  # uniform scaling scales distances
    return sdf, s


def build_shape(name: str, variant: Variant, size_level: str, prompt: str, params: dict,
                size: float, yaw: float = 0.0) -> Shape:
    """A shape from explicit parameters (the canonical ones for `canonical_shape`)."""
    parts, _, revolved = _CLASSES[name]
    local, lo, hi = parts(params)
    # Yaw does not change a solid of revolution but would inflate its rotated corner box.
    yaw = 0.0 if revolved else yaw
    rot = _rot_y(yaw) @ (_rot_z(math.pi / 2) if variant.lying else np.eye(3))
    sdf, scale = _place(local, lo, hi, size, rot)
    full = dict(params, size=size, yaw=yaw, scale=scale, variant=variant.key, size_level=size_level)
    return Shape(name=name, params=full, prompt=prompt, sdf=sdf)


def _prompt(variant: Variant, size_level: str, rng: np.random.Generator) -> str:
    size_word = _pick(rng, _SIZE_WORDS[size_level])
    return "a " + (size_word + " " if size_word else "") + _pick(rng, variant.phrases)


def _pick(rng: np.random.Generator, options):
    return options[int(rng.integers(len(options)))]


def make_shape(name: str, rng: np.random.Generator, variant_index: int | None = None) -> Shape:
    """One shape of class `name` drawn from rng: variant (unless given), size level, wording,
    jitter."""
    options = variants(name)
    variant = _pick(rng, options) if variant_index is None else options[variant_index % len(options)]
    size_level = _pick(rng, tuple(SIZE_LEVELS))
    prompt = _prompt(variant, size_level, rng)
    params = {k: float(v * rng.uniform(1 - JITTER, 1 + JITTER)) if isinstance(v, float) else v
              for k, v in variant.params.items()}
    size = SIZE_LEVELS[size_level] + float(rng.uniform(-SIZE_JITTER, SIZE_JITTER))
    yaw = float(rng.uniform(-YAW_JITTER, YAW_JITTER))
    return build_shape(name, variant, size_level, prompt, params, size, yaw)


def canonical_shape(name: str, variant_key: str, size_level: str = "medium") -> Shape:
    """The un-jittered shape of a concept, worded with its first synonyms."""
    variant = {v.key: v for v in variants(name)}[variant_key]
    size_word = _SIZE_WORDS[size_level][0]
    prompt = "a " + (size_word + " " if size_word else "") + variant.phrases[0]
    return build_shape(name, variant, size_level, prompt, dict(variant.params), SIZE_LEVELS[size_level])


def _shapes(n: int, seed_words: list[int], classes) -> list[Shape]:
    classes = tuple(classes) if classes is not None else CLASSES
    unknown = set(classes) - set(CLASSES)
    if unknown:
        raise ValueError(f"unknown shape classes {sorted(unknown)}; known: {list(CLASSES)}")
    # Classes cycle so every class is equally represented, and within a class its variants
    # cycle (every variant equally often); each shape draws the rest from its own stream.
    k = len(classes)
    return [make_shape(classes[i % k], np.random.default_rng(seed_words + [i]), variant_index=i // k)
            for i in range(n)]


def sample_shapes(n: int, seed: int = 0, classes=None) -> list[Shape]:
    """n training shapes, cycling over `classes` (default: all), deterministic for a seed."""
    return _shapes(n, [seed], classes)


def heldout_shapes(seed: int = 0, n: int = 45, classes=None) -> list[Shape]:
    """A fixed evaluation set: same classes and prompt vocabulary, parameters from streams that
    `sample_shapes` never draws (an extra seed word), so no held-out shape is a training shape."""
    return _shapes(n, [_HELDOUT_SALT, seed], classes)


# -- sampling points ------------------------------------------------------------------------------

def sdf_gradient(sdf: SDF, points: torch.Tensor, h: float = 1e-3) -> torch.Tensor:
    """d sdf / d p by central differences (the outward normal direction).

    Not autograd: on the surface the distance to a face is ~0, and the gradient of a norm at 0
    is undefined (zero here), whereas a signed distance is smooth across the surface, so
    differences over +-h see the true normal. At creases they average the faces' normals.
    """
    with torch.no_grad():
        eye = torch.eye(3, dtype=points.dtype, device=points.device) * h
        cols = [(sdf(points + eye[i]) - sdf(points - eye[i])) / (2 * h) for i in range(3)]
    return torch.stack(cols, dim=-1)


def surface_points(shape: Shape, n: int, seed: int = 0, band: float = 0.03, steps: int = 5,
                   tol: float = 1e-4, check: float = 2e-3) -> tuple[torch.Tensor, torch.Tensor]:
    """n points on the surface with unit outward normals, [n, 3] each, deterministic for a seed.

    Uniform points within `band` of the surface (|sdf| < band) are roughly area-uniform; each
    is projected onto the zero level by Newton steps along the gradient (one step is exact for
    an exact SDF away from creases). Normals are the normalised gradient at the result.
    Points where this is unreliable are dropped: those still off the surface (|sdf| > tol,
    Newton can oscillate in a concave crease of a composition) and those whose normal does not
    cross the surface cleanly (sdf(p +- check * normal) not of sign +-), i.e. points within
    about `check` of a crease or of a wedge's edge. That removes a sliver of area only.
    """
    g = torch.Generator().manual_seed(seed)
    kept_p, kept_n, total = [], [], 0
    for _ in range(100):
        cand = torch.rand(100_000, 3, generator=g) * 2.0 - 1.0
        pts = cand[shape.sdf(cand).abs() < band]
        for _ in range(steps):
            grad = sdf_gradient(shape.sdf, pts)
            pts = pts - shape.sdf(pts)[:, None] * grad / (grad * grad).sum(-1, keepdim=True).clamp_min(1e-12)
        normals = torch.nn.functional.normalize(sdf_gradient(shape.sdf, pts), dim=-1)
        ok = ((shape.sdf(pts).abs() < tol) & (shape.sdf(pts + check * normals) > 0)
              & (shape.sdf(pts - check * normals) < 0))
        kept_p.append(pts[ok])
        kept_n.append(normals[ok])
        total += int(ok.sum())
        if total >= n:
            break
    else:
        raise RuntimeError(f"{shape.name}: could not find {n} surface points (is the shape empty?)")
    pts, normals = torch.cat(kept_p), torch.cat(kept_n)
    pick = torch.randperm(len(pts), generator=g)[:n]
    return pts[pick], normals[pick]


def occupancy_samples(shape: Shape, n_uniform: int, n_near: int, seed: int = 0, sigma: float = 0.02,
                      bound: float = 1.05) -> tuple[torch.Tensor, torch.Tensor]:
    """Training queries for an occupancy decoder: uniform points in [-bound, bound]^3 plus
    surface points jittered by N(0, sigma); returns points [n, 3] and occupancy (bool) [n]."""
    g = torch.Generator().manual_seed(seed)
    uniform = (torch.rand(n_uniform, 3, generator=g) * 2.0 - 1.0) * bound
    surf, _ = surface_points(shape, n_near, seed=seed + 1)
    near = surf + torch.randn(n_near, 3, generator=g) * sigma
    pts = torch.cat([uniform, near])
    return pts, shape.occupancy(pts)
