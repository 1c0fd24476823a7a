"""The whole run config (``ShardRLConfig``) and the rules that span its sections.

Each rule returns None or one line naming the fields, their values and why the combination cannot work; they run in
the root model's validator, so every way of building a config (TOML, RUN/config.json, overrides) passes them.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from .algorithms import (
    Algorithm,
    GrpoConfig,
)
from .env import EnvConfig
from .sections import (
    DataConfig,
    EvalConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    TrainerConfig,
    _Section,
)

# The reward.function of an env.verifiers run, filled in when the config names none: the environment's rubric scores
# its episodes (rollout_worker/envs/verifiers_env.py), and the name says so in RUN/config.json.  A string, not an
# import: buffer imports nothing of the rollout side.
VERIFIERS_REWARD = "rollout_worker.envs.verifiers_env:rubric_reward"


class ShardRLConfig(_Section):
    """The whole run configuration (the content of RUN/config.json)."""

    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    reward: RewardConfig  # no default: every run names its reward function
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algorithm: Algorithm = Field(default_factory=GrpoConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)

    @model_validator(mode="before")
    @classmethod
    def _rubric_is_the_reward(cls, data: Any) -> Any:
        # Only here can a missing section get a default that depends on another; the rules below refuse a
        # reward.function the user set beside env.verifiers, which the rubric would silently replace.
        if not isinstance(data, dict):
            return data
        env, reward = data.get("env"), data.get("reward", {})
        verifiers = env.get("verifiers") if isinstance(env, dict) else getattr(env, "verifiers", None)
        if verifiers is None or not isinstance(reward, dict) or "function" in reward:
            return data
        return {**data, "reward": {**reward, "function": VERIFIERS_REWARD}}

    @model_validator(mode="after")
    def _cross_field_rules(self) -> ShardRLConfig:
        broken = [msg for rule in RULES if (msg := rule(self)) is not None]
        if broken:
            raise ValueError(broken[0] + (f" (and {len(broken) - 1} more)" if len(broken) > 1 else ""))
        return self

    def context_length(self) -> int:
        """The rollout engine's context: rollout.vllm.max_model_len when set, else the prompt + response budget."""
        vllm = self.rollout.vllm
        if vllm is not None and vllm.max_model_len is not None:
            return vllm.max_model_len
        return self.data.max_prompt_length + self.rollout.sampling.max_response_length


GROUP_ALGORITHMS = frozenset({"grpo", "rloo"})  # advantages from a group of n samples of one prompt


def _rule_backlog_fills_a_step(cfg: ShardRLConfig) -> str | None:
    # A worker starts a batch only while the backlog is at most max_backlog_samples, so with one worker the backlog
    # never exceeds max_backlog_samples + one batch: below samples_per_step the bound could never hold, as workers
    # keep generating until a step can fill (and older versions stalled there), so such a setting is refused.
    r, batch = cfg.rollout, cfg.rollout.prompts_per_batch * cfg.rollout.sampling.n
    if r.max_backlog_samples + batch >= cfg.trainer.samples_per_step:
        return None
    return (
        f"rollout.max_backlog_samples ({r.max_backlog_samples}) + one worker batch (rollout.prompts_per_batch x "
        f"rollout.sampling.n = {batch}) must reach trainer.samples_per_step ({cfg.trainer.samples_per_step}), "
        "or workers pause before a step can fill"
    )


def _rule_whole_groups(cfg: ShardRLConfig) -> str | None:
    name, n, step = cfg.algorithm.name, cfg.rollout.sampling.n, cfg.trainer.samples_per_step
    if name not in GROUP_ALGORITHMS or step % n == 0:
        return None
    return (
        f"trainer.samples_per_step ({step}) must be a multiple of rollout.sampling.n ({n}) with "
        f"algorithm.name = {name!r}: a step takes whole groups, so it would train on {-(-step // n) * n} samples"
    )


def _rule_staleness_bounds(cfg: ShardRLConfig) -> str | None:
    mode = cfg.algorithm.staleness_mode
    produce, accept = cfg.rollout.max_staleness, cfg.trainer.max_staleness
    if mode == "drop" and produce > accept:
        return (
            f"rollout.max_staleness ({produce}) must not exceed trainer.max_staleness ({accept}) with "
            "algorithm.staleness_mode = 'drop': workers would produce samples the trainer drops"
        )
    if mode == "keep" and cfg.algorithm.off_policy == "none":
        return (
            "algorithm.staleness_mode = 'keep' needs algorithm.off_policy = 'tis' or 'decoupled' to correct the "
            "stale samples it keeps (it is 'none')"
        )
    return None


def _rule_context_fits(cfg: ShardRLConfig) -> str | None:
    prompt, response = cfg.data.max_prompt_length, cfg.rollout.sampling.max_response_length
    context = cfg.context_length()
    if prompt + response <= context:
        return None
    return (
        f"data.max_prompt_length ({prompt}) + rollout.sampling.max_response_length ({response}) = "
        f"{prompt + response} must fit rollout.vllm.max_model_len ({context}), the engine's context; "
        "otherwise long prompts get cut-off responses"
    )


def _rule_engine_settings(cfg: ShardRLConfig) -> str | None:
    if cfg.rollout.engine == "hf" and cfg.rollout.vllm is not None:
        return (
            "rollout.vllm is set but rollout.engine is 'hf', which does not use it: remove the [rollout.vllm] "
            "section or set rollout.engine = 'vllm' or 'auto'"
        )
    return None


def _rule_vllm_token_budget(cfg: ShardRLConfig) -> str | None:
    # What vLLM checks when an engine starts, checked here so that a run is refused once rather than every worker
    # dying in a restart loop.  Without chunked prefill (how the CPU build runs: its seeded sampler fails on a
    # prompt prefilled in parts) vLLM also needs the budget to hold one whole sequence.
    v = cfg.rollout.vllm
    if v is None or v.max_num_batched_tokens is None:
        return None
    budget = v.max_num_batched_tokens
    if budget < v.max_num_seqs:
        return (
            f"rollout.vllm.max_num_batched_tokens ({budget}) must be at least rollout.vllm.max_num_seqs "
            f"({v.max_num_seqs}): vLLM refuses to start otherwise"
        )
    if budget < cfg.context_length():
        return (
            f"rollout.vllm.max_num_batched_tokens ({budget}) must be at least rollout.vllm.max_model_len "
            f"({cfg.context_length()}): vLLM without chunked prefill (how the CPU build runs) refuses to start "
            "otherwise"
        )
    return None


def _rule_kl_horizon_spans_a_step(cfg: ShardRLConfig) -> str | None:
    # The adaptive coefficient is multiplied by 1 +- 0.2 * samples_per_step / kl_horizon each step: a horizon
    # shorter than a step would let it swing by more than 20% at once, and below 1/5 of a step turn negative.
    a, step = cfg.algorithm, cfg.trainer.samples_per_step
    if a.kl_target is None or a.kl_horizon >= step:
        return None
    return (
        f"algorithm.kl_horizon ({a.kl_horizon:g}) must be at least trainer.samples_per_step ({step}) with "
        "algorithm.kl_target set: the adaptive KL coefficient would change by more than 20% in one step"
    )


def _rule_initial_workers(cfg: ShardRLConfig) -> str | None:
    r = cfg.run
    if r.initial_workers <= r.max_workers:
        return None
    return f"run.initial_workers ({r.initial_workers}) must not exceed run.max_workers ({r.max_workers})"


def _rule_env_turn_fits_response(cfg: ShardRLConfig) -> str | None:
    # Every turn of an episode, the model's and the environment's, counts against the response budget (the trainer
    # refuses a longer sample), so a single turn longer than it could never be trained.
    turn, response = cfg.env.max_turn_tokens, cfg.rollout.sampling.max_response_length
    if turn is None or turn <= response:
        return None
    return (
        f"env.max_turn_tokens ({turn}) must not exceed rollout.sampling.max_response_length ({response}): every "
        "turn of an episode counts against the response length"
    )


def _rule_sequence_parallel_packs(cfg: ShardRLConfig) -> str | None:
    # The split is of a packed row; the world size and the model's heads are checked when the trainer starts.
    t = cfg.trainer
    if t.sequence_parallel == 1 or t.packing:
        return None
    return (
        f"trainer.sequence_parallel ({t.sequence_parallel}) needs trainer.packing = true: sequences are split "
        "over ranks as chunks of a packed row"
    )


def _rule_offload_checkpoints(cfg: ShardRLConfig) -> str | None:
    # What goes to host memory is the input that checkpointing keeps for the recompute.
    t = cfg.trainer
    if not t.activation_offload or t.activation_checkpointing:
        return None
    return (
        "trainer.activation_offload = true needs trainer.activation_checkpointing = true: the layers' saved inputs "
        "it moves to host memory are those of checkpointing"
    )


def _rule_skip_needs_checkpoints(cfg: ShardRLConfig) -> str | None:
    # Layers left out of checkpointing only mean something when the others are checkpointed.
    t = cfg.trainer
    if not t.activation_checkpointing_skip or t.activation_checkpointing:
        return None
    return (
        f"trainer.activation_checkpointing_skip = {t.activation_checkpointing_skip} needs "
        "trainer.activation_checkpointing = true: it names the layers left out of checkpointing"
    )


def _rule_topk_kl_is_a_loss(cfg: ShardRLConfig) -> str | None:
    # The top-k KL is computed inside the actor's own pass, with grad: it is a loss term, over whole rows.
    a, t = cfg.algorithm, cfg.trainer
    if a.kl_estimator != "topk":
        return None
    if a.kl_mode != "loss":
        return "algorithm.kl_estimator = 'topk' needs algorithm.kl_mode = 'loss' (k1, k2 or k3 with 'reward')"
    if t.sequence_parallel != 1:
        return (
            f"algorithm.kl_estimator = 'topk' with trainer.sequence_parallel = {t.sequence_parallel}: it is computed "
            "over whole rows only; use k1, k2 or k3"
        )
    return None


def _rule_streaming_without_lora(cfg: ShardRLConfig) -> str | None:
    # An adapter version loaded in flight would need the old adapter resident until its requests end.
    if not cfg.rollout.streaming or cfg.model.lora.rank == 0:
        return None
    return (
        f"rollout.streaming = true with model.lora.rank = {cfg.model.lora.rank}: LoRA adapters are served by the "
        "batch workers only; set rollout.streaming = false"
    )


def _rule_env_prompts_from_verifiers(cfg: ShardRLConfig) -> str | None:
    # The episodes of a verifiers environment run its own tasks (a prompt from elsewhere names no task of it).
    task, spec = cfg.data.task, cfg.env.verifiers
    if task == "env" and spec is None:
        return "data.task = 'env' needs env.verifiers: the prompts are the tasks of the environment it names"
    if task != "env" and spec is not None:
        return f"env.verifiers ({spec!r}) needs data.task = 'env' (not {task!r}): its tasks are the prompts"
    return None


def _rule_verifiers_rubric_scores(cfg: ShardRLConfig) -> str | None:
    function, spec = cfg.reward.function, cfg.env.verifiers
    if spec is not None and function != VERIFIERS_REWARD:
        return (
            f"reward.function ({function!r}) is not used with env.verifiers ({spec!r}): the environment's rubric "
            "scores every episode; leave reward.function unset"
        )
    if spec is None and function == VERIFIERS_REWARD:
        return f"reward.function = {function!r} is the rubric of env.verifiers, which is not set"
    return None


def _rule_pretrain_on_a_builtin_task(cfg: ShardRLConfig) -> str | None:
    if cfg.model.tiny_pretrain_steps == 0 or cfg.data.task != "env":
        return None
    return (
        f"model.tiny_pretrain_steps ({cfg.model.tiny_pretrain_steps}) needs a built-in task (data.task max_digit, "
        "mod_add or lookup), not data.task = 'env'"
    )


RULES = (
    _rule_engine_settings,
    _rule_streaming_without_lora,
    _rule_initial_workers,
    _rule_backlog_fills_a_step,
    _rule_whole_groups,
    _rule_staleness_bounds,
    _rule_context_fits,
    _rule_vllm_token_budget,
    _rule_kl_horizon_spans_a_step,
    _rule_sequence_parallel_packs,
    _rule_offload_checkpoints,
    _rule_skip_needs_checkpoints,
    _rule_topk_kl_is_a_loss,
    _rule_env_turn_fits_response,
    _rule_env_prompts_from_verifiers,
    _rule_verifiers_rubric_scores,
    _rule_pretrain_on_a_builtin_task,
)

# Settings a single process may change with a CLI flag without touching the run's contract.
PER_PROCESS_FIELDS = frozenset(
    {
        "rollout.max_local_workers",
        "rollout.streaming",
        "rollout.max_in_flight",
        "rollout.score_processes",
        "rollout.cpu_workers",
        "rollout.threads_per_worker",
        "rollout.drain_deadline_s",
        "rollout.weights_poll_s",
        "rollout.engine",
        "trainer.max_steps",
        "trainer.step_wait_timeout_s",
        "trainer.poll_interval_s",
        "trainer.tensorboard",
        # a layout of the computation, not of the results: a run may resume at another K
        "trainer.sequence_parallel",
        "trainer.fsdp_prefetch",
        "trainer.activation_checkpointing_skip",  # the same gradients, another memory-for-speed trade
        *(f"eval.{k}" for k in EvalConfig.model_fields),  # the evaluator is optional and may run with its own
    }
)
