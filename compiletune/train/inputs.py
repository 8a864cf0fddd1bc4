"""What a run reads before its model is built (`read_inputs`): the tokenizer, the training rows
of each --data source with its mixture weight, the held-out rows, and with --resume the
checkpoint's training state; or, for a build that reads nothing (`BuildOptions.read_inputs`),
the facts the data would give, from the model's shapes (`model_facts`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from compiletune import distributed as dist_
from compiletune.checkpoint import adapter_io
from compiletune.checkpoint import steps as ckpt
from compiletune.config import RunFacts, TrainConfig
from compiletune.data.image_batch import ImagePrep
from compiletune.data.pairs import PairRows, read_pairs
from compiletune.data.prompts import Prompt, PromptSet, read_prompts
from compiletune.data.rows import PackedData, check_rows, pack_store, split_indices
from compiletune.data.sources import parse_sources
from compiletune.data.token_cache import cached_store, check_vocabulary
from compiletune.data.token_store import ExampleRows, MemoryStore, Store
from compiletune.data.tokenizer import byte_tokenizer, load_processor, load_tokenizer
from compiletune.errors import UserError
from compiletune.models import ModelArgs
from compiletune.models.hf_config import load_hf_config
from compiletune.models.lora import LoRASpec
from compiletune.models.vision.model import is_vision_checkpoint
from compiletune.train.build_model import tower_lora, wants_vision


def resolve_tokenizer(cfg: TrainConfig) -> Any:
    if cfg.model.tokenizer is not None:
        return load_tokenizer(cfg.model.tokenizer, "--tokenizer")
    if cfg.model.model_dir is not None:
        return load_tokenizer(cfg.model.model_dir)
    # Random-init presets train on raw bytes: no tokenizer files needed, any vocab >= 259 fits.
    return byte_tokenizer()


def check_shapes(cfg: TrainConfig, args: ModelArgs, tokenizer: Any) -> None:
    if len(tokenizer) > args.vocab_size:
        raise UserError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary is "
            f"{args.vocab_size}; pass a --tokenizer that matches the model"
        )
    seq_len = cfg.data.seq_len
    if seq_len > args.max_seq_len:
        raise UserError(
            f"--seq-len {seq_len} is beyond the model's {args.max_seq_len} positions; "
            f"pass --seq-len {args.max_seq_len} or less"
        )
    if cfg.optim.router_bias_update_rate and args.router_score != "sigmoid":
        raise UserError(
            "--router-bias-update-rate nudges the correction bias of DeepSeek-V3-style "
            "(sigmoid) routers; this model has none, so leave it 0"
        )


@dataclass
class Inputs:
    """What a run reads before its model is built (nothing, without `read_inputs`)."""

    facts: RunFacts
    tokenizer: Any = None
    data: list[PackedData] | None = None  # one per --data source
    eval_set: Any = None  # as Run.eval_set
    resume_from: Path | None = None
    state: dict[str, Any] | None = None
    weights: list[float] | None = None  # the sources' mixture weights


def read_inputs(
    cfg: TrainConfig, env: dist_.DistEnv | None, args: ModelArgs, spec: LoRASpec | None
) -> Inputs:
    """Tokenizer, packed data, and with --resume the latest checkpoint and its state."""
    world = env.world if env is not None else 1
    tokenizer = resolve_tokenizer(cfg)
    check_shapes(cfg, args, tokenizer)
    say = print if env is None or env.is_main else (lambda line: None)
    if cfg.objective.objective == "grpo":
        datas, weights, eval_set = build_prompts(cfg, tokenizer, say)
    elif cfg.objective.objective in ("dpo", "ipo", "simpo"):
        datas, weights, eval_set = build_pairs(cfg, tokenizer, say)
    else:
        datas, weights, eval_set = build_data(cfg, tokenizer, say, args.vocab_size)
        check_vision(cfg, datas)
    packs = any(getattr(d, "packs_documents", lambda: False)() for d in datas)
    rows = sum(d.rows for d in datas)
    facts = RunFacts(
        args.vocab_size,
        packs_documents=packs,
        rows=rows,
        world=world,
        router_aux_coef=args.router_aux_coef,
    )
    inputs = Inputs(facts, tokenizer, datas, eval_set, weights=weights)
    if cfg.run.resume:
        inputs.resume_from = ckpt.pick_resume(Path(cfg.run.output_dir), cfg.run.resume_from, say)
        inputs.state = ckpt.load_train_state(inputs.resume_from)
        ranks = world if env is not None else None
        ckpt.check_resumable(inputs.resume_from, inputs.state, ranks, cfg.parallel.sharding)
        # the adapters as this run builds them: a text-only run drops the tower's that
        # --train-vision implies (its checkpoint holds none)
        built = tower_lora(cfg, spec, wants_vision(cfg, holds_images(datas)))
        adapter_io.check_resume_kind(inputs.resume_from, built)
    return inputs


def holds_images(datas: list | None) -> bool:
    """Does any of a run's training sources hold images (image conversations)?"""
    return any(getattr(getattr(d, "store", None), "images", None) for d in datas or [])


def check_vision(cfg: TrainConfig, datas: list) -> None:
    """Image data needs a model whose vision tower compiletune loads: --model-dir a
    vision-language checkpoint (Gemma 3 4B and up, Gemma 4, Qwen3.5 with their towers), and
    rows that stay whole on one rank (no --cp)."""
    if not holds_images(datas):
        return
    folder = cfg.model.model_dir
    config = load_hf_config(folder) if folder is not None else {}
    if not is_vision_checkpoint(config):
        what = f"--model-dir {folder}" if folder else f"the random-init preset {cfg.model.preset}"
        raise UserError(
            f"--data {cfg.data.source} holds images, and {what} has no vision tower "
            "compiletune loads; train a vision-language checkpoint (Gemma 3 4B and up, Gemma 4, "
            "Qwen3.5) or drop the image parts"
        )
    if cfg.parallel.cp > 1:  # a piece of a row holds only part of an image's tokens
        raise UserError(
            f"--cp {cfg.parallel.cp} does not split image rows yet (an image's tokens would be "
            "cut between ranks, each merging only part of its features); drop --cp for "
            f"--data {cfg.data.source} (--fsdp shards the model, --ac and --offload-activations "
            "make long rows fit)"
        )


def model_facts(cfg: TrainConfig, args: ModelArgs, world: int) -> RunFacts:
    """The facts a build that reads no data fills `cfg`'s defaults from (then its params'
    dtype): the model's shapes, the world, and the objective's rows as the data would be."""
    return RunFacts(
        args.vocab_size,
        # pair rows hold two sequences each (the estimator's random pairs): masked as in a run
        packs_documents=cfg.objective.objective in ("dpo", "ipo", "simpo"),
        world=world,
        router_aux_coef=args.router_aux_coef,
    )


def build_data(
    cfg: TrainConfig, tokenizer: Any, say: Any = print, vocab: int | None = None
) -> tuple[list[PackedData], list[float], PackedData | None]:
    """The training rows of each --data source (with its mixture weight), and the held-out rows
    (--val-split or --eval-data) if any. Sources are read from the token cache, tokenised
    first if needed (data/token_cache.py); an entry holding a token id outside the model's `vocab`
    is refused."""
    d = cfg.data
    opts = _read_options(cfg, say)
    prep = ImagePrep(opts["processor"]) if opts["processor"] is not None else None
    sources = parse_sources(d.source)
    stores: list[Store] = [cached_store(src, tokenizer, **opts) for src, _ in sources]
    if vocab is not None:
        for store in stores:
            check_vocabulary(store, vocab)
    held: Store | None = None
    held_name = None
    if d.val_split > 0:
        # Whole documents are held out before packing, so none is on both sides.
        parts = []
        for i, store in enumerate(stores):
            train, out = split_indices(store.n_docs, d.val_split, cfg.run.seed)
            parts.append((store, out))
            stores[i] = store.subset(train)
        held = MemoryStore.from_stores(parts)
        held_name = f"the --val-split {d.val_split} held-out examples"
    elif d.eval_data is not None:
        held_opts = {**opts, "split": d.eval_split or d.data_split}
        held = read_held_out(d.eval_data, tokenizer, held_opts, vocab)
        held_name = f"--eval-data {d.eval_data}"
    datas = [
        check_rows(pack_store(store, d.seq_len, d.packing, d.truncation, prep), src)
        for store, (src, _) in zip(stores, sources, strict=True)
    ]
    for data, (src, _) in zip(datas, sources, strict=True):
        if isinstance(data, ExampleRows):
            say(f"{src}: {data.summary()}")
    eval_set = None if held is None else pack_held_out(cfg, held, held_name, prep)
    return datas, [w for _, w in sources], eval_set


def _read_options(cfg: TrainConfig, say: Any) -> dict[str, Any]:
    """How `cached_store` reads a source of this run (layout, columns, split, roles, cache)."""
    d = cfg.data
    return {
        "fmt": d.data_format,
        "columns": d.data_columns,
        "split": d.data_split,
        "roles": d.data_roles,
        "cache_dir": d.cache_dir,
        "workers": d.data_workers,
        "say": say,
        "processor": image_processor(cfg),
        "skip_bad_images": d.skip_bad_images,
    }


def image_processor(cfg: TrainConfig) -> Any:
    """The checkpoint's processor for image conversations: --tokenizer's, else --model-dir's;
    None for a checkpoint without one (and random-init presets), whose data holds no images."""
    folder = cfg.model.tokenizer or cfg.model.model_dir
    if folder is None:
        return None
    return load_processor(folder, "--tokenizer" if cfg.model.tokenizer else "--model-dir")


def read_held_out(
    source: str, tokenizer: Any, opts: dict[str, Any], vocab: int | None = None
) -> Store:
    """The examples of a held-out SOURCE (one, or several joined), from the token cache."""
    evals = [cached_store(src, tokenizer, **opts) for src, _ in parse_sources(source)]
    for store in evals if vocab is not None else []:
        check_vocabulary(store, vocab)
    if len(evals) == 1:
        return evals[0]
    return MemoryStore.from_stores([(e, np.arange(e.n_docs)) for e in evals])


def pack_held_out(
    cfg: TrainConfig, held: Store, name: str, images: ImagePrep | None = None
) -> PackedData:
    """Held-out examples packed into rows as training packs them, the tail that does not fill a
    row padded into a last one (so every held-out target counts)."""
    d = cfg.data
    rows = pack_store(held, d.seq_len, d.packing, d.truncation, images, keep_tail=True)
    return check_rows(rows, name)


def build_eval_set(
    cfg: TrainConfig,
    tokenizer: Any,
    say: Any = print,
    vocab: int | None = None,
    max_examples: int | None = None,
) -> tuple[PackedData, int]:
    """`cfg.data.source` read as held-out data (`compiletune eval`): its rows, packed and masked
    as --eval-data would be, and how many examples they hold (the first `max_examples`)."""
    opts = _read_options(cfg, say)
    held = read_held_out(cfg.data.source, tokenizer, opts, vocab)
    if max_examples is not None and max_examples < held.n_docs:
        held = held.subset(np.arange(max_examples))
    prep = ImagePrep(opts["processor"]) if opts["processor"] is not None else None
    return pack_held_out(cfg, held, f"--data {cfg.data.source}", prep), held.n_docs


def build_prompts(cfg: TrainConfig, tokenizer: Any, say: Any = print) -> tuple[list, None, Any]:
    """--objective grpo: the prompts (data/prompts.py) for training and, with --val-split or
    --eval-data, held-out ones for the reward evaluation."""
    d = cfg.data

    def read(source: str, split: str | None) -> list[Prompt]:
        limit = d.seq_len - cfg.objective.max_new_tokens
        return read_prompts(source, tokenizer, limit, d.data_columns, split, d.data_roles, say)

    prompts, held = read(d.source, d.data_split), None
    if d.val_split > 0:
        # a fraction of the distinct prompts, with every row of each: a prompt that appears in
        # several rows is never trained on and evaluated at once; each is evaluated once
        rows: dict[str, list[int]] = {}
        for i, p in enumerate(prompts):
            rows.setdefault(p.text, []).append(i)
        groups = list(rows.values())
        train, out = split_indices(len(groups), d.val_split, cfg.run.seed)
        held = [prompts[groups[g][0]] for g in out]
        prompts = [prompts[i] for g in train for i in groups[g]]
    elif d.eval_data is not None:
        held = read(d.eval_data, d.eval_split or d.data_split)
        # the rewards read the rows' columns: missing ones would stop the run at its end
        missing = sorted(
            {k for p in prompts for k in p.columns} - {k for p in held for k in p.columns}
        )
        if missing:
            raise UserError(
                f"--eval-data {d.eval_data}: the held-out prompts lack the column(s) "
                f"{', '.join(missing)} that --data's have (the rewards may read them); add them"
            )
    return [PromptSet(prompts)], None, None if held is None else PromptSet(held)


def build_pairs(cfg: TrainConfig, tokenizer: Any, say: Any = print) -> tuple[list, list, Any]:
    """The rows of preference pairs (data/pairs.py) for training and, with --val-split or
    --eval-data, for evaluation."""
    d = cfg.data
    pairs = read_pairs(d.source, tokenizer, d.data_columns, d.data_split, say, d.data_roles)
    held = None
    if d.val_split > 0:
        train, out = split_indices(len(pairs), d.val_split, cfg.run.seed)
        pairs, held = [pairs[i] for i in train], [pairs[i] for i in out]
    elif d.eval_data is not None:
        split = d.eval_split or d.data_split
        held = read_pairs(d.eval_data, tokenizer, d.data_columns, split, say, d.data_roles)
    rows = PairRows(pairs, d.seq_len)
    say(f"preference pairs: {rows.n_pairs} in {rows.rows} rows of {d.seq_len} tokens")
    return [rows], [1.0], None if held is None else PairRows(held, d.seq_len)


# ----------------------------------------------------------------------------- model
