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

from titan_core.data.loader import PackedBatches, path_field, read_documents
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
    label = f"validation.dataset {name!r}"
    # The same record read at the same path yields the training documents: the same string
    # (the dataset's own notion of a path), or one file on disk however it is spelled.
    same_path = data.path == d.path or _same_file(data.path, d.path)
    if dataset == registry.get("datasets", d.dataset, what="dataset") and same_path:
        if dataset.held_out is not None:
            documents = dataset.held_out
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
        first = next(_as_validation(read_documents(lambda: documents(data), label)), None)
    finally:
        path_field.reset(token)
    if first is None:
        raise UsageError(f"validation.dataset = {name!r} yields no documents; check validation.path")
    coords = trainer.parallel_dims.coordinates(trainer.topology.rank)
    return PackedBatches(
        documents=lambda: _as_validation(documents(data)),
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
