"""The data worker of image runs (data/prefetch.py): batches prepared ahead in a thread equal the
batches prepared when taken, bit for bit (one source, a mixture, Gemma 3's and Qwen3.5's
processors); the saved position is that of the batches taken; a bad image's error comes when its
batch is taken, with the same message; the thread stops at `close`."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from image_cases import png, save_tiny_gemma3_processor
from test_image_data import qwen_processor, row, write_rows

from compiletune.data import prefetch
from compiletune.data.image_batch import ImagePrep
from compiletune.data.prefetch import PixelPrefetch
from compiletune.data.rows import Batches, Mixture
from compiletune.data.token_cache import cached_store
from compiletune.data.token_store import ExampleRows
from compiletune.errors import UserError


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("proc")
    save_tiny_gemma3_processor(folder)
    return transformers.AutoProcessor.from_pretrained(folder)


def image_rows(folder, name: str, n: int, seed: int) -> str:
    """`n` conversations with 0 to 2 images of varied sizes (every fourth one text only)."""
    rows = []
    for i in range(n):
        names = [f"img/{name}_{i}_{k}.png" for k in range(i % 4 if i % 4 < 3 else 0)]
        for k, image in enumerate(names):
            png(folder / image, 8 + 3 * ((i + k) % 7), 10 + 2 * (i % 5), seed=seed * 100 + i)
        rows.append(row(*names, reply="a reply " * (1 + i % 3)))
    return write_rows(folder / f"{name}.jsonl", rows)


def rows_of(source: str, processor, folder, seq_len: int = 256) -> ExampleRows:
    store = cached_store(
        source, processor.tokenizer, processor=processor, workers=0, cache_dir=str(folder)
    )
    return ExampleRows(store, seq_len, images=ImagePrep(processor))


def streams(kind: str, processor, folder):
    """Two equal streams over the same data: (plain, its row sets) made twice."""

    def make():
        a = rows_of(image_rows(folder, "a", 12, 1), processor, folder / "cache")
        if kind == "batches":
            return Batches(a, 3, seed=5), [a]
        b = rows_of(image_rows(folder, "b", 7, 2), processor, folder / "cache")
        return Mixture([a, b], [0.6, 0.4], 3, seed=5), [a, b]

    return make(), make()


def same(x, y) -> None:
    """Batches equal bit for bit, keys in the same order."""
    assert list(x) == list(y)
    for k, v in x.items():
        if k == "images":
            for field in ("pixel_values", "image_grid_thw"):
                a, b = getattr(v, field, None), getattr(y[k], field, None)
                assert (a is None) == (b is None), field
                if a is not None:
                    assert a.dtype == b.dtype and torch.equal(a, b), field
        else:
            assert v.dtype == y[k].dtype and torch.equal(v, y[k]), k


@pytest.mark.parametrize("kind", ["batches", "mixture"])
@pytest.mark.parametrize("family", ["gemma3", "qwen35"])
def test_prefetched_batches_equal_the_batches_taken_in_place(kind, family, gemma3, tmp_path):
    processor = gemma3 if family == "gemma3" else qwen_processor()
    (plain, _), (inner, datas) = streams(kind, processor, tmp_path)
    ahead = PixelPrefetch(inner, datas, depth=2)
    seen_images = 0
    try:
        for _ in range(9):  # past an epoch of either source
            want, got = plain.next(), ahead.next()
            same(got, want)
            seen_images += 0 if "images" not in want else want["images"].num_images
            assert ahead.state_dict() == plain.state_dict()
            assert ahead.served_inputs == plain.served_inputs and ahead.epoch == plain.epoch
        assert seen_images > 0 and len(ahead._drawn) == 2  # two batches drawn ahead
    finally:
        ahead.close()


def test_resume_from_the_position_of_the_batches_taken(gemma3, tmp_path):
    (plain, _), (inner, datas) = streams("mixture", gemma3, tmp_path)
    ahead = PixelPrefetch(inner, datas, depth=2)
    straight = [plain.next() for _ in range(6)]
    for want in straight[:3]:
        same(ahead.next(), want)
    saved = ahead.state_dict()  # three drawn ahead of the trainer: not in the position
    ahead.close()
    assert ahead.state_dict() == saved and not ahead._drawn
    (_, _), (again, datas2) = streams("mixture", gemma3, tmp_path)
    resumed = PixelPrefetch(again, datas2, depth=1)
    resumed.load_state_dict(saved)
    try:
        for want in straight[3:]:
            same(resumed.next(), want)
        resumed.next()  # a load drops the batches drawn ahead and draws from the position
        resumed.load_state_dict(saved)
        same(resumed.next(), straight[3])
    finally:
        resumed.close()


def test_a_bad_image_fails_when_its_batch_is_taken(gemma3, tmp_path):
    """A file deleted after tokenising: the worker's UserError names the row, and is raised by
    the `next` that takes its batch (the batches before it come), as without the worker."""
    source = image_rows(tmp_path, "a", 12, 1)

    def stream() -> Batches:
        return Batches(rows_of(source, gemma3, tmp_path / "cache"), 3, seed=5)

    plain, inner = stream(), stream()
    probe = stream()
    first_seen: dict[str, int] = {}  # each image's first batch
    for i in range(4):
        for r in probe.next_rows(3).tolist():
            for ref in probe.data.row_images(r):
                first_seen.setdefault(ref["path"], i)
    path, bad_at = max(first_seen.items(), key=lambda kv: kv[1])
    assert bad_at >= 1  # batches come before the bad one
    Path(path).unlink()
    for _ in range(bad_at):
        plain.next()
    with pytest.raises(UserError, match=r"a\.jsonl:\d+ .*: image .* cannot be read") as want:
        plain.next()

    ahead = PixelPrefetch(inner, [inner.data], depth=2)
    try:
        for _ in range(bad_at):
            ahead.next()  # the bad batch is drawn ahead of these: its error waits
        with pytest.raises(UserError) as got:
            ahead.next()
        assert str(got.value) == str(want.value)
    finally:
        ahead.close()
    assert not [t for t in threading.enumerate() if t.name == prefetch.THREAD_NAME]


def test_the_worker_starts_at_the_first_image_batch_and_stops_at_close(gemma3, tmp_path):
    data = rows_of(image_rows(tmp_path, "a", 12, 1), gemma3, tmp_path / "cache")
    ahead = PixelPrefetch(Batches(data, 3, seed=5), [data])

    def workers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == prefetch.THREAD_NAME]

    assert not workers()  # nothing before the first batch (the memory estimate may fork)
    ahead.next()
    (thread,) = workers()
    assert thread.daemon
    ahead.close()
    assert not thread.is_alive() and not workers()
    ahead.next()  # drawn again after a close: a new worker
    assert len(workers()) == 1
    ahead.close()
    assert not workers()


def test_the_pixel_jobs_run_in_the_worker(gemma3, tmp_path, monkeypatch):
    data = rows_of(image_rows(tmp_path, "a", 12, 1), gemma3, tmp_path / "cache")
    threads = []
    prep = data.prep.__class__.__call__

    def spy(self, refs):
        threads.append(threading.current_thread().name)
        return prep(self, refs)

    monkeypatch.setattr(ImagePrep, "__call__", spy)
    ahead = PixelPrefetch(Batches(data, 3, seed=5), [data])
    try:
        for _ in range(3):
            ahead.next()
    finally:
        ahead.close()
    assert threads and set(threads) == {prefetch.THREAD_NAME}
    assert np.all([t == prefetch.THREAD_NAME for t in threads])


def test_in_row_images_read_back_in_the_worker(gemma3, tmp_path):
    """Images held in a parquet column are read back from the file by the worker (its own
    reader of the file, the main thread keeps its own): the pixels equal the main thread's."""
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from compiletune.data import sources

    raws = [png(tmp_path / f"{i}.png", 10 + i, 14, seed=i).read_bytes() for i in range(5)]
    messages = [row()["messages"] for _ in raws]
    for m in messages:
        m[0]["content"].insert(0, {"type": "image"})
    images = [[{"bytes": raw, "path": None}] for raw in raws]
    pq.write_table(pa.table({"messages": messages, "images": images}), tmp_path / "t.parquet")
    source = str(tmp_path / "t.parquet")
    plain = Batches(rows_of(source, gemma3, tmp_path / "cache"), 2, seed=1)
    inner = Batches(rows_of(source, gemma3, tmp_path / "cache"), 2, seed=1)
    ahead = PixelPrefetch(inner, [inner.data])
    sources._table.cache_clear()
    try:
        for _ in range(4):
            same(ahead.next(), plain.next())
    finally:
        ahead.close()
    assert sources._table.cache_info().currsize == 2  # the main thread's and the worker's


def test_a_held_out_pass_prepares_its_pixels_ahead(gemma3, tmp_path, monkeypatch):
    """`prefetch.ahead` over `eval_batches`: the same batches in the same order, every one, the
    pixels prepared in the worker, the thread stopped when the pass ends or is left early; the
    rows' own setting comes back (a text-only set passes through)."""
    from compiletune.data.rows import eval_batches

    source = image_rows(tmp_path, "a", 12, 1)
    plain = rows_of(source, gemma3, tmp_path / "cache", seq_len=96)
    held = rows_of(source, gemma3, tmp_path / "cache", seq_len=96)
    want = list(eval_batches(plain, 1))
    assert len(want) >= 4
    names = []
    prep = ImagePrep.__call__
    monkeypatch.setattr(
        ImagePrep,
        "__call__",
        lambda self, refs: names.append(threading.current_thread().name) or prep(self, refs),
    )
    with prefetch.ahead(held, eval_batches(held, 1), depth=2) as batches:
        got = list(batches)
    assert len(got) == len(want) and set(names) == {prefetch.THREAD_NAME}
    for x, y in zip(got, want, strict=True):
        same(x, y)
    assert not held.defer_pixels and not [
        t for t in threading.enumerate() if t.name == prefetch.THREAD_NAME
    ]
    with prefetch.ahead(held, eval_batches(held, 1), depth=2) as batches:
        same(next(iter(batches)), want[0])  # left after one batch
    assert not [t for t in threading.enumerate() if t.name == prefetch.THREAD_NAME]
    text = object()
    with prefetch.ahead(text, [1, 2]) as batches:
        assert batches == [1, 2]
