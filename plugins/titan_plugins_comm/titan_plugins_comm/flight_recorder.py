"""The flight recorder under gloo: every rank dumps its recent collectives when one fails.

PyTorch's gloo process groups record their collectives in the same flight recorder as NCCL
(``TORCH_FR_BUFFER_SIZE`` entries: process group, sequence number, operator, sizes, dtypes, the
Python stack), but only NCCL's watchdog dumps it on a timeout. Under gloo a collective that
times out raises on the rank that waited (``Timed out waiting ...ms``); the rank that stalled is
typically still busy elsewhere and never notices. This callback closes the gap, as NCCL's
``TORCH_NCCL_DUMP_ON_TIMEOUT`` does:

- when an exception leaves the training loop on any rank (a collective timeout, a peer that
  went away, or any other failure that would leave the peers waiting), that rank writes its trace
  and asks every rank to write theirs through the job's store (key ``titan_fr/dump``), then waits
  up to :data:`ACK_SECONDS` for them before the error propagates;
- every rank runs a small watchdog thread that watches that key, so a rank stuck outside
  collectives (in a slow data loader, a long ``time.sleep``, a Python loop releasing the GIL)
  still dumps what it last did.

Dumps go to ``<job.dump_folder>/comm_traces/rank_<rank>``, the names NCCL's dumps get there:
the pickle of ``torch._C._distributed_c10d._dump_fr_trace`` (the NCCL dump format, version 2.x)
plus a ``titan`` entry (rank, world size, backend, each process group's global ranks, the
error, the time of the dump), because gloo's own dump leaves the groups' ranks empty.
``titan fr analyze FOLDER`` reads them (and NCCL's).

Private torch APIs used (no public equivalent in torch 2.11-2.14): ``_dump_fr_trace`` (the
flight recorder's dump), ``distributed_c10d._get_default_store`` (the job's store) and
``distributed_c10d._world.pg_names`` (process group names, to record each group's ranks).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import socket
import threading
import time
from typing import Any

from titan_core.log import get_logger

log = get_logger("titan.comm")

DUMP_KEY = "titan_fr/dump"
ACK_PREFIX = "titan_fr/dumped/"
#: How long the failing rank waits for its peers' dumps before the error propagates.
ACK_SECONDS = 20.0
#: How often the watchdog thread looks for a dump request (one store lookup per rank each time).
POLL_SECONDS = 1.0


def dump_path(dump_folder: str, rank: int) -> str:
    return os.path.join(dump_folder, "comm_traces", f"rank_{rank}")


def _group_ranks() -> dict[str, list[int]]:
    """Global ranks of every process group this rank knows, by the name its trace entries carry."""
    import torch.distributed as dist

    names = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_names", None) or {}
    out: dict[str, list[int]] = {}
    for group, name in list(names.items()):
        try:
            out[str(name)] = dist.get_process_group_ranks(group)
        except Exception:  # a group of a foreign backend, or one being destroyed
            continue
    return out


def gloo_groups(topology: Any) -> list[Any]:
    """The real gloo groups of this run: the default group, or a backend's own groups."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return []
    candidates = [None, *(getattr(topology, "groups", None) or {}).values()]
    found = []
    for group in candidates:
        try:
            backend = str(dist.get_backend(group))
        except Exception:
            continue
        if "gloo" in backend:
            found.append(group)
    return found


class GlooFlightRecorder:
    """The ``flight_recorder`` callback: dumps on failure, and on a peer's request."""

    def __init__(self, dump_folder: str, rank: int, peers: list[int], store: Any) -> None:
        self.path = dump_path(dump_folder, rank)
        self.rank = rank
        #: Global ranks of the processes that really exist (the members of the real gloo group).
        self.peers = peers
        self.store = store
        self.step = 0
        self._dumped = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    # -- the loop's calls ----------------------------------------------------------------------------

    def on_train_start(self, step: int) -> None:
        self.step = step
        if self.store is not None:
            self._thread = threading.Thread(target=self._watch, name="titan-fr-watchdog", daemon=True)
            self._thread.start()

    def on_step_end(self, step: int, metrics: Any, last: bool) -> None:
        self.step = step

    def on_train_end(self, step: int) -> None:
        self._stop.set()

    def on_failure(self, step: int, exc: BaseException) -> None:
        """Dump, ask every rank to dump, and wait (bounded) for them."""
        self.step = step
        reason = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:500] if str(exc).strip() else ''}"
        self.dump(reason)
        if self.store is None:
            return
        try:
            self.store.set(DUMP_KEY, f"rank {self.rank} at step {step}: {reason}")
            keys = [f"{ACK_PREFIX}{r}" for r in self.peers if r != self.rank]
            deadline = time.monotonic() + ACK_SECONDS
            while keys and time.monotonic() < deadline:
                keys = [k for k in keys if not self.store.check([k])]
                if keys:
                    time.sleep(POLL_SECONDS)
            if keys:
                log.warning(
                    "flight recorder: some ranks did not dump", missing=[k.rsplit("/", 1)[1] for k in keys]
                )
        except Exception as store_exc:  # the store went away with a peer: nothing more to ask
            log.warning("flight recorder: cannot ask the other ranks to dump", error=str(store_exc))
        finally:
            self._stop.set()

    # -- dumping -------------------------------------------------------------------------------------

    def _watch(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            try:
                requested = self.store.check([DUMP_KEY])
            except Exception:  # the store is gone (the job is ending)
                return
            if requested:
                try:
                    reason = self.store.get(DUMP_KEY).decode(errors="replace")
                except Exception:
                    reason = "requested by a peer"
                self.dump(f"requested: {reason}")
                return

    def dump(self, reason: str) -> str | None:
        """Write this rank's trace once; returns its path (``None`` if torch cannot dump)."""
        with self._lock:
            if self._dumped.is_set():
                return self.path
            import torch._C._distributed_c10d as c10d

            dump = getattr(c10d, "_dump_fr_trace", None)
            if dump is None:
                log.warning("this torch has no flight-recorder dump for gloo; nothing written")
                return None
            data = pickle.loads(dump(True, True, False))
            data["titan"] = {
                "rank": self.rank,
                "ranks": self.peers,
                "backend": "gloo",
                "hostname": socket.gethostname(),
                "pid": os.getpid(),
                "step": self.step,
                "reason": reason,
                "dump_time_ns": time.time_ns(),
                "pg_ranks": _group_ranks(),
            }
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            tmp = f"{self.path}.tmp{os.getpid()}"
            with open(tmp, "wb") as f:
                pickle.dump(data, f)
            os.replace(tmp, self.path)
            self._dumped.set()
        with contextlib.suppress(Exception):  # the store may be gone with a peer
            self.store.set(f"{ACK_PREFIX}{self.rank}", "1")
        log.error(
            "flight recorder trace written",
            path=self.path,
            entries=len(data.get("entries", [])),
            reason=reason,
        )
        return self.path


#: Where a run moves the dumps an earlier attempt left under its ranks' names: one folder per
#: attempt, ``earlier/<time>/`` (:func:`attempt_name`).
EARLIER = "earlier"
_DUMP_NAME = re.compile(r"^rank_(\d+)$")
#: The store key through which the processes of one attempt agree on its folder name.
ATTEMPT_KEY = "titan_fr/attempt"


def attempt_name(store: Any = None, processes: list[int] | None = None) -> str:
    """The name of the folder this attempt moves the earlier dumps into: the UTC time it started,
    to the microsecond (sorted by name, the folders are in the order they were moved aside).

    Every process of the attempt must use the same name, or one attempt's dumps would be split
    over folders: with several processes the first to ask sets it in the job's store (which is
    the attempt's own: torchrun gives each restart a store prefix of its own) and the others read
    it. Without a store (one process) the name is this process's."""
    now = time.time_ns()
    mine = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now // 10**9)) + f".{now // 1000 % 10**6:06d}Z"
    if store is None or len(processes or []) <= 1:
        return mine
    try:
        agreed = store.compare_set(ATTEMPT_KEY, "", mine)
    except Exception as exc:  # a store without compare_set: each process names its own
        log.warning("flight recorder: no folder agreed for the earlier dumps", error=str(exc))
        return mine
    name = agreed.decode(errors="replace") if isinstance(agreed, bytes) else str(agreed)
    return name if re.fullmatch(r"[0-9T.Z]+", name) else mine


def retire_earlier_dumps(
    dump_folder: str, rank: int, processes: list[int], attempt: str | None = None
) -> list[str]:
    """Move the dumps an earlier run or attempt left in ``comm_traces/`` to
    ``comm_traces/earlier/<attempt>/``.

    ``titan fr analyze`` reads every ``rank_<r>`` of the folder: a dump left by an earlier hang,
    beside this run's (or alone, when this run does not hang or a hung rank writes nothing), would
    name a rank "behind" in this run. They are kept, not removed: they are the evidence of the hang
    this attempt is made to fix (``--overwrite`` removes the whole folder, ``Callback.outputs``).
    Each attempt's go to a folder of their own (``attempt``, the same in every process of this
    one, :func:`attempt_name`): into one shared ``earlier/`` a later attempt's ``rank_0`` replaced
    an earlier one's and sat beside that attempt's other ranks, read as one hang.
    Each process moves its own rank's dump; the first process also those of ranks no process of
    this run has (``processes``: the ranks launched). Returns the paths moved (their new names).
    """
    folder = os.path.join(dump_folder, "comm_traces")
    if not os.path.isdir(folder):
        return []
    first = rank == min(processes, default=rank)
    into = os.path.join(folder, EARLIER, attempt or attempt_name())
    moved = []
    for name in sorted(os.listdir(folder)):
        match = _DUMP_NAME.match(name)
        if match is None or not os.path.isfile(os.path.join(folder, name)):
            continue
        owner = int(match.group(1))
        if owner != rank and not (first and owner not in processes):
            continue
        target = os.path.join(into, name)
        os.makedirs(into, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):  # moved by its own process meanwhile
            os.replace(os.path.join(folder, name), target)
            moved.append(target)
    if moved:
        log.warning(
            "flight recorder: earlier dumps moved aside",
            dumps=", ".join(os.path.basename(p) for p in moved),
            to=into,
            note="they are an earlier run's; this run's dumps go to comm_traces/ (titan fr analyze "
            "reads each folder alone)",
        )
    return moved


def _processes(topology: Any, groups: list[Any]) -> list[int]:
    """The global ranks launched as processes: the real gloo groups' members, else every rank
    (NCCL) or this one alone (a backend simulating every peer)."""
    import torch.distributed as dist

    if groups:
        return sorted(
            {r for group in groups for r in dist.get_process_group_ranks(group or dist.group.WORLD)}
        )
    if getattr(topology, "simulated", None):
        return [topology.rank]
    return list(range(topology.world_size))


def build(trainer: Any) -> GlooFlightRecorder | None:
    """The recorder for CPU runs with real gloo groups and ``comm.trace_buf_size > 0``.

    On CUDA, NCCL's own watchdog dumps to the same files (``TORCH_FR_DUMP_TEMP_FILE``). Either
    way, earlier dumps under this run's ranks' names are moved aside first (``retire_earlier_dumps``).
    """
    topology = trainer.topology
    dump_folder = trainer.config.job.dump_folder
    groups = gloo_groups(topology)
    processes = _processes(topology, groups)
    store = _store()
    retire_earlier_dumps(dump_folder, topology.rank, processes, attempt_name(store, processes))
    if trainer.config.comm.trace_buf_size <= 0:
        return None
    if topology.device.type == "cuda":
        # NCCL writes into the folder and does not create it; --overwrite may have removed it
        # (with the earlier run's outputs) after the backend created it.
        os.makedirs(os.path.join(dump_folder, "comm_traces"), exist_ok=True)
        return None
    if not groups:
        return None
    import torch.distributed as dist

    if store is None:
        log.warning("flight recorder: no store to ask peers to dump; only this rank will")
    return GlooFlightRecorder(dump_folder, dist.get_rank(), processes, store)


def _store() -> Any:
    """The job's store (shared by every process of this attempt), or ``None``."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError):  # no store to reach the peers through
        return None
