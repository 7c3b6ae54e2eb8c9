"""The generation engine: requests, KV cache, cached decode, sampling, batching and geometry.

Names are imported lazily so that torch-free users (the request/protocol code in the client
and in the predict-API model) do not pay for importing torch.
"""

__all__ = ["Engine", "GenerationResult", "Timings", "GenerationRequest", "InvalidRequest", "Unavailable"]


def __getattr__(name):
    if name in ("Engine", "GenerationResult", "Timings"):
        from cubeserve.engine import engine

        return getattr(engine, name)
    if name in ("GenerationRequest", "InvalidRequest", "Unavailable"):
        from cubeserve import requests

        return getattr(requests, name)
    raise AttributeError(name)
