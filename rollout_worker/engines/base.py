"""The one small interface every generation engine implements, and what it returns.

A rollout worker holds one engine for its whole life: it calls ``generate`` on token ids (the worker tokenizes, so
the ids it trains on are exactly the ids the engine saw) and ``load_weights`` between batches when the trainer has
published a new version.  Importing this module imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol


@dataclass
class Completion:
    """One sampled response to one prompt."""

    prompt_ids: list[int]
    response_ids: list[int]
    # Log-probability of each response token under the distribution it was sampled from (temperature, top-k and
    # top-p applied); what PPO needs as the behaviour policy's logprobs.
    response_logprobs: list[float]
    finish_reason: str  # "stop" (EOS token or stop string) | "length"
    # Detokenized response without special tokens, cut before a stop string.  The ids keep the stop string's tokens
    # and the EOS token: training uses the ids.
    response_text: str


@dataclass
class SamplingSpec:
    """How to sample; one spec for every prompt of a ``generate`` call."""

    temperature: float = 1.0  # 0 = greedy (logprobs then come from the unscaled distribution)
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) disables
    max_tokens: int = 16
    n: int = 1  # samples per prompt
    stop: list[str] = field(default_factory=list)
    # A call with a seed is reproducible on the same engine and weights (vLLM seeds sample j of prompt i with
    # seed + i * n + j; the transformers engine draws the whole call from one generator seeded with it).  Samples
    # of one call never share a stream, even for identical prompts.  None: the engine's own seeded stream.
    seed: int | None = None


class Engine(Protocol):
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSpec) -> list[list[Completion]]:
        """For each prompt, ``sampling.n`` completions, in prompt order."""
        ...

    def load_weights(self, weights_dir: Path) -> None:
        """Replace the weights in place from a HF-format directory of safetensors; no restart, no recompile."""
        ...

    def close(self) -> None: ...


class EngineError(RuntimeError):
    """A user-caused engine problem (missing model, bad weights directory); its message is one line."""


def require_model_dir(path: Path, what: str = "model directory") -> Path:
    """``path`` as a HF directory that holds config.json, or a one-line EngineError."""
    path = Path(path)
    if not path.is_dir():
        raise EngineError(f"{path}: {what} not found")
    if not (path / "config.json").is_file():
        raise EngineError(f"{path}: not a HF model directory (no config.json)")
    return path


def safetensors_files(weights_dir: Path) -> list[Path]:
    """The safetensors files of a published weights directory, or a one-line EngineError."""
    weights_dir = Path(weights_dir)
    if not weights_dir.is_dir():
        raise EngineError(f"{weights_dir}: weights directory not found")
    files = sorted(weights_dir.glob("*.safetensors"))
    if not files:
        raise EngineError(f"{weights_dir}: no *.safetensors files in the weights directory")
    return files


def check_prompts(prompt_ids: list[list[int]], sampling: SamplingSpec, max_model_len: int) -> None:
    """Refuse, with one line, what either engine would refuse or handle differently."""
    if sampling.n < 1 or sampling.max_tokens < 1:
        raise ValueError(f"sampling: n ({sampling.n}) and max_tokens ({sampling.max_tokens}) must be >= 1")
    for i, ids in enumerate(prompt_ids):
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        if len(ids) >= max_model_len:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens; the engine's max_model_len is {max_model_len}"
            )


def sample_seed(seed: int | None, prompt_index: int, n: int, sample_index: int) -> int | None:
    return None if seed is None else seed + prompt_index * n + sample_index
