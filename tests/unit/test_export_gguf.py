"""`compiletune export --gguf`: each exported family read back by transformers' GGUF loader.

Tiny models and tokenizers are made here (no network). A family passes when the file transformers
reads back gives the original's logits (f16: within fp16 rounding; q8_0: within 8-bit block
quantisation), encodes text to the same ids, and carries the chat template and end tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from tiny_hf import save_tiny_llama
from tokenizers import (
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from compiletune.cli import main
from compiletune.errors import UserError
from compiletune.export_gguf import export_gguf
from compiletune.gguf_vocab import PRE_BY_SPLIT

gguf = pytest.importorskip("gguf")  # the [gguf] extra (in [dev])

CORPUS = [
    "Hello world, this is a tiny corpus for a tokenizer test.",
    "The quick brown fox jumps over the lazy dog 12345 times.",
    "Fine-tuning a model, then running it locally with llama.cpp or Ollama!",
    "  Indented text,\nnew lines\tand tabs: they're all here; isn't it?",
] * 4
TEXT = "Hello there, the quick fox ran 2024 times!\n  Isn't it lazy?"
SPLIT = {pre: regex for regex, pre in PRE_BY_SPLIT.items()}
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "\n\n{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def byte_level_bpe(pre: str, chatml: bool) -> transformers.PreTrainedTokenizerFast:
    """A byte-level BPE trained here, split as llama.cpp's `pre` names (Llama 3 or Qwen2 style)."""
    specials = (
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        if chatml
        else ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>"]
        + ["<|end_header_id|>", "<|eot_id|>", "<|pad|>"]
    )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=alphabet, special_tokens=specials, show_progress=False
    )
    tok.train_from_iterator(CORPUS, trainer)
    if chatml:  # Qwen: no bos, <|im_end|> ends a reply and the text
        hf = transformers.PreTrainedTokenizerFast(
            tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
        )
        hf.chat_template = CHATML_TEMPLATE
        return hf
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
    )
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        pad_token="<|pad|>",
    )
    hf.chat_template = LLAMA3_TEMPLATE
    return hf


def sentencepiece_bpe() -> transformers.PreTrainedTokenizerBase:
    """A Gemma-style tokenizer (BPE over "▁"-spaced text, byte fallback) trained here."""
    trained = Tokenizer(models.BPE())
    trained.normalizer = normalizers.Replace(" ", "▁")
    trained.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    trained.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    model = json.loads(trained.to_str())["model"]
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    pieces = specials + [f"<0x{b:02X}>" for b in range(256)]
    pieces += sorted(model["vocab"], key=model["vocab"].get)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = transformers.GemmaTokenizer(vocab={p: i for i, p in enumerate(pieces)}, merges=merges)
    tok.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    tok.chat_template = GEMMA_TEMPLATE
    return tok


# family -> (config class, config fields, tokenizer, generation_config eos tokens)
def _families() -> dict:
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    gqa = dict(small, num_attention_heads=4, num_key_value_heads=2)
    # Gemma: head_dim 256 = query_pre_attn_scalar (llama.cpp scales queries by head_dim); a
    # window shorter than the test's text, so the sliding layers differ from the global ones.
    gemma = dict(small, num_attention_heads=2, num_key_value_heads=1, head_dim=256)
    gemma |= dict(query_pre_attn_scalar=256, sliding_window=8)
    llama3 = ("llama-bpe", False)
    return {
        "llama": (transformers.LlamaConfig, gqa, llama3, ["<|end_of_text|>", "<|eot_id|>"]),
        "mistral": (transformers.MistralConfig, dict(gqa, sliding_window=None), llama3, []),
        "qwen2": (transformers.Qwen2Config, gqa, ("qwen2", True), ["<|im_end|>"]),
        # head_dim 128 (every Qwen3's): transformers' reader ignores qwen3.attention.key_length
        "qwen3": (transformers.Qwen3Config, dict(gqa, head_dim=128), ("qwen2", True), []),
        "phi3": (transformers.Phi3Config, dict(gqa, pad_token_id=None), llama3, []),
        "gemma2": (transformers.Gemma2Config, gemma, "spm", ["<eos>", "<end_of_turn>"]),
        # six layers: llama.cpp's (and transformers') pattern makes the sixth one global
        "gemma3_text": (
            transformers.Gemma3TextConfig,
            dict(gemma, num_hidden_layers=6),
            "spm",
            ["<eos>", "<end_of_turn>"],
        ),
    }


FAMILIES = _families()


def save_family(folder: Path, family: str, extra_rows: int = 0) -> Path:
    """A tiny random model of `family` with its tokenizer (and generation_config.json ends)."""
    config_cls, fields, tok_kind, ends = FAMILIES[family]
    tok = sentencepiece_bpe() if tok_kind == "spm" else byte_level_bpe(*tok_kind)
    config = config_cls(
        vocab_size=len(tok) + extra_rows,
        max_position_embeddings=256,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        **{"pad_token_id": tok.pad_token_id, **fields},
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms away from their init (ones / zeros), so an offset shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    if ends:
        generation = {"eos_token_id": [tok.convert_tokens_to_ids(t) for t in ends]}
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def read_back(out: Path):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        out.parent, gguf_file=out.name, dtype=torch.float32
    )
    return model.eval(), transformers.AutoTokenizer.from_pretrained(out.parent, gguf_file=out.name)


def field(reader, key: str):
    f = reader.fields[key]
    value = f.parts[f.data[0]]
    return bytes(value).decode() if f.types[0] == gguf.GGUFValueType.STRING else value[0]


def as_stored(model: torch.nn.Module, kind: str) -> torch.nn.Module:
    """`model` with every matrix rounded as the file stores it (fp16, or Q8_0 blocks through
    gguf's own quantize / dequantize): the logits a faithful export must give back."""
    Q8 = gguf.GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for p in {id(p): p for p in model.parameters()}.values():
            if p.dim() < 2:
                continue  # norms and biases stay fp32
            if kind == "q8_0" and p.shape[-1] % 32 == 0:
                blocks = gguf.quants.quantize(p.numpy(), Q8)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, Q8)).reshape(p.shape))
            else:
                p.copy_(p.half().float())
    return model


# Against the same weights rounded as stored (as_stored), the read-back logits agree to fp32
# rounding (gemma's norms pass through 1 + w and back). Against the original weights, fp16 stays
# within 5e-3 of the largest logit; Q8_0 (each weight rounded to 1/127 of its 32-value block's
# largest, <= 0.4%) within 10% on these tiny random models, whose errors add over layers.
EXACT = 1e-4
TOLERANCE = {"f16": 5e-3, "q8_0": 1e-1}


def rel_max(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_reads_back_in_transformers(tmp_path, family):
    folder = save_family(tmp_path / family, family, extra_rows=3 if family == "llama" else 0)
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ref_tok = transformers.AutoTokenizer.from_pretrained(folder)
    ids = torch.tensor([ref_tok(TEXT)["input_ids"]])
    assert ids.shape[1] > 8  # longer than Gemma's window
    with torch.no_grad():
        want = ref(ids).logits
    for kind in ("f16", "q8_0"):
        (tmp_path / kind).mkdir()
        out = export_gguf(folder, kind, tmp_path / kind / f"{family}.gguf", log=lambda m: None)
        model, tok = read_back(out)
        rounded = as_stored(
            transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), kind
        )
        with torch.no_grad():
            got, exact = model(ids).logits, rounded.eval()(ids).logits
        assert rel_max(got, exact) <= EXACT, (kind, rel_max(got, exact))
        assert rel_max(got, want) <= TOLERANCE[kind], (kind, rel_max(got, want))
        reader = gguf.GGUFReader(out)
        types = {t.name: t.tensor_type.name for t in reader.tensors}
        matrix = "F16" if kind == "f16" else "Q8_0"
        assert types["blk.0.attn_output.weight"] == matrix and types["output_norm.weight"] == "F32"

    # The tokenizer: the same ids, template, ends (tested on the q8_0 file; the keys are shared).
    assert tok(TEXT)["input_ids"] == ref_tok(TEXT)["input_ids"]
    assert tok.chat_template == ref_tok.chat_template
    assert tok.eos_token == ref_tok.eos_token and tok.bos_token == ref_tok.bos_token
    _, _, _, ends = FAMILIES[family]
    eot = [t for t in ends if t != ref_tok.eos_token]
    if eot:
        eot_id = ref_tok.convert_tokens_to_ids(eot[0])
        assert field(reader, "tokenizer.ggml.eot_token_id") == eot_id
        types = reader.fields["tokenizer.ggml.token_type"]
        assert types.parts[types.data[eot_id]][0] == gguf.TokenType.CONTROL


def test_gemma_norms_and_llama_rows_are_what_llama_cpp_reads(tmp_path):
    """The two value changes, checked against the checkpoint directly: Gemma's norms hold 1 + w,
    Llama's q rows are interleaved per head (transformers undoes both, so a round trip alone
    would pass with neither)."""
    from safetensors.torch import load_file

    for family, hf_name, gguf_name in [
        ("gemma2", "model.norm.weight", "output_norm.weight"),
        ("llama", "model.layers.0.self_attn.q_proj.weight", "blk.0.attn_q.weight"),
    ]:
        folder = save_family(tmp_path / family, family)
        out = export_gguf(folder, "f16", tmp_path / f"{family}.gguf", log=lambda m: None)
        hf = load_file(folder / "model.safetensors")[hf_name].float()
        t = next(t for t in gguf.GGUFReader(out).tensors if t.name == gguf_name)
        stored = torch.from_numpy(t.data.astype("float32")).reshape(hf.shape)
        if family == "gemma2":
            torch.testing.assert_close(stored, hf + 1, atol=1e-3, rtol=1e-3)
        else:
            d = hf.shape[0] // 4
            first_head = hf[:d]
            pairs = torch.stack([first_head[: d // 2], first_head[d // 2 :]], 1).reshape(d, -1)
            torch.testing.assert_close(stored[:d], pairs, atol=1e-3, rtol=1e-3)


def test_llama3_rope_factors_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from compiletune.gguf_arch import llama3_rope_factors

    rope = dict(
        rope_type="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
        rope_theta=500000.0,
    )
    config = transformers.LlamaConfig(
        hidden_size=256, num_attention_heads=2, max_position_embeddings=512, rope_parameters=rope
    )
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / (500000.0 ** (torch.arange(0, 128, 2).float() / 128))
    factors = torch.tensor(llama3_rope_factors(config.to_dict()))
    assert factors.min() == 1.0 and factors.max() == 8.0  # both ends of the range occur
    torch.testing.assert_close(plain / factors, scaled.float(), rtol=1e-5, atol=0)


def test_unsupported_family_is_refused_in_one_line(tmp_path, capsys):
    folder = tmp_path / "moe"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    assert main(["export", "--gguf", "q8_0", str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "qwen3_moe" in err and "supported: llama, mistral, qwen2, qwen3, phi3, gemma2" in err
    assert not list(tmp_path.glob("*.gguf"))


def test_missing_gguf_package_names_the_extra(tmp_path, monkeypatch):
    folder = save_family(tmp_path / "llama", "llama")
    monkeypatch.setitem(__import__("sys").modules, "gguf", None)  # import gguf -> ImportError
    with pytest.raises(UserError, match=r"pip install 'compiletune\[gguf\]'"):
        export_gguf(folder, "f16", tmp_path / "x.gguf")


def test_a_failed_write_leaves_no_file(tmp_path, monkeypatch):
    """A full disk on the third tensor: one line, no OUT.gguf, no temporary file, an old file
    of that name untouched."""
    folder = save_family(tmp_path / "llama", "llama")
    out = tmp_path / "out" / "model.gguf"
    out.parent.mkdir()
    out.write_bytes(b"previous export")
    monkeypatch.setenv("COMPILETUNE_FAIL_AT", "gguf_tensor:3")
    with pytest.raises(UserError, match="writing failed .*No space left.*nothing was written"):
        export_gguf(folder, "q8_0", out, log=lambda m: None)
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.gguf"]
    assert out.read_bytes() == b"previous export"


def test_lora_step_is_merged_first(tmp_path):
    """A LoRA run's step folder (adapter + tokenizer, no base weights) exports as base + adapters."""
    from compiletune.checkpoint import adapter_io
    from compiletune.models import from_hf
    from compiletune.models.lora import LoRASpec, apply_lora

    base = save_family(tmp_path / "base", "llama")
    spec = LoRASpec(rank=4, alpha=8.0, targets=("q", "k", "v", "o", "gate", "up", "down"))
    model = apply_lora(from_hf(base), spec, dtype=torch.float32, seed=3).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    step = tmp_path / "run" / "step_5"
    adapter_io.save_adapter(model, step, base_model=str(base))
    transformers.AutoTokenizer.from_pretrained(base).save_pretrained(step)
    lines = []
    out = export_gguf(step, "f16", tmp_path / "run" / "lora.gguf", log=lines.append)
    assert "LoRA adapter: merging it" in lines[0]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["lora.gguf", "step_5"]
    ids = torch.tensor([transformers.AutoTokenizer.from_pretrained(base)(TEXT)["input_ids"]])
    with torch.no_grad():
        want = model(ids)
        plain = transformers.AutoModelForCausalLM.from_pretrained(base)(ids).logits
        got = read_back(out)[0](ids).logits
    assert rel_max(got, want) <= TOLERANCE["f16"]
    assert rel_max(plain, want) > 10 * TOLERANCE["f16"]  # the adapters changed the model


def test_the_byte_tokenizer_reads_back(tmp_path):
    """compiletune's default tokenizer (bytes, no merges) through the CLI: same ids and template."""
    folder = save_tiny_llama(tmp_path / "run" / "step_2", hidden_size=64)
    assert main(["export", "--gguf", "f16", str(folder)]) == 0
    out = tmp_path / "run" / "step_2-f16.gguf"  # the default: beside the folder
    tok = transformers.AutoTokenizer.from_pretrained(out.parent, gguf_file=out.name)
    ref_tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert tok(TEXT)["input_ids"] == ref_tok(TEXT)["input_ids"]
    assert tok.chat_template == ref_tok.chat_template and tok.eos_token == ref_tok.eos_token


def test_refusals_come_before_torch_is_imported(tmp_path):
    """A wrong family or folder is refused without importing torch (well under a second)."""
    import subprocess
    import sys

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    code = (
        "import sys; from compiletune.cli import main; "
        f"rc = main(['export', '--gguf', 'f16', {str(tmp_path)!r}]); "
        "print(rc, 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.stdout.split() == ["2", "False"], done.stderr
    assert "'mixtral' is not exported to GGUF" in done.stderr


def test_fields_a_config_leaves_out_take_the_family_defaults(tmp_path):
    """A config.json without rms_norm_eps: Phi-3's default (1e-5), not another family's."""
    folder = save_family(tmp_path / "phi3", "phi3")
    config = json.loads((folder / "config.json").read_text())
    del config["rms_norm_eps"]
    (folder / "config.json").write_text(json.dumps(config))
    out = export_gguf(folder, "f16", tmp_path / "phi3.gguf", log=lambda m: None)
    eps = field(gguf.GGUFReader(out), "phi3.attention.layer_norm_rms_epsilon")
    assert eps == pytest.approx(transformers.Phi3Config().rms_norm_eps) and eps != 1e-6


def test_sentencepiece_scores_give_the_merge_order(tmp_path):
    """llama.cpp merges a "llama" vocabulary by token score, not by the merges list: merges rebuilt
    from the file's scores alone (transformers' rule: the best-scoring result first) encode alike."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import sentencepiece_tokenizer

    folder = save_family(tmp_path / "gemma2", "gemma2")
    reader = gguf.GGUFReader(export_gguf(folder, "f16", tmp_path / "g.gguf", log=lambda m: None))
    tokens, scores = reader.fields["tokenizer.ggml.tokens"], reader.fields["tokenizer.ggml.scores"]
    vocab = {
        "tokens": [bytes(tokens.parts[i]).decode() for i in tokens.data],
        "scores": [float(scores.parts[i][0]) for i in scores.data],
    }
    assert field(reader, "tokenizer.ggml.model") == "llama"
    from_scores = sentencepiece_tokenizer(vocab, transformers.GemmaTokenizer).backend_tokenizer
    ref = transformers.AutoTokenizer.from_pretrained(folder)
    want = ref(TEXT, add_special_tokens=False)["input_ids"]
    assert len(want) > 10 and from_scores.encode(TEXT, add_special_tokens=False).ids == want


@pytest.mark.parametrize(
    "family, change, message",
    [
        (
            "llama",
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
            "rope scaling 'yarn'",
        ),
        ("gemma2", {"query_pre_attn_scalar": 144}, "query_pre_attn_scalar 144"),
        ("gemma3_text", {"sliding_window_pattern": 2}, "layer_types differs"),
    ],
)
def test_configs_llama_cpp_would_run_differently_are_refused(tmp_path, family, change, message):
    config_cls, fields, _, _ = FAMILIES[family]
    config = config_cls(vocab_size=300, max_position_embeddings=256, **{**fields, **change})
    if family == "llama":
        config.rope_parameters["original_max_position_embeddings"] = 128
    config.save_pretrained(tmp_path)
    with pytest.raises(UserError, match=message):
        export_gguf(tmp_path, "f16", tmp_path / "x.gguf")
    assert not list(tmp_path.glob("*.gguf"))
