"""``EngineSpec``: how one engine is built, the one argument every engine and factory takes; ``of_run`` decides it
once from the run (kind, dtype, context, vLLM options, LoRA rank), so the worker and the evaluator build theirs the
same way."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from buffer.config import resolve_dtype
from buffer.run import Run
from rollout_worker.engines.base import EngineError

KINDS = ("auto", "vllm", "hf")


def resolve_kind(kind: str) -> str:
    """``auto`` -> ``vllm`` where vLLM is installed, else ``hf``; other kinds are checked and returned."""
    if kind not in KINDS:
        raise EngineError(f"rollout.engine: {kind!r} is not one of {', '.join(KINDS)}")
    if kind == "auto":
        return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
    if kind == "vllm" and importlib.util.find_spec("vllm") is None:
        raise EngineError("rollout.engine: 'vllm' is not installed here; use 'hf' or 'auto'")
    return kind


@dataclass(frozen=True)
class EngineSpec:
    kind: str  # "vllm" | "hf" | "auto" (the factories resolve it)
    model_dir: Path
    dtype: str = "float32"
    seed: int = 0
    max_model_len: int = 2048
    # vllm.LLM arguments (None values: vLLM's default) plus cpu_kvcache_space_gib and cpu_threads_bind
    vllm_options: dict[str, Any] = field(default_factory=dict)
    lora_rank: int = 0  # > 0: serve LoRA adapters of at most this rank on the base (base.plan_load)
    max_batch_size: int = 256  # transformers engines: rows decoded together (vLLM has its own max_num_seqs)
    device: str | None = None  # transformers engines: None = CUDA where visible
    # vLLM: False = no tokenizer in the engine (``skip_tokenizer_init``).  Its front end otherwise turns every
    # sampled token back into a string at every step, for the logprobs and the incremental text, and that one core
    # is what caps a streaming engine on a GPU.  Stop strings need it; the response text is decoded once from the ids.
    detokenize: bool = True

    @classmethod
    def of_run(cls, run: Run, seed: int) -> EngineSpec:
        """The run's engine for this process: ``model.dtype = "auto"`` resolves here (bf16 where CUDA is visible)."""
        import torch

        cfg = run.config
        vllm = cfg.rollout.vllm  # None when this process runs the hf engine
        return cls(
            kind=resolve_kind(cfg.rollout.engine),
            model_dir=run.model_dir,
            dtype=resolve_dtype(cfg.model.dtype, cuda=torch.cuda.is_available()),
            seed=seed,
            max_model_len=cfg.context_length(),
            vllm_options=vllm.model_dump(exclude={"max_model_len"}) if vllm is not None else {},
            lora_rank=cfg.model.lora.rank,
            detokenize=needs_text(run),
        )


def needs_text(run: Run) -> bool:
    """Whether the run's requests may carry stop strings: its own sampling's, or an environment's per turn."""
    cfg = run.config
    return bool(cfg.rollout.sampling.stop or cfg.env.tools or cfg.env.agent or cfg.env.verifiers)
