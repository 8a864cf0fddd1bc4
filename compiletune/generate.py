"""`compiletune generate`: a quick look at what a fine-tune learned.

Loads a checkpoint folder (any `step_N/` or HF folder) into the native model, encodes a prompt
(raw, or through the tokenizer's chat template with `--chat`) and decodes with a KV cache:
greedy by default (token for token what `transformers` `generate(do_sample=False)` gives on the
same checkpoint), or temperature + top-p (nucleus) sampling with a seed. Text is printed as it
is produced. One prompt at a time: this is a checking tool, not a server.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TextIO

import torch

from compiletune.checkpoint import adapter_io
from compiletune.checkpoint.steps import load_train_state
from compiletune.data.image_batch import ImagePrep
from compiletune.data.image_tokens import encode_image_pieces
from compiletune.data.images import ImageRef
from compiletune.data.tokenizer import load_processor, load_tokenizer
from compiletune.errors import UserError
from compiletune.models import PRESETS, Transformer, build_model, from_hf, resolve_model_path
from compiletune.models.cache import KVCache
from compiletune.models.generation_config import eos_ids, load_generation_config
from compiletune.models.lora import apply_lora, block_adapter
from compiletune.models.vision.model import is_vision_checkpoint
from compiletune.sampling import Sampling, check_image_prompt, check_prompt, text_lines
from compiletune.train.build_model import resolve_model_args
from compiletune.train.device import pick_device, pick_dtype


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs [v] -> probs with everything outside the nucleus zeroed (not renormalised).

    The nucleus is the smallest set of most likely tokens whose total probability reaches
    `top_p`; the most likely token is always in it, so top_p -> 0 becomes greedy.
    """
    sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.cumsum(0) - sorted_probs  # probability of the tokens ranked above
    sorted_probs[before >= top_p] = 0.0
    return torch.zeros_like(probs).scatter_(0, order, sorted_probs)


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """logits [v] (any float dtype) -> the next token id."""
    if sampling.temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        probs = top_p_filter(probs, sampling.top_p)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


@torch.no_grad()
def generate_ids(
    model: Transformer,
    prompt: list[int],
    max_new_tokens: int,
    sampling: Sampling | None = None,
    stop_ids: set[int] | frozenset[int] = frozenset(),
    generator: torch.Generator | None = None,
    images: Any = None,
) -> Iterator[int]:
    """Yield up to `max_new_tokens` new token ids after `prompt`, stopping after a stop id.

    The prompt runs through the model once (prefill, with the prompt's `images`, an
    `ImageInputs`, for a vision-language model); every later step feeds only the newest
    token, whose keys and values join the cache. `generator` (default: seeded with
    `sampling.seed`) draws the samples; pass one to continue its stream across calls.
    """
    sampling = sampling or Sampling()
    if not prompt:
        raise UserError("the prompt encodes to no tokens; pass a non-empty --prompt")
    args = model.args
    total = len(prompt) + max_new_tokens
    if total > args.max_seq_len:
        raise UserError(
            f"the prompt ({len(prompt)} tokens) plus --max-new-tokens {max_new_tokens} exceeds "
            f"the model's {args.max_seq_len} positions; shorten the prompt or lower "
            "--max-new-tokens"
        )
    device = model.tok_embeddings.weight.device
    dtype = model.tok_embeddings.weight.dtype
    cache = KVCache(args, batch=1, max_len=total, dtype=dtype, device=device)
    generator = generator or torch.Generator().manual_seed(sampling.seed)
    tokens = torch.tensor([prompt], device=device)  # [1, s]
    for _ in range(max_new_tokens):
        prefill = {"images": images} if images is not None else {}
        hidden = model.hidden_states_cached(tokens, cache, **prefill)  # [1, s, d]
        images = None
        logits = model.logits(hidden[0, -1])  # [v]
        token = next_token(logits, sampling, generator)
        yield token
        if token in stop_ids:
            return
        tokens = torch.tensor([[token]], device=device)


def stop_ids(tokenizer: Any, model_dir: Path) -> set[int]:
    """eos of the tokenizer plus the eos ids of generation_config.json (chat models list their
    end-of-turn token there, e.g. Llama 3's <|eot_id|>)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    settings = load_generation_config(model_dir) or {}
    return ids | set(eos_ids(settings.get("eos_token_id")))


def adapter_base(folder: Path) -> tuple[Path | None, dict[str, Any]]:
    """The base of a LoRA adapter folder: (its model folder, or None for a preset drawn from the
    run's seed; the run's saved config, {} when there is no trainer_state.pt). The base is
    adapter_config.json's base_model_name_or_path: a folder (or a hub id in the local HF
    cache, see `resolve_model_path`), else a preset that the run's config reproduces."""

    config_file = folder / adapter_io.ADAPTER_CONFIG
    adapter_io.read_adapter_spec(folder)  # the config and weights are a LoRA adapter
    base = json.loads(config_file.read_text()).get("base_model_name_or_path")
    saved: dict[str, Any] = {}
    if (folder / "trainer_state.pt").is_file():
        saved = load_train_state(folder).get("config") or {}
    if not isinstance(base, str) or not base:
        raise UserError(
            f"{config_file} names no base model (base_model_name_or_path); set it to the base "
            "model folder the adapter was trained on"
        )
    if base in PRESETS and not Path(base).exists():
        if not saved:
            raise UserError(
                f"{folder} adapts the preset {base!r}, whose weights were drawn from the run's "
                "seed, and has no trainer_state.pt recording that seed; generate from the run's "
                "--merge export (OUTPUT_DIR/merged) instead"
            )
        return None, saved
    try:
        path = resolve_model_path(base)
    except UserError as e:
        raise UserError(
            f"{config_file} names the base model {base}, which is not here ({e}); put the base "
            "model folder at that path or set base_model_name_or_path to where it is"
        ) from e
    return path, saved


def load_lora_checkpoint(
    folder: Path,
    dtype: torch.dtype | None,
    device: torch.device,
    base: tuple[Path | None, dict[str, Any]] | None = None,
) -> Transformer:
    """A LoRA checkpoint (adapter folder) as a model: its base, loaded or drawn again from the
    run's seed (a preset base matches the run's when drawn on the same kind of device), with
    the adapters on top. `base`: what `adapter_base(folder)` gives, if already known."""

    base_dir, saved = base or adapter_base(folder)
    spec = adapter_io.read_adapter_spec(folder)
    dtype = dtype or pick_dtype(saved.get("dtype"), device)
    quantize = saved.get("quantize_base")
    base_dtype = pick_dtype(saved["base_dtype"], device) if saved.get("base_dtype") else dtype
    lora_kw: dict[str, Any] = {"dtype": dtype, "base_dtype": base_dtype, "quantize": quantize}
    seed = int(saved.get("seed") or 0)
    adapt = block_adapter(spec, **lora_kw, seed=seed)
    if base_dir is not None:
        model = from_hf(base_dir, dtype=dtype, device=device, on_block=adapt)
    else:  # a preset: the weights the run drew from its seed
        facts = SimpleNamespace(model_dir=None, preset=saved.get("model"), n_layers=None)
        facts.n_layers = saved.get("n_layers")
        args = resolve_model_args(SimpleNamespace(model=facts))
        model = build_model(args, device, dtype, init=True, seed=seed, on_block=adapt)
    apply_lora(model, spec, **lora_kw, blocks_adapted=True)
    adapter_io.load_adapter(model, folder)
    return model


def encode_prompt(tokenizer: Any, text: str, chat: bool, history: list[dict] | None = None):
    """Token ids of `text`: raw (with the tokenizer's bos, as HF encodes it), or with `chat` the
    conversation `history` + this user message rendered by the chat template, ending with the
    assistant's turn header."""
    if not chat:
        return tokenizer(text)["input_ids"]
    if getattr(tokenizer, "chat_template", None) is None:
        raise UserError(
            "--chat needs a tokenizer with a chat template and this one has none; drop --chat "
            "to continue raw text, or pass --tokenizer with a chat template"
        )
    messages = [*(history or []), {"role": "user", "content": text}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # The template writes bos itself where the model wants one.
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


class _Printer:
    """Prints decoded text as tokens arrive, holding back an incomplete UTF-8 character."""

    def __init__(self, tokenizer: Any, out: TextIO) -> None:
        self.tokenizer, self.out = tokenizer, out
        self.ids: list[int] = []
        self.shown = 0

    def add(self, token: int) -> None:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            self.out.write(text[self.shown :])
            self.out.flush()
            self.shown = len(text)

    def text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)


def reply(
    model: Transformer,
    tokenizer: Any,
    prompt: list[int],
    max_new_tokens: int,
    sampling: Sampling,
    stops: set[int],
    out: TextIO,
    generator: torch.Generator,
    images: Any = None,
) -> tuple[str, int, float]:
    """Stream one completion to `out`; returns (text, new tokens, seconds)."""
    printer = _Printer(tokenizer, out)
    t0 = time.perf_counter()
    tokens = generate_ids(model, prompt, max_new_tokens, sampling, stops, generator, images)
    for token in tokens:
        printer.add(token)
    out.write("\n")
    return printer.text(), len(printer.ids), time.perf_counter() - t0


def _generate_with_image(
    model_dir: str,
    image: str,
    prompt: str | None,
    max_new_tokens: int,
    sampling: Sampling,
    tokenizer_dir: str | None,
    dtype_name: str | None,
    out: TextIO,
    log: Callable[[str], None],
) -> list[str]:
    """`generate --image FILE --prompt TEXT`: one user turn holding the image and the text,
    rendered and expanded by the checkpoint's processor, its pixels prepared as training
    prepares a batch's, one reply."""
    check_image_prompt(image, prompt)
    assert prompt is not None, "checked"
    folder = resolve_model_path(model_dir)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if not is_vision_checkpoint(config):
        archs = ", ".join(config.get("architectures") or []) or "no architecture"
        raise UserError(
            f"--image needs a vision-language checkpoint (Gemma 3 4B and up, Gemma 4, Qwen3.5 "
            f"with their vision tower); --model-dir {model_dir} is {archs} (a LoRA adapter "
            "folder: merge it first with `compiletune export`)"
        )
    processor = load_processor(
        tokenizer_dir or folder, "--tokenizer" if tokenizer_dir else "--model-dir"
    )
    if processor is None:
        raise UserError(
            f"--image: {tokenizer_dir or folder} has no image processor "
            "(preprocessor_config.json); pass --tokenizer with the checkpoint's processor files"
        )
    device = pick_device()
    model = from_hf(folder, dtype=pick_dtype(dtype_name, device), device=device, vision=True)
    model = model.eval()
    ref = ImageRef(Path(image).expanduser().resolve(), "--image")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}]
    rendered = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = encode_image_pieces([(rendered, False)], [ref], processor, "--image")[0]
    images = ImagePrep(processor)([[ref.to_json()]])["images"]
    images = images.to(device, dtype=model.tok_embeddings.weight.dtype)
    tokenizer = processor.tokenizer
    stops = stop_ids(tokenizer, folder)
    generator = torch.Generator().manual_seed(sampling.seed)
    text, n, seconds = reply(
        model, tokenizer, ids, max_new_tokens, sampling, stops, out, generator, images
    )
    log(f"{n} tokens in {seconds:.2f}s ({n / seconds:.1f} tok/s)")
    return [text]


def _tokenizer_folder(folder: Path, base: Path | None) -> Path:
    """Where a LoRA checkpoint's tokenizer is: beside the adapter (a run saves it there), else
    in its base folder (a PEFT adapter folder may hold none)."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if base is not None and not any((folder / n).is_file() for n in names):
        return base
    return folder


def run_generate(
    model_dir: str,
    prompt: str | None,
    chat: bool,
    max_new_tokens: int,
    sampling: Sampling,
    tokenizer_dir: str | None = None,
    dtype_name: str | None = None,
    stdin: TextIO | None = None,
    out: TextIO | None = None,
    log: Callable[[str], None] | None = None,
    image: str | None = None,
) -> list[str]:
    """The `compiletune generate` command; returns the replies (for tests). `image`: a file
    the prompt asks about (a vision-language checkpoint; rendered with its chat template)."""

    out = out or sys.stdout
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    sampling.check(max_new_tokens)
    check_prompt(prompt, chat)
    if image is not None:
        return _generate_with_image(
            model_dir, image, prompt, max_new_tokens, sampling, tokenizer_dir, dtype_name, out, log
        )

    folder = resolve_model_path(model_dir)
    lora = adapter_io.is_adapter_folder(folder) and not (folder / "config.json").is_file()
    if not lora and not (folder / "config.json").is_file():
        raise UserError(
            f"--model-dir {model_dir} holds neither config.json nor a LoRA adapter "
            "(adapter_config.json); pass a checkpoint folder (e.g. OUTPUT_DIR/step_N) or a HF "
            "model folder"
        )
    device = pick_device()
    if lora:
        base, saved = adapter_base(folder)
        tokenizer_dir = tokenizer_dir or _tokenizer_folder(folder, base)
        tokenizer = load_tokenizer(tokenizer_dir, "--tokenizer")
        dtype = pick_dtype(dtype_name, device) if dtype_name else None
        model = load_lora_checkpoint(folder, dtype, device, (base, saved)).eval()
        stops = stop_ids(tokenizer, folder) | (stop_ids(tokenizer, base) if base else set())
    else:
        tokenizer = load_tokenizer(
            tokenizer_dir or folder, "--tokenizer" if tokenizer_dir else "--model-dir"
        )
        model = from_hf(folder, dtype=pick_dtype(dtype_name, device), device=device).eval()
        stops = stop_ids(tokenizer, folder)
    generator = torch.Generator().manual_seed(sampling.seed)  # one stream for the session

    replies = []
    if prompt is not None:  # one completion (raw, or one chat turn with --chat)
        ids = encode_prompt(tokenizer, prompt, chat)
        text, n, seconds = reply(
            model, tokenizer, ids, max_new_tokens, sampling, stops, out, generator
        )
        log(f"{n} tokens in {seconds:.2f}s ({n / seconds:.1f} tok/s)")
        return [text]
    # --chat without --prompt: a conversation on stdin, one user message per line.
    stdin = stdin or sys.stdin
    history: list[dict] = []
    log("chat: one message per line; an empty line or end of input quits")
    for line in text_lines(stdin):
        message = line.strip()
        if not message:
            break
        ids = encode_prompt(tokenizer, message, True, history)
        text, n, seconds = reply(
            model, tokenizer, ids, max_new_tokens, sampling, stops, out, generator
        )
        history += [{"role": "user", "content": message}, {"role": "assistant", "content": text}]
        replies.append(text)
    return replies
