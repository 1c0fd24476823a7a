"""Typed configuration of a shardrl run, one pydantic model per process family.

Loaded from TOML (``shardrl init RUN --config CFG.toml``) with dotted CLI overrides (``--trainer.lr 1e-6``).  The
resolved config is written into the run directory, and every later process reads it from there, so a rollout job and
a trainer job submitted separately can never disagree on the model, tokenizer, schema or algorithm.  Only the fields
in ``PER_PROCESS_FIELDS`` may differ per process.  This package imports no torch.

Rules that span fields (``RULES``: a backlog bound that lets a step fill, whole groups per step, consistent
staleness bounds, prompt + response within the engine's context, vLLM settings only for a vLLM engine, an adaptive-KL
horizon of at least one step, no more initial workers than the maximum, an episode's turn within its response budget,
``data.task = 'env'`` exactly with ``env.verifiers``, whose rubric is then the reward)
run whenever a config is validated: at ``shardrl init`` and again when every process opens the run, so a config that
would deadlock or silently waste samples never starts.  Each failure is one line naming the fields and the rule.

The modules: ``sections`` (one model per TOML table), ``algorithms`` (the `algorithm` table, one model per algorithm), ``rules`` (the whole config and its cross-field rules),
``overrides`` (dotted command-line overrides and the shared argparse helpers), ``load`` (TOML / config.json to a
validated config, errors as one line), ``reference`` (the README's generated reference), ``fields`` (model
introspection the others share).
"""

from .algorithms import (
    ALGORITHMS,
    Algorithm,
    AlgorithmConfig,
    AlgorithmName,
    GrpoConfig,
    LossAgg,
    PpoConfig,
    ReinforcePPConfig,
    RlooConfig,
)
from .env import EnvConfig
from .fields import field_annotations, section_fields
from .load import load_run_config, load_toml, validate
from .overrides import (
    OVERRIDES_HELP,
    RUN_ENV,
    ConfigError,
    add_run_dir_option,
    apply_overrides,
    coerce,
    flatten,
    options_help,
    parse_overrides,
    refuse_sections,
    resolve_dtype,
    split_overrides,
)
from .reference import reference_markdown
from .rules import GROUP_ALGORITHMS, PER_PROCESS_FIELDS, RULES, VERIFIERS_REWARD, ShardRLConfig
from .sections import (
    LORA_TARGETS,
    AdapterConfig,
    DataConfig,
    EvalConfig,
    LoraConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    SamplingConfig,
    TrainerConfig,
    VllmConfig,
)

__all__ = [
    "ALGORITHMS",
    "GROUP_ALGORITHMS",
    "LORA_TARGETS",
    "OVERRIDES_HELP",
    "PER_PROCESS_FIELDS",
    "RULES",
    "RUN_ENV",
    "VERIFIERS_REWARD",
    "AdapterConfig",
    "Algorithm",
    "AlgorithmConfig",
    "AlgorithmName",
    "ConfigError",
    "DataConfig",
    "EnvConfig",
    "EvalConfig",
    "GrpoConfig",
    "LoraConfig",
    "LossAgg",
    "ModelConfig",
    "PpoConfig",
    "ReinforcePPConfig",
    "RewardConfig",
    "RlooConfig",
    "RolloutConfig",
    "RunConfig",
    "SamplingConfig",
    "ShardRLConfig",
    "TrainerConfig",
    "VllmConfig",
    "add_run_dir_option",
    "apply_overrides",
    "coerce",
    "field_annotations",
    "flatten",
    "load_run_config",
    "load_toml",
    "options_help",
    "parse_overrides",
    "reference_markdown",
    "refuse_sections",
    "resolve_dtype",
    "section_fields",
    "split_overrides",
    "validate",
]
