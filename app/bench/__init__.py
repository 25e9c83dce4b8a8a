"""Benchmarks behind bin/bench.py: each reports images/second and ratios against a baseline
measured in the same run."""
