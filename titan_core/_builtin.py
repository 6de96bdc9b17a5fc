"""titan's own plugin: the datasets that ship with the core.

Registered through the ``titan`` entry-point group like any third-party plugin.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from titan_core.hookspecs import hookimpl
from titan_core.records import Dataset

if TYPE_CHECKING:
    from titan_core.config import Data


def _bundled(data: Data) -> Iterable[str]:
    from titan_core.data.corpus import documents

    return documents(data.bundled_documents)


def _text(data: Data) -> Iterable[str]:
    from titan_core.data.loader import read_text_files

    return read_text_files(data.path)


@hookimpl
def titan_datasets() -> list[Dataset]:
    return [
        Dataset("bundled", _bundled, "generated English-like corpus shipped with titan (offline)"),
        Dataset("text", _text, "local .jsonl ({'text': ...} per line) or .txt files at data.path"),
    ]
