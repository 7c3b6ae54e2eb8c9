"""A PNG preview of a mesh, drawn with numpy and Pillow only (no GPU, no torch), so the
client and the server can both make one."""

from __future__ import annotations

import io

import numpy as np


def render_preview(vertices: np.ndarray, faces: np.ndarray, size: int = 512, message: str = "") -> bytes:
    """Flat-shaded three-quarter view with a fixed light; painter's algorithm."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), (245, 245, 245))
    if len(faces) == 0:
        ImageDraw.Draw(img).text((10, 10), message or "empty mesh", fill=(120, 0, 0))
    else:
        v, f = np.asarray(vertices, np.float64), np.asarray(faces)
        ay, ax = np.radians(35.0), np.radians(-25.0)  # rotate about y, then tilt about x
        ry = np.array([[np.cos(ay), 0, np.sin(ay)], [0, 1, 0], [-np.sin(ay), 0, np.cos(ay)]])
        rx = np.array([[1, 0, 0], [0, np.cos(ax), -np.sin(ax)], [0, np.sin(ax), np.cos(ax)]])
        p = v @ (rx @ ry).T
        tri = p[f]
        normals = np.cross(tri[:, 1] - tri[:, 0], tri[:, 2] - tri[:, 0])
        normals /= np.linalg.norm(normals, axis=1, keepdims=True) + 1e-12
        light = np.array([0.3, 0.5, 0.8]) / np.linalg.norm([0.3, 0.5, 0.8])
        shade = np.abs(normals @ light) * 0.75 + 0.25
        scale = 0.9 * size / max(np.ptp(p[:, 0]), np.ptp(p[:, 1]), 1e-6)
        center = (p[:, :2].max(0) + p[:, :2].min(0)) / 2
        xy = (p[:, :2] - center) * scale * np.array([1, -1]) + size / 2
        draw = ImageDraw.Draw(img)
        for i in np.argsort(tri[:, :, 2].mean(axis=1)):  # far to near (the viewer looks down -z)
            c = int(60 + 170 * shade[i])
            draw.polygon([tuple(xy[j]) for j in f[i]], fill=(c // 2, c // 2 + 20, c))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def render_mesh_file(data: bytes, file_type: str, size: int = 512) -> bytes:
    """Preview of a GLB/OBJ file's bytes."""
    import trimesh

    mesh = trimesh.load(io.BytesIO(data), file_type=file_type, force="mesh", process=False)
    faces = getattr(mesh, "faces", np.zeros((0, 3), np.int64))
    vertices = getattr(mesh, "vertices", np.zeros((0, 3)))
    return render_preview(vertices, faces, size, message="" if len(faces) else "empty mesh")
