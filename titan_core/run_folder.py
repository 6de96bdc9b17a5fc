"""The run folder (``job.dump_folder``): created and checked up front, locked while a run writes,
and never shared by two different runs (:class:`RunFolder`, ``run.json``).

Two runs writing into one folder would overwrite each other's checkpoints and logs. The first
process of a run takes an exclusive ``flock`` on ``<dump_folder>/.titan.lock`` (the kernel drops it
when the process ends, however it ends, so a crashed run leaves no stale lock) and writes its host
and pid there; a second run gets one error naming them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
from collections.abc import Callable
from typing import Any

from titan_core.errors import PluginError, UsageError, write_failure

LOCK_NAME = ".titan.lock"


def _folder_problem(path: str, what: str) -> str | None:
    """Why ``path`` cannot be a folder this run writes into, or ``None``."""
    if os.path.islink(path) and not os.path.exists(path):
        return (
            f"{what}: {path!r} is a link to {os.readlink(path)!r}, which does not exist; create "
            "its target or choose another path"
        )
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{what}: {path!r} exists and is not a folder; choose another path"
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        return f"{what}: cannot create {path!r} ({exc.strerror}); choose a writable folder"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{what}: {path!r} is not writable; choose a writable folder"
    return None


def _writable_folder_problem(path: str, what: str) -> str | None:
    """Why ``path`` cannot become a folder this run writes into, or ``None``; creates nothing."""
    probe = path
    while not os.path.lexists(probe) and os.path.dirname(probe) not in ("", probe):
        probe = os.path.dirname(probe)
    if os.path.islink(probe) and not os.path.exists(probe):
        return (
            f"{what}: {probe!r} is a link to {os.readlink(probe)!r}, which does not exist; create "
            "its target or choose another path"
        )
    if os.path.lexists(probe) and not os.path.isdir(probe):
        if probe == path:
            return f"{what}: {path!r} exists and is not a folder; choose another path"
        return f"{what}: cannot create {path!r}: {probe!r} is not a folder; choose another path"
    if os.path.isdir(probe) and not os.access(probe, os.W_OK | os.X_OK):
        return f"{what}: {probe!r} is not writable; choose a writable folder"
    return None


def inside(path: str, dump: str) -> bool:
    """Whether ``path`` resolves to somewhere strictly inside the dump folder ``dump``."""
    real, root = os.path.realpath(path), os.path.realpath(dump)
    return real != root and real.startswith(root.rstrip(os.sep) + os.sep)


#: How TensorBoard names its event files (``events.out.tfevents.<time>.<host>.<pid>.<n>``).
TB_EVENTS = "events.out.tfevents.*"


def tb_location(dump: str, tb_folder: str) -> str:
    """Where a run of dump folder ``dump`` writes its TensorBoard event files.

    ``metrics.save_tb_folder`` inside the dump folder is the run's own: used as it is. One that
    resolves elsewhere (an absolute path, ``../``, a link) may be shared by runs of several dump
    folders and hold other files: each dump folder writes its own subfolder there,
    ``<dump folder name>-<8 hex digits of its real path's SHA-1>``, which TensorBoard shows as a
    run of its own, and a rerun or ``--overwrite`` removes only the event files of that subfolder.
    """
    import hashlib

    path = os.path.join(dump, tb_folder)
    if inside(path, dump):
        return path
    root = os.path.realpath(dump)
    digest = hashlib.sha1(root.encode()).hexdigest()[:8]
    return os.path.join(path, f"{os.path.basename(root) or 'run'}-{digest}")


def overlapping(a: str, b: str) -> bool:
    """Whether two paths resolve to one folder, or one lies inside the other."""
    x, y = os.path.realpath(a), os.path.realpath(b)
    return os.path.commonpath([x, y]) in (x, y)


def _overlap_problem(tb: str, checkpoints: str) -> str | None:
    """The TensorBoard folder and the checkpoint folder must be apart: a rerun replaces the
    first and keeps the second, which it cannot do to one folder or to one inside the other."""
    if not overlapping(tb, checkpoints):
        return None
    return (
        f"metrics.save_tb_folder {tb!r} and checkpoint.folder {checkpoints!r} are the same folder or one "
        "holds the other; give them separate folders (the defaults are 'tb' and 'checkpoint')"
    )


class RunFolderLock:
    """The run's hold on its folders: the dump folder, and a checkpoint folder outside it (which
    other runs may name too: two runs saving into one would replace each other's steps)."""

    def __init__(self, fds: list[int]) -> None:
        self.fds = fds

    @classmethod
    def take(cls, config: Any, *, is_writer: bool) -> RunFolderLock | None:
        """Check the output folders and lock them (on the run's first process only)."""
        dump = config.job.dump_folder
        c = config.checkpoint
        problem = _folder_problem(dump, "job.dump_folder")
        ckpt = os.path.join(dump, c.folder)
        writes_checkpoints = (c.enable and not c.load_only) or c.create_seed_checkpoint
        if problem is None and writes_checkpoints:
            problem = _writable_folder_problem(ckpt, "checkpoint.folder")
        elif problem is None and c.enable and os.path.exists(ckpt) and not os.path.isdir(ckpt):
            # load_only reads the folder (it may be read-only: a shared checkpoint).
            problem = f"checkpoint.folder: {ckpt!r} exists and is not a folder; choose another name"
        if problem is None and config.metrics.enable_tensorboard:
            tb = os.path.join(dump, config.metrics.save_tb_folder)
            problem = _writable_folder_problem(tb, "metrics.save_tb_folder")
            if problem is None and (c.enable or c.create_seed_checkpoint):
                problem = _overlap_problem(tb, ckpt)
        if problem:
            raise UsageError(problem)
        if not is_writer:
            return None
        fds = [_lock(dump, f"job.dump_folder {dump!r}", "job.dump_folder (--dump-folder)")]
        # The checkpoint folder too, inside the dump folder as well: another run may name this
        # run's checkpoint folder as its own (an absolute checkpoint.folder), and the two would
        # replace each other's steps whichever of them started first. (A load_only run writes
        # none: it leaves the folder as it is.)
        if writes_checkpoints:
            try:
                os.makedirs(ckpt, exist_ok=True)
                fds.append(_lock(ckpt, f"checkpoint.folder {ckpt!r}", "checkpoint.folder"))
            except BaseException:
                cls(fds).release()
                raise
        return cls(fds)

    def release(self) -> None:
        for fd in self.fds:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        self.fds = []


def _lock(folder: str, what: str, other: str) -> int:
    """An exclusive lock on ``folder/.titan.lock`` naming this process, or one error naming the
    holder (another run writing there)."""
    fd = os.open(os.path.join(folder, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 200).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise UsageError(
            f"{what} is in use by another run ({holder}); wait for it to end or give this run another {other}"
        ) from None
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"host {socket.gethostname()}, pid {os.getpid()}".encode())
    except OSError as exc:  # a full disk: the first file a run writes
        os.close(fd)
        raise write_failure(os.path.join(folder, LOCK_NAME), exc, what="the run's lock") from None
    return fd


def _split(folder: str, patterns: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """The entries of ``folder`` (titan's lock file aside) that ``patterns`` match, and the
    others, sorted by name."""
    import fnmatch

    mine: list[str] = []
    others: list[str] = []
    for name in sorted(_entries(folder)):
        (mine if any(fnmatch.fnmatchcase(name, p) for p in patterns) else others).append(name)
    return mine, others


def _remove_entries(folder: str, names: list[str]) -> None:
    """Remove ``names`` from ``folder`` (a link itself, never what it points to), then the folder
    if that leaves it empty."""
    import contextlib
    import shutil

    for name in names:
        path = os.path.join(folder, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.remove(path)
    with contextlib.suppress(OSError):  # other entries stay, or titan's lock file
        os.rmdir(folder)


def _entries(folder: str) -> list[str]:
    """What ``folder`` holds, without titan's lock file (a checkpoint folder outside the dump
    folder holds one while a run uses it)."""
    return [n for n in os.listdir(folder) if n != LOCK_NAME] if os.path.isdir(folder) else []


def write_whole(path: str, write: Callable[[str], Any]) -> None:
    """``write(partial)`` into ``path + '.partial'``, then rename it to ``path``: a write cut
    short (a full disk, a kill) never leaves a file under the name of a whole one (a half
    ``run.json`` made the folder refuse every later attempt; a half trace or report passed for
    one). The partial file is removed when ``write`` or the rename raises, and the error goes on."""
    partial = path + ".partial"
    try:
        write(partial)
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(partial)
        raise


def write_json_whole(path: str, data: Any) -> None:
    """``data`` as indented JSON at ``path``, written whole (:func:`write_whole`)."""

    def dump(partial: str) -> None:
        with open(partial, "w") as f:
            json.dump(data, f, indent=2)

    write_whole(path, dump)


RUN_FILE = "run.json"
#: Files a run writes at the top of its dump folder (besides its TensorBoard and checkpoint folders).
RUN_FILES = ("config.toml", "metrics.jsonl", "train.log")


def plugin_outputs(registry: Any) -> list[str]:
    """The glob patterns of what plugins write at the top of dump folders (``outputs`` of their
    callbacks and run options), in registration order."""
    kinds = ("callbacks", "run_options")
    patterns = [p for kind in kinds for record in registry.records(kind).values() for p in record.outputs]
    return list(dict.fromkeys(patterns))


def _declared_paths(dump: str, patterns: list[str]) -> list[str]:
    """The paths in ``dump`` that ``patterns`` match (the dump folder itself never)."""
    import glob

    found: dict[str, None] = {}
    for pattern in patterns:
        for path in sorted(glob.glob(os.path.join(glob.escape(dump), pattern))):
            if os.path.realpath(path) != os.path.realpath(dump):
                found[path] = None
    return list(found)


#: The sections that define a run's results (plus ``debug.seed``, ``comm.backend`` and the fields
#: plugin sections name in ``ConfigSection.results``); the others (job, metrics, comm, checkpoint, validation,
#: debug switches, the rest of plugin sections) are operational: a rerun that
#: changes only those is the same run. ``training.steps`` is in: a run to another length started
#: from step 0 is another run (resuming to more steps goes through the checkpoint). The layout
#: (``parallelism`` and the per-rank ``training.local_batch_size``) is not: the same run may go on
#: under another layout (DCP reshards), and the documented loss-curve comparison runs every layout
#: from one seed checkpoint in one folder. Nor are the fields of these sections that cannot change
#: the numbers (``data.prefetch``: when batches are prepared, not which): :data:`_NOT_IDENTITY`.
_IDENTITY = ("model", "data", "training")
_NOT_IDENTITY = {"training": ("local_batch_size",), "data": ("prefetch",)}


def identity(config: Any, dp: int | None) -> dict[str, Any]:
    """What defines a run's results under a data-parallel degree ``dp`` (``None``: a run whose
    peers are simulated, which has no results of its own to keep apart): see :data:`_IDENTITY`."""
    from titan_core.config import to_dict

    data = to_dict(config)
    found = _without_operational({key: dict(data[key]) for key in _IDENTITY})
    # The local batch is left out (the layout's), but without a global batch size it sets the
    # sequences of a step (local x DP), and with them the results.
    t = config.training
    if dp is not None:
        found["batch"] = {"sequences_per_step": t.global_batch_size or t.local_batch_size * dp}
    found["debug"] = {"seed": data["debug"]["seed"]}
    # A comm backend that simulates its peers logs no real losses (or none at all): its rerun in
    # a real run's folder would replace that run's history, so the backend is part of the identity.
    found["comm"] = {"backend": data["comm"]["backend"]}
    found.update(plugin_results(config, data))
    return found


def plugin_results(config: Any, data: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
    """The values of the plugin-section fields named in ``ConfigSection.results``, by section, as
    JSON gives them back (``data``: ``to_dict(config)`` when the caller has it already)."""
    from titan_core.config import to_dict

    data = to_dict(config) if data is None else data
    found = {}
    for name, fields in _plugin_result_fields().items():
        unknown = [f for f in fields if f not in data[name]]
        if unknown:
            raise PluginError(
                f"config section {name!r}: ConfigSection.results names {', '.join(unknown)}, not fields "
                f"of the section ({', '.join(data[name])}); correct the plugin's results"
            )
        found[name] = {f: data[name][f] for f in fields}
    return found


def _without_operational(found: dict[str, Any]) -> dict[str, Any]:
    """``found`` (an identity) without :data:`_NOT_IDENTITY`'s fields (a ``run.json`` of an earlier
    titan recorded some of them)."""
    found = dict(found)
    for section_name, names in _NOT_IDENTITY.items():
        if isinstance(found.get(section_name), dict):
            found[section_name] = {k: v for k, v in found[section_name].items() if k not in names}
    return found


def _plugin_result_fields() -> dict[str, tuple[str, ...]]:
    from titan_core._registry import get_registry

    sections = get_registry().records("config_sections")
    return {name: record.results for name, record in sections.items() if record.results}


def _comparable(prior: dict[str, Any], mine: dict[str, Any]) -> dict[str, Any]:
    """``mine`` without the plugin sections a ``run.json`` of an earlier titan did not record."""
    return {k: v for k, v in mine.items() if k in prior or k in _IDENTITY or k == "debug"}


def run_dp(config: Any, registry: Any, parallel_dims: Any) -> int | None:
    """The ``dp`` a :class:`RunFolder` of this run compares (``None`` under a backend that
    simulates peers): one function, so the trainer and run_train.sh's check decide alike."""
    backend = registry.get("comm_backends", config.comm.backend, what="comm.backend")
    return None if backend.simulates_peers else parallel_dims.dp


def _differences(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    found = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict) and key not in ("overrides",):
            found += _differences(a, b, f"{prefix}{key}.")
        elif a != b:
            found.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return found


class RunFolder:
    """Whose outputs the dump folder holds, and what this run may do with them.

    Every run records ``<dump_folder>/run.json`` (its recipe and identity: :func:`identity`). A
    later run into the same folder

    - resumes when checkpointing is on and a checkpoint loads (its files are appended to);
    - starts over when its identity is the same (it replaces the earlier attempt's files: a rerun
      of the same run, e.g. after a crash without checkpoints);
    - takes over a folder holding only a seed checkpoint of the same model;
    - otherwise stops with one error naming the differences and the fixes (another folder, or
      ``--overwrite``, which first deletes the earlier run's outputs: its files, the entries of
      its checkpoint folder that the checkpointer declares its own (``Checkpointer.outputs``),
      and what plugins declare (``Callback.outputs``, ``RunOption.outputs``); anything else a
      user keeps in these folders stays).

    Nothing of two different runs is ever mixed in one folder. All ranks read ``run.json`` before
    any writes it, so they decide alike.
    """

    def __init__(
        self,
        config: Any,
        *,
        dp: int | None,
        overwrite: bool,
        is_writer: bool,
        outputs: list[str] | None = None,
        registry: Any = None,
    ) -> None:
        """``dp``: the run's data-parallel degree (with the local batch, the sequences of a step);
        ``None`` for a backend that simulates peers (:func:`identity`). ``registry``: where the
        checkpointer of ``checkpoint.backend`` says what it writes (``Checkpointer.outputs``);
        without one, ``--overwrite`` removes nothing from a checkpoint folder."""
        self.config = config
        self.dp = dp
        #: Glob patterns of what plugins write at the top of the folder (:func:`plugin_outputs`).
        self.outputs = outputs or []
        self.registry = registry
        self.dump = config.job.dump_folder
        self.is_writer = is_writer
        self.prior = self._read_prior()
        self.decided = False
        self.restart = False
        self.resumed = False
        if self.prior is not None and overwrite:
            # Every process checks (and run_train.sh's check before any starts): a refusal is the
            # same on all of them, and comes before the first process has removed anything.
            self._check_overwrite(self.prior)
            if is_writer:
                removed, kept, seeds = self._remove(self.prior, checkpoints=True)
                from titan_core.log import get_logger

                # What went from the checkpoint folder and what stayed, by name: the user sees
                # that their own files there were left alone.
                named: dict[str, str] = {}
                if removed or kept:
                    named["checkpoint_folder"] = self._prior_checkpoints(self.prior)[1]
                    named["checkpoints_removed"] = ", ".join(removed) or "none"
                if kept:
                    named["checkpoint_entries_kept"] = f"{', '.join(kept)} (not written by the checkpointer)"
                if seeds:
                    named["seed_checkpoints_kept"] = (
                        f"{', '.join(seeds)} (the seed the previous run started from, written by a seed "
                        "run: this run starts from it too; remove it by hand to start from fresh weights)"
                    )
                get_logger("titan.run_folder").warning(
                    "--overwrite: removed the previous run's outputs", dump_folder=self.dump, **named
                )
            self.prior = None
        if self.prior is None:
            self.decided = True
        elif not self._may_resume():
            self._decide(resumed=False)

    def _read_prior(self) -> dict[str, Any] | None:
        path = os.path.join(self.dump, RUN_FILE)
        if os.path.isfile(path):
            try:
                with open(path) as f:
                    prior = json.load(f)
                if isinstance(prior, dict):
                    return prior
            except (OSError, ValueError):
                pass
            return {"unreadable": True}
        # A TensorBoard folder outside the dump folder may be shared: its files are no sign of a run here.
        tb = os.path.join(self.dump, self.config.metrics.save_tb_folder)
        if any(os.path.exists(os.path.join(self.dump, n)) for n in RUN_FILES) or (
            inside(tb, self.dump) and os.path.isdir(tb) and os.listdir(tb)
        ):
            return {"unidentified": True}
        return None

    def _may_resume(self) -> bool:
        c = self.config.checkpoint
        folder = os.path.join(self.dump, c.folder)
        has_files = bool(_entries(folder))
        return c.enable and not c.create_seed_checkpoint and has_files

    def started(self, *, resumed: bool) -> None:
        """After the checkpoint load: decide if not yet decided (``resumed``: a checkpoint loaded)."""
        if not self.decided:
            self._decide(resumed=resumed)

    def _decide(self, *, resumed: bool) -> None:
        self.decided = True
        prior = self.prior or {}
        if resumed:
            self.resumed = True
            return
        recorded = _without_operational(prior["identity"]) if "identity" in prior else None
        mine = _comparable(recorded or {}, identity(self.config, self.dp))
        same_model = (recorded or {}).get("model") == mine.get("model")
        if recorded and not same_model and self._same_built_model(recorded.get("model"), mine.get("model")):
            # Another spelling of the recorded model (n_kv_heads None and = n_heads; an override
            # at its default): the same model, as a resume decides, so the same run.
            mine = {**mine, "model": recorded["model"]}
            same_model = True
        if prior.get("seed_checkpoint") and not self.config.checkpoint.create_seed_checkpoint and same_model:
            return  # a seed checkpoint of this model: this run starts from it
        if recorded == mine and not prior.get("seed_checkpoint"):
            c = self.config.checkpoint
            prior_folder = prior.get("checkpoint_folder") or c.folder
            checkpoints = os.path.join(self.dump, prior_folder)
            # A run that loads from that same folder resumed from it, or found nothing to load.
            looked = c.enable and not c.create_seed_checkpoint and prior_folder == c.folder
            if not looked and _entries(checkpoints):
                # Starting over would replace the logs of the run those checkpoints continue.
                raise UsageError(
                    f"job.dump_folder {self.dump!r} holds checkpoints of this run ({checkpoints}), which "
                    "this run does not load (checkpoint.enable = False, create_seed_checkpoint, or another "
                    "checkpoint.folder); set checkpoint.enable = True with that folder to resume it, give "
                    "this run a new folder (--dump-folder DIR), or start it over with `titan run ... "
                    "--overwrite`"
                )
            self.restart = True
            return
        if prior.get("unidentified") or prior.get("unreadable"):
            what = "outputs of a run titan cannot identify (no readable run.json)"
        else:
            diff = _differences(recorded or {}, mine)
            what = f"the outputs of another run (recipe {prior.get('recipe')!r}"
            what += f"; differs in {', '.join(diff[:4])}{' ...' if len(diff) > 4 else ''})" if diff else ")"
            if prior.get("seed_checkpoint"):
                what = f"a seed checkpoint of another model (recipe {prior.get('recipe')!r})"
        raise UsageError(
            f"job.dump_folder {self.dump!r} holds {what}; give this run a new folder (--dump-folder DIR) "
            "or replace them with `titan run ... --overwrite`"
        )

    def _same_built_model(self, recorded: Any, mine: Any) -> bool:
        """Whether two ``model`` sections of identities build the same model, by the rule a
        resume applies (:func:`titan_core.resume.model_changes`: arguments resolved by the
        model), compute-only arguments included; ``False`` when that cannot be told."""
        if self.registry is None or not isinstance(recorded, dict) or not isinstance(mine, dict):
            return False
        from titan_core.resume import model_changes

        try:
            spec = self.registry.get("models", mine.get("name"), what="model")
        except Exception:  # a model this titan lacks: compared as written
            return False
        # Compute-only arguments still tell runs apart (a fuse_qkv = False run timed beside the
        # fused one would replace its logs); only spellings of one argument are the same run.
        same = not model_changes(spec, recorded, mine, compute_only=False)
        return recorded.get("name") == mine.get("name") and same

    def claim(self, *, is_logging_rank: bool) -> bool:
        """Record this run in ``run.json`` and clear a replaced attempt's files; whether to append."""
        if not is_logging_rank:
            return self.resumed
        if self.restart and self.prior is not None:
            from titan_core.log import get_logger

            # Said where the user reads the run (and in the new train.log): the earlier attempt
            # may have completed, and a rerun meant to keep it needs a folder of its own.
            get_logger("titan.run_folder").warning(
                f"starting the same run over: replaces the earlier attempt's train.log, metrics.jsonl "
                f"and TensorBoard events ({self._prior_progress(self.prior)}); to keep an earlier run's "
                "outputs, give a rerun a folder of its own (--dump-folder DIR)",
                dump_folder=self.dump,
            )
            self._remove(self.prior, checkpoints=False)
        record = {
            "recipe": self.config.recipe,
            "seed_checkpoint": self.config.checkpoint.create_seed_checkpoint,
            "tb_folder": self.config.metrics.save_tb_folder,
            "tb_path": tb_location(self.dump, self.config.metrics.save_tb_folder),
            "checkpoint_folder": self.config.checkpoint.folder,
            "identity": identity(self.config, self.dp),
        }
        path = os.path.join(self.dump, RUN_FILE)
        try:
            write_json_whole(path, record)
        except OSError as exc:
            raise write_failure(path, exc, what="the run's record") from None
        return self.resumed

    def _prior_progress(self, prior: dict[str, Any]) -> str:
        """``it logged steps 1-30 of 30``: how far the earlier attempt got, from its metrics.jsonl."""
        steps: list[int] = []
        try:
            with open(os.path.join(self.dump, "metrics.jsonl")) as f:
                for line in f:
                    try:
                        row = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(row, dict) and isinstance(row.get("step"), int):
                        steps.append(row["step"])
        except OSError:
            pass
        total = (prior.get("identity") or {}).get("training", {}).get("steps")
        of = f" of {total}" if isinstance(total, int) else ""
        if not steps:
            return "it logged no step"
        return f"it logged steps {min(steps)}-{max(steps)}{of}"

    def _prior_checkpoints(self, prior: dict[str, Any]) -> tuple[str, str]:
        """The earlier run's ``checkpoint.folder`` as it named it, and its path."""
        checkpoint_folder = prior.get("checkpoint_folder") or self.config.checkpoint.folder
        return checkpoint_folder, os.path.join(self.dump, checkpoint_folder)

    def _checkpointer_outputs(self) -> tuple[str, ...]:
        """``Checkpointer.outputs`` of ``checkpoint.backend`` (looked up only when a checkpoint
        folder holds something: a run without checkpoints may name a backend not installed)."""
        if self.registry is None:
            return ()
        record = self.registry.get("checkpointers", self.config.checkpoint.backend, what="checkpoint.backend")
        return tuple(record.outputs)

    def _checkpointer_seeds(self) -> tuple[str, ...]:
        """``Checkpointer.seeds`` of ``checkpoint.backend`` (looked up as the outputs are)."""
        if self.registry is None:
            return ()
        record = self.registry.get("checkpointers", self.config.checkpoint.backend, what="checkpoint.backend")
        return tuple(record.seeds)

    def _check_overwrite(self, prior: dict[str, Any]) -> None:
        """Refuse an ``--overwrite`` that would delete what is not the earlier run's, before
        anything is removed; reads only."""
        checkpoint_folder, ck_path = self._prior_checkpoints(prior)
        if not os.path.isdir(ck_path):
            return
        entries = sorted(_entries(ck_path))
        if not inside(ck_path, self.dump):
            # Outside the dump folder (absolute, "..", a link out) it may hold another run's
            # checkpoints, or be an ancestor of this folder: titan removes nothing there. Only
            # checkpoints there stand in the way (others' files are no run's to replace); with
            # no declared outputs, anything there may be one.
            patterns = self._checkpointer_outputs() if entries else ()
            theirs = _split(ck_path, patterns)[0] if patterns else entries
            if theirs:
                shown = ", ".join(theirs[:5]) + (f" and {len(theirs) - 5} more" if len(theirs) > 5 else "")
                raise UsageError(
                    f"--overwrite: checkpoint.folder {checkpoint_folder!r} ({os.path.realpath(ck_path)}) "
                    f"is outside job.dump_folder {self.dump!r} and holds {shown}, and titan deletes "
                    "nothing outside the dump folder (another run may share it, or it holds this "
                    "one); remove those yourself, or give this run a new folder (--dump-folder DIR)"
                )
            return
        if entries and not self._checkpointer_outputs():
            # Removing everything would delete the user's files there; removing nothing would
            # leave the earlier run's checkpoints for a later run of this folder to resume from.
            backend = self.config.checkpoint.backend
            label = (
                self.registry.label("checkpointers", backend)
                if self.registry is not None
                else f"checkpoint.backend {backend!r}"
            )
            shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
            raise UsageError(
                f"--overwrite: checkpoint.folder {checkpoint_folder!r} ({ck_path}) holds {shown}, and "
                f"{label} does not say which files are its own (Checkpointer.outputs), so titan "
                "removes nothing there; remove them yourself, or give this run a new folder "
                "(--dump-folder DIR)"
            )

    def _remove(self, prior: dict[str, Any], *, checkpoints: bool) -> tuple[list[str], list[str], list[str]]:
        """Remove the earlier run's files (``checkpoints``: ``--overwrite``, its checkpoints and
        what plugins declare too, after :meth:`_check_overwrite`); returns the entries of the
        checkpoint folder removed, those kept (not the checkpointer's), and the seed checkpoints
        kept (``Checkpointer.seeds``: the earlier run started from them, a seed run wrote them)."""
        import shutil

        ck_path = self._prior_checkpoints(prior)[1]
        names = [RUN_FILE, *RUN_FILES]
        tb_folder = prior.get("tb_folder") or self.config.metrics.save_tb_folder
        # Only the event files go, inside the dump folder too: whatever else a user keeps there
        # (or a checkpoint folder an earlier titan let overlap it) is not the run's to delete.
        self._remove_events(tb_location(self.dump, tb_folder))
        for name in names:
            path = os.path.join(self.dump, name)
            if os.path.isfile(path):
                os.remove(path)
        removed: list[str] = []
        kept: list[str] = []
        seeds: list[str] = []
        if checkpoints and os.path.isdir(ck_path) and inside(ck_path, self.dump):
            # Only what the checkpointer declares its own: a user's notes or exported model there
            # stay (with none declared, _check_overwrite refused an occupied folder).
            removed, kept = _split(ck_path, self._checkpointer_outputs() if _entries(ck_path) else ())
            if removed and not prior.get("seed_checkpoint"):
                # A seed is no output of a run that started from it: deleted, the run "started
                # over" from fresh weights (a seed of imported weights lost). A seed run's own
                # seed is its output, replaced as the rest.
                import fnmatch

                patterns = self._checkpointer_seeds()
                seeds = [n for n in removed if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
                removed = [n for n in removed if n not in seeds]
            _remove_entries(ck_path, removed)
        if checkpoints:  # --overwrite: what plugins wrote goes too (their records' outputs)
            for path in _declared_paths(self.dump, self.outputs):
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                elif os.path.lexists(path):
                    os.remove(path)
        return removed, kept, seeds

    @staticmethod
    def _remove_events(folder: str) -> None:
        """The event files of this dump folder's TensorBoard folder (:func:`tb_location`: its own
        inside the dump folder, its subfolder of one outside); anything else there stays, and the
        folder goes once empty."""
        import contextlib
        import glob

        for path in glob.glob(os.path.join(glob.escape(folder), TB_EVENTS)):
            if os.path.isfile(path) and not os.path.islink(path):
                os.remove(path)
        with contextlib.suppress(OSError):  # not empty, or not there
            os.rmdir(folder)
