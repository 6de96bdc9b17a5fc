"""titan's profiler plugin: torch.profiler traces and memory snapshots (CUDA, or a CPU tensor account).

Importing this package does not import torch; the session lives in
:mod:`titan_plugins_profiler.session` and is imported only when a run enables profiling.
"""
