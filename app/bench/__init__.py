"""Benchmarks behind bin/bench.py: each reports images/second and ratios against a baseline
measured in the same run.

Imports any package below it (it measures them all); nothing imports it but bin/bench.py.
"""
