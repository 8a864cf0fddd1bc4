"""The typed run configuration: defaults < `--config run.yaml` < command-line flags.

`TrainConfig` is the single source of truth for a run: sections (model, data, optim, techniques,
parallel, lora, run), each a dataclass whose fields carry their own help text, and whose choice
sets are the `Literal`s of `choices.py`. From these declarations come, with nothing written twice:

- the command-line flags (`add_flags`: name, type, choices, help with the real default),
- the YAML keys (the flag without its dashes; `seq-len` and `seq_len` both accepted),
- the type checks of YAML values, and `config.yaml`, the flat resolved copy a run writes.

`resolve` merges and checks the values; `fill_defaults` is the one function that decides every
default that depends on other choices (some of them on facts known only once the model's
config and the data are read, which the build passes in as `RunFacts`).
"""

from compiletune.config.checks import check_inputs, check_model_folder, check_types
from compiletune.config.files import (
    SAVED_CONFIG,
    load_yaml,
    read_saved_config,
    save_yaml,
    unknown_option,
)
from compiletune.config.flags import add_flags
from compiletune.config.resolve import (
    RunFacts,
    default_lr,
    fill_defaults,
    resolve,
    resume_changes,
)
from compiletune.config.schema import (
    DEFAULT_MAX_STEPS,
    FIELD_NAMES,
    LORA_ALPHA_PER_RANK,
    LR_FINE_TUNE,
    LR_LORA,
    LR_RANDOM_INIT,
    MAX_GRAD_NORM,
    SECTIONS,
    WARMUP_FRACTION,
    DataConfig,
    LoRAConfig,
    ModelConfig,
    ObjectiveConfig,
    OptimConfig,
    ParallelConfig,
    RunConfig,
    TechniquesConfig,
    TrainConfig,
    flag_of,
    flag_text,
    hints_of,
    key_of,
    opt,
    unwrap,
)

__all__ = [
    "default_lr",
    "DEFAULT_MAX_STEPS",
    "FIELD_NAMES",
    "LORA_ALPHA_PER_RANK",
    "LR_FINE_TUNE",
    "LR_LORA",
    "LR_RANDOM_INIT",
    "MAX_GRAD_NORM",
    "SAVED_CONFIG",
    "SECTIONS",
    "WARMUP_FRACTION",
    "DataConfig",
    "LoRAConfig",
    "ModelConfig",
    "ObjectiveConfig",
    "OptimConfig",
    "ParallelConfig",
    "RunConfig",
    "RunFacts",
    "TechniquesConfig",
    "TrainConfig",
    "add_flags",
    "check_inputs",
    "check_model_folder",
    "check_types",
    "fill_defaults",
    "flag_of",
    "flag_text",
    "hints_of",
    "key_of",
    "load_yaml",
    "opt",
    "read_saved_config",
    "resolve",
    "resume_changes",
    "save_yaml",
    "unknown_option",
    "unwrap",
]
