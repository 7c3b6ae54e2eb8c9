# The adapter lives in the cubeserve package so that every version directory (one per
# checkpoint version) runs the same code: see cubeserve/serving/triton_engine.py.
from cubeserve.serving.triton_engine import EngineModel as TritonPythonModel  # noqa: F401
