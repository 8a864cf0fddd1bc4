"""A checkpoint's tokenizer as GGUF metadata (`tokenizer.*` keys), for `compiletune export --gguf`.

A GGUF file carries no tokenizer.json: llama.cpp rebuilds the tokenizer from a vocabulary list,
per-token types, merges or scores, and a few ids and flags. Two kinds are written:

    tokenizer.json model                     tokenizer.ggml.model   what llama.cpp runs
    byte-level BPE (Llama 3, Qwen, Phi-4)    "gpt2"                 BPE over merges, after a regex
                                                                    split named by tokenizer.ggml.pre
    BPE with byte fallback over "▁" spaces   "llama"                SentencePiece-style BPE that
      (Llama 2, Gemma, Mistral v0.x, Phi-3)                         merges by token score

For "llama" the scores are made from the merge ranks (an earlier merge scores higher), which is
the order llama.cpp merges in; the merges are written too, so readers that take merges (transformers)
need no scores. Any other tokenizer (Unigram, WordPiece) is refused.

End tokens: `eos` is the tokenizer's; the end of a chat turn (<|eot_id|>, <|im_end|>,
<end_of_turn>, <|end|>) comes from generation_config.json's eos_token_id list and is written as
tokenizer.ggml.eot_token_id, with every end token marked CONTROL so llama.cpp stops on it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compiletune.errors import UserError

# llama.cpp's token types (gguf.TokenType), spelled here so the tokenizer can be read without gguf.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# The regex a byte-level BPE splits text with before its merges, as tokenizer.json spells it, and the
# name llama.cpp gives that split (tokenizer.ggml.pre). A split that is not here is written as
# "default" (GPT-2's), with a warning: words still tokenize alike, digit runs and some whitespace may not.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_BY_SPLIT = {_LLAMA3_SPLIT: "llama-bpe", _QWEN2_SPLIT: "qwen2"}


@dataclass
class Vocab:
    """What the `tokenizer.*` keys say: one entry per token id, padded to the model's rows."""

    model: str  # "gpt2" | "llama"
    pre: str
    tokens: list[str]
    types: list[int]
    merges: list[str]
    scores: list[float] | None
    special_ids: dict[str, int]  # bos / eos / unk / pad / eot -> id
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool | None
    chat_templates: dict[str, str] = field(default_factory=dict)  # "" is the default template
    warnings: list[str] = field(default_factory=list)


def _pre_tokenizer_name(pre: dict | None, has_merges: bool, warnings: list[str]) -> str:
    """llama.cpp's name for a byte-level BPE's split (see PRE_BY_SPLIT)."""
    parts = (pre or {}).get("pretokenizers") or ([pre] if pre else [])
    kinds = [p.get("type") for p in parts]
    splits = [p for p in parts if p.get("type") == "Split"]
    if len(splits) == 1 and kinds[-1] == "ByteLevel":
        regex = (splits[0].get("pattern") or {}).get("Regex")
        if regex in PRE_BY_SPLIT:
            return PRE_BY_SPLIT[regex]
    if kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits"):
        return "smollm"  # SmolLM's: digits one by one, then GPT-2's split
    if has_merges and not (kinds == ["ByteLevel"] and not parts[0].get("use_regex", True)):
        warnings.append(
            f"the tokenizer's pre-tokenizer ({', '.join(map(str, kinds))}) has no llama.cpp name; "
            "written as 'default' (GPT-2's split): digit runs and whitespace may tokenize "
            "differently in llama.cpp"
        )
    return "default"


def _merges(model: dict) -> list[str]:
    """tokenizer.json's merges as "left right" lines (newer files store [left, right] pairs)."""
    return [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]


def _spm_scores(tokens: list[str], merges: list[str]) -> list[float]:
    """A score per token for llama.cpp's SentencePiece-style merging, which joins the adjacent
    pair whose result scores highest: the result of merge rank r scores -r, so merges happen in
    the order the tokenizer learned them. Tokens no merge makes score 0 (never a merge result)."""
    rank = {}
    for r, line in enumerate(merges):
        rank.setdefault(line.replace(" ", "", 1), r)
    return [-float(rank[t]) - 1.0 if t in rank else 0.0 for t in tokens]


def _is_spm_like(tj: dict) -> bool:
    """A BPE over "▁"-spaced text with byte fallback (Llama 2, Gemma): llama.cpp's "llama"."""
    parts = [tj.get("normalizer"), tj.get("pre_tokenizer"), tj.get("decoder")]
    return bool(tj["model"].get("byte_fallback")) and "▁" in json.dumps(parts, ensure_ascii=False)


def _adds_space_prefix(tj: dict) -> bool:
    """Whether the tokenizer puts "▁" before the text (Llama 2's Prepend, Metaspace's "first")."""
    text = json.dumps([tj.get("normalizer"), tj.get("pre_tokenizer")])
    return (
        '"Prepend"' in text
        or '"prepend_scheme": "first"' in text
        or ('"prepend_scheme": "always"' in text)
    )


def _id_table(tj: dict, n_rows: int) -> tuple[list[str], list[int]]:
    """Tokens by id with their llama.cpp types, padded with [PADi] (UNUSED) to `n_rows` (the
    embedding's rows: llama.cpp wants one token per row)."""
    by_id: dict[int, str] = {i: t for t, i in tj["model"]["vocab"].items()}
    kinds: dict[int, int] = {}
    for added in tj.get("added_tokens") or []:
        by_id[added["id"]] = added["content"]
        kinds[added["id"]] = CONTROL if added.get("special") else USER_DEFINED
    if not by_id:
        raise UserError("the tokenizer has no tokens; export a folder with the model's tokenizer")
    size = max(n_rows, max(by_id) + 1)
    if size > n_rows:
        raise UserError(
            f"the tokenizer has {size} tokens but the model's embedding has {n_rows} rows; "
            "export the tokenizer the model was trained with"
        )
    tokens, types = [], []
    for i in range(size):
        token = by_id.get(i)
        tokens.append(token if token is not None else f"[PAD{i}]")
        types.append(UNUSED if token is None else kinds.get(i, NORMAL))
    return tokens, types


def read_vocab(folder: Path, tokenizer: Any, n_rows: int, end_ids: list[int]) -> Vocab:
    """The `tokenizer.*` metadata of `tokenizer` (a transformers fast tokenizer loaded from
    `folder`); `n_rows`: the embedding's rows; `end_ids`: generation_config.json's eos ids."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise UserError(
            f"{folder}: the tokenizer has no tokenizer.json form (a slow tokenizer); save it "
            "with a fast tokenizer (tokenizer.save_pretrained) and export again"
        )
    tj = json.loads(backend.to_str())
    kind = tj["model"].get("type")
    if kind != "BPE":
        raise UserError(
            f"{folder}: the tokenizer is a {kind} model; GGUF export writes BPE tokenizers "
            "(byte-level like Llama 3 / Qwen, or SentencePiece-style like Llama 2 / Gemma)"
        )
    tokens, types = _id_table(tj, n_rows)
    merges = _merges(tj["model"])
    warnings: list[str] = []
    spm = _is_spm_like(tj)
    if spm:
        for i, t in enumerate(tokens):
            if len(t) == 6 and t.startswith("<0x") and t.endswith(">") and types[i] == NORMAL:
                types[i] = BYTE
    special = {
        name: getattr(tokenizer, f"{name}_token_id")
        for name in ("bos", "eos", "unk", "pad")
        if getattr(tokenizer, f"{name}_token_id", None) is not None
    }
    if "unk" in special and spm:
        types[special["unk"]] = UNKNOWN
    # Every end token is CONTROL (llama.cpp treats CONTROL tokens it knows as ends of generation);
    # the first one that is not eos is the end of a chat turn.
    ends = [i for i in end_ids if 0 <= i < len(tokens)]
    for i in ends + [special.get("eos", -1)]:
        if i >= 0:
            types[i] = CONTROL
    eot = [i for i in ends if i != special.get("eos")]
    if eot:
        special["eot"] = eot[0]
    probe = backend.encode("a", add_special_tokens=True).ids
    pre = "default" if spm else _pre_tokenizer_name(tj.get("pre_tokenizer"), bool(merges), warnings)
    return Vocab(
        model="llama" if spm else "gpt2",
        pre=pre,
        tokens=tokens,
        types=types,
        merges=merges,
        # a byte-level BPE without merges (compiletune's byte tokenizer): zero scores, which
        # readers that rebuild merges from scores (transformers) need when the file has none
        scores=_spm_scores(tokens, merges) if spm else (None if merges else [0.0] * len(tokens)),
        special_ids=special,
        add_bos="bos" in special and bool(probe) and probe[0] == special["bos"],
        add_eos="eos" in special and bool(probe) and probe[-1] == special["eos"],
        add_space_prefix=_adds_space_prefix(tj) if spm else None,
        chat_templates=_chat_templates(tokenizer),
        warnings=warnings,
    )


def _chat_templates(tokenizer: Any) -> dict[str, str]:
    """The chat template(s): "" -> the default one, NAME -> a named one (e.g. tool_use)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        return {"": template}
    if isinstance(template, dict):
        return {("" if k == "default" else k): v for k, v in template.items()}
    return {}


def write_vocab(writer: Any, vocab: Vocab) -> None:
    """Add the `tokenizer.*` keys to a gguf.GGUFWriter."""
    writer.add_tokenizer_model(vocab.model)
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    if vocab.merges:
        writer.add_token_merges(vocab.merges)
    adders = {
        "bos": writer.add_bos_token_id,
        "eos": writer.add_eos_token_id,
        "unk": writer.add_unk_token_id,
        "pad": writer.add_pad_token_id,
        "eot": writer.add_eot_token_id,
    }
    for name, token_id in vocab.special_ids.items():
        adders[name](token_id)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(vocab.add_eos)
    if vocab.add_space_prefix is not None:
        writer.add_add_space_prefix(vocab.add_space_prefix)
    for name, template in vocab.chat_templates.items():
        if name:
            writer.add_string(f"tokenizer.chat_template.{name}", template)
        else:
            writer.add_chat_template(template)
