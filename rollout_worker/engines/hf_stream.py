"""Streaming generation with plain transformers: continuous batching over a KV cache, weights swapped in flight.

One thread runs the decode loop.  Each turn of it: apply new weights if some are staged; prefill the requests that
joined (left-padded into a batch of their own) while the running rows take one decode step; sample every row's
next token (``hf.process_logits``: the same distribution and logprob rule as the batch engine); merge the joined
rows' cache into the running one (both left-padded to one width) and drop the rows that finished.  A request thus
waits for at most one decode step to start, and a row that ends frees its place at once.

A weight update: the caller's thread reads the safetensors onto the device (a second copy, while the loop keeps
decoding on the first), then the loop copies them into the live parameters between two decode steps and prefills
every running row again (its prompt and the tokens it has), so, as with vLLM's engine, everything sampled after the
update comes from the new weights alone and each token's logprob is under the weights that drew it
(``Completion.token_versions``).

Samples are drawn from one generator seeded at start: a streaming run is not sample-for-sample reproducible (the
batch engine is), since which rows share a step depends on timing.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rollout_worker.engines.base import (
    BusyClock,
    Completion,
    EngineError,
    EngineStats,
    SamplingSpec,
    check_prompts,
    plan_load,
)
from rollout_worker.engines.hf import HFEngine, process_logits
from rollout_worker.engines.ragged_attention import decode_mask, install, prefill_mask
from rollout_worker.engines.spec import EngineSpec

if TYPE_CHECKING:
    import torch

JOIN_STEPS = 8  # a joining row waits at most this many decode steps


class Timings:
    """Where the decode loop's time goes, by phase (``SHARDRL_ENGINE_TIMINGS=1``: each phase waits for the device,
    so the figures are exact and the loop a little slower; otherwise nothing is timed)."""

    def __init__(self, device: Any) -> None:
        self.on = os.environ.get("SHARDRL_ENGINE_TIMINGS") == "1"
        self.device = device
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.steps = 0
        self.rows = 0  # rows decoded, summed over steps: rows / steps is the mean batch

    @contextlib.contextmanager
    def time(self, phase: str) -> Iterator[None]:
        if not self.on:
            yield
            return
        start = time.perf_counter()
        yield
        if self.device.type == "cuda":
            import torch

            torch.cuda.synchronize(self.device)
        self.seconds[phase] += time.perf_counter() - start

    def report(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "mean_batch": self.rows / self.steps if self.steps else None,
            "seconds": {k: round(v, 3) for k, v in self.seconds.items()},
        }


@dataclass
class _Row:
    key: str
    prompt_ids: list[int]
    sampling: SamplingSpec
    budget: int
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    @property
    def sequence(self) -> list[int]:
        return self.prompt_ids + self.ids


class StreamingHFEngine:
    """The ``StreamingEngine`` interface on a transformers causal LM (``HFEngine`` holds the model)."""

    def __init__(self, spec: EngineSpec) -> None:
        seed, max_model_len, max_batch_size = spec.seed, spec.max_model_len, spec.max_batch_size
        import torch

        if spec.lora_rank > 0:
            raise EngineError(
                "rollout.streaming: LoRA adapters are served by the batch engine only; "
                "set rollout.streaming = false or model.lora.rank = 0"
            )
        self.hf = HFEngine(replace(spec, lora_rank=0))
        install(self.hf.model)
        self.model_dir = self.hf.model_dir
        self.max_model_len = max_model_len
        self.max_batch_size = max_batch_size
        self.tokenizer = self.hf.tokenizer
        self.generator = torch.Generator(device=self.hf.device).manual_seed(seed)
        self.version = 0
        self.last_reload_s = 0.0
        self._cond = threading.Condition()
        self._joining: collections.deque[_Row] = collections.deque()
        self._aborted: set[str] = set()
        self._done: list[tuple[str, Completion]] = []
        self._rows: list[_Row] = []  # the running rows, in the cache's batch order
        self._cache: Any = None
        self._mask: torch.Tensor | None = None
        self._staged: tuple[dict[str, Any], int] | None = None
        self._applied = threading.Event()
        self._clock = BusyClock()
        self._tokens = 0
        self._updates = 0
        self._error: BaseException | None = None
        self._closing = False
        self._waited = 0  # decode steps the first joining row has waited
        self.timings = Timings(self.hf.device)
        self._thread = threading.Thread(target=self._loop, daemon=True, name="hf-stream")
        self._thread.start()

    # ------------------------------------------------------------------ the caller's side

    def submit(self, key: str, prompt_ids: list[int], sampling: SamplingSpec) -> None:
        check_prompts([prompt_ids], sampling, self.max_model_len)
        self._raise_error()
        budget = min(sampling.max_tokens, self.max_model_len - len(prompt_ids))
        with self._cond:
            self._joining.append(_Row(key, list(prompt_ids), sampling, budget))
            self._clock.set(in_flight=self._in_flight())
            self._cond.notify_all()

    def finished(self, timeout: float) -> list[tuple[str, Completion]]:
        with self._cond:
            if not self._done and self._error is None:
                self._cond.wait(timeout=max(timeout, 0.0))
            out, self._done = self._done, []
        self._raise_error()
        return out

    def abort(self, key: str) -> None:
        with self._cond:
            self._aborted.add(key)
            self._cond.notify_all()

    def update_weights(self, weights_dir: Path, version: int) -> None:
        """Read the version onto the device here (the loop decodes on meanwhile), then wait for the loop to swap
        it in between two decode steps."""
        start = time.perf_counter()
        state = self._read(weights_dir)
        self._applied.clear()
        with self._cond:
            self._staged = (state, version)
            self._cond.notify_all()
        while not self._applied.wait(0.1):
            self._raise_error()
        self._raise_error()
        self.last_reload_s = time.perf_counter() - start

    def _read(self, weights_dir: Path) -> dict[str, Any]:
        """The directory's tensors on the device, checked against the model: a bad directory changes nothing."""
        plan = plan_load(Path(weights_dir), lora_rank=0, base_sha256=None, base_dir=self.model_dir)
        return self.hf.read_weights(plan.path)

    def stats(self) -> EngineStats:
        busy, paused = self._clock.read()
        return EngineStats(self._in_flight(), busy, paused, self._updates, self._tokens)

    def _in_flight(self) -> int:
        return len(self._rows) + len(self._joining)

    def _raise_error(self) -> None:
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
        self.hf.close()

    # ------------------------------------------------------------------ the decode loop

    def _loop(self) -> None:
        import torch

        try:
            with torch.inference_mode():
                while self._turn():
                    pass
        except BaseException as e:  # every later call raises it: the worker's crash path
            with self._cond:
                self._error = e
                self._cond.notify_all()
            self._applied.set()

    def _turn(self) -> bool:
        """One decode step of the running rows and one prefill of the joining ones; False once closing."""
        with self._cond:
            while not self._closing and not (self._rows or self._joining or self._staged):
                self._cond.wait()
            if self._closing:
                return False
            staged, self._staged = self._staged, None
            joining = self._admit()
            aborted, self._aborted = self._aborted, set()
        if aborted:
            self._drop([i for i, r in enumerate(self._rows) if r.key in aborted])
            joining = [r for r in joining if r.key not in aborted]
        if staged is not None:
            self._swap(*staged)
            joining = self._rows + joining  # every running row prefills again under the new weights
            self._rows, self._cache, self._mask = [], None, None
        if not self._rows and not joining:
            return True
        self._step(joining)
        with self._cond:
            self._clock.set(in_flight=self._in_flight())
            if self._done:
                self._cond.notify_all()
        return True

    def _room(self) -> int:
        return max(0, self.max_batch_size - len(self._rows))

    def _admit(self) -> list[_Row]:
        """The joining rows to prefill now.  A join costs a prefill and a copy of the whole cache, so rows join a
        few at a time: once enough wait (a sixteenth of the batch), or they have waited JOIN_STEPS decode steps,
        or nothing else runs."""
        room = self._room()
        waiting = min(len(self._joining), room)
        self._waited = self._waited + 1 if waiting else 0
        if not waiting or not (
            not self._rows or waiting >= max(1, self.max_batch_size // 16) or self._waited >= JOIN_STEPS
        ):
            return []
        self._waited = 0
        return [self._joining.popleft() for _ in range(waiting)]

    def _swap(self, state: dict[str, Any], version: int) -> None:
        self._clock.set(paused=True)
        try:
            self.hf.model.load_state_dict(state, strict=False)
            self.version = version
            self._updates += 1
        finally:
            self._clock.set(paused=False)
            self._applied.set()

    def _step(self, joining: list[_Row]) -> None:
        import torch

        timed = self.timings.time
        logits = []
        if self._rows:
            with timed("decode"):
                logits.append(self._decode())
        new_cache = new_mask = None
        if joining:
            with timed("prefill"):
                new_logits, new_cache, new_mask = self._prefill(joining)
            logits.append(new_logits)
        rows = self._rows + joining
        with timed("sample"):
            self._sample(rows, torch.cat(logits))
        with timed("merge"):
            self._cache, self._mask = _merge(
                self._cache, self._mask, new_cache, new_mask, self.hf.model.config
            )
        self._rows = rows
        with timed("drop"):
            self._drop([i for i, r in enumerate(rows) if self._finished(r)], emit=True)
        self.timings.steps += 1
        self.timings.rows += len(rows)

    def _decode(self) -> torch.Tensor:
        import torch

        assert self._mask is not None
        self._mask = torch.cat([self._mask, self._mask.new_ones((len(self._rows), 1))], dim=-1)
        last = torch.tensor([r.ids[-1] for r in self._rows], device=self.hf.device)[:, None]
        positions = [len(r.prompt_ids) + len(r.ids) - 1 for r in self._rows]
        positions_t = torch.tensor(positions, device=self.hf.device)[:, None]
        out = self.hf.model(
            input_ids=last,
            attention_mask=decode_mask(self._mask),
            position_ids=positions_t,
            past_key_values=self._cache,
        )
        return out.logits[:, -1, :].float()

    def _prefill(self, rows: list[_Row]) -> tuple[torch.Tensor, Any, torch.Tensor]:
        import torch
        from transformers import DynamicCache

        seqs = [r.sequence for r in rows]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(rows), width), self.hf.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.bool)
        for i, s in enumerate(seqs):
            ids[i, width - len(s) :] = torch.tensor(s)
            mask[i, width - len(s) :] = True
        ids, mask = ids.to(self.hf.device), mask.to(self.hf.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.hf.model.config)
        out = self.hf.model(
            input_ids=ids,
            attention_mask=prefill_mask(mask),
            position_ids=positions,
            past_key_values=cache,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :].float(), cache, mask

    def _sample(self, rows: list[_Row], logits: torch.Tensor) -> None:
        """Each row's next token and its logprob; rows with the same sampling settings are drawn together."""
        import torch

        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        logprobs = torch.empty(len(rows), dtype=torch.float32, device=logits.device)
        by_spec: dict[tuple[float, float, int], list[int]] = collections.defaultdict(list)
        for i, r in enumerate(rows):
            s = r.sampling
            by_spec[(s.temperature, s.top_p, s.top_k)].append(i)
        for (temperature, top_p, top_k), idx in by_spec.items():
            index = torch.tensor(idx, device=logits.device)
            raw = logits.index_select(0, index)
            lp = process_logits(raw, temperature, top_k, top_p).log_softmax(dim=-1)
            if temperature <= 0:
                tok = raw.argmax(dim=-1)
            else:
                tok = torch.multinomial(lp.exp(), 1, generator=self.generator).squeeze(-1)
            tokens[index] = tok
            logprobs[index] = lp.gather(-1, tok[:, None]).squeeze(-1)
        for r, t, lp_ in zip(rows, tokens.tolist(), logprobs.tolist(), strict=True):
            r.ids.append(t)
            r.logprobs.append(lp_)
            r.versions.append(self.version)
        self._tokens += len(rows)

    def _finished(self, r: _Row) -> bool:
        s = r.sampling
        if not s.ignore_eos and r.ids[-1] in self.hf.eos_ids:
            return True
        if s.stop and any(x in self.hf._decode(r.ids) for x in s.stop):
            return True
        return len(r.ids) >= r.budget

    def _drop(self, idx: list[int], *, emit: bool = False) -> None:
        if not idx:
            return
        gone = set(idx)
        if emit:
            with self._cond:
                self._done.extend((self._rows[i].key, self._completion(self._rows[i])) for i in idx)
        keep = [i for i in range(len(self._rows)) if i not in gone]
        self._rows = [self._rows[i] for i in keep]
        if not keep:
            self._cache, self._mask = None, None
            return
        self._cache.batch_select_indices(self._keep_index(keep))
        assert self._mask is not None
        self._mask = self._mask[keep]
        self._trim()

    def _keep_index(self, keep: list[int]) -> Any:
        import torch

        return torch.tensor(keep, device=self.hf.device)

    def _trim(self) -> None:
        """Drop the leading columns that are padding in every row (left by rows that finished)."""
        assert self._mask is not None
        used = self._mask.any(dim=0).nonzero()
        start = int(used[0]) if len(used) else 0
        if start == 0:
            return
        self._mask = self._mask[:, start:]
        for layer in self._cache.layers:
            layer.keys = layer.keys[:, :, start:, :]
            layer.values = layer.values[:, :, start:, :]

    def _completion(self, r: _Row) -> Completion:
        s = r.sampling
        finish = "length"
        text: str | None = None
        if not s.ignore_eos and r.ids[-1] in self.hf.eos_ids:
            finish = "stop"
        elif s.stop:
            decoded = self.hf._decode(r.ids)
            hits = [i for i in (decoded.find(x) for x in s.stop) if i >= 0]
            if hits:
                finish, text = "stop", decoded[: min(hits)]
        return Completion(
            prompt_ids=r.prompt_ids,
            response_ids=r.ids,
            response_logprobs=r.logprobs,
            finish_reason=finish,
            response_text=self.hf._decode(r.ids) if text is None else text,
            token_versions=r.versions,
        )


def _merge(cache: Any, mask: Any, new_cache: Any, new_mask: Any, config: Any) -> tuple[Any, Any]:
    """The running rows' cache and the joined rows' one as one batch, both left-padded to the wider."""
    import torch
    from transformers import DynamicCache

    if new_cache is None:
        return cache, mask
    if cache is None:
        return new_cache, new_mask
    width = max(mask.shape[1], new_mask.shape[1])
    merged = DynamicCache(config=config)
    for i, (a, b) in enumerate(zip(cache.layers, new_cache.layers, strict=True)):
        keys = torch.cat([_pad_left(a.keys, width), _pad_left(b.keys, width)])
        values = torch.cat([_pad_left(a.values, width), _pad_left(b.values, width)])
        merged.update(keys, values, i)
    masks = [torch.nn.functional.pad(m, (width - m.shape[1], 0)) for m in (mask, new_mask)]
    return merged, torch.cat(masks)


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    """``[B, H, T, D]`` -> ``[B, H, width, D]`` with zeros before (masked out: they are padding)."""
    import torch

    return torch.nn.functional.pad(t, (0, 0, width - t.shape[2], 0))
