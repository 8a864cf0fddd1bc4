"""What `compiletune generate` takes from a user, checked before anything heavy loads (no torch
here): the sampling options, and text that must be UTF-8 (a prompt from the command line, a
conversation on stdin)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from compiletune.errors import UserError


@dataclass
class Sampling:
    temperature: float = 0.0  # 0 -> greedy (argmax)
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    seed: int = 0

    def check(self, max_new_tokens: int) -> None:
        """One line for an option out of range (nan and inf included)."""
        if max_new_tokens < 1:
            raise UserError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise UserError(
                f"--temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:  # false for nan too
            raise UserError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_p < 1.0 and self.temperature == 0:
            raise UserError(
                "--top-p chooses among sampled tokens; add --temperature > 0 (e.g. 0.7)"
            )


def _bad_byte(raw: bytes, error: UnicodeDecodeError, where: str) -> UserError:
    return UserError(
        f"{where} is not valid UTF-8 (byte 0x{raw[error.start]:02x} at offset {error.start}); "
        "pass UTF-8 text"
    )


def checked_text(text: str, where: str) -> str:
    """`text`, which must be UTF-8: Python gives the bytes of command-line arguments and
    streams that are not as lone surrogates (surrogateescape), which no tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raw = text.encode("utf-8", "surrogateescape")
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _bad_byte(raw, e, where) from None
        raise UserError(f"{where} holds a lone UTF-16 surrogate, which is not text") from None
    return text


def check_prompt(prompt: str | None, chat: bool) -> None:
    """`generate` has a prompt (UTF-8), or a chat, whose turns may come from stdin."""
    if prompt is None and not chat:
        raise UserError("pass --prompt TEXT, or --chat for a conversation")
    if prompt is not None:
        checked_text(prompt, "--prompt")


def check_image_prompt(image: str, prompt: str | None) -> None:
    """`generate --image`: the file exists and comes with --prompt (what to ask about it)."""
    if prompt is None:
        raise UserError("--image needs --prompt: the question or instruction about the image")
    if not Path(image).expanduser().is_file():
        raise UserError(f"--image {image}: no such file; pass an image file (PNG, JPEG, ...)")


def text_lines(stream: Iterable, where: str = "stdin") -> Iterator[str]:
    """The lines of a text stream (or of its bytes, where it has them), each checked as UTF-8
    and named by its number when it is not."""
    source = getattr(stream, "buffer", stream)
    for number, line in enumerate(source, 1):
        if isinstance(line, bytes):
            try:
                line = line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise _bad_byte(line, e, f"{where} line {number}") from None
        yield checked_text(line, f"{where} line {number}")
