"""What validation reads: ``validation.dataset``/``path`` (else ``data``'s), never the training
text where the dataset can help it.

The trainer's :meth:`~titan_core.trainer.Trainer.validate` runs the forward over these batches;
this module chooses them: the dataset's held-out documents when validation would read the
training dataset at the training path, warnings when it reads training text anyway, and errors
naming ``validation.*`` rather than the ``data.*`` fields a dataset names.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import attrs

from titan_core.data.loader import PackedBatches, path_field, read_documents, same_start
from titan_core.errors import UsageError
from titan_core.log import get_logger
from titan_core.run_folder import overlapping

if TYPE_CHECKING:
    from titan_core._registry import Registry
    from titan_core.trainer import Trainer

log = get_logger("titan.trainer")


def validation_batches(trainer: Trainer, registry: Registry) -> PackedBatches:
    """The validation data: ``validation.dataset``/``path`` (else ``data``'s), unshuffled.

    Validation that would read the training dataset at the training path reads the
    dataset's held-out documents (``Dataset.held_out``) instead: a loss on training text
    says nothing about how the model does on text it has not seen. A dataset without them
    is read as it is, with a warning naming the fields that fix it.
    """
    v, d = trainer.config.validation, trainer.config.data
    name = v.dataset or d.dataset
    dataset = registry.get("datasets", name, what="validation.dataset")
    data = attrs.evolve(d, dataset=name, path=v.path if v.path is not None else d.path)
    documents = dataset.documents
    held_out = False
    # The field and the plugin behind its value: ``validation.dataset 'x' (plugin p, dist 1.0)``.
    label = "validation." + registry.label("datasets", name)
    # The same record read at the same path yields the training documents: the same string
    # (the dataset's own notion of a path), or one file on disk however it is spelled.
    same_path = data.path == d.path or _same_file(data.path, d.path)
    if dataset == registry.get("datasets", d.dataset, what="dataset") and same_path:
        if dataset.held_out is not None:
            documents, held_out = dataset.held_out, True
            label += " (held-out documents)"
        else:
            log.warning(
                f"validation reads the training data: dataset {name!r} has no held-out "
                "documents, so validation/loss is measured on training text; set "
                "validation.path or validation.dataset to held-out data",
                dataset=name,
                path=data.path,
            )
    elif dataset == registry.get("datasets", d.dataset, what="dataset") and _nested(data.path, d.path):
        log.warning(
            f"validation reads part of the training data: validation.path {data.path!r} and "
            f"data.path {d.path!r} are one inside the other, so validation/loss is measured on "
            "training text; give validation a folder of its own",
            dataset=name,
        )
    token = path_field.set("validation.path")  # a folder is listed (and warned of) on first read
    try:
        # A plugin's exception there is one error naming the dataset, as later reads' are.
        first = next(_as_validation(read_documents(lambda: documents(data), label)), _NOTHING)
    finally:
        path_field.reset(token)
    if first is _NOTHING:
        if held_out:
            raise UsageError(
                f"{label} yields no documents: Dataset.held_out(data) of dataset {name!r} gave none; "
                "validate on other held-out data with validation.path (and validation.dataset = "
                "'text') or validation.dataset"
            )
        field = ("validation.path" if v.path is not None else "data.path") if dataset.reads_path else None
        raise UsageError(
            f"validation.dataset = {name!r} yields no documents; "
            + (f"check {field}" if field else "its Dataset.documents(data) gave none")
        )
    coords = trainer.parallel_dims.coordinates(trainer.topology.rank)
    batches = PackedBatches(
        documents=lambda: same_start(_as_validation(documents(data)), first, label),
        tokenizer=trainer.tokenizer,
        seq_len=trainer.config.training.seq_len,
        batch_size=trainer.config.training.local_batch_size,
        dp_rank=coords["dp_replicate"] * trainer.parallel_dims.dp_shard + coords["dp_shard"],
        dp_degree=trainer.parallel_dims.dp,
        seed=trainer.seed,
        shuffle_buffer=0,
        name=label,
        repeat_warning="validation.steps",
        batches_per_step=trainer.accumulation,
    )
    # One batch now, as each validation reads it: a set too small for one batch (known at the end
    # of its first pass) stopped the run only at the first validation, validation.freq steps into
    # training, and documents that differ from the first read's are found before any step.
    next(iter(batches))
    return batches


#: No document read (a dataset may yield ``None``, which the loader names as no text).
_NOTHING: object = object()  # no document


def _as_validation(documents: Iterable[str]) -> Iterator[str]:
    """The validation documents, a dataset's error naming ``validation.*`` (the dataset names the
    ``data.*`` fields it reads): the first read and a bad line met by a later validation alike."""
    try:
        yield from documents
    except UsageError as exc:
        text = str(exc)
        raise UsageError("validation." + text[5:] if text.startswith("data.") else text) from None


def _nested(a: str | None, b: str | None) -> bool:
    """Whether one of two local paths lies inside the other (a file of the training folder);
    paths not on this machine (a hub name) are not compared."""
    if a is None or b is None or not (os.path.exists(a) and os.path.exists(b)):
        return False
    return overlapping(a, b)


def _same_file(a: str | None, b: str | None) -> bool:
    """Whether two paths name one file or folder (a relative spelling, a symlink)."""
    if a is None or b is None:
        return False
    try:
        return os.path.samefile(a, b)
    except OSError:  # not both on this machine (a hub name, a URL)
        return False
