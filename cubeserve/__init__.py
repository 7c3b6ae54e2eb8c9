"""cube-serve: serving Roblox's Cube 3D text-to-3D models."""

__version__ = "0.1.0"
