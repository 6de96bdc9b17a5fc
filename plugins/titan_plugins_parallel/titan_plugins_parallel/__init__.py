"""titan's parallelism strategies, one module each; ``plugin.py`` registers them.

Nothing here imports torch at module level: a strategy's module is imported only when a run
applies it (see :mod:`titan_plugins_parallel.plugin`).
"""
