"""Batches prepared ahead on a background thread, off the training step's critical path.

Tokenizing and packing the next batch takes the host milliseconds, and every ~6 steps of the 8B
benchmark shape a new chunk of documents is tokenized at once; done inside the step, the GPU
waits for it. :class:`Prefetcher` runs the batch iterator on a thread ``depth`` batches ahead
(the tokenizer releases the GIL while it encodes) and, for CUDA, copies each batch into pinned
memory so that the step's ``.to(device, non_blocking=True)`` is a real asynchronous copy.

The order of batches is the iterator's (one producer), so runs stay deterministic and resuming
skips exactly the batches the restored steps consumed. An exception of the iterator (a data
error) is raised by ``next`` in the training thread, as if there were no thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

#: Put into the queue when the iterator is exhausted.
_END = object()


class _Raised:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class Prefetcher:
    """Iterate ``batches`` (tuples of tensors) ``depth`` ahead on a daemon thread."""

    def __init__(self, batches: Iterator[Any], depth: int, *, pin: bool = False) -> None:
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        self._batches = batches
        self._pin = pin
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._produce, name="titan-data-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item: Any) -> bool:
        """Block until there is room or the prefetcher is closed (then ``False``)."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self) -> None:
        try:
            for batch in self._batches:
                if self._pin:
                    batch = tuple(t.pin_memory() for t in batch)
                if not self._put(batch):
                    return
        except BaseException as exc:  # handed to the training thread, which raises it
            self._put(_Raised(exc))
            return
        self._put(_END)

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        item = self._queue.get()
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, _Raised):
            self._done = True
            raise item.exc
        return item

    def close(self) -> None:
        """Stop the thread (it finishes the batch it is preparing) and drop what it prepared."""
        self._stop.set()
        self._done = True
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=10)
