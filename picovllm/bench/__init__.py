"""Benchmarks: fixed workloads (workloads.py) and their runners (throughput.py, latency.py, serve.py)."""
