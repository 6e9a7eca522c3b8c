"""Benchmark tools, reached only from ``mpistage bench``: a simulated shared
file system, workloads, the start-up sweep, the data benchmark and the model
of start-up at scale."""
