"""Benchmarks of the embedded inference engine and the weight-sync path; run with `python -m bench`."""
