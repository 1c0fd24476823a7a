"""Generation engines behind one small interface (``base.Engine``): vLLM, or plain transformers as the fallback.

``make_engine`` is the only constructor the rollout worker uses.  Importing this package imports neither torch nor
vLLM; the chosen engine imports its library when it is built.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from rollout_worker.engines.base import Completion, Engine, EngineError, SamplingSpec, StreamingEngine

__all__ = [
    "Completion",
    "Engine",
    "EngineError",
    "SamplingSpec",
    "StreamingEngine",
    "make_engine",
    "make_streaming_engine",
    "resolve_kind",
]

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


def make_engine(
    kind: str,
    model_dir: Path,
    *,
    dtype: str = "float32",
    seed: int = 0,
    max_model_len: int = 2048,
    vllm_options: dict[str, Any] | None = None,
    lora_rank: int = 0,
) -> Engine:
    """Build the engine of ``kind`` ("vllm" | "hf" | "auto") on the HF model in ``model_dir``.

    ``vllm_options`` are ``vllm.LLM`` arguments (``None`` values mean vLLM's default) plus ``cpu_kvcache_space_gib``
    and ``cpu_threads_bind``; the transformers engine ignores them.  ``lora_rank`` > 0 (``model.lora.rank``): the
    engine serves LoRA adapters of at most that rank on its base (``base.plan_load``).
    """
    kind = resolve_kind(kind)
    if kind == "vllm":
        from rollout_worker.engines.vllm import VllmEngine

        return VllmEngine(
            model_dir,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            options=vllm_options,
            lora_rank=lora_rank,
        )
    from rollout_worker.engines.hf import HFEngine

    return HFEngine(model_dir, dtype=dtype, seed=seed, max_model_len=max_model_len, lora_rank=lora_rank)


def make_streaming_engine(
    kind: str,
    model_dir: Path,
    *,
    dtype: str = "float32",
    seed: int = 0,
    max_model_len: int = 2048,
    vllm_options: dict[str, Any] | None = None,
    lora_rank: int = 0,
    max_batch_size: int = 256,
) -> StreamingEngine:
    """The streaming engine of ``kind`` (``rollout.streaming``): requests one at a time, weights updated in flight.

    ``max_batch_size``: the transformers engine's rows decoded together (vLLM schedules by its own
    ``max_num_seqs``)."""
    kind = resolve_kind(kind)
    if kind == "vllm":
        from rollout_worker.engines.vllm_stream import StreamingVllmEngine

        return StreamingVllmEngine(
            model_dir,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            options=vllm_options,
            lora_rank=lora_rank,
        )
    from rollout_worker.engines.hf_stream import StreamingHFEngine

    return StreamingHFEngine(
        model_dir,
        dtype=dtype,
        seed=seed,
        max_model_len=max_model_len,
        lora_rank=lora_rank,
        max_batch_size=max_batch_size,
    )
