# The predict-API adapter lives in the cubeserve package so that every version directory runs
# the same code: see cubeserve/serving/triton_predict.py.
from cubeserve.serving.triton_predict import PredictModel as TritonPythonModel  # noqa: F401
