"""Procedural shapes with signed distance functions and prompts that describe them.

Every shape is a `Shape`: a class name, its sampled parameters, a prompt whose size and
proportion words follow those parameters, and an SDF (torch, vectorised over [..., 3] points,
negative inside). Occupancy is `sdf < 0`.

Conventions:
* +y is up (glTF, as Cube's meshes): revolved shapes (cylinder, cone, capsule, mug) have their
  axis along y, and "tall", "flat", "low" refer to the y extent.
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
MIN_SIZE = 0.5
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
    params: dict  # sampled parameters, in the shape's local units, plus "size", "yaw", "tilt"
    prompt: str
    sdf: SDF = field(repr=False, compare=False)  # world frame, [..., 3] -> [...], negative inside

    def occupancy(self, points: torch.Tensor) -> torch.Tensor:
        return self.sdf(points) < 0


def _finish(name, params, prompt, local: SDF, lo, hi, rng: np.random.Generator, tilt_max: float) -> Shape:
    """Orient (random yaw about y, a small tilt), then centre and scale so the bounding box fits
    [-size, size]^3. The box of the rotated local box's corners is conservative, so the shape
    itself fits too; it is exact for boxes, tables and chairs with rectangular tops, but up to
    sqrt(2) too large for a yawed round table or mug and ~20% for a tilted solid of revolution,
    so `size` is an upper bound on the half-extent (see the report: support functions next)."""
    yaw = float(rng.uniform(0.0, 2.0 * math.pi))
    tilt = float(rng.uniform(-tilt_max, tilt_max)) if tilt_max > 0 else 0.0
    if name in _REVOLVED:
        # Yaw does not change a solid of revolution but would inflate its rotated corner box
        # by up to sqrt(2): leave it out so the shape fills its `size`.
        yaw = 0.0
    rot = _rot_y(yaw) @ _rot_x(tilt)
    corners = np.array([[x, y, z] for x in (lo[0], hi[0]) for y in (lo[1], hi[1]) for z in (lo[2], hi[2])])
    moved_corners = corners @ rot.T
    c_lo, c_hi = moved_corners.min(0), moved_corners.max(0)
    centre, half = (c_lo + c_hi) / 2, float((c_hi - c_lo).max() / 2)
    size = params["size"]
    s = size / half
    rot_t = torch.tensor(rot, dtype=torch.float32)
    shift = torch.tensor(-centre * s, dtype=torch.float32)

    def sdf(p):
        local_p = ((p - shift.to(p)) / s) @ rot_t.to(p)  # x_local = R^T (x - t) / s
        return local(local_p) * s  # uniform scaling scales distances

    params = dict(params, yaw=yaw, tilt=tilt, scale=s)
    return Shape(name=name, params=params, prompt=prompt, sdf=sdf)


def _size_word(size: float) -> str:
    if size < 0.62:
        return "small "
    if size > 0.85:
        return "large "
    return ""


def _pick(rng: np.random.Generator, options):
    return options[int(rng.integers(len(options)))]


# -- classes: each draws parameters from rng, builds the local SDF and its bounding box, and words
# the prompt from the same parameters --------------------------------------------------------------

def _sphere(rng, size):
    word = _pick(rng, ["ball", "sphere", "orb"])
    return dict(r=1.0), f"a {_size_word(size)}{word}", sphere_sdf(1.0), (-1, -1, -1), (1, 1, 1), 0.0


def _box(rng, size):
    hx, hy, hz = (float(v) for v in rng.uniform(0.15, 1.0, 3))
    horiz_min, horiz_max = min(hx, hz), max(hx, hz)
    if max(hx, hy, hz) < 1.2 * min(hx, hy, hz):
        desc = _pick(rng, ["cube", "cubic block"])
    elif hy < 0.4 * horiz_min:
        desc = _pick(rng, ["flat box", "flat slab", "thin plank"])
    elif hy > 1.8 * horiz_max:
        desc = _pick(rng, ["tall box", "tall pillar", "tall block"])
    elif horiz_max > 2.0 * horiz_min:
        desc = _pick(rng, ["long box", "long brick"])
    else:
        desc = _pick(rng, ["box", "block", "crate"])
    params = dict(hx=hx, hy=hy, hz=hz)
    return params, f"a {_size_word(size)}{desc}", box_sdf((hx, hy, hz)), (-hx, -hy, -hz), (hx, hy, hz), 0.25


def _aspect_word(height_over_width: float, tall: list[str], flat: list[str], rng) -> str:
    """"tall thin" / "tall" / "" / "short" / "flat" from height / diameter."""
    if height_over_width > 2.5:
        return _pick(rng, tall) + " "
    if height_over_width > 1.4:
        return "tall "
    if height_over_width < 0.35:
        return _pick(rng, flat) + " "
    if height_over_width < 0.7:
        return "short "
    return ""


def _cylinder(rng, size):
    r, half_h = float(rng.uniform(0.15, 1.0)), float(rng.uniform(0.1, 1.0))
    aspect = half_h / r  # height / diameter
    word = _aspect_word(aspect, ["tall thin"], ["flat"], rng)
    nouns = ["cylinder", "tube", "column"] if aspect > 1.4 else ["cylinder", "can"]
    noun = "disc" if aspect < 0.35 else _pick(rng, nouns)
    params = dict(r=r, half_h=half_h)
    box = (-r, -half_h, -r), (r, half_h, r)
    return params, f"a {_size_word(size)}{word}{noun}", cylinder_sdf(r, half_h), *box, 0.25


def _cone(rng, size):
    r, half_h = float(rng.uniform(0.2, 1.0)), float(rng.uniform(0.2, 1.0))
    aspect = half_h / r
    word = _aspect_word(aspect, ["tall pointy", "tall thin"], ["flat"], rng)
    noun = _pick(rng, ["cone", "spike"]) if aspect > 1.4 else "cone"
    params = dict(r=r, half_h=half_h)
    return params, f"a {_size_word(size)}{word}{noun}", cone_sdf(r, half_h), (-r, -half_h, -r), (r, half_h, r), 0.25


def _torus(rng, size):
    major = 1.0
    minor = float(rng.uniform(0.12, 0.6))
    if minor < 0.25:
        desc = _pick(rng, ["thin ring", "thin hoop"])
    elif minor > 0.45:
        desc = _pick(rng, ["fat donut", "thick ring"])
    else:
        desc = _pick(rng, ["donut", "torus", "ring"])
    e = major + minor
    params = dict(major=major, minor=minor)
    return params, f"a {_size_word(size)}{desc}", torus_sdf(major, minor), (-e, -minor, -e), (e, minor, e), 0.25


def _capsule(rng, size):
    r, half_h = float(rng.uniform(0.2, 0.7)), float(rng.uniform(0.1, 1.0))
    aspect = (half_h + r) / r  # total height / diameter
    word = "tall " if aspect > 2.2 else ""
    noun = _pick(rng, ["capsule", "pill"])
    e = half_h + r
    params = dict(r=r, half_h=half_h)
    return params, f"a {_size_word(size)}{word}{noun}", capsule_sdf(r, half_h), (-r, -e, -r), (r, e, r), 0.25


def _legs(xs, zs, y_lo, y_hi, thick, round_legs):
    """Four legs from y_lo to y_hi at (+-xs, +-zs)."""
    half = (y_hi - y_lo) / 2
    leg = cylinder_sdf(thick, half) if round_legs else box_sdf((thick, half, thick))
    mid = (y_lo + y_hi) / 2
    return [moved(leg, (sx * xs, mid, sz * zs)) for sx in (-1, 1) for sz in (-1, 1)]


def _table(rng, size):
    w, d = float(rng.uniform(0.6, 1.0)), float(rng.uniform(0.4, 1.0))
    height = float(rng.uniform(0.3, 1.6))  # floor to top surface
    top_t = float(rng.uniform(0.05, 0.12))
    leg_t = float(rng.uniform(0.05, 0.1))
    round_top = bool(rng.random() < 0.3)
    round_legs = bool(rng.random() < 0.5)
    if round_top:
        d = w
        top = moved(cylinder_sdf(w, top_t / 2), (0.0, height - top_t / 2, 0.0))
        inset = w * 0.6  # legs well inside the disc
        legs = _legs(inset, inset, 0.0, height - top_t, leg_t, round_legs)
    else:
        top = moved(box_sdf((w, top_t / 2, d)), (0.0, height - top_t / 2, 0.0))
        legs = _legs(w - leg_t - 0.03, d - leg_t - 0.03, 0.0, height - top_t, leg_t, round_legs)
    if height < 0.6:
        height_word = "low coffee "
    else:
        height_word = "tall bar " if height > 1.3 else _pick(rng, ["", "wooden ", "dining "])
    shape_word = "round " if round_top else ""
    params = dict(w=w, d=d, height=height, top_t=top_t, leg_t=leg_t, round_top=round_top, round_legs=round_legs)
    return params, f"a {shape_word}{height_word}table", union(top, *legs), (-w, 0.0, -d), (w, height, d), 0.0


def _mug(rng, size):
    r, half_h = float(rng.uniform(0.4, 0.7)), float(rng.uniform(0.4, 1.0))
    wall = float(rng.uniform(0.06, 0.12))
    body = cup_sdf(r, half_h, wall)
    h_major = float(rng.uniform(0.25, 0.45)) * half_h * 1.6
    h_minor = float(rng.uniform(0.05, 0.09))
    # A ring in the xy plane (axis z) centred on the wall at +x; the part inside the body's radius
    # is cut off so the handle never pokes into the cavity.
    ring = moved(torus_sdf(h_major, h_minor), (r, 0.0, 0.0), _rot_x(math.pi / 2))

    def handle(p):  # intersection (max) of the ring with the outside of the body's cylinder
        return torch.maximum(ring(p), r - (p[..., 0] ** 2 + p[..., 2] ** 2).clamp_min(1e-30).sqrt())
    aspect = half_h / r
    word = "tall " if aspect > 1.3 else ("wide " if aspect < 0.8 else "")
    noun = _pick(rng, ["mug", "coffee mug", "cup with a handle"])
    reach = r + h_major + h_minor
    params = dict(r=r, half_h=half_h, wall=wall, handle_major=h_major, handle_minor=h_minor)
    return (params, f"a {word}{noun}", union(body, handle),
            (-r, -half_h, -r), (reach, half_h, r), 0.0)


def _chair(rng, size):
    w, d = float(rng.uniform(0.4, 0.6)), float(rng.uniform(0.4, 0.6))
    seat_h = float(rng.uniform(0.6, 0.9))
    seat_t = float(rng.uniform(0.06, 0.1))
    back_h = float(rng.uniform(0.4, 1.2))
    back_t = float(rng.uniform(0.05, 0.08))
    leg_t = float(rng.uniform(0.04, 0.07))
    round_legs = bool(rng.random() < 0.5)
    seat = moved(box_sdf((w, seat_t / 2, d)), (0.0, seat_h - seat_t / 2, 0.0))
    back = moved(box_sdf((w, back_h / 2, back_t / 2)), (0.0, seat_h + back_h / 2, -d + back_t / 2))
    legs = _legs(w - leg_t, d - leg_t, 0.0, seat_h - seat_t, leg_t, round_legs)
    word = "high-backed " if back_h > 0.9 else ("low-backed " if back_h < 0.6 else _pick(rng, ["", "wooden "]))
    params = dict(w=w, d=d, seat_h=seat_h, seat_t=seat_t, back_h=back_h, back_t=back_t, leg_t=leg_t,
                  round_legs=round_legs)
    return params, f"a {word}chair", union(seat, back, *legs), (-w, 0.0, -d), (w, seat_h + back_h, d), 0.0


_CLASSES = {
    "sphere": _sphere, "box": _box, "cylinder": _cylinder, "cone": _cone, "torus": _torus,
    "capsule": _capsule, "table": _table, "mug": _mug, "chair": _chair,
}
CLASSES: tuple[str, ...] = tuple(_CLASSES)
_REVOLVED = {"sphere", "cylinder", "cone", "torus", "capsule"}


def make_shape(name: str, rng: np.random.Generator) -> Shape:
    """One shape of class `name` drawn from rng."""
    size = float(rng.uniform(MIN_SIZE, MAX_SIZE))
    params, prompt, local, lo, hi, tilt_max = _CLASSES[name](rng, size)
    return _finish(name, dict(params, size=size), prompt, local, lo, hi, rng, tilt_max)


def _shapes(n: int, seed_words: list[int], classes) -> list[Shape]:
    classes = tuple(classes) if classes is not None else CLASSES
    unknown = set(classes) - set(CLASSES)
    if unknown:
        raise ValueError(f"unknown shape classes {sorted(unknown)}; known: {list(CLASSES)}")
    # Classes cycle so every class is equally represented; each shape has its own stream.
    return [make_shape(classes[i % len(classes)], np.random.default_rng(seed_words + [i])) for i in range(n)]


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
