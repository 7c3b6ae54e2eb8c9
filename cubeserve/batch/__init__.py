"""Batch generation on Ray Data: a prompts file (JSONL or Parquet) to meshes and a results table,
streaming, resumable, on this machine or a Ray cluster (`cubeserve batch`; docs/batch.md).
rows.py reads the input, stages.py holds the decode, geometry and write stages,
run.py the pipeline, results.py the table, kuberay.py the RayJob that runs it on Kubernetes."""
