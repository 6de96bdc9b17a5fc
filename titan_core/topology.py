"""Who this process is in the (possibly logical) job: what a comm backend's ``init`` returns.

``world_size`` and ``rank`` are logical: a backend may simulate peers (one process standing for
one rank of a larger job), and says which mesh dimensions it simulates; the trainer and the
strategies read only these generic fields, never a backend's name.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

import attrs


@attrs.define
class Topology:
    #: World size of the job this process is part of (logical when peers are simulated).
    world_size: int
    #: Global rank of this process in that job.
    rank: int
    #: Device index on this host.
    local_rank: int
    #: ``torch.device`` this process computes on.
    device: Any
    #: Name of the comm backend that built this topology (for logs and reports only).
    backend: str = "default"
    #: Mesh dimensions (``parallel_dims.MESH_DIMS``) whose peers are simulated: collectives over
    #: them complete without moving data, so received values, reduced losses and gradient norms
    #: are garbage by design and the trainer skips its checks of them. Empty for real jobs.
    simulated: frozenset[str] = frozenset()
    #: Real process groups that carry a mesh dimension's traffic instead of the mesh's own group
    #: (a backend simulating the others keeps one dimension real), by dimension name.
    groups: dict[str, Any] = attrs.field(factory=dict)
    #: ``after_first_step(mesh)``, called once after the first training step of the process, or
    #: ``None``; the default backend shortens collective timeouts to ``comm.train_timeout_seconds``.
    after_first_step: Callable[[Any], None] | None = None
    #: ``on_shutdown(completed)`` ends the backend's process groups (``None``: nothing to end).
    on_shutdown: Callable[[bool], None] | None = None
    #: ``barrier()`` waits for every process of the job (the real ones, when peers are simulated),
    #: or ``None``: the default process group's barrier, when the job has several processes. A
    #: backend whose default group simulates peers sets its own (its barrier would not wait).
    barrier: Callable[[], None] | None = None

    @property
    def simulates_peers(self) -> bool:
        """Whether any mesh dimension is simulated (then losses and norms are not meaningful)."""
        return bool(self.simulated)

    def group(self, dim: str, mesh: Any) -> Any:
        """The process group of mesh dimension ``dim``: the backend's own, else the mesh's."""
        if dim in self.groups:
            return self.groups[dim]
        return None if mesh is None else mesh[dim].get_group()

    def shutdown(self, *, completed: bool = False) -> None:
        if self.on_shutdown is not None:
            self.on_shutdown(completed)


# -- what the processes of one job must agree on, and what they tell each other when one fails --


def config_differences(configs: list[dict[str, Any]]) -> list[str]:
    """``path: rank 0 has A, rank 1 has B`` for each field of the flattened ``configs`` (one per
    rank, by rank) on which the ranks disagree, in the order of rank 0's fields."""
    differences = []
    for path in dict.fromkeys(p for c in configs for p in c):
        values: list[tuple[Any, list[int]]] = []  # each distinct value with the ranks holding it
        for rank, config in enumerate(configs):
            value = config.get(path, "<no such field>")
            for seen, ranks in values:
                if _same(seen, value):
                    ranks.append(rank)
                    break
            else:
                values.append((value, [rank]))
        if len(values) > 1:
            parts = []
            for value, ranks in values:
                who = f"rank {ranks[0]} has" if len(ranks) == 1 else f"ranks {_ranks(ranks)} have"
                text = repr(value)
                parts.append(f"{who} {text if len(text) <= 120 else text[:117] + '...'}")
            differences.append(f"{path}: {', '.join(parts)}")
    return differences


def _same(a: Any, b: Any) -> bool:
    """Equal config values, NaN included (it is not equal to itself: a plugin section's NaN made
    identical configs differ), also inside lists and tables."""
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:4])
    return shown if len(ranks) <= 4 else f"{shown} and {len(ranks) - 4} more"


def check_same_config(config: Any) -> None:
    """Every process of the job (the default process group's) resolved the same config, else one
    :class:`~titan_core.errors.UsageError` on every rank naming the fields that differ.

    A recipe reading the rank, the host or its environment gave each process another job, and
    nothing stopped it: other steps made the ranks wait in mismatched collectives (a rank that
    ended early looked like a dead peer), another model size hung until the collective timeout,
    another seed trained on without a word. Each rank gathers every rank's config (a few KB,
    once), so every rank raises the same error and none waits for another."""
    import torch.distributed as dist

    from titan_core.config import to_dict
    from titan_core.errors import UsageError

    if not dist.is_initialized():  # a backend that started no default group has no one to ask
        return
    flat: dict[str, Any] = {}
    for name, fields in to_dict(config).items():
        if isinstance(fields, dict):
            flat.update({f"{name}.{key}": value for key, value in fields.items()})
        else:  # the recipe's name
            flat[name] = fields
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, flat)
    differences = config_differences(gathered)
    if differences:
        more = f"; and {len(differences) - 3} more" if len(differences) > 3 else ""
        raise UsageError(
            f"the processes of this job resolved different configs ({len(differences)} field"
            f"{'s' if len(differences) > 1 else ''}): {'; '.join(differences[:3])}{more}; every "
            "process must run one config: a recipe that reads the rank, the host or its environment "
            "gives each process another job (titan run --print-config on each host shows what it resolves)"
        )


#: The job store's key under which a process posts why it failed (one per rank and restart).
_FAILED_KEY = "titan/failed/{restart}/{rank}"


def _failed_key(rank: int) -> str:
    """Where ``rank`` of this attempt (torchrun's restart count) posts why it failed."""
    return _FAILED_KEY.format(restart=os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), rank=rank)


def _store() -> Any:
    import torch.distributed as dist

    # Private (tests/core/test_private_torch_apis.py): the store torchrun's processes share has
    # no public getter; it outlives a failed worker (torchrun's agent hosts it).
    return dist.distributed_c10d._get_default_store()


def post_failure(rank: int, reason: str) -> None:
    """Tell the job's other processes why this one fails (:func:`peer_cause` reads it): torchrun
    shows one local rank's output by default (``LOG_RANK=0``), and the peers of a rank that
    raised fail in their next collective with nothing to say but 'a peer died'. Best effort."""
    # No store (or it went away): the peers say what they can.
    with contextlib.suppress(Exception):
        _store().set(_failed_key(rank), reason[:1000])


def peer_cause(rank: int, world_size: int) -> str | None:
    """``rank R failed first: <its reason>`` for the lowest peer that posted why it failed
    (:func:`post_failure`), else ``None``. The peer posts before it exits, and its exit is what
    fails this process's collective, so the reason is there when this is asked. Best effort."""
    try:
        store = _store()
        for peer in range(world_size):
            key = _failed_key(peer)
            if peer != rank and store.check([key]):
                return f"rank {peer} failed first: {store.get(key).decode(errors='replace')}"
    except Exception:  # no store (or it went away)
        return None
    return None
