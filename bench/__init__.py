"""Benchmarks behind `make bench`: they write BENCHMARKS.md tables and bench/results.json."""
