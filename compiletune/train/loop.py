"""`compiletune train`: `train(cfg)` -> `Trainer(cfg, env).train()`.

The loop reads as calls: draw a batch -> `train_step` -> (evaluate) -> log -> (checkpoint) ->
stop on a signal or at the last step. Building is `build.py`'s, the step is `step.py`'s, and
the run folder's duties are `run_dir/`'s.
"""

from __future__ import annotations

import hashlib
import math
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from compiletune import distributed as dist_
from compiletune import harness, plot, recipes, torch_internals
from compiletune.checkpoint import adapter_io
from compiletune.checkpoint import steps as ckpt
from compiletune.config import TrainConfig
from compiletune.errors import UserError, show
from compiletune.loggers import check_available, open_loggers, parse_loggers
from compiletune.metrics import MetricsLog, peak_memory_gib
from compiletune.models import num_params
from compiletune.models.hf_config import brief
from compiletune.rl.rewards import load_rewards
from compiletune.train import grpo, objective
from compiletune.train.build import Run, build_run
from compiletune.train.device import pick_device
from compiletune.train.nonfinite import Facts, advice
from compiletune.train.objective import evaluate_pairs
from compiletune.train.run_dir import closing, contents, disk, hub_pin, resume, signals
from compiletune.train.run_dir.lock import OutputLock
from compiletune.train.step import evaluate, weights_norm
from compiletune.train.strategy import StepStrategy, SupervisedStep

# A checkpoint is a good one to continue from when its weights' norm is at most this many times
# their norm when the run (this invocation) started; fine-tuning moves it by a few percent.
GOOD_NORM_GROWTH = 4.0


def train(cfg: TrainConfig, estimate_gib: float | None = None) -> dict[str, Any]:
    """Run a training job described by `cfg`; returns the run summary (the same on every rank).

    With --fsdp every process of the job runs this function; rank 0 alone writes the metrics,
    the config and the summary, and prints. `estimate_gib`: the pre-flight's estimated peak,
    reported beside the measured one (before_train.py runs the pre-flight on a GPU, and plans
    --offload-activations auto, before calling this).
    """
    recipes.check_no_placeholders(cfg)
    cfg = hub_pin.align_hub_specs(cfg)  # --resume naming a Hub repo again: the run's commit
    env = dist_.init_distributed(pick_device().type) if cfg.parallel.fsdp else None
    main = env is None or env.is_main
    try:
        # One run per folder: rank 0 holds the lock; every rank learns whether it got it.
        lock = OutputLock(Path(cfg.run.output_dir), enabled=main, say=print)
        refusal = None
        try:
            lock.__enter__()
        except UserError as e:
            refusal = e
        if env is not None and dist_.any_rank(refusal is not None, env.device):
            refusal = refusal or UserError("rank 0 could not take the --output-dir (see above)")
        if refusal is not None:
            raise refusal
        try:
            return _train_locked(cfg, env, lock, estimate_gib)
        finally:
            lock.release()
    except BaseException as e:
        if env is not None:
            # Every rank prints its line before the group closes: torchrun stops the other
            # ranks as soon as one exits. And the frames that hold the model are cleared, so it
            # is freed while the group lives (destroying gloo under live FSDP state aborts).
            if isinstance(e, UserError):
                show(e)
            traceback.clear_frames(e.__traceback__)
        raise
    finally:
        if env is not None:
            dist_.shutdown(env)


def _train_locked(
    cfg: TrainConfig,
    env: dist_.DistEnv | None,
    lock: OutputLock,
    estimate_gib: float | None,
) -> dict[str, Any]:
    trainer = Trainer(cfg, env, lock)
    trainer.estimate_peak_gib = estimate_gib  # the pre-flight's, beside the measured
    return trainer.train()


def _eval_text(record: dict[str, Any]) -> str:
    """The held-out figures of a progress line: loss and perplexity, a preference run's
    reward accuracy, or grpo's held-out reward."""
    if "eval_reward" in record:
        return f" eval_reward {record['eval_reward']:.3f}"
    if "eval_ppl" in record:
        return f" eval_loss {record['eval_loss']:.4f} ppl {record['eval_ppl']:.2f}"
    return (
        f" eval_loss {record['eval_loss']:.4f} reward accuracy {record['eval_reward_accuracy']:.3f}"
    )


def pin_hub_specs(cfg: TrainConfig, env: dist_.DistEnv | None) -> TrainConfig:
    """Hub models and datasets downloaded once the options are known good, and pinned to their
    commit (hub_pin.pin_hub_specs). Every process resolves them; should a branch move while the
    job starts, the processes would train on different commits: refused."""
    box: list[TrainConfig] = []
    dist_.agree(dist_.attempt(lambda: box.append(hub_pin.pin_hub_specs(cfg))), str)
    pinned = box[0]
    if env is not None and env.world > 1:
        key = hashlib.sha256(hub_pin.hub_specs(pinned).encode()).digest()[:6]
        if len(set(dist_.gather_floats(float(int.from_bytes(key, "big")), env.device))) > 1:
            raise UserError(
                "the processes resolved different Hub commits (a repository changed while the "
                "job started); pass each Hub id with @COMMIT, or run again"
            )
    return pinned


class Trainer:
    """One process's part of a training job: set up, then `train()`."""

    def __init__(
        self, cfg: TrainConfig, env: dist_.DistEnv | None, lock: OutputLock | None = None
    ) -> None:
        self.cfg, self.env = cfg, env
        self.estimate_peak_gib: float | None = None
        self.peak_floor = 0.0  # the training's peak before --eval-tasks reset the GPU's counter
        self.main = env is None or env.is_main
        self.graphs_before = torch_internals.dynamo_graphs_compiled()
        # Everything that can be wrong is checked before anything is written.
        world = env.world if env is not None else 1
        self.out, resume_notes = contents.check_output_dir(cfg, world)
        self.log_names = parse_loggers(cfg.run.log)
        check_available(self.log_names)
        # --eval-tasks: lm-eval's task names looked up now, so a wrong one is refused here
        self.tasks = harness.TrainingTasks(cfg, self.out, self.say) if cfg.run.eval_tasks else None
        rewards = None
        if cfg.objective.objective == "grpo":  # a reward that cannot load: before the model
            rewards = load_rewards(cfg.objective.reward or "", cfg.objective.reward_weights)
        if cfg.objective.rollout_cuda_graphs and pick_device().type != "cuda":
            raise UserError("--rollout-cuda-graphs replays CUDA graphs; there is no CUDA device")
        cfg = self.cfg = pin_hub_specs(cfg, env)
        self.run: Run = build_run(cfg, env)
        if cfg.objective.precompute_ref:
            objective.precompute_reference(self.run, self.say)
        self.grpo = grpo.Grpo(self.run, rewards) if rewards is not None else None
        self.strategy: StepStrategy = (
            grpo.GrpoStep(self.run, self.grpo)
            if self.grpo is not None
            else SupervisedStep(self.run, env, self.peak_gib)
        )
        if self.run.resume_from is not None:
            pending = resume.merge_pending(cfg, self.out)
            resume.check_length(cfg.run.max_steps, self.run.start_step, pending)
            if pending and self.run.start_step == cfg.run.max_steps:
                resume_notes.append(
                    f"--resume: the run is at its last step ({cfg.run.max_steps}); writing the "
                    f"merged model it did not finish ({self.out / 'merged'})"
                )
        if self.main:
            contents.prepare_output_dir(cfg, self.out)
            if lock is not None:
                lock.keep_folder()
        for note in resume_notes:
            self.say(note)
        self.step = self.run.start_step
        self.last_saved: Path | None = self.run.resume_from
        # The newest checkpoint fit to continue from (see `save`), and the weights' norm when
        # this invocation started, the yardstick of "fit".
        self.last_good: Path | None = self.run.resume_from
        self.start_norm: float | None = None
        self.skipped_steps = 0
        self.checkpoint_bytes = disk.checkpoint_bytes(self.run, self.last_saved)
        if self.main:
            warning = disk.space_warning(self.out, self.checkpoint_bytes)
            if warning:
                self.say(warning)
        self.first_loss = self.last_loss = float("nan")
        self.last_eval: dict[str, Any] | None = None
        self.eval_seconds = 0.0
        # this invocation's work: real input tokens, padding beside them, target tokens
        self.tokens_done = self.padding_done = self.targets_done = 0
        self.t_start = time.perf_counter()

    def say(self, text: str) -> None:
        if self.main:
            print(text, flush=True)

    # ------------------------------------------------------------------------- the loop

    def train(self) -> dict[str, Any]:
        cfg, run = self.cfg, self.run
        self.banner()
        resumed = run.resume_from is not None
        metrics, loggers = None, []
        if self.main:
            at = self.step if resumed else None
            metrics = MetricsLog(self.out / "metrics.jsonl", resume_step=at)
            loggers = open_loggers(self.log_names, self.out, cfg.to_dict(), at)
        interactive = sys.stderr.isatty() and self.main
        bar = tqdm(
            total=cfg.run.max_steps,
            initial=self.step,
            disable=not interactive,
            unit="step",
            ncols=100,
        )
        self.start_norm = weights_norm(run.params)
        self.t_start = time.perf_counter()
        try:
            with signals.StopSignal(distributed=self.env is not None) as stop:
                run.model.train()
                while self.step < cfg.run.max_steps and not stop.should_stop():
                    compile_t0 = self.announce_compile()
                    record = self.one_step(stop)
                    if record is None:  # a reward stopped the run (train/grpo.py): saved below
                        break
                    self.compiled(compile_t0)
                    at_end = self.step == cfg.run.max_steps or stop.should_stop()
                    # a signal's grace period goes to the save: grpo's evaluation decodes
                    stopping = stop.should_stop() and self.grpo is not None
                    if "nonfinite" not in record and not stopping:
                        self.maybe_evaluate(record, at_end)
                    if metrics is not None:
                        metrics.write(record)
                    for logger in loggers:
                        logger.log(record)
                    if "nonfinite" in record:
                        self.handle_nonfinite(record)
                    self.progress(record, bar, interactive)
                    if self.step == run.start_step + 1:
                        self.write_dump()  # every region has compiled by now
                    if cfg.run.save and contents.checkpoint_due(cfg, self.step):
                        self.last_saved = self.save(final=False)
                        self.run_tasks(final=False)
                self.stop_data_worker()  # the final save keeps the batches taken
                train_peaks = self.gather_peaks()  # before the final save adds its own
                merged = self.finish()
        finally:
            self.stop_data_worker()
            bar.close()
            if metrics is not None:
                metrics.close()
            for logger in loggers:
                logger.close()
        # A stop signal from here on finds the run finished: it waits for the summary, and is
        # then answered with a line instead of ending the process silently.
        with signals.LateSignal() as late:
            summary = self.summarise(time.perf_counter() - self.t_start, train_peaks, merged)
            late.finished(summary["interrupted"])
            if late.received is not None:
                self.say(
                    f"compiletune: {late.received} arrived after the run had finished; nothing "
                    f"was lost ({self.out / 'summary.json'} is written)"
                )
        return summary

    def stop_data_worker(self) -> None:
        """An image run's data worker stops (data/prefetch.py): no thread outlives the run."""
        close = getattr(self.run.batches, "close", None)
        if close is not None:
            close()

    def one_step(self, stop: signals.StopSignal) -> dict[str, Any] | None:
        """One optimizer step through the objective's strategy (strategy.py), its counters kept
        here, and its metrics line. None: grpo's step was abandoned, a reward having stopped
        the run (`stop` is set)."""
        outcome = self.strategy.one_step(self.step, stop)
        if outcome is None:
            return None
        self.step += 1
        self.tokens_done += outcome.tokens
        self.padding_done += outcome.padding
        self.targets_done += outcome.targets
        if outcome.loss is not None:
            if self.step == self.run.start_step + 1 or math.isnan(self.first_loss):
                self.first_loss = outcome.loss
            self.last_loss = outcome.loss
        return outcome.record

    def handle_nonfinite(self, record: dict[str, Any]) -> None:
        """After a step that was not finite: skip it (--skip-nonfinite) or stop, naming the
        last checkpoint written, which holds finite weights (every save checks)."""
        self.skipped_steps += 1
        allowed = self.cfg.run.skip_nonfinite
        if record["applied"] or self.skipped_steps > allowed:
            what = (
                "the update was applied during backward (--optimizer-in-backward)"
                if record["applied"]
                else "its update was not applied"
            )
            skipped = f" after skipping {allowed} such steps" if allowed else ""
            # updates this invocation applied before this step (the skipped ones were not)
            before = record["step"] - 1 - self.run.start_step - (self.skipped_steps - 1)
            updated = before > 0 or bool(record["applied"])
            raise UserError(
                f"step {record['step']}: {record['nonfinite']}; {what}. Stopped{skipped}: "
                f"{self.restart_advice(updated, skip_hint=not record['applied'])}"
            )
        self.say(
            f"step {record['step']}: {record['nonfinite']}; the step was skipped "
            f"({self.skipped_steps} of --skip-nonfinite {allowed})"
        )

    def maybe_evaluate(self, record: dict[str, Any], at_end: bool) -> None:
        """Held-out loss at --eval-every and at the end, onto this step's metrics line."""
        every = self.cfg.data.eval_every
        if self.run.eval_set is None or not (at_end or (every and self.step % every == 0)):
            return
        t0 = time.perf_counter()
        cfg, run = self.cfg, self.run
        if self.grpo is not None:
            self.last_eval = self.grpo.evaluate(run, run.eval_set.prompts)
        elif cfg.objective.objective in ("dpo", "ipo", "simpo"):
            self.last_eval = evaluate_pairs(run, cfg.data.batch_size)
        else:
            self.last_eval = evaluate(
                run.model,
                run.eval_set,
                cfg.techniques.loss,
                cfg.data.batch_size,
                run.device,
                bool(cfg.data.doc_mask),
                self.env,
                run.seq,
            )
        self.eval_seconds += time.perf_counter() - t0
        record.update(self.last_eval)  # eval_loss, eval_ppl, eval_targets (grpo: eval_reward)

    def progress(self, record: dict[str, Any], bar: tqdm, interactive: bool) -> None:
        """The progress bar on a terminal; otherwise a line every tenth of the run."""
        bar.update(1)
        postfix = {
            "loss": f"{record['loss']:.3f}",
            "tok_s": f"{record['tokens_per_s']:.0f}",
            "mem": f"{record['peak_mem_gib']:.2f}G",
        }
        if self.last_eval:  # ({}: grpo's evaluation was cut by a reward's stop)
            postfix["eval"] = (
                f"{self.last_eval.get('eval_loss', self.last_eval.get('eval_reward')):.3f}"
            )
        if "reward" in record:  # grpo: the loss is advantage-weighted, about 0 by design
            postfix["reward"] = f"{record['reward']:.3f}"
        bar.set_postfix(postfix)
        max_steps = self.cfg.run.max_steps
        evaluated = "eval_loss" in record or "eval_reward" in record
        due = self.step % max(1, max_steps // 10) == 0 or self.step == max_steps or evaluated
        if interactive or not due:
            return
        self.say(
            f"step {self.step}/{max_steps} loss {record['loss']:.4f} lr {record['lr']:.2e} "
            f"{record['tokens_per_s']:.0f} tok/s mem {record['peak_mem_gib']:.2f} GiB"
            + (f" reward {record['reward']:.3f}" if "reward" in record else "")
            + (_eval_text(record) if evaluated else "")
        )

    # ------------------------------------------------------------------------- saving

    def train_state(self) -> dict[str, Any]:
        state = {
            "step": self.step,
            "data": self.run.batches.state_dict(),
            "rng": ckpt.rng_state(),
            "config": self.cfg.to_dict(),
            "totals": self.run_totals(),
        }
        if self.env is None:
            state["optimizer"] = self.run.optimizer.state_dict()
        else:  # the optimizer state is in the sharded checkpoint, one entry per rank
            state["world_size"] = self.run.world
        return state

    def run_totals(self, elapsed: float | None = None) -> dict[str, float] | None:
        """What the whole run has done by now, every invocation (resume) together: tokens,
        padding, target tokens and training seconds; None when the checkpoint resumed from
        predates these totals. `elapsed`: this invocation's training seconds (default: so far)."""
        before = self.run.done_before
        if before is None:
            return None
        if elapsed is None:
            elapsed = time.perf_counter() - self.t_start - self.eval_seconds
        now = {
            "tokens": self.tokens_done,
            "padding_tokens": self.padding_done,
            "targets": self.targets_done,
            "seconds": elapsed,
        }
        return {k: before.get(k, 0) + v for k, v in now.items()}

    def save(self, final: bool) -> Path:
        """Write step_N (atomically); never non-finite weights, and a full disk is one line.

        A checkpoint becomes the last good one (`last_good`, what a divergence's message names)
        only when its weights' norm is within GOOD_NORM_GROWTH times their norm when this
        invocation started: a learning rate far too high leaves finite weights thousands of
        times larger, from which no step is finite."""
        run = self.run
        norm = weights_norm(run.params)
        if not math.isfinite(norm):
            raise UserError(
                f"step {self.step}: the weights are not finite, so no checkpoint is written; "
                + self.restart_advice()
            )
        try:
            if self.env is None:
                path = ckpt.save_checkpoint(
                    self.out, self.step, run.model, run.tokenizer, self.train_state()
                )
            else:
                path = ckpt.save_sharded_checkpoint(
                    self.out,
                    self.step,
                    run.model,
                    run.tokenizer,
                    self.train_state(),
                    run.optimizer.state_dict(),
                    is_main=self.main,
                    export_hf=final,
                    describe=self._save_error,
                )
        except UserError:  # every rank's one line (FSDP)
            raise
        except Exception as e:  # OSError, torch's RuntimeError, SafetensorError, ...
            full = disk.disk_full_error(self.out, self.step, e, self.checkpoint_bytes)
            if full is None:
                raise
            raise full from e
        self.checkpoint_bytes = disk.folder_bytes(path) or self.checkpoint_bytes
        if self.start_norm is not None and norm <= GOOD_NORM_GROWTH * self.start_norm:
            self.last_good = path
        return path

    def run_tasks(self, final: bool) -> None:
        """--eval-tasks on the checkpoint just saved, when due (harness.py); its time is kept
        out of the training time, as the held-out loss's is."""
        if self.tasks is None or self.last_saved is None or not self.tasks.due(self.step, final):
            return
        dtype = "bf16" if self.run.dtype == torch.bfloat16 else "fp32"
        device = str(self.run.device)
        self.peak_floor = self.peak_gib()
        self.eval_seconds += self.tasks.run(self.last_saved, self.step, dtype, device)
        if self.run.device.type == "cuda":  # lm-eval's own model is not the run's peak
            torch.cuda.reset_peak_memory_stats(self.run.device)

    def peak_gib(self) -> float:
        """This process's peak memory in training (a GPU's peak restarts after --eval-tasks,
        whose model is not the run's; on a CPU the peak RSS includes it)."""
        return max(self.peak_floor, peak_memory_gib(self.run.device))

    def restart_advice(self, updated: bool = True, skip_hint: bool = False) -> str:
        """Where to go on from after a divergence (train/nonfinite.py): the last good checkpoint
        with a lower lr, a new start, or, when no update preceded it, not the lr at all."""
        facts = Facts(self.cfg, self.run.dtype, self.last_good, self.run.resume_from, updated)
        return advice(facts, skip_hint)

    def _save_error(self, e: BaseException) -> str:
        """One line for a checkpoint that could not be written (the line every rank prints)."""
        full = disk.disk_full_error(self.out, self.step, e, self.checkpoint_bytes)
        if full is not None:
            return str(full)
        return f"step_{self.step} could not be written ({type(e).__name__}: {brief(e, 300)})"

    def finish(self) -> Path | None:
        """The final checkpoint, and with --merge the merged model; returns the merged folder."""
        if not self.cfg.run.save:
            return None
        if self.step > self.run.start_step or self.run.resume_from is None:
            self.last_saved = self.save(final=True)
            if self.step >= self.cfg.run.max_steps:  # not after a stop signal
                self.run_tasks(final=True)
        if not (self.cfg.lora.merge and self.step >= self.cfg.run.max_steps):
            return None
        path = self.out / adapter_io.MERGED_DIR

        def merge() -> None:
            adapter_io.save_merged(
                self.run.model, path, tokenizer=self.run.tokenizer, writer=self.main
            )

        if self.env is None:
            try:
                merge()
            except Exception as e:  # OSError, SafetensorError: a full disk is one line
                if not disk.is_disk_full(e):
                    raise
                raise UserError(self._merge_error(e)) from e
        else:  # every rank joins the gathers; a failure on one is every rank's one line
            dist_.agree(dist_.attempt(merge), self._merge_error)
        return path

    def _merge_error(self, e: BaseException) -> str:
        return disk.merge_error(self.out, e, self.last_saved)

    def announce_compile(self) -> float | None:
        """Before the first step under --compile: a line, since it compiles every region (tens
        of seconds on a CPU, before any progress can show); returns when it started (None: not
        the first compiled step)."""
        regions = self.run.regions
        if regions is None or self.step != self.run.start_step:
            return None
        names = list(regions.backends)
        blocks = [n for n in names if n.startswith("block")]
        others = " + ".join(n for n in names if not n.startswith("block"))
        kinds = f"{len(blocks)} block kind{'s' if len(blocks) != 1 else ''}"
        self.say(
            f"--compile: compiling {kinds} + {others} ({', '.join(names)}); the first step "
            "takes longer"
        )
        if self.cfg.techniques.dump_graphs:
            folder = Path(self.cfg.techniques.dump_graphs)
            self.say(
                f"--dump-graphs: the graphs go to {folder} after the first step "
                f"({folder / 'index.json'} says which file is which region and stage)"
            )
        return time.perf_counter()

    def compiled(self, started: float | None) -> None:
        """After the first compiled step: how long it took, and how much of it compiling."""
        if started is None or self.run.regions is None:
            return
        seconds = self.run.regions.stats()["compile_seconds"]
        self.say(
            f"--compile: compiled in {seconds:.1f}s (the first step took "
            f"{time.perf_counter() - started:.1f}s)"
        )

    def write_dump(self) -> None:
        if self.run.regions is not None and self.cfg.techniques.dump_graphs and self.main:
            self.run.regions.write_dump(Path(self.cfg.techniques.dump_graphs))

    # ------------------------------------------------------------------------- reporting

    def gather_peaks(self) -> list[float]:
        """Every rank's peak memory so far (the busiest rank's is the run's)."""
        peak = self.peak_gib()
        return [peak] if self.env is None else dist_.gather_floats(peak, self.run.device)

    def banner(self) -> None:
        cfg, run = self.cfg, self.run
        if cfg.techniques.offload_activations and not run.offload_activations:
            self.say(
                "--offload-activations: training on the CPU, where activations already live in "
                "host memory; nothing to offload, the flag is ignored"
            )
        dtype_name = (
            "bf16-mixed" if cfg.model.dtype == "bf16-mixed" else str(run.dtype).split(".")[-1]
        )
        where = f"{dtype_name} on {run.device.type}"
        if self.env is not None:
            offload = ", CPU offload" if cfg.parallel.cpu_offload else ""
            where += f" x {run.world} processes (FSDP2 {cfg.parallel.sharding}{offload})"
        n_params = num_params(run.args)
        line = (
            f"model {cfg.name}: {n_params / 1e6:.1f}M parameters, {where}; data "
            f"{cfg.data.source}: {sum(d.rows for d in run.data)} rows of {cfg.data.seq_len} tokens"
            + (", document-masked" if cfg.data.doc_mask else "")
            + (f"; eval {run.eval_set.rows} rows" if run.eval_set is not None else "")
            + f"; output {self.out}"
            + (f"; resuming from {run.resume_from.name}" if run.resume_from else "")
        )
        self.say(line)
        for note in run.notes:
            self.say(note)
        if run.lora is not None:
            n_trainable = sum(p.numel() for p in run.params)
            stored = cfg.lora.quantize_base or str(run.base_dtype).split(".")[-1]
            self.say(
                f"LoRA rank {run.lora.rank} (alpha {run.lora.alpha:g}) on "
                f"{adapter_io.targets_text(run.lora)}: {n_trainable / 1e6:.2f}M trainable "
                f"parameters ({n_trainable / n_params:.2%}), frozen projections stored as {stored}"
            )

    def summarise(
        self, seconds: float, train_peaks: list[float], merged: Path | None
    ) -> dict[str, Any]:
        cfg, run = self.cfg, self.run
        elapsed = seconds - self.eval_seconds  # training time alone
        rank_peaks = self.gather_peaks()
        compile_stats = run.regions.stats() if run.regions is not None else None
        # Graphs compiled outside the model's regions: torch.compile'd helpers (the fused
        # head's row functions and gradient scaling on a CPU, our optimizer step).
        graphs = torch_internals.dynamo_graphs_compiled() - self.graphs_before
        helper_graphs = max(0, graphs - (compile_stats["compiles"] if compile_stats else 0))
        self.write_dump()
        last_eval = self.last_eval
        totals = self.run_totals(elapsed)
        summary = {
            # this invocation: steps run, data tokens (padding apart), training seconds
            "steps": self.step - run.start_step,
            "first_step": run.start_step + 1,
            "step": self.step,  # the run's last step
            "max_steps": cfg.run.max_steps,
            # a reward's stop (grpo) after the last step, in its held-out evaluation, too
            "interrupted": self.step < cfg.run.max_steps
            or (self.grpo is not None and self.grpo.stopped is not None),
            "first_loss": self.first_loss,
            "final_loss": self.last_loss,
            "tokens": self.tokens_done,
            "padding_tokens": self.padding_done,
            "targets": self.targets_done,
            "seconds": elapsed,
            "tokens_per_s": self.tokens_done / elapsed if elapsed > 0 else 0.0,
            # the whole run, every invocation together (None: resumed from an older checkpoint)
            "run_totals": None if totals is None else {"steps": self.step, **totals},
            "peak_mem_gib": max(rank_peaks),  # the busiest rank's peak
            "peak_mem_gib_per_rank": rank_peaks,
            "train_peak_mem_gib_per_rank": train_peaks,
            "checkpoint": str(self.last_saved) if self.last_saved else None,
            "merged": str(merged) if merged else None,
            "trainable_params": sum(p.numel() for p in run.params),
            "optimizer": cfg.optim.optimizer
            + (" in-backward" if cfg.optim.optimizer_in_backward else ""),
            "optimizer_state_bytes": run.optimizer.state_bytes(),
            "output_dir": str(self.out),
            "loss_kind": cfg.techniques.loss,
            "doc_mask": cfg.data.doc_mask,
            "eval_loss": last_eval.get("eval_loss") if last_eval else None,
            "eval_ppl": last_eval.get("eval_ppl") if last_eval else None,
            "eval_reward": last_eval.get("eval_reward") if last_eval else None,
            "eval_seconds": self.eval_seconds,
            "compile": compile_stats,
            "helper_graphs": helper_graphs,
            "processes": run.world,
            "estimate_peak_gib": self.estimate_peak_gib,  # the GPU pre-flight's estimate
            # --packing whole: real inputs / row inputs of the training rows (one source)
            "fill_ratio": getattr(getattr(run.batches, "data", None), "fill_ratio", None),
        }
        if self.main:
            closing.write_summary(self.out, summary)
            plot.after_run(self.out, self.say)  # with matplotlib; a failure is a warning line
        self.say(closing.closing_line(summary))
        return summary
