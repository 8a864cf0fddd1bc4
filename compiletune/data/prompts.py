"""Prompts for `--objective grpo`: rows of any source the data layer reads, each a prompt to
sample completions for, and the row's other columns for the reward functions.

A row's prompt is its `prompt` column (text, used as it is; or chat messages, rendered through
the tokenizer's chat template with the generation prompt), or its `messages` without a last
assistant turn (rendered the same way). `--data-columns prompt=question` renames. The other
columns travel with the prompt (`Prompt.columns`). Prompts too long to leave room for
`--max-new-tokens` within `--seq-len` are left out, counted in one line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from compiletune.data.layouts import RawExample, check_roles, parse_columns, parse_roles
from compiletune.data.pairs import render_chat
from compiletune.data.rows import encode
from compiletune.data.sources import iter_records
from compiletune.errors import UserError


@dataclass
class Prompt:
    ids: list[int]  # bos + the prompt's tokens
    text: str  # as rendered (what the reward functions see)
    columns: dict[str, Any]  # the row's other columns
    where: str = ""  # FILE:LINE (or FILE:row N) of its row, for messages


def _prompt_text(
    row: dict, col: dict[str, str], tokenizer: Any, roles: dict[str, str], where: str
) -> tuple[str, set[str]]:
    """(the prompt as text, the columns it came from)."""
    key = col.get("prompt", "prompt")
    value = row.get(key)
    used = {key}
    if value is None:
        key = col.get("messages", "messages")
        value, used = row.get(key), {key}
        last = value[-1] if isinstance(value, list) and value else None
        if isinstance(last, dict) and last.get("role") == roles.get("assistant", "assistant"):
            value = value[:-1]  # the answer to be generated
    if isinstance(value, str):
        if not value.strip():
            raise UserError(f"{where}: the prompt is empty; fix the row or leave it out")
        return value, used
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        messages = check_roles(value, tokenizer, roles, where, "prompt")
        return render_chat(tokenizer, messages, True, where), used
    raise UserError(
        f'{where}: a GRPO row needs a "prompt" (text or chat messages) or "messages"; rename '
        "columns with --data-columns prompt=NAME"
    )


def read_prompts(
    source: str,
    tokenizer: Any,
    max_prompt_tokens: int,
    columns: str | None = None,
    split: str | None = None,
    roles: str | None = None,
    say: Callable[[str], None] = print,
) -> list[Prompt]:
    """Every prompt of `source`, tokenised (see the module docstring)."""
    col = parse_columns(columns)
    role_map = parse_roles(roles)
    texts, extras = [], []
    for row, where in iter_records(source, split):
        text, used = _prompt_text(row, col, tokenizer, role_map, where)
        texts.append(RawExample([(text, False)], False, where))
        extras.append({k: v for k, v in row.items() if k not in used})
    if not texts:
        raise UserError(f"{source} has no prompts; add rows to it or pick another --data")
    examples = encode(texts, tokenizer, source)
    eos = getattr(tokenizer, "eos_token_id", None)
    prompts, long = [], 0
    for ex, raw, cols in zip(examples, texts, extras, strict=True):
        ids = ex.ids[:-1] if eos is not None and ex.ids and ex.ids[-1] == eos else ex.ids
        if len(ids) > max_prompt_tokens:
            long += 1
            continue
        prompts.append(Prompt(ids, raw.pieces[0][0], cols, raw.where))
    if not prompts:
        raise UserError(
            f"{source}: every prompt is longer than {max_prompt_tokens} tokens (--seq-len less "
            "--max-new-tokens); raise --seq-len or lower --max-new-tokens"
        )
    if long:
        say(
            f"{source}: left out {long} of {len(texts)} prompts longer than {max_prompt_tokens} "
            "tokens (--seq-len less --max-new-tokens)"
        )
    return prompts


class PromptSet:
    """The prompts as rows for `data.rows.Batches` (which draws them in a seeded order per
    epoch and saves its position for --resume)."""

    def __init__(self, prompts: list[Prompt]) -> None:
        self.prompts = prompts

    @property
    def rows(self) -> int:
        return len(self.prompts)

    def real_inputs(self, rows: np.ndarray) -> int:
        return sum(len(self.prompts[i].ids) for i in rows)

    def take(self, rows: np.ndarray) -> list[Prompt]:
        return [self.prompts[i] for i in rows]
