"""One step of `--objective grpo` (docs/grpo.md): rollout, rewards, advantages, then
`--grpo-iterations` optimizer updates on those completions.

    prompts (--batch-size x --grad-accum, drawn like any rows)
      -> G = --num-generations completions each (rl/rollout.py, the trained weights, no copy;
         --batch-size prompts decoded together)
      -> rewards (rl/rewards.py), group-normalised advantages (loss/grpo.py)
      -> rows prompt + completion, targets only on the completion tokens
      -> old log-probs (once, when there is more than one update) and the reference's (--beta)
      -> per update: micro-batches of --batch-size prompts' rows -> loss -> backward
         -> clip -> optimizer step

Log-probabilities of the chosen tokens come from the loss head's chunked op (never
`[tokens, vocab]` logits), the policy's through the compiled head under --compile. The reference
is the frozen starting weights (a full fine-tune) or the LoRA model with its adapters off.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from compiletune import distributed as dist_
from compiletune.config import TrainConfig
from compiletune.data.prompts import Prompt
from compiletune.errors import UserError
from compiletune.hardware import machine_host_bytes
from compiletune.loss.grpo import GrpoOptions, advantages, grpo_loss
from compiletune.loss.head import IGNORE_INDEX
from compiletune.metrics import peak_memory_gib
from compiletune.models.cache import KVCache
from compiletune.models.generation_config import eos_ids
from compiletune.rl.rewards import Reward, RewardStopped, check_columns, load_rewards, score
from compiletune.rl.rollout import sample_prompts
from compiletune.train import nonfinite
from compiletune.train.build import Run
from compiletune.train.forward import forward_hidden
from compiletune.train.objective import frozen_eager, logprobs, reference_model
from compiletune.train.run_dir.signals import StopSignal
from compiletune.train.step import lr_factor
from compiletune.train.strategy import StepOutcome

Batch = dict[str, Tensor]
# The largest advantage a step may train on. A completion token's gradient is about its
# advantage over the completions, and the gradient norm squares and sums every parameter's in
# fp32 (max 3.4e38): past 1e12, some 1e11 parameters overflow it. Scaled advantages (the
# default) stay below sqrt(--num-generations); only --no-scale-rewards with rewards that spread
# past this reaches it.
ADVANTAGE_LIMIT = 1e12


def stop_ids(run: Run) -> set[int]:
    """The ids that end a completion: the tokenizer's eos and the checkpoint's end of turn."""
    ids = set(eos_ids(getattr(run.model, "generation_config", None)) or ())
    eos = getattr(run.tokenizer, "eos_token_id", None)
    if eos is not None:
        ids.add(int(eos))
    if not ids:
        raise UserError(
            "--objective grpo needs a tokenizer with an eos token (or a generation_config.json "
            "naming one) to end completions; pass a --tokenizer that has one"
        )
    return ids


class _StoppedElsewhere(RewardStopped):
    """Under FSDP: another rank's reward stopped the run (that rank prints its line)."""


class Grpo:
    """What a GRPO run keeps from step to step: its rewards and stop ids."""

    def __init__(self, run: Run, rewards: list[Reward] | None = None) -> None:
        """`rewards`: loaded already (the trainer loads them before the model, so a reward
        that cannot load stops the run first); else loaded from the config."""
        o = run.cfg.objective
        if rewards is None:
            rewards = load_rewards(o.reward or "", o.reward_weights)
        self.rewards: list[Reward] = rewards
        self.stop = stop_ids(run)
        self.timeout = o.reward_timeout
        self.group = o.num_generations
        # the line of a reward that stopped the run (RewardStopped), once one has
        self.stopped: str | None = None
        d = run.cfg.data
        for prompts in run.data or []:  # the rows the built-ins read, before the first step
            check_columns(self.rewards, prompts.prompts, f"--data {d.source}")
        if run.eval_set is not None:
            held = f"--eval-data {d.eval_data}" if d.eval_data else f"--data {d.source}"
            check_columns(self.rewards, run.eval_set.prompts, held)
        check_rollout_fits(run)
        # --compile: the rollout's decode step compiled once with the run's backend
        t = run.cfg.techniques
        self.decode_backend = t.compile_backend if t.compile else None
        self.opts = GrpoOptions(
            o.grpo_loss, o.epsilon_low, o.epsilon_high, o.beta or 0.0, o.max_new_tokens
        )

    # ---------------------------------------------------------------------------- rollout

    def rollout(
        self, run: Run, prompts: list[Prompt], step: int, indices: list[int]
    ) -> dict[str, Any]:
        """Completions of every prompt, their rewards and advantages. `indices`: the prompts'
        places in the step's global batches."""
        o = run.cfg.objective
        # one stream per (seed, step, prompt of the global batch): a resumed run, and the same
        # batch on any number of ranks, sample the same completions
        seeds = [
            ((run.cfg.run.seed * 1_000_003 + step) * 1_000_003 + i) % (1 << 63) for i in indices
        ]
        completions = self._sample(run, prompts, seeds)
        per_fn, total = self._score(run, prompts, completions)
        rewards = torch.tensor(total, dtype=torch.float32)
        adv = advantages(rewards, o.num_generations, scale=o.scale_rewards)
        self._check_range(per_fn, rewards, adv)
        return {"completions": completions, "per_fn": per_fn, "rewards": rewards, "adv": adv}

    def evaluate(self, run: Run, held: list[Prompt]) -> dict[str, Any]:
        """The held-out reward: --num-generations completions of each held-out prompt, sampled
        as the rollout samples (--temperature, --top-p) from a stream fixed per prompt, so that
        evaluations at different steps differ only by the weights and any number of ranks
        gives the same completions. Under FSDP each rank decodes every world-th prompt (a rank
        left short repeats one and drops its scores, so that all decode in step) and the sums
        are added up over ranks. `eval_reward` is the weighted sum's mean (what GRPO
        maximises), `eval_rewards` each function's mean, `eval_completion_len` the mean
        length."""
        if not held:  # every rank has the same held-out set: all return here
            return {}
        world, rank = (run.dp_world, run.dp_rank) if run.env is not None else (1, 0)
        mine = list(range(rank, len(held), world))
        turns = -(-len(held) // world)  # prompts per rank, the last ones padded
        padded = (mine or [0]) + [(mine or [0])[-1]] * (turns - len(mine))
        seeds = [(run.cfg.run.seed * 1_000_003 + i) % (1 << 63) + 7 for i in padded]
        completions = self._sample(run, [held[i] for i in padded], seeds)
        try:
            per_fn, total = self._score(run, [held[i] for i in padded], completions)
        except RewardStopped as e:  # the step is done: the loop stops before the next one
            self.halt(run, e, "the held-out evaluation")
            return {}
        kept = len(mine) * run.cfg.objective.num_generations  # the real prompts' rows
        sums = [sum(total[:kept]), sum(len(c) for c in completions[:kept]), float(kept)]
        # each function's sum and count of scored values (None: it did not apply)
        for v in per_fn:
            sums += [
                sum(x for x in v[:kept] if x is not None),
                sum(x is not None for x in v[:kept]),
            ]
        if world > 1:
            sums = dist_.all_reduce_sum(sums, run.device)
        n = sums[2]
        pairs = zip(sums[3::2], sums[4::2], strict=True)
        return {
            "eval_reward": sums[0] / n,
            "eval_rewards": {
                r.name: {"mean": v / max(1, c)}
                for r, (v, c) in zip(self.rewards, pairs, strict=True)
            },
            "eval_completion_len": sums[1] / n,
            "eval_prompts": len(held),
        }

    def _sample(self, run: Run, prompts: list[Prompt], seeds: list[int]) -> list[list[int]]:
        """--num-generations completions of each prompt (in order), each prompt's from its own
        seeded stream, with the trained weights (gathered whole under FSDP)."""
        o = run.cfg.objective
        going = None
        if run.env is not None:  # every rank decodes as long as any rank's rows go on

            def going(mine: bool) -> bool:
                return dist_.any_rank(mine, run.device)

        completions: list[list[int]] = []
        size = run.cfg.data.batch_size  # prompts decoded together: one update's micro-batch
        run.model.eval()
        try:
            with _gathered(run.model):
                for first in range(0, len(prompts), size):
                    generators = [
                        torch.Generator(device=run.device).manual_seed(seed)
                        for seed in seeds[first : first + size]
                    ]
                    completions += sample_prompts(
                        run.model,
                        [p.ids for p in prompts[first : first + size]],
                        o.num_generations,
                        o.max_new_tokens,
                        o.temperature,
                        o.top_p,
                        self.stop,
                        generators,
                        going,
                        compile_backend=self.decode_backend,
                        cuda_graphs=o.rollout_cuda_graphs,
                    )
        finally:
            run.model.train()
        return completions

    def _score(
        self, run: Run, prompts: list[Prompt], completions: list[list[int]]
    ) -> tuple[list[list[float | None]], list[float]]:
        """(each reward function's values, the weighted sums) of the completions of `prompts`
        (--num-generations each, in order), with the rows' extra columns. A None (the function
        does not apply to that completion) adds nothing to its sum. RewardStopped on every rank
        when a reward stopped the run on any."""
        g = run.cfg.objective.num_generations
        rows = [p for p in prompts for _ in range(g)]
        texts = run.tokenizer.batch_decode(completions, skip_special_tokens=True)
        columns = {
            k: [p.columns.get(k) for p in rows] for k in {k for p in prompts for k in p.columns}
        }
        stopped = None
        try:
            per_fn = [
                score(r, [p.text for p in rows], texts, completions, columns, self.timeout)
                for r in self.rewards
            ]
        except RewardStopped as e:
            stopped = e
        if run.env is not None and dist_.any_rank(stopped is not None, run.device):
            raise stopped or _StoppedElsewhere("a reward stopped the run on another rank")
        if stopped is not None:
            raise stopped
        total = [
            sum(
                r.weight * v[i]
                for r, v in zip(self.rewards, per_fn, strict=True)
                if v[i] is not None
            )
            for i in range(len(rows))
        ]
        return per_fn, total

    def _check_range(self, per_fn: list[list[float | None]], rewards: Tensor, adv: Tensor) -> None:
        """Finite rewards so large that the step's fp32 rewards, their group's variance or the
        advantages overflow would train on inf or NaN (or, divided by an infinite std, on
        nothing), and advantages past ADVANTAGE_LIMIT overflow the gradient norm: refused before
        any update, naming the reward with the largest values and their range (rather than a
        divergence blamed on the learning rate or the model)."""
        spread = rewards.view(-1, self.group).var(dim=1)
        finite = all(bool(torch.isfinite(t).all()) for t in (rewards, spread, adv))
        if finite and float(adv.abs().max()) <= ADVANTAGE_LIMIT:
            return
        weighted = [
            (abs(r.weight) * max((abs(x) for x in v if x is not None), default=0.0), r, v)
            for r, v in zip(self.rewards, per_fn, strict=True)
        ]
        _, reward, values = max(weighted, key=lambda t: t[0])
        scored = [x for x in values if x is not None]
        raise UserError(
            f"reward {reward.name!r} returned values from {min(scored):.3g} to {max(scored):.3g}"
            f" (weight {reward.weight:g}): too large for the step's fp32 rewards, advantages and "
            "gradients, which overflow; scale that reward down (to within +-1e6, say)"
        )

    def halt(self, run: Run, e: RewardStopped, where: str) -> None:
        """A reward stopped the run during `where`: one line (on the rank whose reward it was,
        and rank 0), kept in `stopped` for the loop, which then stops as on Ctrl-C."""
        self.stopped = f"{where}: {e}"
        main = run.env is None or run.env.is_main
        if main or not isinstance(e, _StoppedElsewhere):
            print(
                f"compiletune: {self.stopped}; the run stops as on Ctrl-C (a checkpoint of the "
                "last step completed, exit status 130)",
                flush=True,
            )

    # ---------------------------------------------------------------------------- rows

    @staticmethod
    def rows(prompts: list[Prompt], completions: list[list[int]], g: int, pad: int) -> Batch:
        """inputs/targets [n, L] (L: the longest prompt + completion less one), targets only
        on completion tokens."""
        seqs = [prompts[i // g].ids + c for i, c in enumerate(completions)]
        length = max(len(s) for s in seqs) - 1
        inputs = torch.full((len(seqs), length), pad, dtype=torch.long)
        targets = torch.full((len(seqs), length), IGNORE_INDEX, dtype=torch.long)
        for i, s in enumerate(seqs):
            n_prompt = len(prompts[i // g].ids)
            inputs[i, : len(s) - 1] = torch.tensor(s[:-1])
            targets[i, n_prompt - 1 : len(s) - 1] = torch.tensor(s[n_prompt:])
        return {"inputs": inputs, "targets": targets}

    # ---------------------------------------------------------------------------- the step

    def step(
        self, run: Run, prompts: list[Prompt], step: int, lr: float, indices: list[int]
    ) -> dict[str, Any]:
        """Rollout, then the updates (see the module docstring), on this rank's `prompts`
        (at `indices` of the global batches). Returns the step's values, over every rank."""
        o, cfg = run.cfg.objective, run.cfg
        t0 = time.perf_counter()
        roll = self.rollout(run, prompts, step, indices)
        t_gen = time.perf_counter() - t0
        g = o.num_generations
        pad = getattr(run.tokenizer, "pad_token_id", None) or 0
        batch = self.rows(prompts, roll["completions"], g, int(pad))
        per_micro = cfg.data.batch_size * g  # rows of one micro-batch
        micro = [
            {k: v[a : a + per_micro] for k, v in batch.items()}
            for a in range(0, batch["inputs"].shape[0], per_micro)
        ]
        micro = [{k: v.to(run.device) for k, v in mb.items()} for mb in micro]
        adv = roll["adv"].to(run.device).split(per_micro)
        completion = [mb["targets"] != IGNORE_INDEX for mb in micro]
        n_tokens = sum(int(c.sum()) for c in completion)
        n_all, tokens_all = len(roll["completions"]), n_tokens
        if run.env is not None:  # the normaliser of the whole global batch
            n_all, tokens_all = (
                int(v) for v in dist_.all_reduce_sum([n_all, n_tokens], run.device)
            )
        # FSDP averages gradients over ranks; the factor `world` makes that the global sum
        denominator = self._denominator(n_all, tokens_all) / run.world
        old = ref = None
        if o.grpo_iterations > 1:
            with frozen_eager():
                old = [self._logp(run.model, mb) for mb in micro]
        if self.opts.beta:
            ref = [self._reference_logp(run, mb) for mb in micro]
        run.optimizer.set_lr(lr)
        losses, clipped, kl, norms = [], 0.0, 0.0, []
        bad: str | None = None  # what was not finite (train/nonfinite.py)
        t1 = time.perf_counter()
        for _ in range(o.grpo_iterations):
            total = torch.zeros((), device=run.device)
            for i, mb in enumerate(micro):
                hidden = forward_hidden(run.model, mb, False)
                logp = run.head(hidden, mb["targets"], logprobs=True).view(mb["targets"].shape)
                before = old[i] if old is not None else logp.detach()
                loss, sums = grpo_loss(
                    logp,
                    before,
                    None if ref is None else ref[i],
                    adv[i],
                    completion[i],
                    self.opts,
                    denominator,
                )
                loss.backward()
                total += loss.detach()
                clipped += float(sums["clipped"])
                kl += float(sums.get("kl", 0.0))
            loss_value = float(total) / run.world
            if run.env is not None:
                loss_value = dist_.all_reduce_sum([loss_value], run.device)[0]
            norm, bad = self._update(run, loss_value)
            losses.append(loss_value)
            norms.append(norm)
            if bad is not None:  # not applied: the loop stops the run (or skips the step)
                break
        t_train = time.perf_counter() - t1
        if run.env is not None:  # every rank's completions, rewards and counts
            roll = _all_ranks(run, roll)
            clipped, kl = dist_.all_reduce_sum([clipped, kl], run.device)
        n_tokens = tokens_all
        lengths = [len(c) for c in roll["completions"]]
        n_updates = o.grpo_iterations
        record: dict[str, Any] = {
            "loss": losses[-1],
            "grad_norm": norms[-1],
            "reward": float(roll["rewards"].mean()),
            "reward_std": float(roll["rewards"].std()) if len(lengths) > 1 else 0.0,
            "rewards": {
                r.name: _reward_summary(v)
                for r, v in zip(self.rewards, roll["per_fn"], strict=True)
            },
            "advantage_std": float(roll["adv"].std()) if len(lengths) > 1 else 0.0,
            "completion_len": _mean(lengths),
            "completion_len_max": max(lengths),
            "completion_clipped": sum(
                1
                for c in roll["completions"]
                if len(c) == o.max_new_tokens and c[-1] not in self.stop
            )
            / len(lengths),
            "ratio_clipped": clipped / max(1, n_tokens * n_updates),
            "generate_tokens_per_s": sum(lengths) / max(t_gen, 1e-9),
            "train_tokens_per_s": n_updates * batch["inputs"].numel() / max(t_train, 1e-9),
            "tokens": int(batch["inputs"].numel()) * run.world,
            "targets": n_tokens,
            "nonfinite": bad,
        }
        if self.opts.beta:
            record["kl"] = kl / max(1, n_tokens * n_updates)
        return record

    def _denominator(self, n: int, n_tokens: int) -> float:
        """What the step's summed loss is divided by (loss/grpo.py): completions, completions
        x max_new_tokens, or completion tokens."""
        kind = self.opts.kind
        if kind == "grpo":
            return float(n)
        if kind == "dr_grpo":
            return float(n * self.opts.max_new_tokens)
        return float(max(1, n_tokens))

    @staticmethod
    def _logp(model: torch.nn.Module, mb: Batch) -> Tensor:
        hidden = forward_hidden(model, mb, False)
        return logprobs(model, hidden, mb["targets"]).view(mb["targets"].shape)

    def _reference_logp(self, run: Run, mb: Batch) -> Tensor:
        with reference_model(run) as model:
            return self._logp(model, mb)

    @staticmethod
    def _update(run: Run, loss: float) -> tuple[float, str | None]:
        """Clip, step, zero: one optimizer update. Returns the gradient norm and, when it or the
        `loss` is not finite, what was (SFT's check, train/nonfinite.py): the update is then
        not applied."""
        max_norm = run.cfg.optim.max_grad_norm or 0.0
        grads = [p.grad for p in run.params if p.grad is not None]
        if max_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(run.params, max_norm)
        else:
            norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        value = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        bad = None
        if nonfinite.finite(loss, value):
            run.optimizer.step()
        else:  # named before the gradients are zeroed (a collective under FSDP)
            bad = nonfinite.cause(run.model, loss, value, None, run.env)
        run.optimizer.zero_grad()
        return value, bad


@contextlib.contextmanager
def _gathered(model: torch.nn.Module) -> Iterator[None]:
    """Under FSDP every block's weights gathered whole for the rollout (decoding runs the
    blocks outside their forward hooks, one token at a time), resharded after; as it is
    otherwise."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in units:
        m.unshard()
    try:
        yield
    finally:
        for m in units:
            m.reshard()


def _all_ranks(run: Run, roll: dict[str, Any]) -> dict[str, Any]:
    """The rollout's completions, rewards and advantages of every rank, in rank order (for
    the step's metrics)."""
    import torch.distributed as dist

    mine = {k: roll[k] for k in ("completions", "per_fn")}
    mine["rewards"], mine["adv"] = roll["rewards"].tolist(), roll["adv"].tolist()
    parts: list[Any] = [None] * run.world
    dist.all_gather_object(parts, mine)
    return {
        "completions": [c for p in parts for c in p["completions"]],
        "per_fn": [sum((p["per_fn"][i] for p in parts), []) for i in range(len(mine["per_fn"]))],
        "rewards": torch.tensor([r for p in parts for r in p["rewards"]]),
        "adv": torch.tensor([a for p in parts for a in p["adv"]]),
    }


def _reward_summary(values: list[float | None]) -> dict[str, float]:
    """One function's values over a step: mean and std of those scored, and how many were None
    (the function did not apply)."""
    scored = [v for v in values if v is not None]
    return {"mean": _mean(scored), "std": _std(scored), "none": len(values) - len(scored)}


def check_rollout_fits(run: Run) -> None:
    """The rollout's --batch-size x --num-generations rows, decoded at once, fit the machine:
    their KV cache and logits (`rollout_bytes`, counted on the meta device) and
    the weights against the GPU's memory, or this machine's on a CPU. Refused before the first
    rollout allocates them, rather than an allocator's traceback (on a GPU the pre-flight
    estimate usually refused first)."""
    cfg, o = run.cfg, run.cfg.objective
    kv, temporaries = rollout_bytes(cfg, run.args)
    weights = sum(p.numel() * p.element_size() for p in run.model.parameters())
    if run.device.type == "cuda":
        have, where = torch.cuda.mem_get_info(run.device)[1], "the GPU's"
    else:
        have, where = machine_host_bytes(), "this machine's"
    if kv + temporaries + weights <= have:
        return
    gib, rows = 2**30, cfg.data.batch_size * o.num_generations
    raise UserError(
        f"--num-generations {o.num_generations}: the rollout decodes --batch-size "
        f"{cfg.data.batch_size} x {o.num_generations} = {rows:,} completions at once, whose KV "
        f"cache and logits need about {(kv + temporaries) / gib:,.1f} GiB beside "
        f"{weights / gib:.1f} GiB of weights, more than {where} {have / gib:.1f} GiB; lower "
        "--num-generations or --batch-size (`compiletune estimate-memory --objective grpo` "
        "counts the rollout)"
    )


def rollout_bytes(cfg: TrainConfig, args: Any) -> tuple[int, int]:
    """(KV cache, temporaries) in bytes of GRPO's rollout of --batch-size prompts' G
    completions each, decoded together over --seq-len positions: the cache (on the meta
    device: nothing is allocated), the rows' fp32 logits, probabilities and cdf, and one decode
    step's attention temporaries. `check_rollout_fits` checks them against the machine before
    the first rollout; the memory estimate counts them beside the step (estimate/estimator.py)."""
    size = 4 if (cfg.model.dtype or "bf16") == "fp32" else 2
    dtype = torch.float32 if size == 4 else torch.bfloat16
    rows = cfg.data.batch_size * cfg.objective.num_generations
    cache = KVCache(args, rows, cfg.data.seq_len, dtype, "meta")
    kv = sum(t.numel() * t.element_size() for t, _ in cache.sized())
    temporaries = 3 * rows * args.vocab_size * 4  # fp32 logits, probabilities, cdf
    temporaries += _decode_attention_bytes(args, rows, cfg.data.seq_len, size)
    return kv, temporaries


def _decode_attention_bytes(args: Any, rows: int, positions: int, size: int) -> int:
    """The largest attention temporaries of one decode step over a static cache of `positions`:
    every head's keys and values over the whole cache, where the layer makes them (grouped
    query heads repeated; MLA's latents expanded: the projection's keys and values, then the
    keys joined with their rope part)."""
    worst = 0
    for i in range(args.n_layers):
        kind = args.layer_kind(i)
        if kind == "linear":
            continue
        if args.kv_rank:  # models/mla.py `expand`
            width = args.hd + (args.hd - args.rotary_dim) + args.v_head_dim
        elif args.kv_heads_of(kind) != args.n_heads:  # models/decoder.py `_repeat_kv`
            width = 2 * args.head_dim_of(kind)
        else:
            continue
        worst = max(worst, rows * args.n_heads * positions * width * size)
    return worst


def _mean(values: list[float] | list[int]) -> float:
    return statistics.fmean(values) if values else 0.0


def _std(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


class GrpoStep:
    """--objective grpo's step strategy (strategy.py): this rank's prompts of the step's global
    batches -> `Grpo.step` (rollout, rewards, updates) -> the metrics line."""

    def __init__(self, run: Run, grpo: Grpo) -> None:
        self.run, self.grpo = run, grpo

    def one_step(self, step: int, stop: StopSignal) -> StepOutcome | None:
        """None when a reward stopped the run (RewardStopped: the step is abandoned, `stop`
        set)."""
        run, cfg, grpo = self.run, self.run.cfg, self.grpo
        t0 = time.perf_counter()
        if grpo.stopped is not None:  # a reward stopped the run during the last evaluation
            stop.requested = stop.agreed = True
            return None
        # every rank draws the same global batches (world x --batch-size prompts each) and
        # takes its slice of each, as in any run
        b = cfg.data.batch_size
        position = run.batches.state_dict()
        prompts: list[Prompt] = []
        indices: list[int] = []
        for k in range(cfg.data.grad_accum):
            drawn = run.batches.next()
            mine = range(run.rank * b, (run.rank + 1) * b)
            prompts += [drawn[i] for i in mine]
            indices += [k * b * run.world + i for i in mine]
        lr = cfg.optim.lr * lr_factor(step, cfg)
        try:
            values = grpo.step(run, prompts, step, lr, indices)
        except RewardStopped as e:
            # the rewards come before any update: the weights are the last step's, and the
            # prompts go back, so that a resume draws them again and runs what this run would
            run.batches.load_state_dict(position)
            grpo.halt(run, e, f"step {step + 1}")
            stop.requested = stop.agreed = True
            return None
        dt = time.perf_counter() - t0
        nonfinite = values.pop("nonfinite")
        record = {"step": step + 1, "lr": lr, **values}
        record.update(
            tokens_per_s=values["tokens"] / dt,
            step_time_s=dt,
            peak_mem_gib=peak_memory_gib(run.device),
            epoch=run.batches.epoch,
            padding=0,
        )
        if nonfinite is not None:
            record["nonfinite"] = nonfinite
            record["applied"] = False
        stop.agreed = bool(stop.requested)
        loss = values["loss"] if nonfinite is None else None
        return StepOutcome(record, values["tokens"], values["targets"], loss=loss)
