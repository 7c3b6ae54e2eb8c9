"""Serving glue: the Open Inference Protocol tensors, the Triton models and a local server."""
