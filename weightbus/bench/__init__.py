"""Benchmarks behind ``weightbus bench``: planner scale now, GPU scenarios with the GPU data plane."""
