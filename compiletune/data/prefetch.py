"""The data worker of image runs: one daemon thread that prepares the pixels of the next
batches (decoding the files, the checkpoint's image processor) while the trainer's step runs.

`PixelPrefetch` wraps a run's batch stream (`rows.Batches` or `rows.Mixture`). The rows of each
batch are still chosen in the main thread, in the same order as without it, and its token
tensors taken there; only the pixel job a batch's rows leave (`ExampleRows.defer_pixels`,
`image_batch.PIXEL_JOB`) goes to the worker. `DEPTH` batches are drawn ahead of the one taken,
so on an accelerator (whose step returns before the device finishes) the host decodes the next
batches' images meanwhile. The batches are the same, bit for bit, as without the worker.

What a checkpoint saves is the position of the batches the trainer took, never of those drawn
ahead (`state_dict`); a job's error (a missing, unreadable or oversized image: a `UserError`
naming the row) is raised in the main thread when its batch is taken. The thread starts at the
first batch with images (none for text-only data, and none while the memory estimate forks)
and stops at `close`.

Why a thread, not worker processes: decoding (Pillow) and resizing (numpy, Pillow, torch)
release the GIL, the rows and their references need no pickling, and a process pool beside a
compiled model would fork a process holding threads (forks.py) or spawn-import torch again.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from compiletune.data.token_store import PIXEL_JOB

# Batches drawn ahead of the one the trainer takes: their pixels are prepared while it steps.
# 0 turns the worker off (the pixels prepared in the main thread when a batch is taken).
DEPTH = 2
THREAD_NAME = "compiletune-pixels"
# Seconds `close` waits for a job under way (one batch's images) before leaving the daemon.
JOIN_SECONDS = 30.0


class PixelWorker:
    """One daemon thread running pixel jobs in the order they are submitted."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[[], Any]) -> Future:
        """`job`'s result (or error) to come, as a Future; the thread starts at the first job."""
        if self._thread is None:  # its own queue: one left behind by `close` ends on its own
            self._jobs = queue.SimpleQueue()
            self._thread = threading.Thread(
                target=self._serve, args=(self._jobs,), name=THREAD_NAME, daemon=True
            )
            self._thread.start()
        done: Future = Future()
        self._jobs.put((job, done))
        return done

    @staticmethod
    def _serve(jobs: queue.SimpleQueue) -> None:
        while (item := jobs.get()) is not None:
            job, done = item
            if not done.set_running_or_notify_cancel():  # dropped (a resume, the run's end)
                continue
            try:
                done.set_result(job())
            except BaseException as e:  # raised in the main thread when the batch is taken
                done.set_exception(e)

    def close(self) -> None:
        """Stop the thread: the jobs queued are dropped by their owner, the one under way ends."""
        thread, self._thread = self._thread, None  # once, even if Ctrl-C lands in the join
        if thread is not None:
            self._jobs.put(None)
            thread.join(JOIN_SECONDS)


@dataclass
class _Drawn:
    """A batch drawn ahead: its tokens, its pixels to come, and the stream's place before it."""

    batch: dict[str, Any] | None
    pixels: Future | None
    error: BaseException | None  # drawing it failed: raised when it is taken
    state: dict
    served_inputs: int
    epoch: int


class PixelPrefetch:
    """A batch stream whose pixels are prepared `depth` batches ahead by a `PixelWorker`.

    `datas`: the stream's row sets; those with an image processor leave their pixels as a job
    (`defer_pixels`). Serves `next`, `state_dict`, `load_state_dict`, `epoch`, `served_inputs`
    and `data` as the stream it wraps does, counted at the batches taken."""

    def __init__(self, batches: Any, datas: list[Any], depth: int = DEPTH) -> None:
        self.inner, self.depth = batches, depth
        for d in datas:
            if getattr(d, "prep", None) is not None:
                d.defer_pixels = True
        self._drawn: deque[_Drawn] = deque()
        self._worker = PixelWorker()

    def _draw(self) -> None:
        inner = self.inner
        at = _Drawn(None, None, None, inner.state_dict(), inner.served_inputs, inner.epoch)
        try:
            at.batch = inner.next()
        except Exception as e:  # as the stream would have raised it at this batch
            at.error = e
        else:
            job = at.batch.pop(PIXEL_JOB, None)
            at.pixels = None if job is None else self._worker.submit(job)
        self._drawn.append(at)

    def next(self) -> dict[str, Any]:
        """The next batch, its pixels prepared; the `depth` after it drawn and queued."""
        while len(self._drawn) < self.depth + 1 and (not self._drawn or not self._drawn[-1].error):
            self._draw()
        at = self._drawn.popleft()
        if at.error is not None:
            raise at.error
        assert at.batch is not None
        if at.pixels is not None:
            at.batch |= at.pixels.result()
        return at.batch

    __next__ = next

    def __iter__(self) -> PixelPrefetch:
        return self

    @property
    def epoch(self) -> int:
        return self._drawn[0].epoch if self._drawn else self.inner.epoch

    @property
    def served_inputs(self) -> int:
        return self._drawn[0].served_inputs if self._drawn else self.inner.served_inputs

    @property
    def data(self) -> Any:
        return self.inner.data  # AttributeError for a mixture, as unwrapped

    def state_dict(self) -> dict:
        """The position of the next batch the trainer takes (not of the ones drawn ahead)."""
        return self._drawn[0].state if self._drawn else self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._drop()
        self.inner.load_state_dict(state)

    def _drop(self) -> None:
        """Forget the batches drawn ahead: the stream goes back to the first of them."""
        if not self._drawn:
            return
        first = self._drawn[0]
        for at in self._drawn:
            if at.pixels is not None:
                at.pixels.cancel()
        self._drawn.clear()
        self.inner.load_state_dict(first.state)
        self.inner.served_inputs = first.served_inputs

    def close(self) -> None:
        """Stop the worker; the batches drawn ahead are dropped, the position stays that of the
        batches taken (a `next` after it draws them again and starts a new worker)."""
        self._drop()
        self._worker.close()


@contextlib.contextmanager
def ahead(data: Any, batches: Iterable[dict[str, Any]], depth: int | None = None) -> Iterator[Any]:
    """A finite pass over `data`'s `batches` (the held-out evaluation) with each batch's pixels
    prepared `depth` batches ahead by a worker, stopped when the block ends; `batches` as they
    are for rows without images (or `depth` 0; None: `DEPTH`). The batches are the same as
    without it."""
    depth = DEPTH if depth is None else depth
    if getattr(data, "prep", None) is None or depth <= 0:
        yield batches
        return
    worker, drawn = PixelWorker(), deque()

    def taken() -> Iterator[dict[str, Any]]:
        stream = iter(batches)
        while True:
            for batch in stream:  # fill up to the batch taken and `depth` after it
                job = batch.pop(PIXEL_JOB, None)
                drawn.append((batch, None if job is None else worker.submit(job)))
                if len(drawn) > depth:
                    break
            if not drawn:
                return
            batch, pixels = drawn.popleft()
            if pixels is not None:
                batch |= pixels.result()
            yield batch

    before, data.defer_pixels = data.defer_pixels, True
    try:
        yield taken()
    finally:
        data.defer_pixels = before
        for _, pixels in drawn:
            if pixels is not None:
                pixels.cancel()
        worker.close()
