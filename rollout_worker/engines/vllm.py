"""Generation with vLLM (the CPU build here, the CUDA build on GPU nodes), with in-place hot reload of weights.

``vllm.LLM`` runs its engine core and its model worker in processes it spawns; the process that builds a
``VllmEngine`` must therefore be importable without side effects (an ``if __name__ == "__main__":`` guard in scripts).
Logprobs are vLLM's ``processed_logprobs``: each sampled token's logprob under the distribution it was actually drawn
from (temperature, top-k, top-p applied), the behaviour policy PPO corrects for.

Hot reload goes through ``WorkerExtension``, which vLLM mixes into its worker class in the worker process (named by
its import path; only a path string and a method name cross the process boundary).  This module imports vLLM only
when an engine is built, so the worker process can import the extension cheaply.

With LoRA the engine starts with ``enable_lora`` (``max_lora_rank``: the configured rank rounded up to a size vLLM
has kernels for) and a new version is a new ``LoRARequest`` id, registered with ``add_lora`` at load time (so a bad
adapter is refused there, not in the next generate) while the base weights never move; the previous id is removed.
The prefix cache needs no reset: vLLM keys cached blocks by adapter.

On the CPU build the engine runs without chunked prefill: its seeded sampler fails on a prompt prefilled in parts
(``RuntimeError: CPU Generator does not use offset``), which a batch larger than ``max_num_batched_tokens`` would
otherwise cause.  vLLM then needs a token budget that holds one whole sequence (a config rule checks it at init).
When the engine dies, vLLM's own exception only says "see stack trace above"; ``EngineDied`` carries the root
exception instead, read from what the engine's processes wrote to this process's stderr (the worker's log).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rollout_worker.engines.base import (
    Completion,
    EngineError,
    SamplingSpec,
    check_prompts,
    engine_base_hash,
    plan_load,
    require_model_dir,
    safetensors_files,
    sample_seed,
)
from rollout_worker.engines.gpu_start import engine_start
from rollout_worker.engines.spec import EngineSpec

EXTENSION = f"{__name__}.WorkerExtension"
# Options that are not vllm.LLM arguments.
_OWN_OPTIONS = {"cpu_kvcache_space_gib", "cpu_threads_bind"}
# The adapter ranks vLLM 0.32 accepts as max_lora_rank.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


# A line that names an exception: bare (``RuntimeError: ...``) or in a vLLM process's log prefix
# (``(Worker pid=12) ERROR 12-01 19:06:39 [multiproc_executor.py:1063] RuntimeError: ...``).
_EXCEPTION_LINE = re.compile(r"^(?:\(\w+ pid=\d+\) ERROR .*?\] )?((?:\w+\.)*\w*(?:Error|Exception)): (.+)$")
# Phrases of vLLM's wrapper exceptions, which point at a root cause instead of being one.
_WRAPPER_PHRASES = ("stack trace", "root cause", "encountered an issue")
_LOG_TAIL_BYTES = 1 << 20


class EngineDied(RuntimeError):
    """The vLLM engine's processes died; the message is the root exception from the log when one was found."""


def root_cause(log_text: str) -> str | None:
    """The first exception line of ``log_text`` that is not one of vLLM's "see the stack trace" wrappers."""
    for line in log_text.splitlines():
        m = _EXCEPTION_LINE.match(line.rstrip())
        if m is None or any(p in m.group(2).lower() for p in _WRAPPER_PHRASES):
            continue
        return f"{m.group(1).rsplit('.', 1)[-1]}: {m.group(2)}"[:400]
    return None


def _stderr_size() -> int | None:
    """Size of this process's stderr when it is a regular file (a worker's log), else None."""
    try:
        st = os.fstat(2)
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None


def _stderr_since(offset: int | None) -> str:
    if offset is None:
        return ""
    with contextlib.suppress(OSError), open("/proc/self/fd/2", "rb") as f:
        end = f.seek(0, os.SEEK_END)
        f.seek(max(offset, end - _LOG_TAIL_BYTES))
        return f.read().decode(errors="replace")
    return ""


def _is_engine_death(e: BaseException) -> bool:
    text = str(e).lower()
    return type(e).__name__ == "EngineDeadError" or any(p in text for p in _WRAPPER_PHRASES)


@contextlib.contextmanager
def engine_errors(log_offset: int | None) -> Iterator[None]:
    """Turn vLLM's "engine died, see above" into ``EngineDied`` naming the root exception from the log."""
    try:
        yield
    except Exception as e:
        if not _is_engine_death(e):
            raise
        cause = root_cause(_stderr_since(log_offset))
        if cause is None:
            raise
        raise EngineDied(f"vLLM engine died: {cause}") from e


def max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds adapters of ``rank``."""
    for r in LORA_RANKS:
        if r >= rank:
            return r
    raise EngineError(
        f"model.lora.rank {rank} is above the largest LoRA rank vLLM supports ({LORA_RANKS[-1]})"
    )


class WorkerExtension:
    """Methods added to vLLM's worker class (``worker_extension_cls``); ``self`` is the worker."""

    def shardrl_reload_weights(self, weights_path: str) -> float:
        """Reload HF-format safetensors from ``weights_path`` in place; returns the seconds it took."""
        from vllm.platforms import current_platform

        start = time.perf_counter()
        self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        lm_head = getattr(model, "lm_head", None)
        tied = getattr(self.model_config.hf_config, "tie_word_embeddings", False)  # type: ignore[attr-defined]
        if tied and lm_head is not None and current_platform.is_cpu():
            # On CPU the LM head's matmul runs on a prepacked copy of its weight.  A tied head shares the embedding,
            # which the reload refilled, but nothing repacks the head: without this it keeps the old weights.
            lm_head.quant_method.process_weights_after_loading(lm_head)
        return time.perf_counter() - start


def configure_env(options: dict[str, Any]) -> None:
    """Environment for vLLM, read by the processes it starts.

    Start method: always ``spawn`` (the CPU build chooses it anyway).  vLLM forks its engine process unless CUDA
    is initialised in this one, but ``torch.cuda.is_available()`` (``model.dtype = "auto"`` asks it) already marks
    this process so that CUDA cannot start in a forked child: on an H200 every worker died with "Cannot
    re-initialize CUDA in forked subprocess" while the same engine built in a process that had used CUDA ran.

    CPU backend (harmless on the CUDA build):

    KV cache: ``cpu_kvcache_space_gib`` (whole GiB; vLLM reads an integer).  Threads: ``cpu_threads_bind`` becomes
    ``VLLM_CPU_OMP_THREADS_BIND`` (``"0-3"``, ``"4-7"``, ...).  Without it vLLM's ``auto`` binding stays: the model
    worker gets all cores but one, kept for the scheduler and detokenizer processes.  On two cores that looks like a
    waste but measured best (tiny model: 13k tok/s against 8k with both cores bound and 2-5k unbound; an 89M model:
    no gain from the second core either).  Several engines on one node must each get their own cores: ``auto``
    would put every engine on the same ones.  A value already in the environment (supervisor, user) always wins.
    """
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    gib = options.get("cpu_kvcache_space_gib")
    if gib is not None and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(float(gib))))
    bind = options.get("cpu_threads_bind")
    if bind is not None and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(bind)


def sampled_logprobs(logprobs: Any, ids: list[int]) -> list[float]:
    """The sampled tokens' logprobs from vLLM's flat container (``flat_logprobs``; with ``logprobs=0`` it holds one
    entry a position, the sampled token's), read from its lists without a dict per position; looked up per position
    where it holds more, or is the older list of dicts."""
    flat = getattr(logprobs, "logprobs", None)
    if flat is not None and len(flat) == len(ids) and list(logprobs.token_ids) == ids:
        return [float(x) for x in flat]
    return [float(logprobs[i][t].logprob) for i, t in enumerate(ids)]


def engine_tokenizer(engine: Any, model_dir: Path, detokenize: bool) -> Any:
    """The tokenizer that decodes finished responses: vLLM's own, or the model's where the engine has none."""
    if detokenize:
        return engine.get_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def refuse_stops(sampling: SamplingSpec, detokenize: bool) -> None:
    """Stop strings on an engine built without a tokenizer: one line, before vLLM's own error deep in a request."""
    if sampling.stop and not detokenize:
        raise EngineError(
            "rollout.sampling.stop: stop strings need the engine's tokenizer; this engine was built without one "
            "(EngineSpec.detokenize = False)"
        )


def llm_kwargs(
    model_dir: Path,
    *,
    dtype: str,
    seed: int,
    max_model_len: int,
    options: dict[str, Any],
    lora_rank: int = 0,
    cpu: bool = False,
    detokenize: bool = True,
) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments: ours, then the options (``None`` = vLLM's default; dtype ``auto`` = ours).

    ``cpu``: the CPU build, which runs without chunked prefill (see the module's docstring).  ``detokenize``: see
    ``EngineSpec.detokenize``."""
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "dtype": dtype,
        "seed": seed,
        "max_model_len": max_model_len,
        "logprobs_mode": "processed_logprobs",
        "worker_extension_cls": EXTENSION,
        "enforce_eager": True,
        # vLLM's own per-iteration statistics (it logs them; shardrl reports its own) cost the front end's one core
        # about a twentieth of its time at hundreds of requests in flight
        "disable_log_stats": True,
    }
    if cpu:
        kwargs["enable_chunked_prefill"] = False
    if not detokenize:
        kwargs["skip_tokenizer_init"] = True
    if lora_rank > 0:  # one adapter at a time: the newest version
        kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank(lora_rank), max_loras=1)
    for key, value in options.items():
        if key in _OWN_OPTIONS or value is None or (key == "dtype" and value == "auto"):
            continue
        kwargs[key] = value
    return kwargs


class VllmEngine:
    """The ``Engine`` interface on ``vllm.LLM``."""

    def __init__(self, spec: EngineSpec) -> None:
        model_dir, dtype, seed, max_model_len = spec.model_dir, spec.dtype, spec.seed, spec.max_model_len
        options, lora_rank = spec.vllm_options, spec.lora_rank
        model_dir = require_model_dir(Path(model_dir))
        options = dict(options or {})
        configure_env(options)
        from vllm import LLM
        from vllm.platforms import current_platform

        self.model_dir, self.lora_rank = model_dir, lora_rank
        self.base_sha256 = engine_base_hash(model_dir, lora_rank)
        self.lora_request: Any = None  # the adapter every generate applies (LoRA engines, once one is loaded)
        self._lora_ids = 0
        self.kwargs = llm_kwargs(
            model_dir,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            options=options,
            lora_rank=lora_rank,
            cpu=current_platform.is_cpu(),
            detokenize=spec.detokenize,
        )
        self.detokenize = spec.detokenize
        self.max_model_len = int(self.kwargs["max_model_len"])
        self.log_offset = _stderr_size()  # the engine's processes write to our stderr from here on
        with engine_errors(self.log_offset), engine_start(self.kwargs, cpu=current_platform.is_cpu()):
            self.llm = LLM(**self.kwargs)
        self.tokenizer = engine_tokenizer(self.llm, model_dir, spec.detokenize)
        self.last_reload_s = 0.0

    def generate(self, prompt_ids: list[list[int]], sampling: SamplingSpec) -> list[list[Completion]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        check_prompts(prompt_ids, sampling, self.max_model_len)
        refuse_stops(sampling, self.detokenize)

        def params(seed: int | None, n: int = sampling.n, max_tokens: int = sampling.max_tokens) -> Any:
            return SamplingParams(
                n=n,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k if sampling.top_k > 0 else -1,
                max_tokens=max_tokens,
                stop=list(sampling.stop) or None,
                seed=seed,
                logprobs=0,
                flat_logprobs=True,  # lists, not a dict of Logprob objects a token
                ignore_eos=sampling.ignore_eos,
            )

        if sampling.max_tokens_each is not None:  # a request per sample, each with its own length
            return self._generate_each(prompt_ids, sampling, params)

        # vLLM gives the children of one request seeds seed + j; offsetting each prompt by n keeps every sample's
        # stream distinct (one seed for the whole batch would give identical prompts identical samples).
        per_prompt = [params(sample_seed(sampling.seed, i, sampling.n, 0)) for i in range(len(prompt_ids))]
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids]
        with engine_errors(self.log_offset):
            outputs = self.llm.generate(prompts, per_prompt, use_tqdm=False, lora_request=self.lora_request)
        return [[self._completion(req.prompt_token_ids, out) for out in req.outputs] for req in outputs]

    def _generate_each(
        self, prompt_ids: list[list[int]], sampling: SamplingSpec, params: Any
    ) -> list[list[Completion]]:
        from vllm.inputs import TokensPrompt

        assert sampling.max_tokens_each is not None
        n = sampling.n
        flat = [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids for _ in range(n)]
        each = [
            params(sample_seed(sampling.seed, k // n, n, k % n), 1, m)
            for k, m in enumerate(sampling.max_tokens_each)
        ]
        with engine_errors(self.log_offset):
            outputs = self.llm.generate(flat, each, use_tqdm=False, lora_request=self.lora_request)
        done = [self._completion(req.prompt_token_ids, req.outputs[0]) for req in outputs]
        return [done[i * n : (i + 1) * n] for i in range(len(prompt_ids))]

    def _completion(self, prompt_ids: Any, out: Any) -> Completion:
        ids = list(out.token_ids)
        # vLLM's streaming detokenizer holds back a trailing partial UTF-8 character; decoding the ids gives the same
        # text as the transformers engine.  Only a stop string's cut comes from vLLM.
        stopped_by_string = isinstance(out.stop_reason, str)
        return Completion(
            prompt_ids=list(prompt_ids),
            response_ids=ids,
            response_logprobs=sampled_logprobs(out.logprobs, ids),
            finish_reason="length" if out.finish_reason == "length" else "stop",
            response_text=out.text
            if stopped_by_string
            else self.tokenizer.decode(ids, skip_special_tokens=True),
        )

    def load_weights(self, weights_dir: Path) -> None:
        """Between ``generate`` calls: apply the version's adapter (LoRA engines), or reload full weights in place
        and drop the prefix cache filled under the old weights."""
        weights_dir = Path(weights_dir).absolute()
        plan = plan_load(
            weights_dir, lora_rank=self.lora_rank, base_sha256=self.base_sha256, base_dir=self.model_dir
        )
        if plan.what == "adapter":
            self._load_adapter(plan.path)
            return
        weights_dir = plan.path  # a delta version's rebuilt copy
        safetensors_files(weights_dir)
        seconds = self.llm.collective_rpc("shardrl_reload_weights", kwargs={"weights_path": str(weights_dir)})
        self.last_reload_s = max(float(s) for s in seconds)  # one result per tensor-parallel rank
        if not self.llm.reset_prefix_cache():
            raise EngineError(
                "vllm engine: prefix cache not reset after a weight reload (requests still running)"
            )

    def _load_adapter(self, adapter_dir: Path) -> None:
        """Register the adapter under a new id and make it the one every generate applies; drop the previous id."""
        from vllm.lora.request import LoRARequest

        start = time.perf_counter()
        self._lora_ids += 1
        request = LoRARequest(f"shardrl-{self._lora_ids}", self._lora_ids, str(adapter_dir))
        try:
            added = self.llm.llm_engine.add_lora(request)
        except (ValueError, RuntimeError, OSError, KeyError) as e:
            if type(e).__name__ == "EngineDeadError":
                raise
            raise EngineError(
                f"{adapter_dir}: vLLM refused the adapter: {str(e).splitlines()[0] if str(e) else e!r}"
            ) from None
        if not added:
            raise EngineError(f"{adapter_dir}: vLLM did not register the adapter")
        old, self.lora_request = self.lora_request, request
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
        self.last_reload_s = time.perf_counter() - start

    def close(self) -> None:
        """Stop the engine core and worker processes now rather than when the interpreter exits."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
