"""What the rows of `--data` hold (layouts), as examples: pieces of text with the parts to
learn marked. Where the rows come from is `compiletune.data.sources`.

Layouts (`--data-format`, `auto` detects them from the first row; every row must then have the
same layout):

- `text`: `{"text"}`, every token a target.
- `prompt-completion`: `{"prompt", "completion"}`, the completion (and the closing eos) only.
- `messages`: `{"messages": [{"role", "content"}, ...]}` (OpenAI), rendered with the chat template;
  the assistant replies (with the end-of-turn text the template puts after them) only.
- `sharegpt`: `{"conversations": [{"from", "value"}, ...]}`, mapped to messages (human/user ->
  user; gpt/assistant/chatgpt/model -> assistant; system; tool/function -> tool).
- `alpaca`: `{"instruction", "input" (optional), "output"}`: with a chat template, a user message
  "instruction\\n\\ninput" and the assistant reply "output"; without one, prompt-completion with
  the prompt "### Instruction:\\n...\\n\\n### Input:\\n...\\n\\n### Response:\\n".

`--data-columns FIELD=COL,...` reads a layout's field from another column (`prompt=question`,
`messages=dialog`, and inside messages `role=from,content=text`).

Chat templates that rewrite earlier turns (e.g. drop the reasoning of past assistant turns) do not
render a conversation as an extension of its prefixes; such a conversation becomes one example per
assistant turn: the conversation before the turn rendered with the generation prompt (context),
then the rest of the conversation through the turn (target).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from compiletune.data.corpus import pydoc_corpus
from compiletune.data.image_tokens import image_placeholder
from compiletune.data.images import (
    ImageError,
    ImageRef,
    has_image_parts,
    has_images,
    parse_image_messages,
    row_images,
)
from compiletune.data.sources import source_items
from compiletune.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# A piece of an example: text and whether its tokens are targets.
Piece = tuple[str, bool]

LAYOUTS = ("text", "prompt-completion", "messages", "sharegpt", "alpaca")
# The fields --data-columns can map, per layout (the inner fields of a message after a dot-less
# name: role/content for messages, from/value for sharegpt).
FIELDS = {
    "text": ("text",),
    "prompt-completion": ("prompt", "completion"),
    "messages": ("messages", "role", "content", "images"),
    "sharegpt": ("conversations", "from", "value"),
    "alpaca": ("instruction", "input", "output"),
}
_ALL_FIELDS = tuple(dict.fromkeys(f for fields in FIELDS.values() for f in fields))
# Detection order: the first layout whose key column a row has.
_KEY = {
    "messages": ("messages",),
    "sharegpt": ("conversations",),
    "alpaca": ("instruction",),
    "prompt-completion": ("prompt", "completion"),
    "text": ("text",),
}
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "system": "system",
    "tool": "tool",
    "function": "tool",
}
_HOW = (
    'each row needs "text", "prompt"+"completion", "messages", "conversations" (ShareGPT) or '
    '"instruction"+"output" (alpaca); map other names with --data-columns FIELD=COL,... or '
    "pick the layout with --data-format"
)


# A piece of an example: text and whether its tokens are targets.
Piece = tuple[str, bool]


@dataclass
class RawExample:
    """An example before tokenisation: text pieces in order, and what closes it."""

    pieces: list[Piece]
    eos_is_target: bool  # whether an eos appended at the end is a target
    where: str = ""  # FILE:LINE, FILE:row N (or the source), for messages
    images: list[ImageRef] = field(default_factory=list)  # in the order their tokens come


def check_utf8(text: str, where: str, what: str) -> str:
    """`text`, which must be encodable as UTF-8 (a JSON escape like \\ud800 gives a lone
    surrogate, which no tokenizer can take)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UserError(
            f"{where}: {what} holds {text[e.start]!r} (a lone UTF-16 surrogate, from an escape "
            "like \\ud800 without its pair), which is not text; fix the line"
        ) from e
    return text


def parse_columns(spec: str | None) -> dict[str, str]:
    """`--data-columns FIELD=COL,...` as {field: column}."""
    if not spec:
        return {}
    mapping: dict[str, str] = {}
    for item in spec.split(","):
        field, eq, column = (s.strip() for s in item.partition("="))
        if not eq or not field or not column:
            raise UserError(
                f"--data-columns: {item.strip()!r} is not FIELD=COLUMN; write e.g. "
                "prompt=question,completion=answer"
            )
        if field not in _ALL_FIELDS:
            raise UserError(
                f"--data-columns: unknown field {field!r}; fields: {', '.join(_ALL_FIELDS)}"
            )
        if field in mapping:
            raise UserError(f"--data-columns: {field} is mapped twice; map it once")
        mapping[field] = column
    return mapping


# Roles every chat template renders; any other role must be named in the template's source
# (Qwen's "tool", Llama 3.1's "ipython", gpt-oss's "developer") or mapped with --data-roles.
_TEMPLATE_ROLES = ("system", "user", "assistant")
ROLE_TARGETS = ("system", "user", "assistant", "tool")


def parse_roles(spec: str | None) -> dict[str, str]:
    """`--data-roles FROM=TO,...` as {from: to}; TO one of ROLE_TARGETS."""
    if not spec:
        return {}
    mapping: dict[str, str] = {}
    for item in spec.split(","):
        src, eq, dst = (s.strip() for s in item.partition("="))
        if not eq or not src or not dst:
            raise UserError(
                f"--data-roles: {item.strip()!r} is not FROM=TO; write e.g. human=user,bot=assistant"
            )
        if dst not in ROLE_TARGETS:
            raise UserError(
                f"--data-roles: {src}={dst}: the role must become one of {', '.join(ROLE_TARGETS)}"
            )
        if src in mapping:
            raise UserError(f"--data-roles: {src} is mapped twice; map it once")
        mapping[src] = dst
    return mapping


def check_roles(
    messages: list[dict], tokenizer: Any, roles: dict[str, str], where: str, list_col: str
) -> list[dict]:
    """`messages` with their roles mapped by `roles` (--data-roles), each role one the chat
    template renders: system, user and assistant always; another only where the template's
    source names it. A template that ignores a role it does not know (Qwen's drops the
    message) would otherwise train without that text and without a word."""
    template = getattr(tokenizer, "chat_template", None) or ""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str):
            raise UserError(f'{where}: {list_col}[{i}] has no "role" string; fix the row')
        role = roles.get(m["role"], m["role"])
        named = f"'{role}'" in template or f'"{role}"' in template
        if role not in _TEMPLATE_ROLES and not named:
            raise UserError(
                f"{where}: {list_col}[{i}] has role {role!r}, which the tokenizer's chat "
                "template does not name, so it may drop or misplace that text; map it with "
                f"--data-roles {role}=user (or system, assistant, tool)"
            )
        out.append(m if role == m["role"] else {**m, "role": role})
    return out


def _detect(row: dict, col: dict[str, str]) -> str | None:
    """The layout of `row`: the first whose key column it has with a value (parquet, arrow
    and csv give every row every column, null where a row has none), else merely has."""
    for present in (lambda k: row.get(k) is not None, lambda k: k in row):
        for layout, keys in _KEY.items():
            if any(present(col.get(k, k)) for k in keys):
                return layout
    return None


def _found(row: dict) -> str:
    return ", ".join(sorted(map(str, row))) or "none"


def _get_str(row: dict, field: str, col: dict[str, str], where: str, optional=False) -> str:
    name = col.get(field, field)
    value = row.get(name)
    if value is None and optional:
        return ""
    if not isinstance(value, str):
        got = "missing" if name not in row else f"a {type(value).__name__}"
        raise UserError(f'{where}: "{name}" must be a string, got {got}; fix the row')
    return check_utf8(value, where, f'"{name}"')


def _messages(
    row: dict, layout: str, col: dict[str, str], where: str, roles: dict[str, str]
) -> list[dict]:
    """The row's conversation as [{"role", "content", ...}], checked; roles mapped by `roles`
    (--data-roles) first."""
    if layout == "messages":
        list_key, role_key, content_key = "messages", "role", "content"
    else:
        list_key, role_key, content_key = "conversations", "from", "value"
    list_col = col.get(list_key, list_key)
    role_col, content_col = col.get(role_key, role_key), col.get(content_key, content_key)
    messages = row[list_col]
    shape = f'"{list_col}" must be a list of {{"{role_col}": str, "{content_col}": str}} objects'
    if not isinstance(messages, list):
        raise UserError(f"{where}: {shape}, got {type(messages).__name__}; fix the row")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise UserError(
                f"{where}: {shape}; {list_col}[{i}] is a {type(m).__name__}; fix the row"
            )
        for key in (role_col, content_col):
            if not isinstance(m.get(key), str):
                got = "missing" if m.get(key) is None else f"a {type(m[key]).__name__}"
                hint = ""
                if m.get(key) is None:
                    hint = f" (keys: {_found(m)}; map them with --data-columns"
                    hint += f" {role_key}=...,{content_key}=...)"
                raise UserError(
                    f'{where}: {shape}; {list_col}[{i}]["{key}"] is {got}{hint}; fix the row'
                )
            check_utf8(m[key], where, f'{list_col}[{i}]["{key}"]')
        role = roles.get(m[role_col], m[role_col])
        if layout == "sharegpt":
            if role.lower() not in _SHAREGPT_ROLES:
                raise UserError(
                    f'{where}: {list_col}[{i}]["{role_col}"] is {role!r}; ShareGPT roles are '
                    f"{', '.join(_SHAREGPT_ROLES)}; map others with --data-roles {role}=user "
                    "(or system, assistant, tool)"
                )
            role = _SHAREGPT_ROLES[role.lower()]
        # Other keys (name, tool_calls, ...) go to the template; a null is a column this row
        # does not use (parquet and arrow give every row every struct field).
        extra = {
            k: v
            for k, v in m.items()
            if k not in (role_col, content_col, "role", "content") and v is not None
        }
        out.append({"role": role, "content": m[content_col], **extra})
    if not out:
        raise UserError(f'{where}: "{list_col}" is empty; add the conversation or remove the row')
    # The reply's prompt is rendered from the messages before it, and templates (and
    # transformers 5) refuse an empty conversation.
    if out[0]["role"] == "assistant":
        raise UserError(
            f"{where}: the conversation starts with an assistant message; put the user (or "
            "system) message it answers before it"
        )
    # A conversation with no assistant reply (or only empty ones) has nothing to learn: it is
    # kept as an example without a target, which packing counts and leaves out.
    return out


def _text_of(content: str | list[dict]) -> str:
    """A message's text: its content, or the text of its parts."""
    if isinstance(content, str):
        return content
    return "".join(p.get("text") or "" for p in content if p.get("type") == "text")


_ROW_PLACE = re.compile(r"^(?P<file>.+):(?P<row>row )?(?P<n>\d+)$")


def image_chat_examples(
    row: dict, col: dict[str, str], where: str, roles: dict[str, str], processor: Any
) -> list[RawExample]:
    """A `messages` row whose content holds image parts, as examples rendered by the
    checkpoint's processor (its chat template places the image markers), the assistant's text
    the targets as in `chat_examples`, each example with the images its text holds."""
    if processor is None:
        raise UserError(
            f"{where}: the row holds images, and the model has none of the image processor a "
            "vision-language checkpoint ships (preprocessor_config.json): train a vision "
            "checkpoint (Gemma 3 4B and up, Gemma 4, Qwen3.5) with --model-dir, or drop the "
            "image parts"
        )
    _needs_template(processor, where, "messages")
    list_col = col.get("messages", "messages")
    role_col, content_col = col.get("role", "role"), col.get("content", "content")
    messages = [
        {"role": m.get(role_col), "content": m.get(content_col)}
        | {k: v for k, v in m.items() if k not in (role_col, content_col)}
        if isinstance(m, dict)
        else m
        for m in row[list_col]
    ]
    place = _ROW_PLACE.match(where)
    data_file = place["file"] if place else where
    in_table = (data_file, int(place["n"])) if place and place["row"] else None
    images = row_images(row, data_file, in_table, col.get("images", "images"), list_col)
    messages, refs = parse_image_messages(messages, data_file, where, images)
    messages = check_roles(messages, processor, roles, where, list_col)
    if messages[0]["role"] == "assistant":
        raise UserError(
            f"{where}: the conversation starts with an assistant message; put the user (or "
            "system) message it answers before it"
        )
    examples = chat_examples(processor, messages, where)
    full = _render_chat(processor, messages, False, where)
    placeholder = image_placeholder(processor, full, len(refs), where)
    for example in examples:  # each renders the conversation from its start
        example.images = refs[: sum(text.count(placeholder) for text, _ in example.pieces)]
    return examples


def _render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool, where: str) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except Exception as e:  # jinja errors and the templates' own raise_exception()
        raise UserError(
            f"{where}: the tokenizer's chat template failed on this conversation ({e}); "
            "fix the messages (roles, order) or use a tokenizer whose template accepts them"
        ) from e


def chat_examples(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], where: str
) -> list[RawExample]:
    """A conversation as examples whose targets are the assistant replies.

    The reply to message i spans from the end of `messages[:i]` rendered with the generation
    prompt to the end of `messages[:i+1]`: whatever the template puts there (content, end of
    turn, eos) is what the model must produce. When the full rendering extends every such
    prefix, this is one example. A template that rewrites earlier turns (a reasoning block
    dropped from past assistant replies) does not; then each assistant turn is an example of
    its own: that context (never a target), then the reply as the template renders it last.
    """
    full = _render_chat(tokenizer, messages, False, where)
    if not any(m["role"] == "assistant" and _text_of(m["content"]).strip() for m in messages):
        # Nothing to learn (no reply, or only empty ones): an example without a target, which
        # packing counts and leaves out.
        return [RawExample([(full, False)], False, where)]
    turns = []  # (before, through) per assistant reply
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render_chat(tokenizer, messages[:i], True, where)
        through = _render_chat(tokenizer, messages[: i + 1], False, where)
        if not through.startswith(before):
            raise UserError(
                f"{where}: the tokenizer's chat template renders the conversation through "
                f"message {i} differently from its prompt for that reply, so the reply cannot "
                "be located; use a tokenizer whose template extends the prompt with the reply"
            )
        turns.append((before, through))
    pieces: list[Piece] = []
    done = 0  # characters of `full` already assigned to pieces
    for before, through in turns:
        if not (full.startswith(through) and len(before) >= done):
            break  # the template rewrites earlier turns: one example per reply
        pieces.append((full[done : len(before)], False))
        pieces.append((full[len(before) : len(through)], True))
        done = len(through)
    else:
        pieces.append((full[done:], False))
        last_is_reply = messages[-1]["role"] == "assistant"
        return [RawExample([p for p in pieces if p[0]], last_is_reply, where)]
    return [
        RawExample(
            [p for p in [(before, False), (through[len(before) :], True)] if p[0]], True, where
        )
        for before, through in turns
    ]


def _alpaca_messages(row: dict, col: dict[str, str], where: str) -> list[dict]:
    instruction = _get_str(row, "instruction", col, where)
    extra = _get_str(row, "input", col, where, optional=True)
    output = _get_str(row, "output", col, where)
    user = f"{instruction}\n\n{extra}" if extra else instruction
    return [{"role": "user", "content": user}, {"role": "assistant", "content": output}]


def _needs_template(tokenizer, where: str, layout: str) -> None:
    if getattr(tokenizer, "chat_template", None) is None:
        raise UserError(
            f'{where}: chat "{layout}" rows need a tokenizer with a chat template and this '
            "one has none; pass --tokenizer with a chat template (an instruct model's) "
            'or use "text" / "prompt"+"completion" rows'
        )


def _learned(prompt: str, reply: str, where: str) -> RawExample:
    """A prompt and the reply to learn; a blank reply teaches nothing (not even to stop at
    once), so it is an example without a target, which packing counts and leaves out."""
    if not reply.strip():
        return RawExample([p for p in [(prompt, False)] if p[0]], False, where)
    return RawExample([p for p in [(prompt, False), (reply, True)] if p[0]], True, where)


def row_examples(
    row: dict,
    layout: str,
    tokenizer: PreTrainedTokenizerBase,
    col: dict[str, str],
    where: str,
    roles: dict[str, str] | None = None,
    processor: Any = None,
) -> list[RawExample]:
    """The examples of one row in `layout` (checked; a UserError naming `where`); chat roles
    mapped by `roles` (--data-roles); a conversation with images rendered by `processor` (the
    checkpoint's, None for a model without a vision tower)."""
    if layout == "text":
        return [_learned("", _get_str(row, "text", col, where), where)]
    if layout == "prompt-completion":
        p, c = col.get("prompt", "prompt"), col.get("completion", "completion")
        if p not in row or c not in row:
            missing = c if p in row else p
            raise UserError(f'{where}: "{missing}" is missing; give both prompt and completion')
        prompt = _get_str(row, "prompt", col, where)
        return [_learned(prompt, _get_str(row, "completion", col, where), where)]
    if layout == "alpaca":
        messages = _alpaca_messages(row, col, where)
        if getattr(tokenizer, "chat_template", None) is not None:
            return chat_examples(tokenizer, messages, where)
        instruction, _, extra = messages[0]["content"].partition("\n\n")
        prompt = f"### Instruction:\n{instruction}\n\n"
        if extra:
            prompt += f"### Input:\n{extra}\n\n"
        prompt += "### Response:\n"
        return [_learned(prompt, messages[1]["content"], where)]
    # messages, sharegpt
    conversation = row.get(col.get("messages", "messages"))
    if layout == "messages" and (
        has_images(conversation) or (processor is not None and has_image_parts(conversation))
    ):
        return image_chat_examples(row, col, where, roles or {}, processor)
    _needs_template(tokenizer, where, layout)
    messages = _messages(row, layout, col, where, roles or {})
    list_col = col.get(_KEY[layout][0], _KEY[layout][0])
    return chat_examples(tokenizer, check_roles(messages, tokenizer, {}, where, list_col), where)


class _Layouts:
    """The layout of a source's rows: forced, or detected from the first row and then the
    same on every row."""

    def __init__(self, fmt: str, col: dict[str, str]):
        if fmt != "auto" and fmt not in LAYOUTS:
            raise UserError(
                f"--data-format {fmt!r} is not a layout; use auto, {', '.join(LAYOUTS)}"
            )
        unused = [f for f in col if fmt != "auto" and f not in FIELDS[fmt]]
        if unused:
            raise UserError(
                f"--data-columns maps {', '.join(unused)}, which --data-format {fmt} does not "
                f"read (its fields: {', '.join(FIELDS[fmt])}); drop them"
            )
        self.forced = fmt != "auto"
        self.layout: str | None = None if fmt == "auto" else fmt
        self.first_where = ""
        self.col = col

    def of(self, row: dict, where: str) -> str:
        detected = _detect(row, self.col)
        if self.layout is None:
            if detected is None:
                raise UserError(f"{where}: no known key (found: {_found(row)}); {_HOW}")
            self.layout, self.first_where = detected, where
            return detected
        keys = [self.col.get(k, k) for k in _KEY[self.layout]]
        if self.forced:
            if not any(k in row for k in keys):
                need = " or ".join(f'"{k}"' for k in keys)
                field = _KEY[self.layout][0]
                raise UserError(
                    f"{where}: no {need} column for --data-format {self.layout} (found: "
                    f"{_found(row)}); map one with --data-columns {field}=COLUMN"
                )
            return self.layout
        if detected == self.layout:
            return detected
        if detected is None:
            raise UserError(
                f"{where}: no known key (found: {_found(row)}); the rows before are "
                f"{self.layout} rows (from {self.first_where}); {_HOW}"
            )
        raise UserError(
            f"{where}: a {detected} row, but the rows before are {self.layout} rows (from "
            f"{self.first_where}); one source holds one layout: make the rows alike or split "
            "the data into separate sources"
        )


def read_examples(
    source: str,
    tokenizer: PreTrainedTokenizerBase,
    fmt: str = "auto",
    columns: str | None = None,
    split: str | None = None,
    roles: str | None = None,
    processor: Any = None,
    skipped: list[str] | None = None,
) -> Iterator[RawExample]:
    """The examples of `source`, lazily, in order (chat roles mapped by `roles`,
    --data-roles; image conversations rendered by `processor`). A source with none is a
    UserError. With `skipped` (a list: --skip-bad-images) a row whose image is missing is left
    out, its place appended there, instead of stopping the run."""
    col = parse_columns(columns)
    role_map = parse_roles(roles)
    layouts = _Layouts(fmt, col)
    count = 0
    if source == "pydocs":
        docs = pydoc_corpus()
        if not docs:
            raise UserError(
                "the pydocs corpus is empty because Python runs with -OO, which strips "
                "docstrings; run without -OO or pass --data FILE"
            )
        for doc in docs:
            yield RawExample([(doc, True)], True, "pydocs")
        return
    text, items = source_items(source, split)
    if text:
        if layouts.forced and layouts.layout != "text":
            raise UserError(
                f"{source}: .txt files hold text documents; drop --data-format "
                f"{layouts.layout} or pass rows (.jsonl, .parquet, ...)"
            )
        for doc, where in items:
            count += 1
            yield RawExample([(doc, True)], True, where)
    else:
        for row, where in items:
            count += 1
            layout = layouts.of(row, where)
            try:
                examples = row_examples(row, layout, tokenizer, col, where, role_map, processor)
            except ImageError:
                if skipped is None:
                    raise
                skipped.append(where)
                continue
            yield from examples
    if count == 0:
        what = f"split {split!r} of {source}" if split else source
        raise UserError(f"{what} has no examples; add data to it or pick another --data")
