"""Generation engines behind one small interface (``base.Engine``): vLLM, or plain transformers as the fallback.

Every engine is built from one ``EngineSpec`` (``build``; ``make_engine`` takes its fields as keywords).  Importing
this package imports neither torch nor vLLM; the chosen engine imports its library when it is built.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from rollout_worker.engines.base import Completion, Engine, EngineError, SamplingSpec, StreamingEngine
from rollout_worker.engines.spec import EngineSpec, resolve_kind

__all__ = [
    "Completion",
    "Engine",
    "EngineError",
    "EngineSpec",
    "SamplingSpec",
    "StreamingEngine",
    "build",
    "build_engine",
    "build_streaming_engine",
    "make_engine",
    "make_streaming_engine",
    "resolve_kind",
]


def make_engine(kind: str, model_dir: Path, **spec: Any) -> Engine:
    """The batch engine of ``kind`` ("vllm" | "hf" | "auto") on the HF model in ``model_dir``; ``spec``: the other
    ``EngineSpec`` fields."""
    return build_engine(EngineSpec(kind, Path(model_dir), **_options(spec)))


def make_streaming_engine(kind: str, model_dir: Path, **spec: Any) -> StreamingEngine:
    """The streaming engine of ``kind`` (``rollout.streaming``): requests one at a time, weights updated in flight."""
    return build_streaming_engine(EngineSpec(kind, Path(model_dir), **_options(spec)))


def _options(spec: dict[str, Any]) -> dict[str, Any]:
    return spec | {"vllm_options": spec.get("vllm_options") or {}}


def build(spec: EngineSpec, *, streaming: bool) -> Engine | StreamingEngine:
    """The streaming engine (``rollout.streaming``) or the batch one."""
    return build_streaming_engine(spec) if streaming else build_engine(spec)


def build_engine(spec: EngineSpec) -> Engine:
    spec = replace(spec, kind=resolve_kind(spec.kind))
    if spec.kind == "vllm":
        from rollout_worker.engines.vllm import VllmEngine

        return VllmEngine(spec)
    from rollout_worker.engines.hf import HFEngine

    return HFEngine(spec)


def build_streaming_engine(spec: EngineSpec) -> StreamingEngine:
    spec = replace(spec, kind=resolve_kind(spec.kind))
    if spec.kind == "vllm":
        from rollout_worker.engines.vllm_stream import StreamingVllmEngine

        return StreamingVllmEngine(spec)
    from rollout_worker.engines.hf_stream import StreamingHFEngine

    return StreamingHFEngine(spec)
