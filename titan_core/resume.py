"""Checkpoints and resumes: what a checkpoint records beside the weights, and how a resume
compares it with the run that resumes.

:func:`resume_record` is what ``meta.json`` holds for a resume to compare (the model, the
optimizer settings, the compute precision, the data and how much of it the saved steps
consumed); :func:`restore` resumes a trainer from its last checkpoint, refusing another model
and naming every setting that changed; :class:`CheckpointSaves` is the end-of-step callback that
saves. ``titan export`` compares models as a resume does (:func:`model_changes`).
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from titan_core.data.loader import tokenizer_fingerprint
from titan_core.errors import UsageError
from titan_core.log import get_logger
from titan_core.run_folder import plugin_results

if TYPE_CHECKING:
    from titan_core.config import TrainerConfig
    from titan_core.records import ModelSpec
    from titan_core.trainer import Trainer

log = get_logger("titan.trainer")


def takes_keyword(fn: Any, name: str) -> bool:
    """Whether a plugin's ``fn`` takes the optional keyword ``name`` of its contract (the
    checkpointer's ``load(..., check_meta=)``, ``verify(..., check_meta=)``, ``save_seed(...,
    meta=)``): one written before the keyword is called as it was. A callable without a signature
    takes none."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def restore(trainer: Trainer) -> None:
    """Resume ``trainer`` from its last checkpoint, if there is one (sets ``trainer.step`` and
    how many microbatches the restored steps consumed).

    The checkpoint brings back weights, optimizer moments and the schedule's position; the
    settings of how training goes on are this run's: its model must be the checkpoint's (or
    the weights would be read as another model), and its optimizer settings and schedule
    apply from the next step (a warning names what changed). Checkpoints of earlier titan
    versions, whose ``meta.json`` lacks a record, skip that comparison.
    """
    #: Microbatches (of this run's size) the restored steps consumed (a resume skips them).
    trainer.consumed = 0
    trainer.resumed_from = 0
    #: The last step this run saved (the Ctrl-C message names what a rerun resumes from).
    trainer.last_saved = 0
    #: The tokenizer's fingerprint (``tokenizer_fingerprint``), once: every save records it.
    trainer.tokenizer_record = None
    if trainer.checkpointer is None or trainer.config.checkpoint.create_seed_checkpoint:
        return
    trainer.tokenizer_record = tokenizer_fingerprint(trainer.tokenizer)
    fresh = [{k: v for k, v in g.items() if k != "params"} for g in trainer.optimizer.param_groups]
    fresh_base_lrs = list(trainer.scheduler.base_lrs)
    resumed = resume_record(trainer.config, 0)

    def same_model(step: int, meta: Mapping[str, Any]) -> None:
        saved_model = meta.get("model")
        if saved_model is not None and saved_model != resumed["model"]:
            changes = model_changes(trainer.spec, saved_model, resumed["model"])
            if not changes:  # another spelling of the same model (an override at its default)
                return
            raise UsageError(
                f"checkpoint of step {step} in {trainer.config.job.dump_folder!r} was saved by another "
                f"model ({'; '.join(changes)}): resuming would read its weights as this model. Resume "
                "it with the model it was written for, or start a new run in another job.dump_folder "
                "from its weights (checkpoint.initial_load_path)"
            )

    # Before any tensor is read, where the checkpointer offers it: another model of other
    # parameters would otherwise fail inside the load, as if the checkpoint were damaged.
    load = trainer.checkpointer.load
    early = takes_keyword(load, "check_meta")
    kwargs: dict[str, Any] = {"check_meta": same_model} if early else {}
    trainer.step, meta = load(trainer.parts, trainer.optimizer, trainer.scheduler, **kwargs)
    if not trainer.step:
        _refuse_seed_and_initial_weights(trainer, meta)
        return
    same_model(trainer.step, meta)
    if trainer.config.checkpoint.initial_load_path:
        log.warning(
            f"resumed from the checkpoint of step {trainer.step}: checkpoint.initial_load_path is not "
            "read (a resume always wins; the initial weights were those of step 1)"
        )
    if trainer.step > trainer.steps:  # nothing to train, and config.toml would say fewer steps than ran
        field = trainer.steps_field()
        raise UsageError(
            f"checkpoint of step {trainer.step} in {trainer.config.job.dump_folder!r} is past this run's "
            f"{field} = {trainer.steps}: raise {field} (above {trainer.step} to train on), or start this "
            "run in another job.dump_folder (--dump-folder DIR) or checkpoint.folder"
        )
    trainer.schedule.check_resume(meta.get("lr_schedule"), trainer.step)
    changed = _changes(meta.get("optimizer") or {}, resumed["optimizer"], "training.")
    if changed:
        log.warning(
            f"resuming with other optimizer settings; this run's apply from step {trainer.step + 1}: "
            + ", ".join(changed)
        )
    changed = _changes(meta.get("compute") or {}, resumed["compute"], "")
    if changed:
        log.warning(
            f"resuming with another compute precision; this run's applies from step {trainer.step + 1}: "
            + ", ".join(changed)
        )
    changed = _changes(meta.get("results") or {}, resumed["results"], "")
    if changed:
        log.warning(
            "resuming with other settings of plugin sections (fields their ConfigSection.results "
            f"names); this run's apply from step {trainer.step + 1}: " + ", ".join(changed)
        )
    saved_data = meta.get("data") or {}
    now_data = resumed["data"]
    saved_tokenizer = meta.get("tokenizer")
    if saved_tokenizer is not None and trainer.tokenizer_record is not None:
        # The tokenizer's fingerprint decides, not its path: a copy elsewhere is the same
        # tokenizer, and another file at the same path is another one (named below, once).
        now_data = {k: v for k, v in now_data.items() if k != "data.tokenizer_path"}
        _warn_tokenizer_change(
            saved_tokenizer, trainer.tokenizer_record, saved_data, resumed["data"], trainer.step
        )
    changed = _changes(saved_data, now_data, "")
    moved = _changes(saved_data, {"data.path": resumed["data"]["data.path"]}, "")
    if moved and changed == moved and _same_files(meta.get("data_files"), trainer.data_files):
        # Only the path moved (a copy, another mount): the same files, by names, sizes and
        # both ends of each, are the same stream.
        log.info("data.path moved; it holds the files the checkpoint recorded", change=moved[0])
        changed = []
    if not changed:
        changed = _files_changes(meta.get("data_files"), trainer.data_files)
    if changed:
        log.warning(
            "resuming with another data configuration; the data will not continue where it stopped: "
            + ", ".join(changed)
        )
    _warn_global_batch_change(trainer, meta.get("sequences_per_step"))
    per_microbatch = trainer.config.training.local_batch_size * trainer.parallel_dims.dp  # all ranks'
    samples = meta.get("samples", trainer.step * sequences_per_step(trainer))  # earlier titans
    saved_len, seq_len = meta.get("seq_len"), trainer.config.training.seq_len
    trainer.consumed, rest = divmod(int(samples), per_microbatch)
    if saved_len is not None and saved_len != seq_len:
        # The saved steps consumed tokens, in sequences of the checkpoint's length: counted in
        # sequences of the new length, the skip landed elsewhere (twice the length skipped as
        # many tokens again, never trained on). The data continues after those tokens, at the
        # next whole microbatch (the packed stream's position; with shuffling, near it).
        tokens = int(samples) * (saved_len + 1)
        trainer.consumed = -(-tokens // ((seq_len + 1) * per_microbatch))
        log.warning(
            f"resuming with training.seq_len {saved_len} -> {seq_len}: the saved steps consumed "
            f"{samples} sequences of {saved_len + 1} tokens ({tokens} tokens); the data continues after "
            f"them, at sequence {trainer.consumed * per_microbatch} of {seq_len + 1} tokens (the next "
            "whole microbatch)"
        )
    elif rest:
        log.warning(
            f"the checkpoint's data stopped after {samples} sequences, not a multiple of the "
            f"{per_microbatch} a microbatch now takes (training.local_batch_size x DP degree); the "
            f"data resumes {per_microbatch - rest} sequences later"
        )
        trainer.consumed += 1
    trainer.resumed_from = trainer.step
    # The checkpoint restored its own hyper-parameters into the optimizer and the scheduler's
    # base LRs; this run's (its recipe's) decide from here on.
    trainer.scheduler.base_lrs = fresh_base_lrs
    for group, own, base in zip(trainer.optimizer.param_groups, fresh, fresh_base_lrs, strict=True):
        group.update(own)
        group["lr"] = base * trainer.schedule(trainer.scheduler.last_epoch)


def _refuse_seed_and_initial_weights(trainer: Trainer, meta: Mapping[str, Any]) -> None:
    """Refuse a seed checkpoint that ``load`` restored beside a ``checkpoint.initial_load_path``
    naming other weights: the trainer would read those over the seed's, after the log said the
    run starts from the seed. The checkpointer says which seed it restored (``loaded_seed()``,
    :class:`~titan_core.records.Checkpointer`): its folder layout is its own. One that does not
    say, but restored something at step 0 (a meta; ``(0, {})`` is no checkpoint), is refused
    whatever ``initial_load_path`` names: the trainer cannot tell whether it is the same seed."""
    initial = trainer.config.checkpoint.initial_load_path
    if not initial:
        return
    c = trainer.config.checkpoint
    folder = os.path.join(trainer.config.job.dump_folder, c.folder)
    says = getattr(trainer.checkpointer, "loaded_seed", None)
    if callable(says):
        seed = says()
        if seed is None or os.path.realpath(initial) == os.path.realpath(seed):
            return
        held, other = f"holds a seed checkpoint ({seed})", "other weights"
        move = f"move {seed} out of that folder"
    elif meta:
        held = (
            f"holds a seed checkpoint, which checkpoint.backend {c.backend!r} loaded (it does not say "
            "from where, so titan cannot tell whether initial_load_path names the same weights)"
        )
        other = "weights too"
        move = "move the seed checkpoint out of that folder"
    else:
        return
    raise UsageError(
        f"checkpoint.folder {folder!r} {held}, and checkpoint.initial_load_path names {other} "
        f"({initial!r}): a run starts from one. Leave out initial_load_path to start from the seed, or "
        f"{move} to start from initial_load_path"
    )


class CheckpointSaves:
    """The checkpointer's saves, as a callback: it decides the steps; the trainer checked the values."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def on_step_end(self, step: int, metrics: Any, last: bool) -> None:
        t = self.trainer
        if t.checkpointer.should_save(step, last):
            microbatches = t.consumed + (step - t.resumed_from) * t.accumulation
            # Of the whole job (every DP rank's share): a resume on another layout skips as many.
            samples = microbatches * t.config.training.local_batch_size * t.parallel_dims.dp
            meta = {
                "lr_schedule": t.schedule.describe(),
                "loss_finite": True,
                "step": step,
                **resume_record(t.config, samples),
                "data_files": t.data_files,
                "tokenizer": t.tokenizer_record,
                # The global batch (every DP rank's microbatches of the step): a resume on fewer
                # ranks with the same recipe takes smaller steps (_warn_global_batch_change).
                "sequences_per_step": sequences_per_step(t),
            }
            # The save is no training: its seconds stay out of step time and tokens/s (it runs
            # after its step's row, so they went into the next interval). The step's own device
            # work is waited for first, outside the pause, so it still counts; a save copies
            # the tensors to the host, which waits for it anyway.
            if t.device.type == "cuda":
                import torch

                torch.cuda.synchronize(t.device)
            with t.metrics.paused():
                t.checkpointer.save(step, t.parts, t.optimizer, t.scheduler, last=last, meta=meta)
            t.last_saved = step


def sequences_per_step(trainer: Trainer) -> int:
    """The global batch: sequences one optimizer step averages over, all DP ranks' microbatches."""
    return trainer.config.training.local_batch_size * trainer.parallel_dims.dp * trainer.accumulation


def _warn_global_batch_change(trainer: Trainer, saved: Any) -> None:
    """Warn when the steps after the checkpoint average over another number of sequences than
    its steps did. Without ``training.global_batch_size`` the global batch is the local batch
    times the DP degree, so a preempted job resumed on fewer ranks with the same recipe trains
    on with smaller steps (the LR tuned for the larger batch): allowed, as a changed
    ``training.lr`` is, but never silent. Checkpoints of earlier titans record no global batch."""
    if not isinstance(saved, int) or isinstance(saved, bool):
        return
    now = sequences_per_step(trainer)
    if saved == now:
        return
    t = trainer.config.training
    per_microbatch = t.local_batch_size * trainer.parallel_dims.dp
    if saved % per_microbatch == 0:
        keep = f"set training.global_batch_size = {saved}"
    else:  # no accumulation of this layout's microbatches gives it: the local batch must change too
        keep = (
            f"set training.global_batch_size = {saved} with a training.local_batch_size that, times "
            f"the DP degree {trainer.parallel_dims.dp}, divides it"
        )
    log.warning(
        f"resuming with another global batch; this run's applies from step {trainer.step + 1}: "
        f"{saved} -> {now} sequences per step (training.local_batch_size {t.local_batch_size} x DP "
        f"degree {trainer.parallel_dims.dp} x {trainer.accumulation} microbatches), so the steps "
        f"after the checkpoint are not those of the run it saved; to keep its batch, {keep}"
    )


def resume_record(config: TrainerConfig, samples: int) -> dict[str, Any]:
    """What a checkpoint's ``meta.json`` records for a resume to compare (:meth:`Trainer._restore`):
    the model, the optimizer settings, the data, and how many sequences the saved steps consumed
    over all data-parallel ranks (so a resume with another accumulation, local batch size or DP
    degree continues where the data stopped)."""
    t, d = config.training, config.data
    return {
        # As JSON gives it back (tuples as lists), so that a resume compares like with like.
        "model": json.loads(
            json.dumps(
                {
                    "name": config.model.name,
                    "flavor": config.model.flavor,
                    "overrides": config.model.overrides,
                },
                default=str,
            )
        ),
        "optimizer": {
            "lr": t.lr,
            "weight_decay": t.weight_decay,
            "beta1": t.beta1,
            "beta2": t.beta2,
            "eps": t.eps,
            "max_norm": t.max_norm,  # the clipping each later step applies
        },
        # How steps compute: another precision changes every later loss.
        "compute": {
            "training.dtype": t.dtype,
            # Read only in bfloat16 (how one device gets it).
            "training.single_device_mixed_precision": (
                t.single_device_mixed_precision if t.dtype == "bfloat16" else None
            ),
        },
        "data": {
            "data.dataset": d.dataset,
            "data.path": _local_path(d.path),
            "data.tokenizer_path": d.tokenizer_path,
            "data.bundled_documents": d.bundled_documents,
        },
        # Plugin fields that change the losses (``ConfigSection.results``), as ``training.lr`` does.
        "results": {
            f"{name}.{field}": value
            for name, fields in plugin_results(config).items()
            for field, value in fields.items()
        },
        "samples": samples,
        # The length of those sequences (``training.seq_len``): a resume with another one
        # continues after the tokens they held.
        "seq_len": t.seq_len,
    }


def model_changes(
    spec: ModelSpec, saved: Mapping[str, Any], mine: Mapping[str, Any], *, compute_only: bool = True
) -> list[str]:
    """How a checkpoint's model record (``resume_record``'s ``model``) differs from ``mine``,
    with the model arguments that differ once each is built (``rope_theta: 500000 -> 10000.0``);
    empty when the two records build the same model (an override at its default, another
    spelling of a value the model resolves, ``ModelSpec.resolve_args``, or a different
    ``ModelSpec.compute_only_args`` such as ``fuse_qkv``). The records
    alone when the checkpoint's no longer builds (another family, a flavor this titan lacks).
    A resume and ``titan export`` decide alike; ``compute_only=False`` compares the
    ``compute_only_args`` too (a dump folder's runs: the same weights, but timings and rounding
    of their own)."""
    from titan_core.initial_weights import _fields

    records = _changes(saved, mine, "model.")
    # The arguments as the model reads them (``ModelSpec.resolve_args``): n_kv_heads None and
    # n_kv_heads = n_heads build the same model, which compared as written would be refused.
    resolve = getattr(spec, "resolve_args", None) or (lambda args: args)

    def resolved(record: Mapping[str, Any]) -> dict[str, Any] | None:
        args = resolve(spec.flavor(record.get("flavor"), record.get("overrides") or {}))
        return dict(args) if isinstance(args, Mapping) else _fields(args)

    try:
        if saved.get("name") != mine.get("name"):
            return records
        old, new = resolved(saved), resolved(mine)
    except Exception:  # a record this titan cannot build (a flavor it lacks): as written
        return records
    if old is None or new is None:
        return records
    for name in getattr(spec, "compute_only_args", ()) if compute_only else ():  # how, not what
        old.pop(name, None)
        new.pop(name, None)
    built = json.loads(json.dumps({"old": old, "new": new}, default=str))
    differ = _changes(built["old"], built["new"], "")
    return [*records, f"arguments that differ: {', '.join(differ)}"] if differ else []


def _warn_tokenizer_change(
    saved: Mapping[str, Any],
    now: Mapping[str, Any],
    saved_data: Mapping[str, Any],
    now_data: Mapping[str, Any],
    step: int,
) -> None:
    """Warn when the tokenizer differs from the checkpoint's (``tokenizer_fingerprint``): the
    embedding and output rows the model learnt belong to the checkpoint's ids, which now stand
    for other text. Not refused: the model's vocabulary (its embedding's shape) is the model
    config's, compared already, and a run may change tokenizers on purpose."""
    if saved.get("digest") == now["digest"]:
        return
    before, after = saved.get("vocab_size"), now["vocab_size"]
    if before == after:
        sizes = f"the same vocabulary size ({after} tokens), other tokens, ids or merges"
    else:
        sizes = f"a vocabulary of {before} -> {after} tokens"
    was, now_path = saved_data.get("data.tokenizer_path"), now_data["data.tokenizer_path"]
    paths = (
        f"{_tokenizer_name(now_path)}, rewritten since"
        if was == now_path
        else f"{_tokenizer_name(was)} -> {_tokenizer_name(now_path)}"
    )
    log.warning(
        f"resuming with another tokenizer than the checkpoint's ({paths}: {sizes}): the token ids "
        f"the model learnt until step {step} mean other text now, and the data will not continue "
        "where it stopped. Resume with the checkpoint's tokenizer (data.tokenizer_path), or start a new "
        "run from these weights (checkpoint.initial_load_path) if the change is meant"
    )


def _tokenizer_name(path: str | None) -> str:
    return "titan's bundled tokenizer" if path is None else repr(path)


def _files_changes(saved: Mapping[str, Any] | None, now: Mapping[str, Any] | None) -> list[str]:
    """How the data files differ from the checkpoint's record of them (``files_fingerprint``),
    comparing what both records hold (an earlier titan recorded no digest)."""
    if saved is None or now is None:
        return []
    if (saved.get("files"), saved.get("bytes")) != (now["files"], now["bytes"]):
        return [
            f"the files at data.path: {saved.get('files')} files of {saved.get('bytes')} bytes -> "
            f"{now['files']} of {now['bytes']}"
        ]
    if "digest" in saved and saved["digest"] != now["digest"]:
        return [
            f"the files at data.path were renamed or rewritten (the same {now['files']} files of "
            f"{now['bytes']} bytes, other names or content)"
        ]
    return []


def _same_files(saved: Mapping[str, Any] | None, now: Mapping[str, Any] | None) -> bool:
    """Whether two ``files_fingerprint`` records, both with a digest, describe the same files."""
    return saved is not None and now is not None and "digest" in saved and dict(saved) == dict(now)


def _changes(saved: Mapping[str, Any], now: Mapping[str, Any], prefix: str) -> list[str]:
    """``prefix + key: saved -> now`` for each key whose value differs (keys ``saved`` lacks:
    recorded by no earlier checkpoint, not compared)."""
    return [f"{prefix}{k}: {saved[k]!r} -> {v!r}" for k, v in now.items() if k in saved and saved[k] != v]


def _local_path(path: str | None) -> str | None:
    """``path`` as its real path when it is one on this machine (a resume spelling it relatively,
    or through a link, reads the same files), else as given (a hub name, a URL)."""
    return os.path.realpath(path) if path is not None and os.path.exists(path) else path
