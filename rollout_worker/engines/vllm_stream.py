"""Streaming generation with vLLM's async engine: requests join as others run, weights change under them.

``vllm.v1.engine.async_llm.AsyncLLM`` runs on an event loop in a thread of its own; the worker's thread submits a
request per sample and collects the finished ones from a queue, so the engine's continuous batching takes a new
request as soon as a slot frees instead of waiting for a batch's longest response.

A weight update in flight: ``pause_generation(mode="keep", clear_cache=True)`` freezes every request where it is
and drops the KV and prefix caches, the worker extension reloads the safetensors in place, and
``resume_generation`` lets the frozen requests go on.  Dropping the caches makes each frozen request prefill its
prompt and the tokens it already has again, under the new weights, so everything sampled after the update comes
from the new weights alone (no KV computed by the old ones): a response then carries the old version's tokens with
the old logprobs and the new version's with the new ones, each token's logprob under the weights that drew it, and
``token_versions`` says which is which.  Tokens are tagged with the version current when vLLM hands them over; the
pause waits until vLLM has processed every token drawn before it, so a token drawn before the pause is never
tagged with the new version.

vLLM hands a request's tokens over every ``rollout.vllm.stream_interval`` tokens (16), not every step: the front
end's one core, which turns each request's output of each step into objects and wakes its coroutine, is what caps
the engine on a GPU, and gathering 16 tokens a hand-over cut its CPU per output token from 43 to 25 us (CPU build,
``bench/engine_alone.py``).  Tokens still held when an update comes are the old weights': the swap reads how many
tokens vLLM's output processor has made for each request (``processed_counts``) and tags those positions with the
old version when they arrive.

LoRA adapters are not served here (an adapter update would need two adapters resident while old requests finish);
a LoRA run uses the batch engine (``rollout.streaming = false``), refused in one line otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from rollout_worker.engines.base import (
    BusyClock,
    Completion,
    EngineError,
    EngineStats,
    SamplingSpec,
    check_prompts,
    plan_load,
    require_model_dir,
    safetensors_files,
)
from rollout_worker.engines.gpu_start import engine_start
from rollout_worker.engines.spec import EngineSpec
from rollout_worker.engines.vllm import (
    EngineDied,
    _is_engine_death,
    _stderr_since,
    _stderr_size,
    configure_env,
    engine_tokenizer,
    llm_kwargs,
    refuse_stops,
    root_cause,
    sampled_logprobs,
)

T = TypeVar("T")


def processed_counts(engine: Any) -> dict[str, int] | None:
    """Tokens vLLM's output processor has made for each request in flight, by our request id; None where this
    vLLM release keeps them elsewhere (its ``OutputProcessor.request_states``, in 0.26 through 0.32)."""
    states = getattr(getattr(engine, "output_processor", None), "request_states", None)
    if not isinstance(states, dict):
        return None
    counts: dict[str, int] = {}
    for state in states.values():
        key = getattr(state, "external_req_id", None)
        made = getattr(getattr(state, "detokenizer", None), "num_output_tokens", None)
        if not isinstance(key, str) or not callable(made):
            return None
        counts[key] = int(made())
    return counts


SETTLE_S = (
    0.005  # after a pause, tokens still being processed are the old weights': wait until none came this long
)
START_TIMEOUT_S = 1800.0
STREAM_INTERVAL = 16  # rollout.vllm.stream_interval's default, for engines built without a run's options


class StreamingVllmEngine:
    """The ``StreamingEngine`` interface on ``AsyncLLM``."""

    def __init__(self, spec: EngineSpec) -> None:
        model_dir, dtype, seed, max_model_len = spec.model_dir, spec.dtype, spec.seed, spec.max_model_len
        options, lora_rank = spec.vllm_options, spec.lora_rank
        if lora_rank > 0:
            raise EngineError(
                "rollout.streaming: LoRA adapters are served by the batch engine only; "
                "set rollout.streaming = false or model.lora.rank = 0"
            )
        model_dir = require_model_dir(Path(model_dir))
        options = {"stream_interval": STREAM_INTERVAL} | dict(options or {})
        configure_env(options)
        from vllm.platforms import current_platform

        self.model_dir = model_dir
        self.kwargs = llm_kwargs(
            model_dir,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            options=options,
            cpu=current_platform.is_cpu(),
            detokenize=spec.detokenize,
        )
        self.detokenize = spec.detokenize
        self.max_model_len = int(self.kwargs["max_model_len"])
        self.version = 0
        self.last_reload_s = 0.0
        self._done: queue.Queue[tuple[str, Completion] | None] = queue.Queue()
        self._tasks: dict[str, asyncio.Task[None]] = {}  # the loop's own
        self._keys: set[str] = set()  # requests in flight, as the caller sees them (under _lock)
        self._lock = threading.Lock()
        self._clock = BusyClock()
        self._arrived = 0  # tokens handed over so far
        # per request: (tokens vLLM had made, the version they came from) at each update since its last hand-over
        self._marks: dict[str, list[tuple[int, int]]] = {}  # the loop's own
        self._updates = 0
        self._error: BaseException | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="vllm-stream")
        self._thread.start()
        self.log_offset = _stderr_size()
        try:
            with engine_start(self.kwargs, cpu=current_platform.is_cpu()):
                self.engine = self._call(self._build(), START_TIMEOUT_S)
        except Exception as e:
            self._stop_loop()
            raise self._died(e) from e
        self.tokenizer = engine_tokenizer(self.engine, model_dir, spec.detokenize)
        self.interval = int(self.kwargs.get("stream_interval") or 1)
        if self.interval > 1 and processed_counts(self.engine) is None:
            self.close()
            raise EngineError(
                "rollout.vllm.stream_interval: this vLLM release does not show how many tokens each request has "
                "made, which an update needs to tag the held ones; set it to 1"
            )

    async def _build(self) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(AsyncEngineArgs(**self.kwargs))

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # ------------------------------------------------------------------ requests

    def submit(self, key: str, prompt_ids: list[int], sampling: SamplingSpec) -> None:
        check_prompts([prompt_ids], sampling, self.max_model_len)
        refuse_stops(sampling, self.detokenize)
        self._raise_error()
        params = self._params(sampling)
        with self._lock:
            if key in self._keys:
                raise ValueError(f"request {key!r} is already in flight")
            self._keys.add(key)
            self._clock.set(in_flight=len(self._keys))
        # Not waited for: with hundreds of requests in flight the loop is busy with their outputs, and a round
        # trip per request would hold back the next group's start by one of its turns each.  The loop runs its
        # callbacks in order, so an abort sent after this finds the task.
        self._loop.call_soon_threadsafe(self._start, key, list(prompt_ids), params)

    def _start(self, key: str, prompt_ids: list[int], params: Any) -> None:  # on the loop
        self._tasks[key] = self._loop.create_task(self._run(key, prompt_ids, params))

    def _forget(self, key: str) -> None:
        self._tasks.pop(key, None)
        self._marks.pop(key, None)
        with self._lock:
            self._keys.discard(key)
            self._clock.set(in_flight=len(self._keys))

    def _params(self, sampling: SamplingSpec) -> Any:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=1,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else -1,
            max_tokens=sampling.max_tokens,
            stop=list(sampling.stop) or None,
            seed=sampling.seed,
            logprobs=0,
            flat_logprobs=True,  # lists, not a dict of Logprob objects a token: this process's one core is the limit
            ignore_eos=sampling.ignore_eos,
            output_kind=RequestOutputKind.DELTA,
            # Text is decoded once from the ids when the response is done; vLLM's incremental detokenizer runs
            # in this process for every request at every step, which at hundreds of requests in flight is what
            # holds the engine back.  Stop strings need it.
            detokenize=bool(sampling.stop),
        )

    async def _run(self, key: str, prompt_ids: list[int], params: Any) -> None:
        from vllm.inputs import TokensPrompt

        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        text: list[str] = []
        finish, by_string = "length", False
        try:
            async for out in self.engine.generate(TokensPrompt(prompt_token_ids=prompt_ids), params, key):
                o = out.outputs[0]
                new = list(o.token_ids)
                versions.extend(self._versions(key, len(ids), len(new)))
                ids.extend(new)
                logprobs.extend(sampled_logprobs(o.logprobs, new))
                text.append(o.text)
                self._arrived += len(new)
                if out.finished:
                    finish = "length" if o.finish_reason == "length" else "stop"
                    by_string = isinstance(o.stop_reason, str)
        except asyncio.CancelledError:
            return
        except Exception as e:  # the engine died: every later call says why
            self._error = self._died(e)
            self._done.put(None)
            return
        finally:
            self._forget(key)
        self._done.put(
            (
                key,
                Completion(
                    prompt_ids=prompt_ids,
                    response_ids=ids,
                    response_logprobs=logprobs,
                    finish_reason=finish,
                    # vLLM holds back a trailing partial character; decoding the ids matches the batch engine
                    response_text="".join(text)
                    if by_string
                    else self.tokenizer.decode(ids, skip_special_tokens=True),
                    token_versions=versions,
                ),
            )
        )

    def _versions(self, key: str, start: int, n: int) -> list[int]:
        """The versions of a request's tokens ``start .. start + n`` as they arrive: the version current now, but
        the old one for those vLLM had made before an update (held back by the stream interval)."""
        marks = self._marks.pop(key, None)
        if not marks:
            return [self.version] * n
        out = [next((v for made, v in marks if i < made), self.version) for i in range(start, start + n)]
        later = [m for m in marks if m[0] > start + n]
        if later:
            self._marks[key] = later
        return out

    def finished(self, timeout: float) -> list[tuple[str, Completion]]:
        out: list[tuple[str, Completion]] = []
        try:
            item = self._done.get(timeout=max(timeout, 0.0))
            while True:
                if item is not None:
                    out.append(item)
                item = self._done.get_nowait()
        except queue.Empty:
            pass
        self._raise_error()
        return out

    def abort(self, key: str) -> None:
        self._call(self._abort(key))

    async def _abort(self, key: str) -> None:
        task = self._tasks.get(key)
        if task is not None:
            task.cancel()
            self._forget(key)  # a task cancelled before its first turn never runs its own finally
            with contextlib.suppress(Exception):
                await self.engine.abort(key)

    # ------------------------------------------------------------------ weights

    def update_weights(self, weights_dir: Path, version: int) -> None:
        plan = plan_load(Path(weights_dir).absolute(), lora_rank=0, base_sha256=None, base_dir=self.model_dir)
        safetensors_files(plan.path)
        self._raise_error()
        start = time.perf_counter()
        self._call(self._swap(plan.path, version))
        self.last_reload_s = time.perf_counter() - start

    async def _swap(self, weights_dir: Path, version: int) -> None:
        await self.engine.pause_generation(mode="keep", clear_cache=True)
        self._clock.set(paused=True)
        try:
            await self._settle()
            await self.engine.collective_rpc(
                "shardrl_reload_weights", kwargs={"weights_path": str(weights_dir)}
            )
            if self.interval > 1:  # with the version change below, nothing runs on the loop in between
                for key, made in (processed_counts(self.engine) or {}).items():
                    self._marks.setdefault(key, []).append((made, self.version))
            self.version = version
            self._updates += 1
        finally:
            await self.engine.resume_generation()
            self._clock.set(paused=False)

    async def _settle(self) -> None:
        """Wait until no token has been processed for two settle periods: those still on their way are the old
        weights'."""
        quiet, seen = 0, self._progress()
        while quiet < 2:
            await asyncio.sleep(SETTLE_S)
            now = self._progress()
            quiet, seen = (quiet + 1, seen) if now == seen else (0, now)

    def _progress(self) -> int:
        """Tokens processed so far: handed over, or made by vLLM's output processor when it holds some back."""
        if self.interval == 1:
            return self._arrived
        return sum((processed_counts(self.engine) or {}).values())

    # ------------------------------------------------------------------ state

    def stats(self) -> EngineStats:
        busy, paused = self._clock.read()
        return EngineStats(
            in_flight=len(self._keys),
            busy_s=busy,
            paused_s=paused,
            updates=self._updates,
            tokens=self._arrived,
        )

    def _died(self, e: BaseException) -> BaseException:
        if not _is_engine_death(e):
            return e
        cause = root_cause(_stderr_since(self.log_offset))
        return e if cause is None else EngineDied(f"vLLM engine died: {cause}")

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        engine = self.__dict__.pop("engine", None)
        if engine is not None:
            with contextlib.suppress(Exception):
                self._call(self._shutdown(engine), 60)
        self._stop_loop()

    async def _shutdown(self, engine: Any) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        engine.shutdown()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
