"""titan's profiler plugin: torch.profiler traces and CUDA memory snapshots.

Importing this package does not import torch; the session lives in
:mod:`titan_plugins_profiler.session` and is imported only when a run enables profiling.
"""
