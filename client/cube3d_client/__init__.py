"""A client for cube-serve's predict API (Open Inference Protocol v2, REST and gRPC)."""

from cube3d_client.client import Cube3DClient, MeshResult, ServerError

__all__ = ["Cube3DClient", "MeshResult", "ServerError"]
