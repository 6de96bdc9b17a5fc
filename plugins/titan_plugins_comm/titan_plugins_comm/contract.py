"""The launch contract of the fake comm backends: which logical rank one process stands for.

Both fake modes represent SPMD coordinate zero of one pipeline (PP) coordinate of a larger,
logical job. ``NGPU`` is that job's world size; with pipeline degree ``P`` each PP coordinate
holds ``NGPU / P`` flattened SPMD ranks, so the represented global rank is::

    logical_rank = pp_rank * (NGPU / P)

=============  =======================  ==================================
variable       ``fake``                 ``real_pp_fake_spmd``
=============  =======================  ==================================
NGPU           required                 required
FAKE_PP_RANK   required when P > 1      must not be set
RANK           unused                   set by torchrun: the PP coordinate
WORLD_SIZE     unused                   set by torchrun: must equal P
=============  =======================  ==================================

Every violation is a :class:`~titan_core.errors.UsageError` naming the variable, its value, the
valid range and the fix, raised before any process group or model exists. ``FAKE_PP_RANK`` set
for any other backend (``default``, a plugin's) is refused too, by the core: both backends
declare it (``CommBackend.env_vars``), and ignored it would let a normal job pass for a simulated
rank. This module reads only the environment and the config (no torch), so the checks are cheap
and testable alone.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

import attrs

from titan_core.errors import UsageError

if TYPE_CHECKING:
    from titan_core.config import TrainerConfig

DOC = "see docs/debugging.md, 'Launch contract'"


@attrs.frozen
class FakeLaunch:
    """The logical coordinate one process represents."""

    #: Logical world size (``NGPU``).
    ngpu: int
    #: Pipeline degree ``P`` (``parallelism.pp``).
    pp: int
    #: Pipeline coordinate this process represents.
    pp_rank: int

    @property
    def spmd_size(self) -> int:
        """Flattened DP x CP x TP ranks inside one PP coordinate."""
        return self.ngpu // self.pp

    @property
    def logical_rank(self) -> int:
        return self.pp_rank * self.spmd_size

    @property
    def pp_line(self) -> list[int]:
        """Logical ranks of SPMD coordinate zero of every PP coordinate (one pipeline line)."""
        return [p * self.spmd_size for p in range(self.pp)]


def _int_or_none(raw: str) -> int | None:
    """Plain decimal digits only, as run_train.sh reads them (Python's ``int`` takes ``1_6``)."""
    text = raw.strip()
    digits = text[1:] if text.startswith("-") else text
    return int(text) if digits.isascii() and digits.isdigit() else None


def read_ngpu(pp: int, env: Mapping[str, str]) -> int:
    """``NGPU``: a positive integer divisible by the pipeline degree."""
    raw = env.get("NGPU")
    fix = (
        "the fake comm backends need the logical world size. Set NGPU to the number of ranks of "
        f"the job to represent (a positive integer divisible by parallelism.pp={pp}), e.g. "
        f"NGPU={max(pp, 1) * 4}; {DOC}"
    )
    if raw is not None and raw.strip() == "":
        # Set but empty (``NGPU=$N`` with N unset): "is not set" sent the user looking for a
        # variable they had set. run_train.sh refuses it alike.
        raise UsageError(f"NGPU is set but empty ({raw!r}): {fix}")
    if raw is None:
        raise UsageError(f"NGPU is not set: {fix}")
    ngpu = _int_or_none(raw)
    if ngpu is None or ngpu < 1:
        raise UsageError(
            f"NGPU={raw!r} is not a positive integer: it is the logical world size of the job to "
            f"represent; set it to a positive integer divisible by parallelism.pp={pp}; {DOC}"
        )
    if ngpu % pp:
        lower, upper = (ngpu // pp) * pp, (ngpu // pp + 1) * pp
        nearest = f"{lower} or {upper}" if lower else f"{upper}"
        raise UsageError(
            f"NGPU={ngpu} is not divisible by the pipeline degree parallelism.pp={pp}: every PP "
            f"coordinate must hold the same number of ranks. Set NGPU to a multiple of {pp} "
            f"(e.g. {nearest}) or change parallelism.pp in the recipe; do not change model shapes "
            f"to get around it; {DOC}"
        )
    return ngpu


def pure_fake_launch(pp: int, env: Mapping[str, str]) -> FakeLaunch:
    """The coordinate of a ``fake`` run: ``FAKE_PP_RANK`` picks the PP rank (required if P > 1)."""
    ngpu = read_ngpu(pp, env)
    raw = env.get("FAKE_PP_RANK")
    valid = f"0..{pp - 1}"
    if raw is not None and raw.strip() == "":
        # Set but empty (``FAKE_PP_RANK=$P`` with P unset): read as unset, the error said "is not
        # set" with PP, and without PP the run went on as rank 0. run_train.sh refuses it alike.
        fix = (
            f"set it to the pipeline coordinate to represent, one of {valid} (parallelism.pp={pp}), "
            "or unset it and pass --all-pp-ranks to run each in turn"
            if pp > 1
            else "unset it (parallelism.pp=1: there is no pipeline coordinate to pick)"
        )
        raise UsageError(f"FAKE_PP_RANK is set but empty ({raw!r}): {fix}; {DOC}")
    if raw is None:
        if pp > 1:
            raise UsageError(
                f"FAKE_PP_RANK is not set: with parallelism.pp={pp} the fake backend represents "
                f"one pipeline coordinate and needs to know which. Set FAKE_PP_RANK to one of "
                f"{valid} (or use --all-pp-ranks to run each in turn); {DOC}"
            )
        return FakeLaunch(ngpu, pp, 0)
    pp_rank = _int_or_none(raw)
    if pp_rank is None:
        raise UsageError(
            f"FAKE_PP_RANK={raw!r} is not an integer: set it to the pipeline coordinate to "
            f"represent, one of {valid} (parallelism.pp={pp}); {DOC}"
        )
    if not 0 <= pp_rank < pp:
        fix = "unset it (there is no pipeline)" if pp == 1 else f"set it to one of {valid}"
        raise UsageError(
            f"FAKE_PP_RANK={pp_rank} is out of range for parallelism.pp={pp}: valid values are "
            f"{valid}; {fix}; {DOC}"
        )
    return FakeLaunch(ngpu, pp, pp_rank)


def hybrid_launch(pp: int, env: Mapping[str, str]) -> FakeLaunch:
    """The coordinate of a ``real_pp_fake_spmd`` run: torchrun's ``RANK`` is the PP rank."""
    if env.get("FAKE_PP_RANK") is not None:  # set empty too: run_train.sh refuses it alike
        raise UsageError(
            f"FAKE_PP_RANK={env['FAKE_PP_RANK']!r} is set, but real_pp_fake_spmd takes the "
            "pipeline coordinate from torchrun's RANK (one process per PP rank). Unset "
            f"FAKE_PP_RANK, or use --comm-backend fake to represent a single PP rank; {DOC}"
        )
    ngpu = read_ngpu(pp, env)
    raw_world, raw_rank = env.get("WORLD_SIZE") or None, env.get("RANK") or None
    if raw_world is None or raw_rank is None:
        raise UsageError(
            "WORLD_SIZE/RANK are not set: real_pp_fake_spmd must be launched by torchrun with one "
            f"process per pipeline rank, i.e. torchrun --nproc_per_node={pp} -m titan_core.train "
            f"... --comm-backend real_pp_fake_spmd (parallelism.pp={pp}); {DOC}"
        )
    world = _int_or_none(raw_world)
    if world != pp:
        raise UsageError(
            f"WORLD_SIZE={raw_world} but real_pp_fake_spmd needs exactly one physical process "
            f"per pipeline rank: WORLD_SIZE must equal parallelism.pp={pp}. Launch torchrun "
            f"with --nproc_per_node={pp} (NGPU={ngpu} stays the logical world size); {DOC}"
        )
    rank = _int_or_none(raw_rank)
    if rank is None or not 0 <= rank < pp:
        raise UsageError(
            f"RANK={raw_rank!r} is not a rank of the {pp} pipeline processes (valid: 0..{pp - 1}); "
            f"launch with torchrun --nproc_per_node={pp}; {DOC}"
        )
    return FakeLaunch(ngpu, pp, rank)


def fake_launch_check(config: TrainerConfig, processes: int) -> None:
    """``fake``'s launch check (``CommBackend.launch_check``): one plain process, never torchrun."""
    if processes > 1:
        # Every process would claim the same logical rank and overwrite the same report.
        raise UsageError(
            "comm.backend = 'fake' runs as ONE process standing for one rank of an NGPU-rank job, "
            f"but {processes} processes are launched (torchrun, WORLD_SIZE={processes}): each "
            "would claim the same logical rank and overwrite one report. Launch one plain process: "
            "COMM_BACKEND=fake NGPU=<ranks of the job> ./run_train.sh, or use --comm-backend "
            f"real_pp_fake_spmd for one process per pipeline rank; {DOC}"
        )


def hybrid_launch_check(config: TrainerConfig, processes: int) -> None:
    """``real_pp_fake_spmd``'s launch check: one process per pipeline rank, and its environment
    (:func:`hybrid_launch`) as torchrun will set it for ``processes`` processes."""
    p = config.parallelism
    pp = p.pp
    if processes != pp:
        torchrun = (
            f"NGPU=<the job's ranks> torchrun --nproc_per_node={pp} -m titan_core.train ... "
            "--comm-backend real_pp_fake_spmd"
        )
        # run_train.sh starts NGPU processes and NGPU is also the job's world size, so it can
        # launch hybrid mode only for a job of exactly pp ranks.
        fixed = [d for d in (p.dp_replicate, p.dp_shard, p.cp, p.tp) if d > 1]
        launch = (
            f"the layout needs more than {pp} ranks, so launch with torchrun: {torchrun}"
            if fixed
            else f"through run_train.sh NGPU={pp} (a job of {pp} ranks), or for a larger job: {torchrun}"
        )
        raise UsageError(
            f"real_pp_fake_spmd needs one process per pipeline rank, but {processes} processes are "
            f"launched (WORLD_SIZE={processes}) and parallelism.pp={pp}. Launch {pp}: {launch}; {DOC}"
        )
    hybrid_launch(pp, {**os.environ, "WORLD_SIZE": str(processes), "RANK": os.environ.get("RANK") or "0"})
