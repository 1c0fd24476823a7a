"""Typed configuration of a shardrl run, one pydantic model per process family.

Loaded from TOML (``shardrl init RUN --config CFG.toml``) with dotted CLI overrides (``--trainer.lr 1e-6``).  The
resolved config is written into the run directory, and every later process reads it from there, so a rollout job and
a trainer job submitted separately can never disagree on the model, tokenizer, schema or algorithm.  Only the fields
in ``PER_PROCESS_FIELDS`` may differ per process.  This module imports no torch.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(_Section):
    """Run-wide settings shared by every process."""

    seed: int = Field(0, ge=0, description="Run seed; worker and trainer seeds are derived from it.")
    max_workers: int = Field(
        64, ge=1, le=4096, description="Upper bound for the desired worker count (control.json)."
    )
    initial_workers: int = Field(1, ge=0, description="Desired worker count when the run is created.")
    lease_timeout_s: float = Field(
        30.0,
        gt=0,
        description="A worker-slot lease whose heartbeat counter stops changing this long is reclaimable.",
    )
    heartbeat_interval_s: float = Field(
        2.0, gt=0, description="How often supervisors renew leases and status."
    )
    control_poll_s: float = Field(1.0, gt=0, description="How often supervisors poll control.json.")
    control_settle_s: float = Field(
        2.0,
        ge=0,
        description="An unparsable control.json is 'still being written' for this long, then rejected.",
    )
    keep_weight_versions: int = Field(
        3, ge=1, description="Published weight versions kept by garbage collection."
    )


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class AdapterConfig(_Section):
    """LoRA adapters on a frozen base: only the low-rank adapters train (rank 0 = off, every weight trains)."""

    rank: int = Field(
        0,
        ge=0,
        le=512,
        description="LoRA rank r; 0 = no adapters (full fine-tuning), e.g. 8 or 16 turns them on.",
    )
    alpha: float = Field(
        16.0, gt=0, description="LoRA alpha: the adapter's update B @ A is scaled by alpha / rank."
    )
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Dropout on the adapters' input; above 0 the trainer's logprob passes become random.",
    )
    target_modules: list[str] = Field(
        default_factory=lambda: list(LORA_TARGETS),
        min_length=1,
        description="Names of the linear layers that get adapters (the last component of the module name).",
    )

    @property
    def enabled(self) -> bool:
        return self.rank > 0


class LoraConfig(AdapterConfig):
    """LoRA on the actor: each weight version is an adapter directory (peft format) on the unchanged base."""

    merge_every: int = Field(
        0,
        ge=0,
        description="Also publish a merged full-weight version (base + adapter, with the adapter inside) every N "
        "versions; 0 = only at the end of a trainer run.",
    )

    @model_validator(mode="after")
    def _merge_needs_adapters(self) -> LoraConfig:
        if self.merge_every > 0 and not self.enabled:
            raise ValueError(
                f"merge_every ({self.merge_every}) needs rank > 0: without adapters every version is full"
            )
        return self


class ModelConfig(_Section):
    """The base model (actor) and its tokenizer."""

    path: str = Field(
        "tiny",
        description="HF model directory, or `tiny` / `tiny-tied` to build the built-in tiny Qwen2 into the run.",
    )
    tokenizer: str | None = Field(None, description="Tokenizer directory; defaults to the model directory.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Dtype of the trainer's parameters as published and of the rollout engine."
    )
    vocab_size: int | None = Field(
        None, ge=1, description="Filled in by `shardrl init` from the model config."
    )
    tiny_init_std: float = Field(
        0.02, gt=0, description="Initializer std of the built-in tiny model (`tiny` / `tiny-tied` only)."
    )
    lora: LoraConfig = Field(default_factory=LoraConfig)


class DataConfig(_Section):
    """Where prompts come from."""

    task: Literal["max_digit", "mod_add", "file"] = Field(
        "max_digit", description="Built-in demo task, or `file` to read `prompts_file`."
    )
    prompts_file: str | None = Field(
        None,
        description="JSONL, Parquet, or a `datasets.save_to_disk` directory; one prompt per row (docs/DATA.md).",
    )
    prompt_field: str = Field(
        "prompt",
        description="Field of the prompt: a string or chat messages [{role, content}]; `a.b` reaches into objects.",
    )
    answer_field: str = Field(
        "answer", description="Field of the answer given to the reward function; `a.b` reaches into objects."
    )
    chat_template: bool = Field(
        False,
        description="Render string prompts with the tokenizer's chat template (chat messages always are).",
    )
    system_prompt: str | None = Field(
        None, description="System message put first in chat-rendered prompts that have none."
    )
    prompt_template: str | None = Field(
        None,
        description="str.format template with one `{prompt}` placeholder, applied to each prompt "
        "(to the last user message of chat prompts).",
    )
    max_prompt_length: int = Field(
        512, ge=1, description="Prompts longer than this (tokens) are skipped and counted."
    )

    @field_validator("prompt_template")
    @classmethod
    def _one_placeholder(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                v.format(prompt="")
            except (KeyError, IndexError, ValueError) as e:
                raise ValueError(
                    f"{v!r} is not a str.format template whose only placeholder is {{prompt}} ({e!r})"
                ) from None
            if "{prompt}" not in v:
                raise ValueError(f"{v!r} has no {{prompt}} placeholder")
        return v


class RewardConfig(_Section):
    """How samples are scored on the rollout workers."""

    function: str = Field(
        description="A registered name (math_answer, exact_match, max_digit, mod_add) or "
        "`package.module:function` (docs/DATA.md).",
    )
    truncated_reward: float | None = Field(
        None,
        description="Function reward of a response cut off at max_response_length (finish_reason `length`); "
        "null = score it like the others.",
    )
    reward_model: str | None = Field(
        None,
        description="HF sequence-classification model directory; its score is added to the function's reward.",
    )
    reward_model_weight: float = Field(1.0, description="Weight of the reward model's score.")


class SamplingConfig(_Section):
    temperature: float = Field(1.0, ge=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(-1, ge=-1, description="Top-k sampling; -1 disables.")
    max_response_length: int = Field(8, ge=1, description="Maximum generated tokens per response.")
    n: int = Field(8, ge=1, description="Samples per prompt (one GRPO group).")
    stop: list[str] = Field(default_factory=list, description="Stop strings (token ids keep them).")


class VllmConfig(_Section):
    dtype: str = Field("auto", description="vLLM dtype; `auto` follows model.dtype.")
    gpu_memory_utilization: float = Field(
        0.5, gt=0, le=1, description="Fraction of GPU memory vLLM may take."
    )
    max_model_len: int | None = Field(
        None, ge=1, description="Context length; default prompt + response budget."
    )
    tensor_parallel_size: int = Field(1, ge=1, description="Tensor-parallel size of each worker's engine.")
    enforce_eager: bool = Field(True, description="Disable CUDA graphs (faster start, slower decode).")
    max_num_seqs: int = Field(256, ge=1, description="Maximum concurrent sequences.")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="Scheduler token budget per step.")
    cpu_kvcache_space_gib: float = Field(1.0, gt=0, description="KV cache size on the CPU build (GiB).")


class RolloutConfig(_Section):
    """Rollout workers and the node supervisor."""

    engine: Literal["auto", "vllm", "hf"] = Field(
        "auto", description="`auto` = vllm when it imports, else hf."
    )
    max_local_workers: int | None = Field(
        None, ge=0, description="Worker slots per node; default: visible GPUs, or `cpu_workers` without GPUs."
    )
    cpu_workers: int = Field(1, ge=1, description="Local worker slots on a node without GPUs.")
    prompts_per_batch: int = Field(16, ge=1, description="Prompts per generate() call (x n samples).")
    shard_samples: int = Field(256, ge=1, description="Publish a shard after this many samples...")
    flush_interval_s: float = Field(
        10.0, gt=0, description="...or after this many seconds, whichever comes first."
    )
    max_staleness: int = Field(
        2, ge=0, description="Do not start a batch more than this many versions behind."
    )
    max_backlog_samples: int = Field(
        4096, ge=1, description="Pause while the unconsumed backlog exceeds this."
    )
    weights_poll_s: float = Field(1.0, gt=0, description="How often to poll weights/LATEST between batches.")
    drain_deadline_s: float = Field(
        20.0, gt=0, description="SIGTERM: workers drained and exited within this."
    )
    restart_backoff_s: float = Field(2.0, gt=0, description="First restart delay of a dead worker (doubles).")
    max_restarts: int = Field(
        5, ge=0, description="Restarts within `restart_window_s` before a slot is failed."
    )
    restart_window_s: float = Field(300.0, gt=0, description="Window for counting crash-loop restarts.")
    threads_per_worker: int | None = Field(None, ge=1, description="OMP threads per CPU worker.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    vllm: VllmConfig = Field(default_factory=VllmConfig)


AlgorithmName = Literal["grpo", "rloo", "reinforce_pp", "ppo"]
LossAgg = Literal[
    "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-sum"
]
_KL_MODE = "KL as a loss term, or as a per-token reward penalty (reward: ppo and reinforce_pp only)."
_NAME = (
    "grpo (group baseline), rloo (leave-one-out group baseline), reinforce_pp (REINFORCE++: returns whitened over "
    "the batch, no critic) or ppo (critic + GAE)."
)


class AlgorithmConfig(_Section):
    """Advantages and losses: the keys every algorithm has (`name` picks the algorithm and its own keys)."""

    name: AlgorithmName = Field("grpo", description=_NAME)
    clip_low: float = Field(0.2, ge=0, description="Ratio clip below 1 - clip_low.")
    clip_high: float = Field(0.28, ge=0, description="Ratio clip above 1 + clip_high.")
    dual_clip: float | None = Field(
        3.0, gt=1, description="Dual-clip bound c for negative advantages; null = off."
    )
    policy_loss: Literal["ppo", "gspo"] = Field(
        "ppo",
        description="ppo: one ratio per token; gspo: one ratio per sequence, exp(mean token log-ratio), clipped "
        "per sequence (GSPO pairs it with much tighter clips, ~3e-4/4e-4, and loss_agg seq-mean-token-mean).",
    )
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus weight.")
    kl_coef: float = Field(
        0.0,
        ge=0,
        description="Weight of the KL to the reference model (0 = no reference); the starting value when "
        "kl_target is set.",
    )
    kl_target: float | None = Field(
        None,
        gt=0,
        description="Adaptive KL: the KL to the reference the coefficient is steered to (proportional "
        "controller); null = fixed kl_coef.",
    )
    kl_horizon: float = Field(
        10000.0,
        gt=0,
        description="Adaptive KL: samples over which the coefficient changes by at most 20%; at least "
        "trainer.samples_per_step.",
    )
    kl_mode: Literal["loss", "reward"] = Field("loss", description=_KL_MODE)
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator.")
    loss_agg: LossAgg = Field(
        "token-mean",
        description="How token losses are aggregated; seq-mean-token-sum-norm divides each sequence's sum by "
        "rollout.sampling.max_response_length (Dr.GRPO), token-sum does not normalise.",
    )
    off_policy: Literal["none", "tis", "decoupled"] = Field(
        "decoupled",
        description="none: PPO ratio against the behaviour logprobs; tis: truncated-IS policy gradient "
        "(weight min(p_train/p_behaviour, tis_cap), no ratio clip); decoupled: PPO ratio against the proximal "
        "policy (weights before this step) times the truncated behaviour weight.",
    )
    off_policy_level: Literal["token", "sequence"] = Field(
        "token",
        description="Truncated IS weight per token, or one per sequence (the product of its token ratios, "
        "truncated at tis_cap).",
    )
    tis_cap: float = Field(2.0, gt=0, description="Cap of the truncated importance weight.")
    staleness_mode: Literal["drop", "keep"] = Field(
        "drop",
        description="Samples older than trainer.max_staleness: drop (counted) or keep with correction.",
    )

    @model_validator(mode="before")
    @classmethod
    def _keys_of_other_algorithms(cls, data: Any) -> Any:
        """A key that belongs to another algorithm says which one, instead of only "extra inputs"."""
        if isinstance(data, dict):
            for key in data:
                owners = [n for n, m in ALGORITHMS.items() if key in m.model_fields]
                if key not in cls.model_fields and owners:
                    raise ValueError(
                        f"{key} is a setting of algorithm.name = {' or '.join(map(repr, owners))} only, "
                        f"not of {data.get('name', 'grpo')!r}"
                    )
        return data

    @model_validator(mode="after")
    def _consistent(self) -> AlgorithmConfig:
        if self.kl_target is not None and self.kl_coef <= 0:
            raise ValueError("kl_target needs kl_coef > 0: the adaptive coefficient starts from kl_coef")
        if self.policy_loss == "gspo" and self.off_policy == "tis":
            raise ValueError(
                "policy_loss = 'gspo' needs a ratio: off_policy 'none' or 'decoupled', not 'tis'"
            )
        return self


class GrpoConfig(AlgorithmConfig):
    """Group baseline: each reward minus its group's mean, optionally over the group's std."""

    name: Literal["grpo"] = Field("grpo", description=_NAME)
    norm_adv_by_std: bool = Field(True, description="grpo: divide by the group std (false = Dr.GRPO).")
    kl_mode: Literal["loss"] = Field("loss", description=_KL_MODE)


class RlooConfig(AlgorithmConfig):
    """Leave-one-out baseline: each reward minus the mean of the other rewards of its group."""

    name: Literal["rloo"] = Field("rloo", description=_NAME)
    kl_mode: Literal["loss"] = Field("loss", description=_KL_MODE)


class ReinforcePPConfig(AlgorithmConfig):
    """REINFORCE++: token returns (reward, less the KL penalty with kl_mode = "reward") whitened over the batch."""

    name: Literal["reinforce_pp"] = Field("reinforce_pp", description=_NAME)


class PpoConfig(AlgorithmConfig):
    """A critic and GAE advantages."""

    name: Literal["ppo"] = Field("ppo", description=_NAME)
    whiten_advantages: bool = Field(False, description="ppo: whiten advantages over the batch.")
    gamma: float = Field(1.0, ge=0, le=1, description="ppo: discount.")
    lam: float = Field(1.0, ge=0, le=1, description="ppo: GAE lambda.")
    value_clip: float = Field(0.2, ge=0, description="ppo: clipped value loss range.")
    value_coef: float = Field(0.5, ge=0, description="ppo: value loss weight.")


ALGORITHMS: dict[str, type[AlgorithmConfig]] = {
    "grpo": GrpoConfig,
    "rloo": RlooConfig,
    "reinforce_pp": ReinforcePPConfig,
    "ppo": PpoConfig,
}


def _grpo_by_default(data: Any) -> Any:
    return {**data, "name": "grpo"} if isinstance(data, dict) and "name" not in data else data


# The `algorithm` section: one model per algorithm, picked by `name` (grpo when absent).
Algorithm = Annotated[
    GrpoConfig | RlooConfig | ReinforcePPConfig | PpoConfig,
    BeforeValidator(_grpo_by_default),
    Field(discriminator="name"),
]


class TrainerConfig(_Section):
    """The torchrun FSDP2 trainer."""

    lr: float = Field(1e-5, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps.")
    schedule: Literal["constant", "cosine"] = Field("constant", description="LR schedule after warmup.")
    total_steps: int = Field(1000, ge=1, description="Horizon of the cosine schedule.")
    grad_clip: float = Field(1.0, gt=0, description="Global gradient-norm clip.")
    samples_per_step: int = Field(256, ge=1, description="Samples consumed per training step (whole groups).")
    updates_per_step: int = Field(
        1,
        ge=1,
        description="Optimizer updates per step (the step's samples split into this many mini-batches).",
    )
    max_tokens_per_microbatch: int = Field(
        8192,
        ge=16,
        description="Token budget of one micro-batch: real tokens when packing, rows x longest row otherwise.",
    )
    packing: bool = Field(
        True,
        description="Pack each micro-batch's sequences into one row without padding (false = right-padded rows).",
    )
    max_staleness: int = Field(
        4, ge=0, description="Samples more versions behind than this are dropped/kept."
    )
    step_wait_timeout_s: float | None = Field(
        None, gt=0, description="Give up waiting for samples after this."
    )
    poll_interval_s: float = Field(0.5, gt=0, description="How often to look for new shards while waiting.")
    publish_every: int = Field(1, ge=1, description="Publish weights every N steps.")
    save_every: int = Field(10, ge=1, description="DCP checkpoint every N steps.")
    keep_checkpoints: int = Field(2, ge=1, description="Complete checkpoints kept.")
    max_steps: int | None = Field(
        None, ge=1, description="Stop after N steps in this invocation (per process)."
    )
    activation_checkpointing: bool = Field(False, description="Recompute decoder layers in backward.")
    param_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="FSDP2 compute dtype; auto = bf16 on GPU, fp32 on CPU."
    )
    logprob_chunk: int = Field(1024, ge=1, description="Tokens per chunk when computing logprobs/entropy.")
    critic_path: str | None = Field(None, description="PPO critic base; default a copy of the actor base.")
    critic_lr: float = Field(1e-5, gt=0, description="Critic learning rate.")
    critic_lora: AdapterConfig = Field(
        default_factory=AdapterConfig,
        description="LoRA on the critic's base (rank 0 = the whole critic trains).",
    )
    eval_every: int = Field(0, ge=0, description="Greedy eval of the demo task every N steps (0 = off).")
    tensorboard: bool = Field(True, description="Also log to TensorBoard when it is installed.")


class ShardRLConfig(_Section):
    """The whole run configuration (the content of RUN/config.json)."""

    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    reward: RewardConfig  # no default: every run names its reward function
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algorithm: Algorithm = Field(default_factory=GrpoConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)


# Settings a single process may change with a CLI flag without touching the run's contract.
PER_PROCESS_FIELDS = frozenset(
    {
        "rollout.max_local_workers",
        "rollout.cpu_workers",
        "rollout.threads_per_worker",
        "rollout.drain_deadline_s",
        "rollout.weights_poll_s",
        "rollout.engine",
        "trainer.max_steps",
        "trainer.step_wait_timeout_s",
        "trainer.poll_interval_s",
        "trainer.tensorboard",
    }
)


class ConfigError(ValueError):
    """A user-caused configuration error; its message is one line naming the file and the field."""


def parse_overrides(args: list[str]) -> dict[str, str]:
    """``["--trainer.lr", "1e-6", "--x.y=2"]`` -> ``{"trainer.lr": "1e-6", "x.y": "2"}``."""
    out: dict[str, str] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(
                f"command line: unexpected argument {arg!r}; overrides look like --section.key VALUE"
            )
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"command line: {arg} needs a value")
            key, value = arg[2:], args[i + 1]
            i += 2
        out[key] = value
    return out


def _coerce(value: str) -> Any:
    """CLI values are JSON when they parse as JSON (numbers, booleans, lists, null), else plain strings."""
    try:
        return json.loads(value)
    except ValueError:
        return value


def apply_overrides(data: dict[str, Any], overrides: dict[str, str]) -> dict[str, Any]:
    for dotted, raw in overrides.items():
        node = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"command line: --{dotted}: {p} is not a section")
        node[leaf] = _coerce(raw)
    return data


def _one_line(err: ValidationError, source: str) -> str:
    e = err.errors()[0]
    loc = ".".join(str(p) for p in e["loc"])
    more = f" (and {len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    return f"{source}: field {loc}: {e['msg']}{more}"


def validate(data: dict[str, Any], source: str) -> ShardRLConfig:
    try:
        return ShardRLConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_one_line(err, source)) from None


def load_toml(path: str | Path, overrides: dict[str, str] | None = None) -> ShardRLConfig:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    return validate(apply_overrides(data, overrides or {}), str(path))


def flatten(cfg: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in cfg.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def load_run_config(run_config_json: Path, overrides: dict[str, str] | None = None) -> ShardRLConfig:
    """The run's resolved config with per-process overrides; a change to a run-wide field is refused."""
    try:
        base = json.loads(run_config_json.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"{run_config_json}: missing; create the run with `shardrl init RUN --config CFG.toml`"
        ) from None
    overrides = overrides or {}
    cfg = validate(
        apply_overrides(json.loads(json.dumps(base)), overrides), f"{run_config_json} + command line"
    )
    before, after = flatten(base), flatten(cfg.model_dump(mode="json"))
    for key in overrides:
        if key not in PER_PROCESS_FIELDS and before.get(key) != after.get(key):
            raise ConfigError(
                f"command line: --{key} would change the run-wide setting in {run_config_json} "
                f"({before.get(key)!r} -> {after.get(key)!r}); only per-process settings may differ: "
                + ", ".join(sorted(PER_PROCESS_FIELDS))
            )
    return cfg


def reference_markdown() -> str:
    """The config reference, generated from the models so that it cannot drift from the code."""
    lines: list[str] = []

    def walk(model: type[BaseModel], prefix: str, variant: str = "") -> None:
        rows = []
        subs = []
        for name, f in model.model_fields.items():
            ann = f.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                subs.append((name, [ann]))
                continue
            variants = [a for a in get_args(ann) if isinstance(a, type) and issubclass(a, BaseModel)]
            if variants:  # a union of sections picked by `name`: one table per variant
                subs.append((name, variants))
                continue
            default = (
                "required" if f.is_required() else f"`{json.dumps(f.get_default(call_default_factory=True))}`"
            )
            rows.append(f"| `{prefix}{name}` | {default} | {f.description or ''} |")
        if rows:
            lines.append(f"\n**[{prefix.rstrip('.')}]**{variant} {(model.__doc__ or '').strip()}\n")
            lines.append("| key | default | meaning |\n|---|---|---|")
            lines.extend(rows)
        for name, sections in subs:
            for sub in sections:
                tag = f" name = {json.dumps(sub.model_fields['name'].default)}:" if len(sections) > 1 else ""
                walk(sub, f"{prefix}{name}.", tag)

    walk(ShardRLConfig, "")
    return "\n".join(lines).strip() + "\n"
