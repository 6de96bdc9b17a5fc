"""titan's memory tools: the memory report of the four observation points, the
``--all-pp-ranks`` sweep, a self-contained HTML view of memory snapshots (CUDA and CPU) and the
``titan memory`` / ``titan compare`` commands.

Importing this package does not import torch: :mod:`titan_plugins_memory.plugin` registers the
records, and the modules doing the work are imported only when a run or a command needs them.
"""
