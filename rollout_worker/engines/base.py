"""The one small interface every generation engine implements, and what it returns.

A rollout worker holds one engine for its whole life: it calls ``generate`` on token ids (the worker tokenizes, so
the ids it trains on are exactly the ids the engine saw) and ``load_weights`` between batches when the trainer has
published a new version.  Importing this module imports nothing heavy.

With LoRA (``model.lora.rank`` > 0) an engine is started with ``lora_rank`` and serves peft adapters on its base,
which never moves: ``load_weights`` of an adapter version (or of a merged full version, which carries its adapter)
makes that adapter the active one.  ``plan_load`` decides what a directory is for an engine, and refuses, in one line,
an adapter trained on another base (its manifest's ``base_sha256`` against ``buffer.weights.base_model_hash`` of the
engine's base), an adapter for an engine without LoRA, and full weights without an adapter for an engine with it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol, cast

from buffer.deltas import DELTA_RECORD
from buffer.records import RecordError
from buffer.weights import MANIFEST, WeightsError, base_model_hash, read_manifest


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
    # The policy version that sampled each response token (streaming engines, which load new weights while
    # responses are being generated); None (batch engines): every token is the version the caller generated with.
    token_versions: list[int] | None = None


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
    # Keep sampling past an EOS token until max_tokens (benchmarks that need a chosen length distribution).
    ignore_eos: bool = False
    # Each sample's own max_tokens (prompt-major: prompt i's sample j is ``i * n + j``); None: max_tokens for all.
    max_tokens_each: list[int] | None = None


class Engine(Protocol):
    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSpec) -> list[list[Completion]]:
        """For each prompt, ``sampling.n`` completions, in prompt order."""
        ...

    def load_weights(self, weights_dir: Path) -> None:
        """Serve the weights of ``weights_dir`` from now on: HF-format safetensors replace the weights in place (no
        restart, no recompile); with LoRA the directory's adapter becomes the active one (see ``plan_load``)."""
        ...

    def close(self) -> None: ...


class StreamingEngine(Protocol):
    """An engine that takes requests one at a time while others run (continuous batching) and loads new weights
    without waiting for them (``rollout.streaming``).

    Every request is one sample (``sampling.n`` is 1, its seed its own).  A request that runs across a weight
    update continues on the new weights; its ``Completion.token_versions`` then says which version sampled each
    token, and its logprobs are each token's under the weights that sampled it.
    """

    version: int  # the policy version new tokens are sampled with

    def submit(self, key: str, prompt_ids: list[int], sampling: SamplingSpec) -> None:
        """Start generating; the result comes back from ``finished`` under ``key``."""
        ...

    def finished(self, timeout: float) -> list[tuple[str, Completion]]:
        """The requests done since the last call, waiting up to ``timeout`` seconds for the first."""
        ...

    def abort(self, key: str) -> None:
        """Stop a request; it never comes back from ``finished``."""
        ...

    def update_weights(self, weights_dir: Path, version: int) -> None:
        """Serve ``weights_dir`` as ``version`` from the next token on, keeping the requests in flight; returns
        once new tokens come from the new weights (EngineError, weights unchanged, when the directory is bad)."""
        ...

    def stats(self) -> EngineStats: ...

    def close(self) -> None: ...


# How a worker hands its engine a new version: a materialised weights directory and the version it is.
WeightLoader = Callable[[Path, int], None]


def weight_loader(engine: Engine | StreamingEngine, streaming: bool) -> WeightLoader:
    """``streaming``: the engine keeps its requests going across the update; otherwise it loads between calls."""
    if streaming:
        return cast(StreamingEngine, engine).update_weights
    batch = cast(Engine, engine)
    return lambda weights_dir, _version: batch.load_weights(weights_dir)


@dataclass
class EngineStats:
    """Counters of a streaming engine since it started (seconds of wall time)."""

    in_flight: int = 0  # requests submitted and not finished
    busy_s: float = 0.0  # time with at least one request in flight and not paused for a weight update
    paused_s: float = 0.0  # time paused for weight updates
    updates: int = 0  # weight updates applied in flight
    tokens: int = 0  # tokens generated


class BusyClock:
    """Wall time with requests in flight (``busy_s``) and paused for a weight update (``paused_s``); thread-safe
    enough for counters read by a status thread (each change is one assignment under the caller's lock)."""

    def __init__(self) -> None:
        self._now = time.monotonic
        self.busy_s = 0.0
        self.paused_s = 0.0
        self._since = self._now()
        self._in_flight = 0
        self._paused = False

    def _tick(self) -> None:
        now = self._now()
        if self._paused:
            self.paused_s += now - self._since
        elif self._in_flight > 0:
            self.busy_s += now - self._since
        self._since = now

    def set(self, *, in_flight: int | None = None, paused: bool | None = None) -> None:
        self._tick()
        if in_flight is not None:
            self._in_flight = in_flight
        if paused is not None:
            self._paused = paused

    def read(self) -> tuple[float, float]:
        self._tick()
        return self.busy_s, self.paused_s


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


ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True)
class LoadPlan:
    """What ``load_weights`` does with a directory: reload full weights from ``path``, or apply the adapter there."""

    what: Literal["full", "adapter"]
    path: Path


def engine_base_hash(model_dir: Path, lora_rank: int) -> str | None:
    """The base fingerprint a LoRA engine checks adapters against (None without LoRA)."""
    if lora_rank <= 0:
        return None
    try:
        return base_model_hash(model_dir)
    except WeightsError as e:
        raise EngineError(str(e)) from None


def plan_load(weights_dir: Path, *, lora_rank: int, base_sha256: str | None, base_dir: Path) -> LoadPlan:
    """What an engine (``lora_rank`` > 0: a LoRA engine on the base ``base_dir``) does with ``weights_dir``.

    A published version says what it holds in its manifest; a directory without one (made by hand, a benchmark) is
    an adapter when it holds ``adapter_config.json``, and has no base fingerprint to check.  A delta version of the
    run directory is refused: an engine is handed whole weights, and rebuilding a delta is the node-local cache's
    job (``buffer.localcache.NodeCache.materialise``, which the worker's weight follower calls), done once per node.
    """
    weights_dir = Path(weights_dir)
    if not weights_dir.is_dir():
        raise EngineError(f"{weights_dir}: weights directory not found")
    if (weights_dir / DELTA_RECORD).is_file():
        raise EngineError(
            f"{weights_dir}: a delta version (it holds {DELTA_RECORD}); an engine loads whole weights: "
            "load the node-local copy that buffer.localcache.NodeCache.materialise rebuilds from it"
        )
    adapter: Path | None = weights_dir if (weights_dir / ADAPTER_CONFIG).is_file() else None
    full = adapter is None
    trained_on: str | None = None
    if (weights_dir / MANIFEST).is_file():
        try:
            manifest = read_manifest(weights_dir)
        except RecordError as e:
            raise EngineError(str(e)) from None
        full = manifest.kind == "full"
        adapter = weights_dir / manifest.adapter if manifest.adapter is not None else None
        trained_on = manifest.base_sha256
    if lora_rank <= 0:
        if not full:
            raise EngineError(
                f"{weights_dir}: a LoRA adapter version, but this engine was started without LoRA "
                "(model.lora.rank = 0); refused"
            )
        return LoadPlan("full", weights_dir)
    if adapter is None:
        raise EngineError(
            f"{weights_dir}: full weights without a LoRA adapter, but this engine serves adapters on its "
            f"unchanged base (model.lora.rank = {lora_rank}); refused"
        )
    if trained_on is not None and trained_on != base_sha256:
        raise EngineError(
            f"{weights_dir / MANIFEST}: base_sha256 {trained_on[:12]}... is not this worker's base {base_dir} "
            f"({str(base_sha256)[:12]}...): the adapter was trained on another base model; refused"
        )
    adapter_rank(adapter, lora_rank)
    return LoadPlan("adapter", adapter)


def adapter_rank(adapter_dir: Path, max_rank: int) -> int:
    """The rank in ``adapter_dir/adapter_config.json``, checked against the engine's ``max_rank``; EngineError when
    the adapter is not one this engine can apply."""
    path = adapter_dir / ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise EngineError(f"{path}: missing; not a peft adapter directory") from None
    except ValueError as e:
        raise EngineError(f"{path}: not valid JSON ({e})") from None
    rank = config.get("r") if isinstance(config, dict) else None
    if not isinstance(rank, int) or rank < 1:
        raise EngineError(f"{path}: field r is {rank!r}, expected the LoRA rank (an integer >= 1)")
    if rank > max_rank:
        raise EngineError(
            f"{path}: field r is {rank}, above the rank this engine was started for ({max_rank}, model.lora.rank)"
        )
    if not (adapter_dir / "adapter_model.safetensors").is_file():
        raise EngineError(f"{adapter_dir}: no adapter_model.safetensors in the adapter directory")
    return rank
