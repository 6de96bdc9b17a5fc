"""Parallel degrees of a run, their validation, and the DeviceMesh built from them.

The mesh's dimensions are, outermost first, ``pp, dp_replicate, dp_shard, cp, tp``. Expert
parallelism borrows its ranks from ``dp_shard x cp`` (as in torchtitan), so it adds no dimension.
Every degree error is raised before any model is built.
"""

from __future__ import annotations

from typing import Any

import attrs

from titan_core.errors import UsageError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@attrs.frozen
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    world_size: int

    @classmethod
    def from_config(cls, parallelism: Any, world_size: int) -> ParallelDims:
        """Resolve ``dp_shard=-1`` and check every degree against ``world_size``.

        Each violation raises one :class:`UsageError` naming all degrees, the world size and
        what to change (:func:`degree_error`).
        """
        p = parallelism
        others = p.dp_replicate * p.cp * p.tp * p.pp
        dp_shard = p.dp_shard
        if dp_shard == -1:
            if world_size % others:
                raise degree_error(
                    p,
                    world_size,
                    f"dp_replicate*cp*tp*pp = {others} does not divide the world size",
                    f"launch a multiple of {others} ranks (NGPU), or lower the degrees so their "
                    f"product divides {world_size}",
                )
            dp_shard = world_size // others
        if dp_shard * others != world_size:
            raise degree_error(
                p,
                world_size,
                f"their product is {dp_shard * others}, it must equal the world size",
                "set parallelism.dp_shard = -1 to fill the remaining ranks, change the degrees, or "
                f"launch {dp_shard * others} ranks (NGPU)",
            )
        if (dp_shard * p.cp) % p.ep:
            raise degree_error(
                p,
                world_size,
                f"ep={p.ep} does not divide dp_shard*cp = {dp_shard * p.cp} (expert parallelism "
                "borrows its ranks from the data-sharding and context axes)",
                f"pick an ep that divides {dp_shard * p.cp}, or raise dp_shard or cp",
            )
        return cls(p.dp_replicate, dp_shard, p.cp, p.tp, p.pp, p.ep, world_size)

    # -- which axes are in use --------------------------------------------------------------------

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard * self.cp > 1

    @property
    def non_data_parallel_size(self) -> int:
        return self.cp * self.tp * self.pp

    def degrees(self) -> dict[str, int]:
        return {d: getattr(self, d) for d in (*MESH_DIMS, "ep")}

    def coordinates(self, rank: int) -> dict[str, int]:
        """Mesh coordinates of a global rank (row-major over ``MESH_DIMS``)."""
        coords: dict[str, int] = {}
        for dim in reversed(MESH_DIMS):
            size = getattr(self, dim)
            coords[dim] = rank % size
            rank //= size
        return {d: coords[d] for d in MESH_DIMS}

    def build_mesh(self, device_type: str) -> Meshes:
        """The world DeviceMesh and the flattened views strategies use."""
        from torch.distributed.device_mesh import init_device_mesh

        world = init_device_mesh(
            device_type, tuple(getattr(self, d) for d in MESH_DIMS), mesh_dim_names=MESH_DIMS
        )
        return Meshes(world, {name: world[dims]._flatten(name) for name, dims in FLATTENED.items()})


#: Flattened views of the world mesh: FSDP shards over ``dp_shard_cp``, losses are averaged over
#: ``dp_cp``, the data loader's rank runs over ``dp``.
FLATTENED = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}


@attrs.frozen
class Meshes:
    """The world mesh and its flattened views, indexed like a DeviceMesh: ``meshes["tp"]``.

    The views are kept as ``DeviceMesh._flatten`` returned them (the private API torchtitan relies
    on too; torch 2.11-2.14 has no public one): since torch 2.11, slicing a flattened dimension
    back out of the world mesh is deprecated, and torch asks callers to keep the views instead.
    """

    world: Any
    flattened: dict[str, Any]

    def __getitem__(self, dims: str | tuple[str, ...]) -> Any:
        if isinstance(dims, str) and dims in self.flattened:
            return self.flattened[dims]
        return self.world[dims]


def degree_error(parallelism: Any, world_size: int, problem: str, fix: str) -> UsageError:
    """The one message of a layout that does not fit: degrees, world size, problem and fix."""
    p = parallelism
    degrees = f"dp_replicate={p.dp_replicate} dp_shard={p.dp_shard} cp={p.cp} tp={p.tp} pp={p.pp} ep={p.ep}"
    return UsageError(
        f"parallel degrees {degrees} do not fit the world size {world_size}: {problem}. "
        f"Fix: {fix} (parallelism.* in the recipe)"
    )
