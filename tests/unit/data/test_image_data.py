"""Image conversations through the data path: tokenised with the checkpoint's processor (a tiny
Gemma 3 one saved and read back with AutoProcessor; a tiny Qwen3.5-style one built here), the
targets the assistant's text only, bad images one line or skipped and counted, the token cache
keeping image references, packing keeping each example whole, the batch's pixels prepared.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from image_cases import (
    QWEN_TOKENS,
    TinyQwenProcessor,
    png,
    save_tiny_gemma3_checkpoint,
    save_tiny_gemma3_processor,
)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from compiletune.data.image_batch import ImagePrep
from compiletune.data.images import ImageError, ImageRef, load_image
from compiletune.data.layouts import read_examples
from compiletune.data.rows import Mixture, pack_store
from compiletune.data.token_cache import cached_store
from compiletune.data.token_store import IGNORE_INDEX, ExampleRows, MemoryStore
from compiletune.data.tokenizer import byte_tokenizer
from compiletune.errors import UserError

QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def qwen_processor() -> TinyQwenProcessor:
    """Patches of 4 merged 2x2: an image of 8x8 to 32x32 pixels takes 1 to 16 tokens."""
    base = byte_tokenizer()
    base.add_special_tokens({"additional_special_tokens": list(QWEN_TOKENS.values())})
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer,
        bos_token=base.bos_token,
        eos_token=base.eos_token,
        pad_token=base.pad_token,
        extra_special_tokens=QWEN_TOKENS,
    )
    images = Qwen2VLImageProcessorPil(
        patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=8 * 8, max_pixels=32 * 32
    )
    return TinyQwenProcessor(images, tokenizer, chat_template=QWEN_TEMPLATE)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    folder = tmp_path_factory.mktemp("proc")
    save_tiny_gemma3_processor(folder)
    return transformers.AutoProcessor.from_pretrained(folder)


def row(*images: str, reply: str = "a red square", question: str = "What is it?") -> dict:
    parts = [{"type": "image", "image": name} for name in images]
    return {
        "messages": [
            {"role": "user", "content": [*parts, {"type": "text", "text": question}]},
            {"role": "assistant", "content": [{"type": "text", "text": reply}]},
        ]
    }


def write_rows(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def data(tmp_path):
    png(tmp_path / "img" / "a.png", 20, 12, seed=1)
    png(tmp_path / "img" / "b.png", 9, 30, seed=2)
    return tmp_path


def encode(source, processor, **kw):
    store = cached_store(
        source, processor.tokenizer, processor=processor, workers=0, say=kw.pop("say", print), **kw
    )
    return store


def image_tokens(processor) -> int:
    return processor.tokenizer.image_token_id


@pytest.mark.parametrize("family", ["gemma3", "qwen35"])
def test_one_and_two_images_tokenise_with_targets_on_the_reply(family, gemma3, data):
    processor = gemma3 if family == "gemma3" else qwen_processor()
    source = write_rows(
        data / "train.jsonl", [row("img/a.png"), row("img/a.png", "img/b.png", reply="two")]
    )
    store = encode(source, processor, cache_dir=str(data / "cache"))
    # expected token counts from the processor on each conversation as a whole
    for doc, names in enumerate([["a"], ["a", "b"]]):
        ids, flags = store.document(doc)
        pictures = [load_image(ImageRef(data / "img" / f"{n}.png", "")) for n in names]
        whole = processor(text=["x" + processor.image_token * len(names)], images=pictures)
        expected = int((np.array(whole["input_ids"]) == image_tokens(processor)).sum())
        assert int((ids == image_tokens(processor)).sum()) == expected > 0
        # the targets are the reply (and what the template puts around it), never the user turn
        text = processor.tokenizer.decode(ids[flags > 0].tolist())
        assert ("a red square" if doc == 0 else "two") in text and "What is it?" not in text
        assert not flags[ids == image_tokens(processor)].any()
    assert [len(r) for r in store.images] == [1, 2]
    assert store.images[1][1]["path"] == str(data / "img" / "b.png")


def test_missing_image_is_one_line_naming_the_row_or_skipped_and_counted(gemma3, data):
    rows = [row("img/a.png"), row("img/gone.png"), row("img/b.png")]
    source = write_rows(data / "train.jsonl", rows)
    with pytest.raises(ImageError) as caught:
        encode(source, gemma3, cache_dir=str(data / "c1"))
    assert str(caught.value).startswith(f"{source}:2 messages[0].content[0]: image img/gone.png")
    assert "\n" not in str(caught.value)
    said = []
    store = encode(
        source, gemma3, cache_dir=str(data / "c2"), skip_bad_images=True, say=said.append
    )
    assert store.n_docs == 2 and store.meta["skipped_images"] == 1
    assert any("1 row with a missing, unreadable or oversized image skipped" in s for s in said)


def test_unreadable_image_is_skipped_at_tokenising(gemma3, data):
    (data / "img" / "bad.png").write_bytes(b"not a png")
    source = write_rows(data / "train.jsonl", [row("img/bad.png"), row("img/a.png")])
    with pytest.raises(
        ImageError, match=r":1 messages\[0\]\.content\[0\]: image .*bad\.png cannot"
    ):
        encode(source, gemma3, cache_dir=str(data / "c1"))
    store = encode(source, gemma3, cache_dir=str(data / "c2"), skip_bad_images=True, say=print)
    assert store.n_docs == 1 and store.images == [
        [{"path": str(data / "img" / "a.png"), "where": f"{source}:2 messages[0].content[0]"}]
    ]


def test_images_need_a_vision_processor(data):
    source = write_rows(data / "train.jsonl", [row("img/a.png")])
    with pytest.raises(UserError, match=r":1: the row holds images, and the model has none"):
        list(read_examples(source, byte_tokenizer()))


def test_cache_round_trip_keeps_references_and_batches_prepare_pixels(gemma3, data):
    rows = [row("img/a.png"), row(question="no image here"), row("img/a.png", "img/b.png")]
    source = write_rows(data / "train.jsonl", rows)
    first = encode(source, gemma3, cache_dir=str(data / "cache"))
    again = encode(source, gemma3, cache_dir=str(data / "cache"))  # read, not built
    assert again.folder == first.folder and again.images == first.images
    assert [len(r) for r in again.images] == [1, 0, 2]
    packed = pack_store(again, 256, images=ImagePrep(gemma3))
    batch = packed.take(np.arange(packed.rows))
    assert packed.rows == 1 and batch["images"].pixel_values.shape == (3, 3, 32, 32)
    assert batch["image_rows"].tolist() == [0, 0, 0]
    assert int((batch["inputs"] == image_tokens(gemma3)).sum()) == 3 * 16


def test_packing_keeps_image_examples_whole(gemma3, data):
    rows = [row("img/a.png", reply="x" * n) for n in (5, 30, 60)] + [row(reply="t" * 40)]
    source = write_rows(data / "train.jsonl", rows)
    store = encode(source, gemma3, cache_dir=str(data / "cache"))
    lens = np.diff(store.starts)
    seq = int(lens[1]) + 2  # the longest image example does not fit a row
    packed = ExampleRows(store, seq, images=ImagePrep(gemma3))
    assert packed.images_too_long == 1 and "1 image conversation longer" in packed.summary()
    seen = 0
    for r in range(packed.rows):
        batch = packed.take(np.array([r]))
        n_images = int((batch["inputs"] == image_tokens(gemma3)).sum()) // 16
        assert (
            n_images
            == len(packed.row_images(r))
            == (0 if "images" not in batch else batch["images"].num_images)
        )
        seen += n_images
    assert seen == 2  # the two that fit, each with all its image tokens in one row
    with pytest.raises(UserError, match="--packing stream cuts examples"):
        pack_store(store, seq, packing="stream")


def test_held_out_and_mixtures_carry_images(gemma3, data):
    source = write_rows(
        data / "train.jsonl", [row("img/a.png"), row(question="q"), row("img/b.png")]
    )
    store = encode(source, gemma3, cache_dir=str(data / "cache"))
    held = MemoryStore.from_stores([(store, np.array([0, 2]))])
    assert [len(r) for r in held.images] == [1, 1]
    prep = ImagePrep(gemma3)
    mix = Mixture(
        [
            ExampleRows(held, 128, images=prep),
            ExampleRows(store.subset(np.array([1])), 128, images=prep),
        ],
        [0.5, 0.5],
        4,
        seed=0,
    )
    batch = mix.next()
    n = int((batch["inputs"] == image_tokens(gemma3)).sum()) // 16
    assert n == (0 if "images" not in batch else batch["images"].num_images)
    if n:
        rows_with = sorted(set(batch["image_rows"].tolist()))
        assert all((batch["inputs"][r] == image_tokens(gemma3)).any() for r in rows_with)
    assert (batch["targets"] != IGNORE_INDEX).any()


def test_images_from_a_parquet_image_column(gemma3, data):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    raw = (data / "img" / "a.png").read_bytes()
    messages = row()["messages"]
    messages[0]["content"].insert(0, {"type": "image"})
    table = pa.table({"messages": [messages], "images": [[{"bytes": raw, "path": None}]]})
    pq.write_table(table, data / "train.parquet")
    store = encode(str(data / "train.parquet"), gemma3, cache_dir=str(data / "cache"))
    ref = store.images[0][0]
    assert ref["file"] == str(data / "train.parquet") and ref["row"] == 1 and "bytes" not in ref
    batch = ExampleRows(store, 128, images=ImagePrep(gemma3)).take(np.array([0]))
    assert batch["images"].pixel_values.shape == (1, 3, 32, 32)
    torch.testing.assert_close(
        batch["images"].pixel_values,
        torch.as_tensor(
            gemma3.image_processor(
                images=[transformers.image_utils.load_image(str(data / "img" / "a.png"))],
                return_tensors="pt",
            )["pixel_values"]
        ),
    )


# ------------------------------------------------------------------ generate --image


def test_generate_with_an_image_equals_transformers_greedy(tmp_path):
    """A tiny Gemma 3 checkpoint with its processor: `generate --image` greedy equals
    transformers' generate on the same rendered prompt and pixels."""
    from compiletune.generate import run_generate
    from compiletune.sampling import Sampling

    save_tiny_gemma3_checkpoint(tmp_path / "ckpt")
    image = png(tmp_path / "q.png", 20, 12, seed=3)
    out = run_generate(
        str(tmp_path / "ckpt"),
        "What is it?",
        False,
        6,
        Sampling(),
        dtype_name="fp32",
        image=str(image),
        out=__import__("io").StringIO(),
        log=lambda line: None,
    )
    processor = transformers.AutoProcessor.from_pretrained(tmp_path / "ckpt")
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}
    ]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    picture = load_image(ImageRef(image, ""))
    inputs = processor(text=[text], images=[picture], add_special_tokens=False, return_tensors="pt")
    hf = transformers.Gemma3ForConditionalGeneration.from_pretrained(
        tmp_path / "ckpt", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        ids = hf.generate(**inputs, max_new_tokens=6, do_sample=False)
    new = ids[0, inputs["input_ids"].shape[1] :]
    assert out == [processor.tokenizer.decode(new, skip_special_tokens=True)]


def test_generate_image_errors(tmp_path):
    from compiletune.sampling import check_image_prompt

    with pytest.raises(UserError, match="--image needs --prompt"):
        check_image_prompt(str(tmp_path), None)
    with pytest.raises(UserError, match="no such file"):
        check_image_prompt(str(tmp_path / "nope.png"), "what?")


# ------------------------------------------------------------------ the run's data and flags


def test_flags_and_build_data_with_a_vision_checkpoint(tmp_path, data):
    """--skip-bad-images and --train-vision parse; build_data reads the processor of
    --model-dir, skips the bad row, and its rows' batches carry the images."""
    from compiletune.cli import build_parser
    from compiletune.config import resolve
    from compiletune.train.inputs import build_data

    save_tiny_gemma3_processor(tmp_path / "ckpt")
    source = write_rows(
        data / "train.jsonl", [row("img/a.png"), row("img/gone.png"), row("img/b.png")]
    )
    argv = ["train", "--data", source, "--skip-bad-images", "--train-vision"]
    argv += ["--cache-dir", str(data / "cache"), "--data-workers", "0", "--seq-len", "128"]
    ns = build_parser().parse_args(argv)
    flags = {k: v for k, v in vars(ns).items() if k in {"data", "skip_bad_images", "train_vision"}}
    flags |= {"cache_dir": ns.cache_dir, "data_workers": 0, "seq_len": 128}
    cfg = resolve({}, flags)
    assert cfg.data.skip_bad_images and cfg.model.train_vision
    cfg.model.model_dir = str(tmp_path / "ckpt")  # (its processor files only: data, no model)
    said: list[str] = []
    datas, _, _ = build_data(cfg, byte_tokenizer(), said.append)
    assert any("1 row with a missing" in line for line in said)
    batch = datas[0].take(np.arange(datas[0].rows))
    assert batch["images"].num_images == 2 == int(batch["image_rows"].numel())


def test_qwen35_batch_pixels_match_the_image_tokens(data):
    """Qwen3.5's tokens per image follow its size: the batch's grids, prepared from the cached
    references, account for every image token of its rows (4 patches merged into one token)."""
    processor = qwen_processor()
    rows = [row("img/a.png", "img/b.png"), row("img/b.png"), row(question="no image")]
    store = encode(write_rows(data / "train.jsonl", rows), processor, cache_dir=str(data / "c"))
    packed = pack_store(store, 512, images=ImagePrep(processor))
    batch = packed.take(np.arange(packed.rows))
    grid = batch["images"].image_grid_thw
    assert grid.shape == (3, 3) and not torch.equal(grid[0], grid[1])  # two sizes
    tokens = int((batch["inputs"] == image_tokens(processor)).sum())
    assert tokens == int(grid.prod(-1).sum()) // 4
    assert batch["images"].pixel_values.shape[0] == int(grid.prod(-1).sum())


def test_a_damaged_image_file_rebuilds_the_entry(gemma3, data):
    source = write_rows(data / "train.jsonl", [row("img/a.png")])
    store = encode(source, gemma3, cache_dir=str(data / "cache"))
    images = store.folder / "images.jsonl"
    images.write_text(images.read_text()[:-5])
    said: list[str] = []
    again = encode(source, gemma3, cache_dir=str(data / "cache"), say=said.append)
    assert any("images.jsonl holds" in line and "rebuilding" in line for line in said)
    assert again.images == store.images


def test_image_data_needs_a_vision_checkpoint(tmp_path, data):
    from types import SimpleNamespace

    from vision_cases import gemma3_config

    from compiletune.config import resolve
    from compiletune.train.inputs import check_vision

    images = [SimpleNamespace(store=SimpleNamespace(images=[[{"path": "a.png"}]]))]
    text_only = [SimpleNamespace(store=SimpleNamespace(images=None))]
    transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        vocab_size=300,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(tmp_path / "llama")
    vision = gemma3_config()
    vision.architectures = ["Gemma3ForConditionalGeneration"]
    vision.save_pretrained(tmp_path / "gemma3")
    cfg = resolve({}, {"model_dir": str(tmp_path / "llama"), "data": "d.jsonl"})
    check_vision(cfg, text_only)
    with pytest.raises(UserError, match=r"d\.jsonl holds images, and --model-dir .*llama has no"):
        check_vision(cfg, images)
    check_vision(resolve({}, {"model_dir": str(tmp_path / "gemma3")}), images)
    split = resolve({}, {"model_dir": str(tmp_path / "gemma3"), "cp": 2, "fsdp": True})
    check_vision(split, text_only)
    with pytest.raises(UserError, match=r"^--cp 2 does not split image rows yet .*drop --cp"):
        check_vision(split, images)
    with pytest.raises(UserError, match="the random-init preset"):
        check_vision(resolve({}, {"model": "debug"}), images)


def test_the_same_rows_in_another_folder_read_that_folders_images(gemma3, data):
    """An entry keeps image paths resolved from the data file's folder: identical rows beside
    other images are another entry, not the first folder's images."""
    stores = []
    for name, seed in (("a", 1), ("b", 2)):
        png(data / name / "img" / "x.png", 20, 12, seed=seed)
        source = write_rows(data / name / "train.jsonl", [row("img/x.png")])
        stores.append(encode(source, gemma3, cache_dir=str(data / "cache")))
    first, second = (json.dumps(s.images) for s in stores)
    assert stores[0].folder != stores[1].folder
    assert str(data / "a" / "img") in first and str(data / "b" / "img") in second
    assert str(data / "a") not in second
