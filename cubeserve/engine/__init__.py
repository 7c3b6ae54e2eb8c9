"""The generation engine: requests, KV cache, cached decode, sampling and geometry."""

from cubeserve.engine.engine import Engine, GenerationResult
from cubeserve.engine.requests import GenerationRequest, InvalidRequest

__all__ = ["Engine", "GenerationResult", "GenerationRequest", "InvalidRequest"]
