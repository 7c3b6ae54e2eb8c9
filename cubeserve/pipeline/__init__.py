"""The checkpoint pipeline's steps as plain functions (kfp_pipelines/ wraps each in a KFP
component): validate, evaluate, gate, package, register, roll out. Tests call them directly."""
