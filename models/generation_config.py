"""What a checkpoint folder carries beside its weights and config.json: the tokenizer's files
and generation_config.json.

transformers' `generate` stops at the end tokens of generation_config.json. Chat models list
their end-of-turn token there (<|end_of_text|> and <|eot_id|>, or <eos> and <end_of_turn>), so a fine-tuned checkpoint without that file talks past the end of
its turn. The source's file is carried into every checkpoint, and the end-of-turn token of the
tokenizer's chat template is added to its end tokens when the file lacks it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from compiletune.errors import UserError

from .hf_config import read_json

GENERATION_CONFIG = "generation_config.json"
_REPLY = "compiletune-reply-marker"


def load_generation_config(folder: str | Path | None) -> dict[str, Any] | None:
    """The generation_config.json of a model folder as a dict, or None where there is none."""
    if folder is None:
        return None
    file = Path(folder) / GENERATION_CONFIG
    if not file.is_file():
        return None
    settings = read_json(file, "fix or remove it")
    if not isinstance(settings, dict):
        raise UserError(
            f"{file} holds a JSON {type(settings).__name__}, not an object; fix or remove it"
        )
    return settings


def end_of_turn_id(tokenizer: Any) -> int | None:
    """The special token the chat template closes an assistant reply with (<|eot_id|>,
    <end_of_turn>, ChatML's <|im_end|>), or None: no template, a template
    that fails on a plain user/assistant exchange, or plain text after the reply."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return None
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _REPLY}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # a template that wants other roles: nothing to learn from it here
        return None
    at = text.rfind(_REPLY)
    if at < 0:
        return None
    ids = tokenizer.encode(text[at + len(_REPLY) :], add_special_tokens=False)
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    return ids[0] if ids and ids[0] in special else None


def eos_ids(value: Any) -> list[int]:
    """The token ids of an eos_token_id field (an id or a list of them)."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def generation_config_for(source: dict[str, Any] | None, tokenizer: Any) -> dict[str, Any] | None:
    """`source` (the generation config the weights came with, or None) with the chat
    template's end-of-turn token among its end tokens; None when there is nothing to write."""
    eot = end_of_turn_id(tokenizer)
    if eot is None or (source is None and eot == tokenizer.eos_token_id):
        return None if source is None else dict(source)  # nothing to add to transformers' default
    settings = dict(source or {})
    eos = eos_ids(settings.get("eos_token_id"))
    if not eos and tokenizer.eos_token_id is not None:
        eos = [tokenizer.eos_token_id]
    if eot not in eos:
        settings["eos_token_id"] = [*eos, eot]
    if source is None and tokenizer.bos_token_id is not None:
        settings["bos_token_id"] = tokenizer.bos_token_id
    return settings


def write_side_files(
    folder: Path, tokenizer: Any, generation_config: dict[str, Any] | None
) -> None:
    """The tokenizer's files and generation_config.json (see `generation_config_for`) in
    `folder`."""
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    settings = generation_config_for(generation_config, tokenizer)
    if settings is not None:
        text = json.dumps(settings, indent=2, sort_keys=True) + "\n"
        (Path(folder) / GENERATION_CONFIG).write_text(text)
