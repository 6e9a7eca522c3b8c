"""Benchmark tools: a simulated shared file system and a Pynamic-like workload."""
