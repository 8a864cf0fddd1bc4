"""Preference pairs (`--objective dpo|ipo|simpo`): read, tokenise, truncate, pack.

A pair is a prompt and two responses to it, chosen and rejected. Rows of any source the data
issue reads (`sources.iter_records`: jsonl, json, parquet, arrow, csv, save_to_disk folders, hub
cache), with the fields `prompt`, `chosen`, `rejected` (`--data-columns` renames them):

    text      "prompt": "...", "chosen": "...", "rejected": "..."
    messages  "chosen" / "rejected": chat message lists ending with the assistant's answer, and
              "prompt" either a message list or absent (then the messages chosen and rejected
              share before their last one are the prompt); rendered with the tokenizer's chat
              template, the response being what the template adds after the prompt's
              generation prompt

Each side is encoded as SFT examples are (`data.encode`: bos, prompt, response, eos), the
prompt's tokens are never targets. Truncation keeps a pair within one row: the prompt is kept
(its last `seq_len // 4` tokens at least, more when the responses leave room), then both
responses are cut to share what is left. A row packs whole pairs, chosen then rejected, each
sequence its own document (positions restart, attention stays inside it), so pairs never see
each other. Per token, `seq_ids` names the sequence its target belongs to within the row:
2k for pair k's chosen response, 2k + 1 for its rejected one, -1 for prompt and padding.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from compiletune.data.layouts import RawExample, check_roles, parse_columns, parse_roles
from compiletune.data.rows import encode
from compiletune.data.sources import iter_records
from compiletune.errors import UserError
from compiletune.loss.head import IGNORE_INDEX


@dataclass
class Pair:
    prompt: list[int]  # bos + prompt tokens
    chosen: list[int]  # response tokens (+ eos)
    rejected: list[int]


def _field(row: dict, name: str, col: dict[str, str], where: str, optional: bool = False) -> Any:
    key = col.get(name, name)
    value = row.get(key)
    if value is None and optional:
        return None
    if isinstance(value, str) or (
        isinstance(value, list) and value and all(isinstance(m, dict) for m in value)
    ):
        return value
    got = "missing" if key not in row else f"a {type(value).__name__}"
    raise UserError(
        f'{where}: "{key}" must be text or a list of chat messages, got {got}; preference data '
        'needs "prompt", "chosen" and "rejected" (rename columns with --data-columns)'
    )


def render_chat(tokenizer: Any, messages: list[dict], generation_prompt: bool, where: str) -> str:
    """`messages` through the tokenizer's chat template, as text (one line for a tokenizer
    without a template, or a template that fails on the row)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise UserError(
            f"{where}: chat messages need a tokenizer with a chat template; pass --tokenizer "
            "with one, or give the rows as text"
        )
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
    except Exception as e:  # jinja errors and the templates' own raise_exception()
        raise UserError(f"{where}: the chat template failed on this row ({e}); fix it") from e


def _texts(
    row: dict, col: dict[str, str], tokenizer: Any, where: str, roles: dict[str, str]
) -> tuple[str, str, str]:
    """(prompt, chosen, rejected) as text; chat roles mapped by `roles` (--data-roles) and
    checked against the template (`layouts.check_roles`)."""
    prompt = _field(row, "prompt", col, where, optional=True)
    chosen, rejected = (_field(row, k, col, where) for k in ("chosen", "rejected"))
    if isinstance(chosen, str) and isinstance(rejected, str):
        if not isinstance(prompt, str):
            raise UserError(f'{where}: text responses need a text "prompt"; fix the row')
        return prompt, chosen, rejected
    if isinstance(chosen, str) or isinstance(rejected, str):
        raise UserError(f'{where}: "chosen" and "rejected" must both be text or both messages')
    if prompt is None:  # the shared turns before the last are the prompt
        shared = 0
        while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
            shared += 1
        prompt, chosen, rejected = chosen[:shared], chosen[shared:], rejected[shared:]
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    prompt, chosen, rejected = (
        check_roles(side, tokenizer, roles, where, name)
        for name, side in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected))
    )
    if not prompt:
        raise UserError(f"{where}: the pair has no prompt (no shared turns); add a prompt")
    for name, side in (("chosen", chosen), ("rejected", rejected)):
        role = side[-1].get("role") if side else None
        if role != "assistant":
            raise UserError(
                f'{where}: the "{name}" messages must end with the assistant\'s answer, not '
                f"a {role!r} turn; fix the row"
            )
    head = render_chat(tokenizer, prompt, True, where)
    sides = []
    for side in (chosen, rejected):
        full = render_chat(tokenizer, [*prompt, *side], False, where)
        if not full.startswith(head):
            raise UserError(
                f"{where}: the chat template renders the prompt differently inside the "
                "conversation, so the response cannot be cut from it; give the pairs as text"
            )
        empty = not str(side[-1].get("content") or "").strip()  # the template's markup aside
        sides.append("" if empty else full[len(head) :])
    return head, sides[0], sides[1]


# A source where more than this fraction of the pairs has nothing to teach is refused: its
# chosen and rejected columns are likely swapped in or copied (a loss of log 2 that never moves).
DEGENERATE_LIMIT = 0.5


def _degenerate(chosen: str, rejected: str) -> str | None:
    """Why a pair teaches nothing (None when it can): a preference needs two different,
    non-empty responses."""
    if not chosen.strip() and not rejected.strip():
        return "both responses empty"
    if not chosen.strip() or not rejected.strip():
        return "an empty response"
    if chosen == rejected:
        return "chosen equals rejected"
    return None


def read_pairs(
    source: str,
    tokenizer: Any,
    columns: str | None = None,
    split: str | None = None,
    say: Callable[[str], None] = print,
    roles: str | None = None,
) -> list[Pair]:
    """Every pair of `source`, tokenised (see the module docstring). Pairs with nothing to
    teach (`_degenerate`) are left out and counted in one line; a source where more than
    DEGENERATE_LIMIT of them are, or none is left, is refused."""
    col = parse_columns(columns)
    role_map = parse_roles(roles)
    raw: list[RawExample] = []
    dropped: Counter[str] = Counter()
    for row, where in iter_records(source, split):
        prompt, chosen, rejected = _texts(row, col, tokenizer, where, role_map)
        why = _degenerate(chosen, rejected)
        if why is not None:
            dropped[why] += 1
            continue
        for response in (chosen, rejected):
            raw.append(RawExample([(prompt, False), (response, True)], True, where))
    total = len(raw) // 2 + sum(dropped.values())
    reasons = ", ".join(f"{n} {why}" for why, n in dropped.most_common())
    if dropped and (not raw or sum(dropped.values()) > DEGENERATE_LIMIT * total):
        raise UserError(
            f"{source}: {sum(dropped.values())} of {total} pairs have nothing to teach "
            f"({reasons}); preference data needs two different, non-empty responses per "
            "prompt: check that the chosen and rejected columns are the right ones"
        )
    if not raw:
        raise UserError(f"{source} has no preference pairs; add rows to it or pick another --data")
    if dropped:
        say(f"{source}: left out {sum(dropped.values())} of {total} pairs ({reasons})")
    examples = encode(raw, tokenizer, source)
    pairs = []
    for c, r in zip(examples[0::2], examples[1::2], strict=True):
        n_prompt = c.is_target.index(True) if True in c.is_target else len(c.ids)
        pairs.append(Pair(c.ids[:n_prompt], c.ids[n_prompt:], r.ids[n_prompt:]))
    return pairs


def truncate(pair: Pair, seq_len: int) -> Pair:
    """The pair cut to fit one row of `seq_len` inputs (both sequences, each one token shorter
    than its tokens): the prompt keeps its end, the responses their starts."""
    room = seq_len + 2  # two sequences of len - 1 inputs each
    p, c, r = pair.prompt, pair.chosen, pair.rejected
    if 2 * len(p) + len(c) + len(r) <= room:
        return pair
    keep = max(room // 4 // 2, min(len(p), (room - len(c) - len(r)) // 2))
    keep = max(1, min(len(p), keep))
    left = room - 2 * keep
    c_len = min(len(c), max(left // 2, left - len(r)))
    r_len = min(len(r), left - c_len)
    if c_len < 1 or r_len < 1:
        raise UserError(
            f"--seq-len {seq_len} leaves no room for both responses of a pair; raise --seq-len"
        )
    return Pair(p[len(p) - keep :], c[:c_len], r[:r_len])


class PairRows:
    """Pairs packed into rows of `seq_len` (see the module docstring); serves batches like
    `PackedData` does (`rows`, `take`), with `seq_ids` [b, s] and `pairs` [b] added."""

    def __init__(self, pairs: list[Pair], seq_len: int) -> None:
        self.seq_len = seq_len
        # each row: (tokens, sequence id, prompt length) per sequence
        rows: list[list[tuple[list[int], int, int]]] = [[]]
        used = 0
        for pair in (truncate(p, seq_len) for p in pairs):
            need = len(pair.prompt) * 2 + len(pair.chosen) + len(pair.rejected) - 2
            if used + need > seq_len:
                rows.append([])
                used = 0
            k, n_prompt = len(rows[-1]) // 2, len(pair.prompt)
            rows[-1].append((pair.prompt + pair.chosen, 2 * k, n_prompt))
            rows[-1].append((pair.prompt + pair.rejected, 2 * k + 1, n_prompt))
            used += need
        n = len(rows)
        shape = (n, seq_len)
        self.inputs = np.zeros(shape, np.int64)
        self.targets = np.full(shape, IGNORE_INDEX, np.int64)
        self.positions = np.zeros(shape, np.int64)
        self.doc_ids = np.zeros(shape, np.int32)
        self.seq_ids = np.full(shape, -1, np.int64)
        self.pairs = np.zeros(n, np.int64)
        self.filled = np.zeros(n, np.int64)  # real inputs of each row (the rest is padding)
        self.ref: np.ndarray | None = None  # [rows, 2 * most pairs in a row]: --precompute-ref
        for i, row in enumerate(rows):
            at = 0
            for doc, (tokens, seq, n_prompt) in enumerate(row):
                m = len(tokens) - 1
                span = slice(at, at + m)
                self.inputs[i, span] = tokens[:-1]
                targets = np.array(tokens[1:], np.int64)
                response = np.arange(1, m + 1) >= n_prompt  # targets past the prompt
                self.targets[i, span] = np.where(response, targets, IGNORE_INDEX)
                self.seq_ids[i, span] = np.where(response, seq, -1)
                self.positions[i, span] = np.arange(m)
                self.doc_ids[i, span] = doc
                at += m
            self.doc_ids[i, at:] = len(row)  # padding: a document of its own
            self.positions[i, at:] = np.arange(seq_len - at)
            self.pairs[i] = len(row) // 2
            self.filled[i] = at
        self.n_pairs = int(self.pairs.sum())

    @property
    def rows(self) -> int:
        return self.inputs.shape[0]

    def packs_documents(self) -> bool:
        return True

    def set_reference(self, sums: list[torch.Tensor]) -> None:
        """Store the reference's summed response log-probabilities, one [2 * pairs] tensor per
        row in order; `take` then serves them as `ref` [b, 2 * most pairs in a row]."""
        width = 2 * int(self.pairs.max()) if self.rows else 0
        self.ref = np.zeros((self.rows, width), np.float32)
        for i, row in enumerate(sums):
            self.ref[i, : row.numel()] = row.float().cpu().numpy()

    def real_inputs(self, idx: np.ndarray) -> int:
        """The inputs of rows `idx` that are tokens of the pairs, not padding."""
        return int(self.filled[np.asarray(idx, dtype=np.int64).reshape(-1)].sum())

    def take(self, idx: np.ndarray) -> dict[str, torch.Tensor]:
        idx = np.asarray(idx)
        extra = {} if self.ref is None else {"ref": torch.from_numpy(self.ref[idx])}
        return {
            **extra,
            "inputs": torch.from_numpy(self.inputs[idx]),
            "targets": torch.from_numpy(self.targets[idx]),
            "positions": torch.from_numpy(self.positions[idx]),
            "doc_ids": torch.from_numpy(self.doc_ids[idx]),
            "seq_ids": torch.from_numpy(self.seq_ids[idx]),
            "pairs": torch.from_numpy(self.pairs[idx]),
        }


def row_values(per_row: torch.Tensor, pairs: list[int]) -> torch.Tensor:
    """[b, W] values by row-local sequence id -> [2 * sum(pairs)] in batch sequence order.
    `pairs`: each row's pair count, known on the host (no device sync, and no data-dependent
    shape for the fake tensors the memory estimate runs the step on)."""
    width = per_row.shape[1]
    keep = [r * width + j for r, n in enumerate(pairs) for j in range(2 * n)]
    return per_row.flatten()[torch.tensor(keep, dtype=torch.long, device=per_row.device)]


def batch_sequence_ids(seq_ids: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """Row-local sequence ids [b, s] -> ids across the batch (row r's pair k is pair
    sum(pairs[:r]) + k; chosen even, rejected odd), -1 kept."""
    offset = (torch.cumsum(pairs, 0) - pairs) * 2  # [b]
    return torch.where(seq_ids >= 0, seq_ids + offset[:, None], -1)
