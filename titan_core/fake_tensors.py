"""Shape-only steps (``debug.fake_tensors``) for runs whose peers are simulated.

When a comm backend simulates this rank's peers, every received activation is garbage by design:
what such a run is for is shapes, sizes and memory. Computing the values anyway is what makes a
rank of a large job slow on a CPU (an 8192-token sequence through 32 bf16 layers, recomputed by
activation checkpointing, takes many minutes on two cores). Under PyTorch's ``FakeTensorMode``,
entered once the model is sharded on the meta device, tensors carry shapes, dtypes, devices and
storage sizes but no data, and no kernel runs: ``to_empty`` creates fake parameters, the step's
operators only propagate metadata, and a storage-level memory account (the memory report's
tracker) sees the same allocations a computed step makes.

What is skipped follows: parameters are not initialised (nor loaded from
``checkpoint.initial_load_path``), batches are zeros of the right shape (no tokenization of the
job's whole stream), and the loss and gradient norm are logged as NaN. Sizes that are values
(how many tokens a mixture-of-experts router sends to each expert and rank) are taken as an
even split (:func:`even_split`): a fake step's memory is that of perfectly balanced routing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from titan_core.errors import UsageError

if TYPE_CHECKING:
    import torch

    from titan_core.records import ModelSpec
    from titan_core.topology import Topology


def wanted(setting: str, topology: Topology, spec: ModelSpec, device: torch.device) -> bool:
    """Whether this run's steps run on fake tensors; ``on`` where it cannot is one error.

    ``auto`` picks them on the CPU when every peer is simulated (no real group carries values)
    and the model's shapes do not depend on values. On CUDA it computes: the fake backends'
    memory figures there are the caching allocator's, which needs real allocations.
    """
    if setting == "off":
        return False
    if setting == "on":
        if not topology.simulates_peers or topology.groups:
            real = f"real {', '.join(sorted(topology.groups))} peers" if topology.groups else "real ones"
            raise UsageError(
                "debug.fake_tensors = 'on' needs a comm backend that simulates its peers "
                f"(this run's {topology.backend!r} backend has {real}, so values matter); "
                "set debug.fake_tensors = 'auto' or use --comm-backend fake"
            )
        if not spec.runs_on_fake_tensors:
            raise UsageError(
                f"debug.fake_tensors = 'on': model {spec.name!r} has shapes that depend on values "
                "(its ModelSpec sets runs_on_fake_tensors = False), so it cannot run on fake "
                "tensors; set debug.fake_tensors = 'auto' (it computes)"
            )
        return True
    # Every peer simulated: a backend keeping one dimension real (real PP groups) sends values.
    every_peer_simulated = topology.simulates_peers and not topology.groups
    return every_peer_simulated and spec.runs_on_fake_tensors and device.type == "cpu"


def fake_mode() -> Any:
    """The mode the trainer enters before materialising the model (leaves it at ``close``).

    Real tensors created inside (a batch, an optimizer's step counter) become fake when an
    operator meets them (``allow_non_fake_inputs``).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def is_fake(t: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(getattr(t, "_local_tensor", t), FakeTensor)


def even_split(total: int, parts: int) -> list[int]:
    """``total`` in ``parts`` sizes differing by at most one: the split a value-dependent size
    (tokens per expert, per rank) is taken to be on fake tensors, where values do not exist."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


class ZeroBatches:
    """Batches of token id 0 of ``batch_size x seq_len`` (inputs and labels), forever."""

    def __init__(self, batch_size: int, seq_len: int) -> None:
        self.batch_size = batch_size
        self.seq_len = seq_len

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        import torch

        data = torch.zeros(self.batch_size, self.seq_len + 1, dtype=torch.long)
        while True:
            yield data[:, :-1], data[:, 1:]
