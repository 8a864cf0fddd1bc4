"""Tokenizers: a byte-level one built in code, and loading a real one from a folder.

The byte tokenizer lets the debug models and the embedded default run train on any text with
nothing downloaded. It is a genuine `transformers` fast tokenizer, so the trainer, checkpoints
and `AutoTokenizer.from_pretrained` treat it exactly like a Llama or Qwen tokenizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from compiletune.errors import UserError
from compiletune.models.hf_config import brief, resolve_model_path

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
PAD = "<|pad|>"

# Plain-text role headers so a debug model's chats stay readable when decoded. Each message is
# "### {role}:\n{content}<|end_of_text|>"; an assistant reply therefore ends with eos, which
# is what the model learns to emit to stop.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '### ' + message['role'] + ':\\n' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '### assistant:\\n' }}{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character (what ByteLevel pre-tokenizes into).

    Printable Latin-1 bytes map to themselves; the other 68 go to chr(256 + k) in byte order.
    """
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level HF fast tokenizer: ids 0..255 are bytes, then bos=256, eos=257, pad=258.

    Any UTF-8 text round-trips exactly: `decode(encode(s, add_special_tokens=False)) == s`.
    Calling it with the default `add_special_tokens=True` prepends bos, as Llama 3 does.
    The chat template renders::

        <|begin_of_text|>### system:\\n{content}<|end_of_text|>### user:\\n{content}<|end_of_text|>
        ### assistant:\\n{content}<|end_of_text|>

    (no newline between messages; shown split here), and `add_generation_prompt=True` appends
    "### assistant:\\n".
    """
    # tokenizers and transformers' tokenizer classes are imported when a tokenizer is built:
    # about 1.7 s that the commands which build none (estimate-memory) should not pay.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    byte_chars = _bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}
    # A BPE with no merges over the 256 byte characters: every byte is its own token.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split and no prefix space: the whole text becomes one byte string, so nothing
    # is added or lost (GPT-2's split would be harmless but buys nothing without merges).
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([BOS, EOS, PAD])  # ids 256, 257, 258 in this order
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, 256)],
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        model_max_length=1 << 30,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


# Files that hold a tokenizer's vocabulary (tokenizer_config.json alone does not).
_VOCAB_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
)
# Ordinary text every real tokenizer encodes to tokens of its vocabulary.
_PROBE = "Hello world"
# Fewer tokens than this is no vocabulary (the byte tokenizer, the smallest real one, has 259).
_MIN_TOKENS = 32


def load_tokenizer(path: str | Path, flag: str = "--model-dir") -> PreTrainedTokenizerBase:
    """Load a tokenizer from a local folder (a HF checkpoint or a `save_pretrained` output; a hub
    id's tokenizer files are downloaded on first use, see `resolve_model_path`). `flag` is the option that
    named the folder, for the messages.

    A folder that loads but has no vocabulary (tokenizer_config.json without tokenizer.json
    gives a tokenizer of its special tokens only) is refused: it would encode every text to
    nothing and a run would train on special tokens alone."""

    folder = resolve_model_path(path, flag, weights=False)
    if not folder.is_dir():
        raise UserError(
            f"{flag} {path} is a file; pass the folder that holds tokenizer.json or "
            "tokenizer_config.json"
        )
    known = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((folder / name).is_file() for name in known):
        raise UserError(
            f"{folder} has no tokenizer files ({', '.join(known)}); pass --tokenizer with a "
            "folder written by save_pretrained or a HF checkpoint folder"
        )
    names = [p.name for p in folder.iterdir()]
    if not any(name in _VOCAB_FILES or name.endswith(".tiktoken") for name in names):
        raise UserError(
            f"{folder} has tokenizer_config.json but no vocabulary file (tokenizer.json is "
            "missing); copy the model's complete tokenizer files into the folder"
        )
    from transformers import AutoTokenizer  # when one is loaded (see byte_tokenizer)

    try:
        tokenizer = AutoTokenizer.from_pretrained(
            str(folder), local_files_only=True, trust_remote_code=False
        )
    except Exception as e:  # OSError, ValueError, JSON and tokenizers errors of broken files
        # AutoTokenizer also reads config.json (for the model type): a bad field there is the
        # config's fault, and the line must send the user to that file, not to the tokenizer.
        config = _config_error(folder)
        if config is not None:
            raise UserError(
                f"{folder / 'config.json'} cannot be read by transformers ({config}), so "
                "neither can the tokenizer beside it; fix the field or re-export the config"
            ) from e
        raise UserError(
            f"could not load the tokenizer in {folder} ({brief(e)}); check that the folder is a "
            "complete HF tokenizer (tokenizer.json, or tokenizer.model / vocab.json + merges.txt)"
        ) from e
    check_vocabulary(tokenizer, folder)
    return tokenizer


def load_processor(path: str | Path, flag: str = "--model-dir") -> Any:
    """The checkpoint's processor (transformers' `AutoProcessor`) when the folder is a
    vision-language checkpoint's (it ships preprocessor_config.json or processor_config.json),
    else None: its data may then hold no images."""
    folder = resolve_model_path(path, flag, weights=False)
    names = ("preprocessor_config.json", "processor_config.json")
    if not folder.is_dir() or not any((folder / n).is_file() for n in names):
        return None
    from transformers import AutoProcessor  # only for vision checkpoints (see byte_tokenizer)

    try:
        return AutoProcessor.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # a missing optional package (torchvision), a broken file
        # Qwen3.5's and Gemma 4's processors also load a video processor, which needs
        # torchvision: not in the vision extra, as its wheel must match the installed torch
        need = (
            "pip install torchvision (the build made for your torch)"
            if "torchvision" in str(e).lower() or "video processor" in str(e).lower()
            else "pip install 'compiletune[vision]'"
        )
        raise UserError(
            f"could not load the image processor in {folder} ({brief(e)}); image conversations "
            f"need it: install what it names ({need}) or fix the files"
        ) from e


def _config_error(folder: Path) -> str | None:
    """Why transformers cannot read `folder`/config.json (one short line), or None when it can
    or there is none."""
    if not (folder / "config.json").is_file():
        return None
    from transformers import AutoConfig  # only on a failed load (see byte_tokenizer)

    try:
        AutoConfig.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    except Exception as e:  # strict-dataclass, JSON and unknown-model-type errors alike
        return brief(e)
    return None


def check_vocabulary(tokenizer: PreTrainedTokenizerBase, folder: Path) -> None:
    """Refuse a tokenizer without a vocabulary: one that encodes ordinary text to no tokens, or
    only to special (unknown) ones, or has implausibly few tokens."""
    try:
        ids = tokenizer(_PROBE, add_special_tokens=False)["input_ids"]
        size = len(tokenizer)
    except Exception as e:  # a tokenizer broken enough to fail on plain text
        raise UserError(
            f"the tokenizer in {folder} cannot encode plain text ({brief(e)}); check that the "
            "folder is a complete HF tokenizer"
        ) from e
    special = set(tokenizer.all_special_ids)
    if size >= _MIN_TOKENS and any(i not in special for i in ids):
        return
    if not (folder / "tokenizer.json").is_file():
        missing = "tokenizer.json is missing"
    else:
        missing = "tokenizer.json holds no usable vocabulary"
    raise UserError(
        f"the tokenizer in {folder} has {size} tokens and encodes {_PROBE!r} to "
        f"{len([i for i in ids if i not in special])} ordinary tokens: {missing}; copy the "
        "model's complete tokenizer files (tokenizer.json) into the folder"
    )
