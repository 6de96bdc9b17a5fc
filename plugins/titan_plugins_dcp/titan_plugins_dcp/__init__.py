"""titan's checkpointer plugin: torch.distributed.checkpoint (DCP) save, resume and seed checkpoints.

Importing this package does not import torch; the checkpointer lives in
:mod:`titan_plugins_dcp.checkpointer` and is imported only when a run enables checkpointing.
"""
