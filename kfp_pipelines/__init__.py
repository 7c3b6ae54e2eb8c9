"""Kubeflow pipelines of cube-serve: one pipeline per module, its compiled YAML beside it."""
