"""Training: `build_run` builds, `train_step` steps, `Trainer` loops, `run_dir` keeps the folder.

build.py     build_run(cfg, env) -> Run: model, techniques, optimizer, data (the one build)
  device.py       where the tensors live, the parameters' dtype
  inputs.py       what a run reads first: tokenizer, data, resume state (or the model's facts)
  build_model.py  architecture, LoRA spec, weights, meta models, the frozen reference/teacher
  techniques.py   fp8 -> activation policy -> compile -> FSDP, each one's step hooks; --cp split
observer.py  BuildOptions and BuildObserver: what a caller outside chooses and how it watches
step.py      train_step = backward_pass + optimizer_step -> StepResult; evaluate; lr schedule
hooks.py     step hooks: each technique's per-step work, registered by apply_techniques
strategy.py  StepStrategy: an objective's step as the loop calls it (grpo.py's GrpoStep too)
loop.py      train(cfg) -> Trainer(cfg, env).train(): the loop, logging, the summary
run_dir/     the run folder: lock, checks, config.yaml, resume judging, disk errors, signals,
             Hub pinning, the closing line (one module each)
"""

from compiletune.train.build import Run, build_run
from compiletune.train.observer import NO_OBSERVER, BuildObserver, BuildOptions
from compiletune.train.step import StepBatch, StepResult, evaluate, next_batch, train_step

__all__ = [
    "BuildObserver",
    "BuildOptions",
    "NO_OBSERVER",
    "Run",
    "StepBatch",
    "StepResult",
    "next_batch",
    "Trainer",
    "build_run",
    "evaluate",
    "train_step",
]
