"""The sections of a run config: one pydantic model per TOML table, each field with a description and bounds."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    field_validator,
    model_validator,
)

from ..fsio import GROUP_SHARED, Modes, mode_problem


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _octal(value: Any) -> Any:
    """A mode given as text (``--run.file_mode 0o640``, or config.json's own "0o640") is octal."""
    if isinstance(value, str):
        try:
            return int(value.removeprefix("0o"), 8)
        except ValueError:
            return value  # left for the int validation to refuse in one line
    return value


_Mode = Annotated[
    int, BeforeValidator(_octal), PlainSerializer(lambda v: f"{v:#o}", return_type=str, when_used="json")
]


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
    wandb: bool = Field(
        False,
        description="Also log metrics to Weights & Biases (the `wandb` extra): one W&B run per process, grouped "
        "by the run id; WANDB_MODE=offline works without network.  Off, with one log line, when wandb is absent.",
    )
    wandb_project: str = Field("shardrl", description="The W&B project of run.wandb.")
    keep_weight_versions: int = Field(
        3, ge=1, description="Published weight versions kept by garbage collection: the newest K."
    )
    keep_weight_every: int = Field(
        0,
        ge=0,
        description="Also keep every version whose number is a multiple of N (milestones for evaluation), "
        "besides the newest run.keep_weight_versions; 0 = none.",
    )
    file_mode: _Mode | None = Field(
        None,
        description="Permission bits of every file the run creates, in octal (0o640); default 0o644, or 0o660 "
        "with run.group_shared.  Never writable by others.",
    )
    dir_mode: _Mode | None = Field(
        None,
        description="Permission bits of every directory the run creates, in octal (0o750, 0o2770 with setgid); "
        "default 0o755, or 0o2770 with run.group_shared.  Never writable by others.",
    )
    group_shared: bool = Field(
        False,
        description="The run is shared by one Unix group: files 0o660 and directories 0o2770 (setgid keeps the "
        "group on new entries), where run.file_mode/run.dir_mode do not say otherwise.",
    )

    def modes(self) -> Modes:
        """The file and directory modes of the run (``buffer.fsio.set_modes``)."""
        base = GROUP_SHARED if self.group_shared else Modes()
        return Modes(
            file=base.file if self.file_mode is None else self.file_mode,
            dir=base.dir if self.dir_mode is None else self.dir_mode,
        )

    @model_validator(mode="after")
    def _modes_are_safe(self) -> RunConfig:
        problem = mode_problem(self.modes())
        if problem is not None:
            raise ValueError(f"run.file_mode/run.dir_mode: {problem} (write modes in octal: 0o640)")
        return self


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
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="Dtype of the published weights and of the rollout engine; `auto` = bfloat16 in a process "
        "that sees CUDA, float32 on CPU.",
    )
    vocab_size: int | None = Field(
        None, ge=1, description="Filled in by `shardrl init` from the model config."
    )
    tiny_init_std: float = Field(
        0.02, gt=0, description="Initializer std of the built-in tiny model (`tiny` / `tiny-tied` only)."
    )
    tiny_pretrain_steps: int = Field(
        0,
        ge=0,
        le=10_000,
        description="Supervised steps on the other built-in task (mod_add for max_digit, and back) that pretrain "
        "the built-in tiny model before the run, so that it knows the answer format as a pretrained base would; "
        "LoRA on a random base cannot learn it (`shardrl demo --lora` uses 200).",
    )
    lora: LoraConfig = Field(default_factory=LoraConfig)


class DataConfig(_Section):
    """Where prompts come from."""

    task: Literal["max_digit", "mod_add", "lookup", "file", "env"] = Field(
        "max_digit",
        description="Built-in demo task (`lookup`: the tool task), `file` to read `prompts_file`, or `env`: "
        "prompts from the environment (env.verifiers).",
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
        "`package.module:function` (docs/DATA.md); unset with env.verifiers, whose rubric scores.",
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
    timeout_s: float = Field(
        60.0,
        gt=0,
        description="Streaming workers (`rollout.streaming`): wall time of one reward call in its scoring "
        "process; past it the process is killed and the sample scores 0.0 (recorded in its `extra`).",
    )


class SamplingConfig(_Section):
    """How each worker samples responses."""

    temperature: float = Field(1.0, ge=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(-1, ge=-1, description="Top-k sampling; -1 disables.")
    max_response_length: int = Field(1024, ge=1, description="Maximum generated tokens per response.")
    n: int = Field(8, ge=1, description="Samples per prompt (one GRPO group).")
    stop: list[str] = Field(default_factory=list, description="Stop strings (token ids keep them).")
    lengths: Literal["natural", "loguniform"] = Field(
        "natural",
        description="For benchmarks: `loguniform` draws each sample's length log-uniformly between "
        "min_response_length and max_response_length and samples past EOS to it (a long-tailed length mix "
        "from any model); `natural` = the model decides.",
    )
    min_response_length: int = Field(16, ge=1, description="Shortest length of `lengths = loguniform`.")


class VllmConfig(_Section):
    """vLLM engine settings: accepted only with rollout.engine = "vllm" or "auto" (an hf run has none)."""

    dtype: str = Field("auto", description="vLLM dtype; `auto` follows model.dtype.")
    gpu_memory_utilization: float = Field(
        0.5, gt=0, le=1, description="Fraction of GPU memory vLLM may take."
    )
    max_model_len: int | None = Field(
        None,
        ge=1,
        description="Context length; must hold data.max_prompt_length + rollout.sampling.max_response_length "
        "(their sum when null).",
    )
    tensor_parallel_size: int = Field(1, ge=1, description="Tensor-parallel size of each worker's engine.")
    enforce_eager: bool = Field(False, description="Disable CUDA graphs (faster start, slower decode).")
    max_num_seqs: int = Field(256, ge=1, description="Maximum concurrent sequences.")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="Scheduler token budget per step.")
    cpu_kvcache_space_gib: float = Field(1.0, gt=0, description="KV cache size on the CPU build (GiB).")
    stream_interval: int = Field(
        16,
        ge=1,
        description="Streaming engine: tokens vLLM gathers per request before handing them over (1 = every step); "
        "fewer hand-overs free the front end's one core, which caps tokens/s on a GPU.",
    )


class RolloutConfig(_Section):
    """Rollout workers and the node supervisor."""

    engine: Literal["auto", "vllm", "hf"] = Field(
        "auto",
        description="`auto` = vllm when it imports, else hf.  `[rollout.vllm]` settings are accepted only with "
        "vllm or auto; `--rollout.engine hf` on a command line drops them.",
    )
    max_local_workers: int | None = Field(
        None,
        ge=0,
        description="Worker slots per node; default: visible GPUs (GPU groups of vllm.tensor_parallel_size), or "
        "`cpu_workers` without GPUs. More slots than GPU groups share them round-robin: give each vLLM worker its "
        "share with vllm.gpu_memory_utilization; engines sharing a GPU start one at a time (each sizes its KV cache "
        "from the memory it sees free).",
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
        4096,
        ge=1,
        description="Pause while the unconsumed backlog, plus the samples other workers are generating, exceeds "
        "this (never below a trainer step's worth).",
    )
    weights_poll_s: float = Field(1.0, gt=0, description="How often to poll weights/LATEST between batches.")
    local_cache_dir: str = Field(
        "",
        description="Node-local directory where the first worker of a node copies (and rebuilds from deltas) "
        "each weight version once for every worker of the node; needs room for a few versions on a local disk. "
        "Empty = the node's temporary directory ($TMPDIR or /tmp)/shardrl-cache-<run id>.",
    )
    drain_deadline_s: float = Field(
        20.0, gt=0, description="SIGTERM: workers drained and exited within this."
    )
    restart_backoff_s: float = Field(2.0, gt=0, description="First restart delay of a dead worker (doubles).")
    max_restarts: int = Field(
        5, ge=0, description="Restarts within `restart_window_s` before a slot is failed."
    )
    restart_window_s: float = Field(300.0, gt=0, description="Window for counting crash-loop restarts.")
    threads_per_worker: int | None = Field(None, ge=1, description="OMP threads per CPU worker.")
    streaming: bool = Field(
        False,
        description="Streaming workers: requests join the engine one sample at a time as others finish "
        "(continuous batching), a group is scored in `score_processes` processes as soon as its last sample "
        "ends, and a new weight version is loaded in flight (requests keep going on the new weights; each token "
        "records its version).  false = batch by batch.",
    )
    max_in_flight: int | None = Field(
        None,
        ge=1,
        description="Streaming: samples generating at once on one worker; default prompts_per_batch x "
        "sampling.n.",
    )
    score_processes: int = Field(
        1,
        ge=0,
        description="Streaming: processes scoring rewards beside the engine; 0 = in the worker's own thread "
        "(no time limit).",
    )
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    vllm: VllmConfig | None = Field(
        None, description="vLLM settings; filled with defaults when the engine is vllm or auto, none for hf."
    )

    @model_validator(mode="before")
    @classmethod
    def _vllm_section_for_vllm_engines(cls, data: Any) -> Any:
        # The engine picks the variant: vllm/auto carry a (default) vLLM section, hf none; an hf engine *with*
        # a vLLM section is refused by `rule_engine_settings`, so that section is kept here for it to see.
        if isinstance(data, dict) and data.get("engine", "auto") != "hf" and data.get("vllm") is None:
            return {**data, "vllm": {}}
        return data


class TrainerConfig(_Section):
    """The torchrun FSDP2 trainer."""

    lr: float = Field(1e-5, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps.")
    schedule: Literal["constant", "cosine"] = Field("constant", description="LR schedule after warmup.")
    total_steps: int = Field(
        1000,
        ge=1,
        description="The run's budget over every trainer incarnation: the trainer that trains this step writes "
        "RUN/finished.json and the run ends.  Also the horizon of the cosine schedule.",
    )
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
    publish_full_every: int = Field(
        10,
        ge=1,
        le=1000,
        description="Every N-th published version is full weights; the N - 1 between are deltas against the last "
        "full one (XOR + zstd of the bytes: a few percent of the size for bf16 after a small step). 1 = every "
        "version full. LoRA adapter and merged versions are always full.",
    )
    save_every: int = Field(10, ge=1, description="DCP checkpoint every N steps.")
    keep_checkpoints: int = Field(2, ge=1, description="Complete checkpoints kept.")
    max_steps: int | None = Field(
        None, ge=1, description="Stop after N steps in this invocation (per process)."
    )
    sequence_parallel: int = Field(
        1,
        ge=1,
        le=64,
        description="Ulysses sequence parallelism: each packed micro-batch is split over this many consecutive "
        "ranks, which exchange attention heads (all-to-all) so that each attends over the whole row; the ranks of "
        "a group train on the same samples and FSDP still shards over every rank. Must divide the trainer's world "
        "size and the model's attention heads (KV heads are repeated up to a multiple of it when it does not "
        "divide them); needs trainer.packing. 1 = off.",
    )
    activation_checkpointing: bool = Field(False, description="Recompute decoder layers in backward.")
    activation_offload: bool = Field(
        False,
        description="With activation_checkpointing: each decoder layer's saved input lives in host memory (pinned) "
        "between forward and backward, so the GPU holds one layer's input instead of all of them; for long "
        "sequences. Costs a copy to the host and back per layer and step.",
    )
    activation_checkpointing_skip: int = Field(
        0,
        ge=0,
        description="With activation_checkpointing: this many decoder layers, spread evenly over the depth, are not "
        "checkpointed and keep their activations for backward. Each one saves a layer's forward in backward (a "
        "faster step) and holds that layer's activations for a whole micro-batch (more memory): for steps with "
        "memory to spare; activation_offload moves none of theirs to host memory. At most the model's layer "
        "count; 0 = every layer checkpointed.",
    )
    cpu_offload: bool = Field(
        False,
        description="Keep parameters, gradients and optimizer state in host memory (FSDP2 CPUOffloadPolicy); "
        "the optimizer step runs on the CPU. Saves GPU memory, costs step time.",
    )
    fsdp_prefetch: int = Field(
        1,
        ge=1,
        le=8,
        description="Decoder layers whose parameter all-gathers are in flight ahead of the layer computing, in "
        "forward and in backward. 1 is FSDP2's own overlap (the next layer's gather, issued when its turn comes); "
        "K >= 2 issues the next K as soon as a layer's own gather lands, for steps where the CPU issues kernels "
        "more slowly than the GPU runs them, and holds up to K - 1 more gathered layers in memory.",
    )
    param_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="FSDP2 compute dtype; auto = bf16 on GPU, fp32 on CPU."
    )
    kernels: Literal["auto", "eager", "compile"] = Field(
        "auto",
        description="compile: each decoder layer's forward compiled (fused RMSNorm, SwiGLU and rotary kernels); "
        "eager: plain PyTorch; auto = compile on GPU, eager on CPU.",
    )
    logprob_chunk: int = Field(1024, ge=1, description="Tokens per chunk when computing logprobs/entropy.")
    fused_head: bool = Field(
        True,
        description="The actor's LM head computes its gradient in forward, chunk by chunk, from the loss, instead "
        "of running each chunk's logits again in backward: one matrix product over the vocabulary less per token, "
        "for one more buffer the size of the head's weight (its gradient) held from forward to backward. For "
        "losses that are sums of per-token terms; GSPO, off_policy = 'tis' at sequence level, "
        "kl_estimator = 'topk' and sequence_parallel > 1 keep the recomputing head. false: always recompute.",
    )
    compile_head: bool | None = Field(
        None,
        description="With the fused head: each chunk's softmax, entropy and logits' gradient as two compiled "
        "kernels (torch.compile: Triton on a GPU, the C compiler on a CPU) that read the logits in their own "
        "dtype, instead of eager fp32 passes over them; the first step compiles them (seconds). null = as "
        "trainer.kernels resolves: compiled where the decoder layers are (compile, or auto on a GPU).",
    )
    critic_path: str | None = Field(None, description="PPO critic base; default a copy of the actor base.")
    critic_lr: float = Field(1e-5, gt=0, description="Critic learning rate.")
    critic_lora: AdapterConfig = Field(
        default_factory=AdapterConfig,
        description="LoRA on the critic's base (rank 0 = the whole critic trains).",
    )
    tensorboard: bool = Field(True, description="Also log to TensorBoard when it is installed.")


class EvalConfig(_Section):
    """The evaluator (`python -m rollout_worker --eval`): greedy scores of published weight versions."""

    every: int = Field(5, ge=1, description="Score every Nth published weight version (v0, the base, first).")
    base: bool = Field(True, description="Also score version 0, the base model, before any training.")
    prompts_file: str | None = Field(
        None,
        description="Held-out prompts, in the formats and fields of data.prompts_file; default the prompts of "
        "data.task (data.prompts_file itself with data.task = 'file').",
    )
    max_prompts: int | None = Field(None, ge=1, description="Score only the first N prompts.")
    max_response_length: int | None = Field(
        None, ge=1, description="Tokens per greedy response; default rollout.sampling.max_response_length."
    )
    full_score: float | None = Field(
        None,
        description="Reward that counts as correct for eval accuracy; default 1.0 for the registered rewards, "
        "none for a user function (then only the reward mean is recorded).",
    )
    poll_s: float = Field(2.0, gt=0, description="How often the evaluator looks for a new version.")
