"""Document-masked packing: a packed row computes exactly what its examples compute one by one."""

from __future__ import annotations

import torch
from tiny_run import tiny_run

from compiletune.cli import main
from compiletune.compiler.activation import parse_ac
from compiletune.compiler.regions import CompileOptions, compile_regions
from compiletune.loss.head import LossHead
from compiletune.models import PRESETS, build_model, from_name
from compiletune.models.attention import doc_segments

VOCAB = 97


def tiny_model(seed: int = 1):
    args = from_name("debug")
    args.n_layers, args.dim, args.ffn_dim, args.n_heads, args.n_kv_heads = 2, 64, 128, 4, 2
    args.vocab_size = VOCAB
    return build_model(args, seed=seed)


def make_rows(lengths_per_row: list[list[int]], seed: int):
    """Examples (token lists of length n + 1) and the packed batch built from them."""
    g = torch.Generator().manual_seed(seed)
    rows, examples = [], []
    for lengths in lengths_per_row:
        docs = [torch.randint(0, VOCAB, (n + 1,), generator=g) for n in lengths]
        examples += docs
        rows.append(
            {
                "inputs": torch.cat([d[:-1] for d in docs]),
                "targets": torch.cat([d[1:] for d in docs]),
                "positions": torch.cat([torch.arange(n) for n in lengths]),
                "doc_ids": torch.cat(
                    [torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)]
                ),
            }
        )
    batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    return examples, batch


def loss_and_grads(model, head, fn):
    model.zero_grad()
    loss = fn()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def one_by_one(model, head, examples):
    def total():
        return sum(head(model.hidden_states(d[None, :-1]), d[None, 1:]) for d in examples)

    return loss_and_grads(model, head, total)


def packed(model, head, batch):
    def total():
        hidden = model.hidden_states(batch["inputs"], batch["positions"], batch["doc_ids"])
        return head(hidden, batch["targets"])

    return loss_and_grads(model, head, total)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def assert_same(got, want, tol: float) -> None:
    (loss, grads), (ref_loss, ref_grads) = got, want
    assert torch.isfinite(loss)
    assert rel(loss, ref_loss) <= tol, (loss, ref_loss)
    for g, r in zip(grads, ref_grads, strict=True):
        assert rel(g, r) <= tol


LAYOUTS = [[[5, 9, 3, 15], [20, 12]], [[32], [1, 30, 1]], [[7, 7, 7, 11], [16, 16]]]


def test_doc_segments():
    doc_ids = torch.tensor([[0, 0, 1, 2, 2], [0, 0, 0, 0, 0]], dtype=torch.int32)
    assert doc_segments(doc_ids) == [(0, 0, 2), (0, 2, 3), (0, 3, 5), (1, 0, 5)]


def test_packed_rows_equal_examples_one_by_one_eager():
    model = tiny_model()
    head = LossHead(model.output, "plain")
    for seed, layout in enumerate(LAYOUTS):
        examples, batch = make_rows(layout, seed)
        assert_same(packed(model, head, batch), one_by_one(model, head, examples), 1e-5)
    # Without the mask the packed row is a different computation: the mask is doing the work.
    examples, batch = make_rows(LAYOUTS[0], 0)
    loss, _ = loss_and_grads(
        model, head, lambda: head(model.hidden_states(batch["inputs"]), batch["targets"])
    )
    assert rel(loss, one_by_one(model, head, examples)[0]) > 1e-3


def test_packed_rows_compiled_no_recompiles():
    model = tiny_model()
    head = LossHead(model.output, "plain")
    references = [
        one_by_one(model, head, make_rows(layout, s)[0]) for s, layout in enumerate(LAYOUTS)
    ]
    regions = compile_regions(model, head, CompileOptions(backend="aot_eager", loss="plain"))
    for seed, layout in enumerate(LAYOUTS):  # new document boundaries every batch
        _, batch = make_rows(layout, seed)
        assert_same(packed(model, head, batch), references[seed], 1e-5)
    stats = regions.stats()
    # One graph for both blocks and the head each; boundaries are data, not graph constants.
    assert stats["regions"]["block"]["compiles"] == 1 and stats["recompiles"] == 0, stats


def test_packed_rows_compiled_selective_ac_saves_the_attention():
    model = tiny_model()
    head = LossHead(model.output, "plain")
    examples, batch = make_rows(LAYOUTS[0], 0)
    reference = one_by_one(model, head, examples)
    opts = CompileOptions(backend="aot_eager", loss="plain", ac=parse_ac("selective"), dump=True)
    regions = compile_regions(model, head, opts)
    assert_same(packed(model, head, batch), reference, 1e-5)
    # The op is in the selective policy's save list: its output is kept for backward, not
    # recomputed (it holds the attention FLOPs).
    (record,) = regions.backends["block"].records
    # (The op returns (out, lse): the only multi-output op of a block, so its output is a getitem.)
    assert any(row["node"].startswith("getitem") for row in record.saved), record.saved


def write_corpus(path, n_docs: int = 120) -> str:
    docs = [
        f"Document {i}: " + " ".join(f"w{(i * j) % 17}" for j in range(i % 9 + 3))
        for i in range(n_docs)
    ]
    path.write_text("\n\n\n".join(docs))
    return str(path)


def run(tmp_path, data, name, **overrides):
    return tiny_run(tmp_path, data, name, **{"seq_len": 64, "max_steps": 3, **overrides})


def test_doc_mask_default_on_when_rows_pack_several_examples(tmp_path):
    summary = run(tmp_path, write_corpus(tmp_path / "docs.txt"), "packed")
    assert summary["doc_mask"] is True
    one_doc = tmp_path / "one.txt"
    one_doc.write_text(" ".join(f"word{i}" for i in range(3000)))  # a single document
    assert run(tmp_path, str(one_doc), "single")["doc_mask"] is False


def test_no_doc_mask_flag_and_compiled_run(tmp_path, capsys):
    data = write_corpus(tmp_path / "docs.txt")
    argv = ["train", "--data", data, "--seq-len", "64", "--batch-size", "2", "--max-steps", "2"]
    assert main([*argv, "--no-doc-mask", "--output-dir", str(tmp_path / "off")]) == 0
    assert "document-masked" not in capsys.readouterr().out
    summary = run(
        tmp_path,
        data,
        "compiled",
        compile=True,
        compile_backend="aot_eager",
        loss="plain",
        max_steps=4,
        val_split=0.1,
        eval_every=2,
    )
    assert summary["doc_mask"] is True and summary["eval_loss"] is not None
    # New boundaries every batch and evaluations in between: still one compile per region.
    assert summary["compile"]["recompiles"] == 0 and summary["compile"]["compiles"] == 2


def test_presets_carry_published_context_lengths():
    published = {"llama2_7b": 4096, "llama3_8b": 8192, "llama3_70b": 8192}
    published |= dict.fromkeys(
        ["llama3_1_8b", "llama3_1_405b", "llama3_2_1b", "llama3_3_70b"], 131072
    )
    published |= {"qwen2_5_0_5b": 32768, "qwen2_5_7b": 131072, "mistral_7b": 32768}
    published |= {"debug": 32768, "debug_128k": 32768}  # long-context checks on CPU
    assert {name: PRESETS[name].max_seq_len for name in published} == published
