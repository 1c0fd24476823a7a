"""``EngineSpec``: how a process's engine is built, decided once from the run (kind, dtype, context, vLLM options,
LoRA rank), so the worker and the evaluator build theirs the same way."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from buffer.config import resolve_dtype
from buffer.run import Run
from rollout_worker.engines import make_engine, make_streaming_engine, resolve_kind


@dataclass(frozen=True)
class EngineSpec:
    kind: str  # "vllm" | "hf", resolved
    model_dir: Path
    dtype: str
    seed: int
    max_model_len: int
    vllm_options: dict[str, Any] = field(default_factory=dict)
    lora_rank: int = 0

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
        )

    def _common(self) -> dict[str, Any]:
        return dict(
            dtype=self.dtype,
            seed=self.seed,
            max_model_len=self.max_model_len,
            vllm_options=self.vllm_options,
            lora_rank=self.lora_rank,
        )

    def build(self, *, streaming: bool, max_batch_size: int) -> Any:
        """The streaming engine (``rollout.streaming``) or the batch one."""
        return self.streaming_engine(max_batch_size) if streaming else self.batch_engine()

    def batch_engine(self) -> Any:
        return make_engine(self.kind, self.model_dir, **self._common())

    def streaming_engine(self, max_batch_size: int) -> Any:
        return make_streaming_engine(
            self.kind, self.model_dir, max_batch_size=max_batch_size, **self._common()
        )
