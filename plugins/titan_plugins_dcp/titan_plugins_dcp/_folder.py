"""The checkpoint folder on disk: step-folder names, completeness checks and atomic commits.

A checkpoint is committed in three moves, so that a crash, a kill or a full disk at any point
leaves every earlier checkpoint usable and never leaves a half-written ``step-N``:

1. every rank writes its shards, and rank 0 DCP's ``.metadata``, into ``step-N.tmp``;
2. rank 0 writes ``meta.json`` (the step and the trainer's meta) into it, synced to disk;
3. rank 0 renames ``step-N.tmp`` to ``step-N`` (atomic on POSIX) and syncs the parent folder.

Resume does not trust the name alone (a disk can fail, a copy can be cut short, someone may
truncate a file): :func:`inspect` checks a step folder without reading any tensor, the
checkpointer then compares every data file with the CRC-32 saved in ``meta.json`` (the ranks
share the files), and falls back to the newest folder that passes. Only names titan writes count:
``step-<N>`` with ``N`` written without leading zeros (``step-006`` is not step 6).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import time
from typing import Any

import attrs

META_FILE = "meta.json"
#: Version of the ``meta.json`` layout; readers refuse other versions.
FORMAT = 1
#: Errors of a full disk or an exhausted quota.
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)

_STEP = re.compile(r"^step-(0|[1-9][0-9]*)$")
_LEFTOVER = re.compile(r"^step-(0|[1-9][0-9]*)\.(tmp|old)$")


def step_name(step: int) -> str:
    return f"step-{step}"


@attrs.frozen
class Usable:
    """A step folder that passed :func:`inspect`: its meta and DCP metadata."""

    step: int
    path: str
    #: ``meta.json``'s ``kind``: ``"train"`` (a resumable checkpoint) or ``"seed"``.
    kind: str
    #: The dict the trainer passed to ``save`` (``{}`` for a seed checkpoint).
    meta: dict[str, Any]
    #: DCP's ``Metadata`` (``state_dict_metadata``: every key with its global shape).
    metadata: Any
    #: CRC-32 of each data file's pieces as saved, ``{"chunk_bytes": N, "files": {name: [crc, ...]}}``
    #: (``{}`` in checkpoints of earlier titan versions).
    checksums: dict[str, Any] = attrs.field(factory=dict)


def scan(folder: str) -> tuple[list[tuple[int, str]], list[tuple[str, str]]]:
    """``(step, path)`` of every step folder, newest first, and ``(path, why)`` of the entries
    that look like checkpoints but are ignored (leftovers of interrupted saves, other names)."""
    if not os.path.isdir(folder):
        return [], []
    steps: list[tuple[int, str]] = []
    ignored: list[tuple[str, str]] = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if (m := _STEP.match(name)) and os.path.isdir(path):
            steps.append((int(m.group(1)), path))
        elif m:
            ignored.append((path, "a file, not a checkpoint folder (titan writes step-<N> as a folder)"))
        elif (m := _LEFTOVER.match(name)) and m.group(2) == "tmp":
            ignored.append((path, f"the leftover of a save of step {m.group(1)} that did not finish"))
        elif m:
            ignored.append(
                (path, f"the leftover of a checkpoint of step {m.group(1)} being replaced or removed")
            )
        elif name.startswith("step") and os.path.isfile(os.path.join(path, ".metadata")):
            # A DCP checkpoint under another name (step-006, a step-2-copy): renamed, it loads.
            # Not any step-like name: an export titan suggests there (step-2-hf) or a user's
            # notes is no checkpoint, and "rename it to load it" would make it pass for one.
            ignored.append(
                (
                    path,
                    "not a name titan writes (step-<N> with N in plain digits, no leading zeros); "
                    "rename it to load it",
                )
            )
    steps.sort(reverse=True)
    return steps, ignored


def inspect(
    step: int,
    path: str,
    folder: str,
    *,
    elsewhere: str = "name another checkpoint with checkpoint.initial_load_path",
) -> Usable | str:
    """The folder as a :class:`Usable` checkpoint, or why it is not one (one phrase);
    ``elsewhere`` says how to use a checkpoint that lies outside ``folder`` instead.

    Checks, without reading tensors: the folder lies inside ``folder`` (no link out of it),
    ``meta.json`` is complete and names this step, ``.metadata`` unpickles, and every data file
    its index points into exists and is at least as long as the index says.
    """
    real, root = os.path.realpath(path), os.path.realpath(folder)
    if os.path.commonpath([real, root]) != root:
        return (
            f"it links to {real}, outside {folder}: checkpoints are loaded only from the "
            f"checkpoint folder; {elsewhere}"
        )
    meta_path = os.path.join(path, META_FILE)
    if not os.path.isfile(meta_path):
        return f"it has no {META_FILE}, which titan writes last: the save did not finish"
    try:
        with open(meta_path, encoding="utf-8") as file:
            record = json.load(file)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"its {META_FILE} cannot be read ({type(exc).__name__}: {exc})"
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        return f"its {META_FILE} is not titan's checkpoint record (format {FORMAT})"
    if record.get("step") != step or not isinstance(record.get("meta"), dict):
        return f"its {META_FILE} describes step {record.get('step')!r}, not step {step}"
    metadata = read_metadata(path)
    if isinstance(metadata, str):
        return metadata
    if (short := _short_file(path, metadata)) is not None:
        return short
    checksums = record.get("checksums") or {}
    if not _checksums_record(checksums):  # parsed, but not what a save writes: damaged
        return f"its {META_FILE}'s checksums are not titan's record (damaged or edited)"
    return Usable(step, path, str(record.get("kind", "train")), record["meta"], metadata, checksums)


def _checksums_record(checksums: Any) -> bool:
    """Whether ``checksums`` has the shape a save writes, ``{"chunk_bytes": N, "files": {name:
    [crc, ...]}}`` (or is empty: an earlier titan's save), so the check of the data can read it."""
    if checksums == {}:
        return True
    if not isinstance(checksums, dict) or not isinstance(checksums.get("files", {}), dict):
        return False
    chunk = checksums.get("chunk_bytes", CHUNK_BYTES)
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0:
        return False
    return all(
        isinstance(crcs, list) and all(isinstance(c, int) and not isinstance(c, bool) for c in crcs)
        for crcs in checksums.get("files", {}).values()
    )


def data_files(metadata: Any) -> list[str]:
    """The data files DCP's index points into, sorted (relative to the step folder)."""
    return sorted({info.relative_path for info in (getattr(metadata, "storage_data", None) or {}).values()})


#: Bytes per checksummed piece of a data file: the ranks share the pieces, not whole files, so
#: one large file (a seed checkpoint is one) is read by every rank in turn, not by one alone.
CHUNK_BYTES = 256 << 20


def pieces(sizes: dict[str, int], chunk: int = CHUNK_BYTES) -> list[tuple[str, int]]:
    """``(file, index)`` of every piece of the files, in one order every rank agrees on."""
    return [(name, i) for name in sorted(sizes) for i in range(max(1, -(-sizes[name] // chunk)))]


def crc32(path: str, index: int = 0, chunk: int = CHUNK_BYTES) -> int:
    """CRC-32 of piece ``index`` (``chunk`` bytes) of a file, read in 16 MiB reads."""
    import zlib

    value, offset, end = 0, index * chunk, (index + 1) * chunk
    fd = os.open(path, os.O_RDONLY)
    try:
        while offset < end and (piece := os.pread(fd, min(16 << 20, end - offset), offset)):
            value = zlib.crc32(piece, value)
            offset += len(piece)
    finally:
        os.close(fd)
    return value


def read_metadata(path: str) -> Any:
    """DCP's ``Metadata`` of a checkpoint folder, or why it cannot be read."""
    from torch.distributed.checkpoint import FileSystemReader

    file = os.path.join(path, ".metadata")
    if not os.path.isfile(file):
        return "it has no .metadata: DCP did not finish writing it"
    if os.path.getsize(file) == 0:
        return "its .metadata is empty (0 bytes)"
    try:
        return FileSystemReader(path).read_metadata()
    except Exception as exc:  # a truncated pickle raises EOFError, UnpicklingError, ValueError, ...
        return f"its .metadata cannot be read, truncated or damaged ({type(exc).__name__}: {exc})"


def _short_file(path: str, metadata: Any) -> str | None:
    """The first data file that is missing or shorter than the index says, as a phrase."""
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"its data file {name} is missing"
        size = os.path.getsize(file)
        if size < end:
            return f"its data file {name} is truncated ({size} bytes; its .metadata needs {end})"
    return None


def meta_text(step: int, kind: str, meta: dict[str, Any], checksums: dict[str, Any] | None = None) -> str:
    """``meta.json``'s content; fails now (TypeError) if ``meta`` is not JSON-able."""
    record = {"format": FORMAT, "step": step, "kind": kind, "saved_at": time.time(), "meta": meta}
    if checksums:
        record["checksums"] = checksums
    try:
        return json.dumps(
            record,
            indent=1,
            sort_keys=True,
        )
    except (TypeError, ValueError) as exc:
        raise TypeError(f"checkpoint meta must be a JSON-able dict: {exc}") from None


def commit(tmp: str, final: str, text: str) -> bool:
    """Write ``meta.json`` into ``tmp``, sync it and rename ``tmp`` to ``final``.

    An existing ``final`` (a folder resume skipped as damaged) is moved aside first and deleted
    after the rename. Returns whether one was replaced.
    """
    meta_path = os.path.join(tmp, META_FILE)
    with open(meta_path, "w", encoding="utf-8") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())
    _fsync_dir(tmp)
    return _replace(tmp, final)


def _replace(tmp: str, final: str) -> bool:
    """Rename ``tmp`` to ``final``, an existing ``final`` moved aside (``.old``) first and deleted
    after the rename; returns whether one was replaced."""
    aside = None
    if os.path.lexists(final):
        aside = final + ".old"
        remove(aside)
        os.rename(final, aside)
    os.rename(tmp, final)
    _fsync_dir(os.path.dirname(final))
    if aside is not None:
        remove(aside)
    return aside is not None


def tidy(folder: str) -> list[tuple[str, str]]:
    """Finish or remove what interrupted saves left in ``folder``: ``(path, "finished")`` for a
    save renamed, ``(path, why it was removed)`` or ``(path, "could not ...")`` for the others.

    Call it only where no process can be writing into ``folder``: every leftover is then dead.
    A ``step-N.tmp`` that :func:`inspect` accepts is a whole checkpoint (``meta.json``, written
    last, after every rank's shards were on disk, names its step) whose save was killed before
    its rename: it is renamed to ``step-N``, as the save would have done (replacing what it
    replaced). Any other ``step-N.tmp`` is a save cut short, and a ``step-N.old`` is a folder
    that was being replaced or removed: both are deleted. Nothing else is touched (only the
    names :data:`_LEFTOVER` matches, which a user's ``step-3-hf`` or ``step-006`` does not).
    """
    done: list[tuple[str, str]] = []
    if not os.path.isdir(folder):
        return done
    leftovers = [(m, name) for name in sorted(os.listdir(folder)) if (m := _LEFTOVER.match(name))]
    # The .tmp folders first: finishing one may move its step-N aside as step-N.old.
    for m, name in sorted(leftovers, key=lambda pair: pair[0].group(2) != "tmp"):
        path = os.path.join(folder, name)
        if os.path.islink(path):  # not a folder titan made: a user's link, left alone
            continue
        step = int(m.group(1))
        if m.group(2) == "tmp" and isinstance(inspect(step, path, folder), Usable):
            final = os.path.join(folder, step_name(step))
            try:
                _replace(path, final)
            except OSError as exc:
                done.append((path, f"could not be renamed to {step_name(step)}: {exc}"))
                continue
            done.append((final, "finished"))
        elif os.path.lexists(path):
            remove(path)
            why = (
                f"the leftover of a save of step {step} that did not finish"
                if m.group(2) == "tmp"
                else f"the leftover of a checkpoint of step {step} being replaced or removed"
            )
            done.append((path, why if not os.path.lexists(path) else f"could not be removed ({why})"))
    return done


def remove(path: str) -> None:
    """Delete a folder (or file, or link) if it exists; errors are ignored (best effort)."""
    if os.path.islink(path) or os.path.isfile(path):
        with contextlib.suppress(OSError):
            os.unlink(path)
    elif os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems cannot sync a directory; the rename still happened
        pass
    finally:
        os.close(fd)


def os_error(exc: BaseException) -> OSError | None:
    """The ``OSError`` behind ``exc`` (itself, or in its cause/context chain), if any."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None
