"""``titan fr analyze FOLDER [--json]``: which ranks are behind, per process group, in flight
recorder dumps.

Reads every dump in FOLDER (``comm_traces/rank_<r>``): NCCL's (written by torch's watchdog on a
timeout) and gloo's (written by :mod:`titan_plugins_comm.flight_recorder`), as pickles or JSON.
Both carry, per rank, the last collectives of every process group with their sequence number
(``collective_seq_id``, the same on every member for the same collective), operator and sizes,
and each group's last enqueued / completed sequence number.

Per process group, the members that enqueued fewer collectives than the others are *behind*:
they never reached the collective the others are waiting in (or failed in, once it timed out).
When every member reached the same collective, a member whose operator or sizes differ is a
*mismatch*; one that has not completed it (NCCL records completion) is *stuck in* it. Ranks
without a dump are listed as missing (a rank that hung hard, or was killed first).

torch's ``fr_trace`` expects NCCL-only fields and stops on gloo dumps; this reader needs only the
fields both have. It reads pickled plain data and does not import torch.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import pickle
import re
from typing import Any

from titan_core.errors import UsageError


@dataclasses.dataclass(frozen=True)
class Unreadable:
    """A rank's dump file that holds no usable trace, and why."""

    path: str
    reason: str
    #: What to do about it.
    advice: str


#: A file cut off mid-write decodes as nothing: torch's NCCL writer writes the file in place.
CUT_SHORT = (
    "it was probably cut short while being written (the process killed, or the disk full); re-run "
    "the job to get a complete dump"
)
#: A file that decodes, but not to a trace, was not written by a flight recorder.
NOT_A_DUMP = "it is no trace this command reads (another file named like a dump?); move it out of the folder"


class _NotATrace(Exception):
    """``_read``: the file is not a flight-recorder trace; ``reason`` says why, ``advice`` what to do."""

    def __init__(self, reason: str, advice: str = CUT_SHORT) -> None:
        super().__init__(reason)
        self.reason = reason
        self.advice = advice


#: What ``load_dumps`` found: rank -> dump, and rank -> the dump file it could not use.
Dumps = tuple[dict[int, dict[str, Any]], dict[int, Unreadable]]

#: Ranks a dump file's name gives (``rank_<r>``, or NCCL's ``<TORCH_FR_DUMP_TEMP_FILE><r>``).
_RANK_SUFFIX = re.compile(r"(\d+)$")
#: The name of a dump titan's run writes (``comm_traces/rank_<r>``).
_RANK_FILE = re.compile(r"^rank_\d+$")
#: How a rerun names the folder of an earlier attempt's dumps (``flight_recorder.attempt_name``).
_ATTEMPT_NAME = re.compile(r"^\d{8}T\d{6}\.\d{6}Z$")

#: Fields ``analyze`` iterates, and the type each must have when present.
_CONTAINERS = {"entries": list, "pg_config": dict, "pg_status": dict, "titan": dict}


def _decode(raw: bytes) -> Any:
    """The pickled or JSON object in ``raw``; ``_NotATrace`` when it is neither."""
    try:
        return pickle.loads(raw)
    except Exception:  # a corrupt pickle raises almost anything (UnpicklingError, EOFError, ...)
        pass
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise _NotATrace("neither a pickle nor JSON: truncated or corrupt") from None


def _shape_problem(data: Any) -> str | None:
    """Why ``data`` is not a trace ``analyze`` can read, or ``None``; checked here so a malformed
    dump is reported by name instead of failing the analysis with a traceback."""
    if not isinstance(data, dict) or not ("entries" in data or "pg_status" in data):
        return f"holds a {type(data).__name__} without 'entries' or 'pg_status', not a trace"
    for key, kind in _CONTAINERS.items():
        if key in data and not isinstance(data[key], kind):
            return f"a malformed trace: '{key}' is of type {type(data[key]).__name__}, not {kind.__name__}"
    if not all(isinstance(e, dict) for e in data.get("entries", [])):
        return "a malformed trace: an entry is not a mapping"
    if not all(isinstance(v, dict) for v in (data.get("pg_status") or {}).values()):
        return "a malformed trace: a 'pg_status' value is not a mapping"
    return None


def _read(path: str) -> dict[str, Any]:
    """The trace in ``path``; ``_NotATrace`` naming what is wrong with the file otherwise."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as exc:
        raise _NotATrace(f"cannot be read: {exc.strerror or exc}", "check its permissions") from None
    if not raw:
        raise _NotATrace("an empty file")
    data = _decode(raw)
    problem = _shape_problem(data)
    if problem:
        raise _NotATrace(problem, NOT_A_DUMP)
    return data


def _rank_of(path: str, data: dict[str, Any]) -> int | None:
    titan = data.get("titan") or {}
    if isinstance(titan.get("rank"), int):
        return titan["rank"]
    if isinstance(data.get("rank"), int):
        return data["rank"]
    return _rank_in_name(path)


def _rank_in_name(path: str) -> int | None:
    match = _RANK_SUFFIX.search(os.path.basename(path))
    return int(match.group(1)) if match else None


def _nothing_readable(folder: str, unreadable: dict[int, Unreadable]) -> UsageError:
    """The error when every dump of ``folder`` is unreadable: the first one, by path and reason."""
    rank = min(unreadable)
    first = unreadable[rank]
    others = len(unreadable) - 1
    more = f" (and {others} more dump(s) alike)" if others else ""
    return UsageError(
        f"{first.path}: the dump of rank {rank} is unreadable ({first.reason}){more}, and {folder} "
        f"holds no other dump to analyse; {first.advice}"
    )


def load_dumps(folder: str) -> Dumps:
    """Rank -> dump for every flight-recorder dump in ``folder``, and rank -> the files named like
    a rank's dump (``rank_<r>``) that hold no usable trace: those ranks did dump, so they are
    reported as unreadable, not as missing."""
    if not os.path.isdir(folder):
        give = "give the comm_traces folder of a run (job.dump_folder/comm_traces)"
        if not os.path.exists(folder):
            raise UsageError(f"{folder}: does not exist; {give}")
        parent = os.path.dirname(os.path.abspath(folder))
        raise UsageError(
            f"{folder}: is a file, not a folder; give the folder that holds it ({parent}), or {give}"
        )
    dumps: dict[int, dict[str, Any]] = {}
    unreadable: dict[int, Unreadable] = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not os.path.isfile(path) or ".tmp" in name:
            continue  # a dump being written (titan's gloo writer renames it when complete)
        try:
            data = _read(path)
        except _NotATrace as exc:
            rank = _rank_in_name(path)
            if rank is not None:  # other files (notes, logs) are no one's dump
                unreadable.setdefault(rank, Unreadable(path, exc.reason, exc.advice))
            continue
        rank = _rank_of(path, data)
        if rank is not None:
            data["_path"] = path
            dumps[rank] = data
    unreadable = {r: u for r, u in unreadable.items() if r not in dumps}  # e.g. rank_0 beside rank_0.json
    if not dumps and unreadable:
        raise _nothing_readable(folder, unreadable)
    if not dumps:
        earlier = os.path.join(folder, "earlier")  # flight_recorder.EARLIER: a rerun moved them there
        if _holds_dumps(earlier):  # as titan before one folder per attempt left them
            raise UsageError(
                f"{folder}: no flight-recorder dumps of the last run (it left none); {earlier} holds "
                f"those of an earlier run or attempt, moved there when the last one started: "
                f"titan fr analyze {earlier}"
            )
        attempts = _attempt_folders(earlier)
        if attempts:
            raise UsageError(
                f"{folder}: no flight-recorder dumps of the last run (it left none); {earlier} holds "
                f"those of {len(attempts)} earlier attempt(s), a folder each, moved there when the next "
                f"attempt started; the latest: titan fr analyze {attempts[-1]}"
            )
        attempts = _attempt_folders(folder)
        if attempts:  # the earlier/ folder itself: the user picks the attempt
            raise UsageError(
                f"{folder}: holds the dumps of {len(attempts)} earlier attempt(s), a folder each "
                f"({', '.join(os.path.basename(a) for a in attempts)}, oldest first); analyse one, "
                f"e.g. the latest: titan fr analyze {attempts[-1]}"
            )
        raise UsageError(
            f"{folder}: no flight-recorder dumps (rank_<r> files); they are written when a collective "
            "times out with comm.trace_buf_size > 0"
        )
    return dumps, unreadable


def _holds_dumps(folder: str) -> bool:
    """Whether ``folder`` holds a file named as titan and NCCL name a rank's dump (``rank_<r>``)."""
    names = os.listdir(folder) if os.path.isdir(folder) else []
    return any(_RANK_FILE.match(n) and os.path.isfile(os.path.join(folder, n)) for n in names)


def _attempt_folders(folder: str) -> list[str]:
    """The subfolders of ``folder`` named as a rerun names an earlier attempt's
    (``earlier/<time>/``, :func:`titan_plugins_comm.flight_recorder.attempt_name`) that hold dumps,
    sorted by name: by the time they were moved aside, oldest first. Other folders (a run's
    ``tb/``, whose files end in digits too) are no attempt's."""
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    return [
        os.path.join(folder, n)
        for n in names
        if _ATTEMPT_NAME.match(n) and _holds_dumps(os.path.join(folder, n))
    ]


def traces_folder(folder: str) -> str:
    """``folder``, or its ``comm_traces/`` when ``folder`` is a run's dump folder (no dump of its own)."""
    inner = os.path.join(folder, "comm_traces")
    if os.path.isdir(inner) and not any(_RANK_FILE.match(n) for n in os.listdir(folder)):
        return inner
    return folder


def _ranks_list(value: Any) -> list[int]:
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    if isinstance(value, str) and value.strip():
        try:
            parsed = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            return []
        return [int(v) for v in parsed] if isinstance(parsed, (list, tuple)) else []
    return []


def _op(entry: dict[str, Any]) -> str:
    name = str(entry.get("profiling_name", "?"))
    return name.split(":", 1)[1] if ":" in name else name


def _describe(entry: dict[str, Any] | None) -> dict[str, Any] | None:
    if entry is None:
        return None
    frames = entry.get("frames") or []
    user = [f for f in frames if "/torch/" not in str(f.get("filename", ""))]  # the caller's code
    return {
        "seq": entry.get("collective_seq_id"),
        "op": _op(entry),
        "input_sizes": entry.get("input_sizes"),
        "input_dtypes": entry.get("input_dtypes"),
        "state": entry.get("state"),
        "time_created_ns": entry.get("time_created_ns"),
        "where": [f"{f.get('name')} {f.get('filename')}:{f.get('line')}" for f in user[:3]],
    }


def _backend(dumps: dict[int, dict[str, Any]]) -> str:
    names = set()
    for d in dumps.values():
        titan = d.get("titan") or {}
        if titan.get("backend"):
            names.add(titan["backend"])
        for e in d.get("entries", [])[:1]:
            names.add(str(e.get("profiling_name", "?")).split(":", 1)[0])
    return ", ".join(sorted(names)) or "?"


def analyze(
    dumps: dict[int, dict[str, Any]], unreadable: dict[int, Unreadable] | None = None
) -> dict[str, Any]:
    """Per process group: members, who is behind, on which collective (plain data).

    ``unreadable``: ranks whose dump file holds no usable trace; they are analysed as having no
    dump, but reported as unreadable rather than missing (they did dump)."""
    unreadable = unreadable or {}
    # The ranks that ran as processes, as titan's gloo dumps record them (``titan.ranks``): under
    # real_pp_fake_spmd only one process per PP rank exists, and the other logical ranks of the
    # fake groups are simulated; they never dump. Empty (NCCL's dumps): every member is a process.
    real: set[int] = set()
    for d in dumps.values():
        real |= set(_ranks_list((d.get("titan") or {}).get("ranks")))
    groups: dict[str, dict[str, Any]] = {}
    for rank, d in dumps.items():
        titan = d.get("titan") or {}
        for key, cfg in (d.get("pg_config") or {}).items():
            name = str(cfg.get("name", key)) if isinstance(cfg, dict) else str(key)
            g = groups.setdefault(name, {"name": name, "desc": "", "members": set(), "ranks": {}})
            if isinstance(cfg, dict):
                g["desc"] = g["desc"] or cfg.get("desc", "")
                g["members"] |= set(_ranks_list(cfg.get("ranks")))
        for name, ranks in (titan.get("pg_ranks") or {}).items():
            groups.setdefault(str(name), {"name": str(name), "desc": "", "members": set(), "ranks": {}})
            groups[str(name)]["members"] |= set(ranks)
        for e in d.get("entries", []):
            pg = e.get("process_group") or (str(e.get("pg_id")), "")
            name, desc = str(pg[0]), str(pg[1]) if len(pg) > 1 else ""
            g = groups.setdefault(name, {"name": name, "desc": desc, "members": set(), "ranks": {}})
            g["desc"] = g["desc"] or desc
            g["ranks"].setdefault(rank, []).append(e)
        for key, status in (d.get("pg_status") or {}).items():
            if str(key) in groups:
                groups[str(key)].setdefault("status", {})[rank] = status
    results = []
    for name, g in groups.items():
        if not g["ranks"] and not g.get("status"):
            continue  # a group this job never used
        members = sorted(g["members"] | set(g["ranks"]))
        per_rank: dict[int, dict[str, Any]] = {}
        for rank in members:
            if rank not in dumps:
                continue
            entries = [e for e in g["ranks"].get(rank, []) if not e.get("is_p2p")]
            status = (g.get("status") or {}).get(rank, {})
            last_seq = max([e.get("collective_seq_id", 0) for e in entries], default=0)
            last_seq = max(last_seq, int(status.get("last_enqueued_collective", 0) or 0))
            by_seq = {e.get("collective_seq_id"): e for e in entries}
            completed = status.get("last_completed_collective")
            per_rank[rank] = {
                "last_seq": last_seq,
                "last": _describe(by_seq.get(last_seq)),
                "last_completed": completed,
                "_by_seq": by_seq,
            }
        simulated = [r for r in members if real and r not in real and r not in dumps and r not in unreadable]
        missing = [r for r in members if r not in dumps and r not in unreadable and r not in simulated]
        corrupt = [r for r in members if r in unreadable]
        if not per_rank:
            continue
        top = max(p["last_seq"] for p in per_rank.values())
        waiting = sorted(r for r, p in per_rank.items() if p["last_seq"] == top)
        behind = sorted(r for r, p in per_rank.items() if p["last_seq"] < top)
        collective = next((_describe(per_rank[r]["_by_seq"].get(top)) for r in waiting), None)
        mismatch: list[int] = []
        stuck: list[int] = []
        if not behind and collective is not None:
            for r in waiting:
                e = per_rank[r]["_by_seq"].get(top)
                if e is not None and (_op(e), e.get("input_sizes")) != (
                    collective["op"],
                    collective["input_sizes"],
                ):
                    mismatch.append(r)
                completed = per_rank[r]["last_completed"]
                nccl_states = e is not None and e.get("state") in ("scheduled", "started")
                if completed is not None and int(completed) < top and nccl_states:
                    stuck.append(r)
        results.append(
            {
                "name": name,
                "desc": g["desc"],
                "ranks": members,
                "dumps": sorted(per_rank),
                "missing_dumps": missing,
                # logical ranks no process ran (real_pp_fake_spmd's fake groups): no dump expected
                "simulated": simulated,
                "unreadable_dumps": corrupt,
                "collective": collective,
                # Without every member's dump, the ranks at the last collective may be waiting
                # for one that left none.
                "waiting": waiting if (behind or missing or corrupt) else [],
                "behind": behind,
                "behind_last": {r: per_rank[r]["last"] for r in behind},
                "mismatch": mismatch,
                "stuck": stuck,
                "ok": not (behind or mismatch or stuck or missing or corrupt),
            }
        )
    results.sort(key=lambda g: (g["ok"], -len(g["behind"]), g["name"]))
    reasons = {
        r: (d.get("titan") or {}).get("reason")
        for r, d in dumps.items()
        if (d.get("titan") or {}).get("reason")
    }
    return {
        "ranks": sorted(dumps),
        "backend": _backend(dumps),
        "process_groups": results,
        "reasons": reasons,
        "unreadable": {r: dataclasses.asdict(u) for r, u in sorted(unreadable.items())},
        "verdict": _verdict(results),
    }


def _collective_text(c: dict[str, Any] | None) -> str:
    if c is None:
        return "an unrecorded collective"
    sizes = f" {c['input_sizes']}" if c.get("input_sizes") else ""
    return f"#{c['seq']} {c['op']}{sizes}"


def _group_text(g: dict[str, Any]) -> str:
    return f"process group {g['name']}" + (f" ({g['desc']})" if g["desc"] else "")


def _verdict(groups: list[dict[str, Any]]) -> str:
    for g in groups:
        if g["behind"]:
            ranks = ", ".join(map(str, g["behind"]))
            noun = "rank" if len(g["behind"]) == 1 else "ranks"
            verb = "is" if len(g["behind"]) == 1 else "are"
            waiting = ", ".join(map(str, g["waiting"]))
            return (
                f"{noun} {ranks} {verb} behind in {_group_text(g)}: never joined collective "
                f"{_collective_text(g['collective'])} that rank(s) {waiting} waited in"
            )
    for g in groups:
        if g["mismatch"]:
            collective = _collective_text(g["collective"])
            return f"{_group_text(g)}: ranks {g['mismatch']} called a different collective at {collective}"
    for g in groups:
        if g["stuck"]:
            return f"{_group_text(g)}: ranks {g['stuck']} never completed {_collective_text(g['collective'])}"
    for g in groups:
        if g["unreadable_dumps"]:
            return f"{_group_text(g)}: unreadable dump from ranks {g['unreadable_dumps']} (see below)"
    for g in groups:
        if g["missing_dumps"]:
            return f"{_group_text(g)}: no dump from ranks {g['missing_dumps']} (hung hard or killed first?)"
    return "every process group agrees: no rank is behind"


def _unreadable_text(rank: int, unreadable: dict[str, str]) -> str:
    return (
        f"rank {rank}: the dump {unreadable['path']} is unreadable ({unreadable['reason']}), so the "
        f"analysis above is without rank {rank}, which may be the one behind; {unreadable['advice']}"
    )


def format_report(result: dict[str, Any], folder: str) -> str:
    lines = [
        f"flight recorder: {len(result['ranks'])} dump(s) in {folder} (ranks "
        f"{', '.join(map(str, result['ranks']))}; {result['backend']})",
        result["verdict"],
    ]
    lines += [_unreadable_text(int(r), u) for r, u in result["unreadable"].items()]
    for g in result["process_groups"]:
        lines.append(f"{_group_text(g)}, ranks {g['ranks']}:")
        if g["behind"]:
            waiting = ", ".join(map(str, g["waiting"]))
            lines.append(f"  waiting in {_collective_text(g['collective'])}: rank(s) {waiting}")
            if g["collective"] and g["collective"]["where"]:
                lines.append(f"    at {g['collective']['where'][0]}")
            for r in g["behind"]:
                last = g["behind_last"][r]
                done = f"last collective {_collective_text(last)}" if last else "no collective in this group"
                lines.append(f"  BEHIND rank {r}: {done}")
        elif g["mismatch"]:
            lines.append(f"  MISMATCH at {_collective_text(g['collective'])}: ranks {g['mismatch']}")
        elif g["stuck"]:
            lines.append(f"  STUCK in {_collective_text(g['collective'])}: ranks {g['stuck']}")
        elif g["missing_dumps"] or g["unreadable_dumps"]:
            at = ", ".join(map(str, g["waiting"]))
            absent = sorted(g["missing_dumps"] + g["unreadable_dumps"])
            noun = "rank" if len(absent) == 1 else "ranks"
            lines.append(
                f"  ranks {at} (those with a dump) at {_collective_text(g['collective'])}; "
                f"{noun} {', '.join(map(str, absent))} left none"
                + (" readable" if g["unreadable_dumps"] else "")
            )
        else:
            lines.append(f"  all members at {_collective_text(g['collective'])}")
        if g.get("simulated"):
            lines.append(
                f"  ranks {', '.join(map(str, g['simulated']))} are simulated (no process ran them: "
                "a fake comm backend), so they left no dump"
            )
        if g["unreadable_dumps"]:
            lines.append(f"  unreadable dump from ranks {g['unreadable_dumps']}")
        if g["missing_dumps"]:
            lines.append(f"  no dump from ranks {g['missing_dumps']}")
    for rank, reason in sorted(result["reasons"].items()):
        lines.append(f"rank {rank} dumped because: {reason}")
    return "\n".join(lines)


def configure(parser: Any) -> None:
    sub = parser.add_subparsers(dest="fr_command", metavar="{analyze}")
    analyze_parser = sub.add_parser(
        "analyze",
        help="which ranks are behind, per process group, in flight-recorder dumps",
        description="Read the flight-recorder dumps of a run (NCCL's or gloo's, "
        "job.dump_folder/comm_traces) and say, per process group, which ranks are behind and on "
        "which collective and sequence number.",
    )
    analyze_parser.add_argument(
        "folder",
        metavar="FOLDER",
        help="e.g. outputs/comm_traces (a run's dump folder reads its comm_traces/)",
    )
    analyze_parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(_fr_parser=parser)


def run(args: Any) -> int:
    if args.fr_command != "analyze":
        args._fr_parser.print_help()
        return 2
    folder = traces_folder(args.folder)
    result = analyze(*load_dumps(folder))
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        print(format_report(result, folder))
    return 0
