"""``complete(prompt_ids, sampling) -> Completion`` on an engine, callable from many threads at once: a
``StreamCompleter`` on a streaming engine, a ``Batcher`` on a batch engine.


Episodes (tool loops, agents behind the endpoint) each wait on their own turn; with this over a streaming engine
each turn is its own request, so while one episode waits on a slow tool the engine generates the others' turns
(continuous batching), instead of every episode waiting for the slowest one's tool at each round.  One waiting
thread at a time collects the engine's finished requests and hands each to the thread that asked for it.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace

from rollout_worker.engines.base import Completion, SamplingSpec, StreamingEngine

# A batch engine's generate: prompts -> n completions each.
Generate = Callable[[list[list[int]], SamplingSpec], list[list[Completion]]]

POLL_S = 0.05


class StreamCompleter:
    def __init__(self, engine: StreamingEngine):
        self.engine = engine
        self._keys = itertools.count()
        self._lock = threading.Lock()
        self._collecting = threading.Lock()
        self._waiting: dict[str, Future[Completion]] = {}

    def __call__(self, prompt_ids: list[int], sampling: SamplingSpec) -> Completion:
        key = f"c{next(self._keys)}"
        done: Future[Completion] = Future()
        with self._lock:
            self._waiting[key] = done
        self.engine.submit(key, list(prompt_ids), replace(sampling, n=1))
        while not done.done():
            if self._collecting.acquire(blocking=False):
                try:
                    self._collect()
                finally:
                    self._collecting.release()
            else:
                try:
                    return done.result(POLL_S)
                except TimeoutError:
                    continue
        return done.result()

    def _collect(self) -> None:
        try:
            finished = self.engine.finished(POLL_S)
        except BaseException as e:  # the engine died: every waiting episode hears it
            with self._lock:
                waiting, self._waiting = self._waiting, {}
            for f in waiting.values():
                f.set_exception(e)
            return
        with self._lock:
            futures = [(self._waiting.pop(k, None), c) for k, c in finished]
        for asked, c in futures:
            if asked is not None:
                asked.set_result(c)


@dataclass
class _Pending:
    prompt_ids: list[int]
    sampling: SamplingSpec
    done: Future[Completion] = field(default_factory=Future)


class Batcher:
    """A thread-safe ``Complete`` over an engine's batched ``generate``, which is then only called from one thread.

    Calls that arrive within ``window_s`` of the first waiting one, with the same sampling apart from
    ``max_tokens``, go to the engine as one batch (an agent's episodes run side by side, and an engine is fastest
    on a full batch), generated to the largest budget among them and each cut to its own, as ``run_episodes`` does:
    a cut completion is what sampling with that budget would have drawn.  ``decode`` gives a cut one's text.
    """

    def __init__(
        self,
        generate: Generate,
        decode: Callable[[list[int]], str],
        *,
        window_s: float = 0.02,
        max_batch: int = 256,
    ):
        self.generate, self.decode = generate, decode
        self.window_s, self.max_batch = window_s, max_batch
        self._queue: queue.Queue[_Pending | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="endpoint-batcher")
        self._thread.start()

    def __call__(self, prompt_ids: list[int], sampling: SamplingSpec) -> Completion:
        pending = _Pending(list(prompt_ids), sampling)
        self._queue.put(pending)
        return pending.done.result()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while (first := self._queue.get()) is not None:
            batch = [first]
            deadline = time.monotonic() + self.window_s
            while len(batch) < self.max_batch and (left := deadline - time.monotonic()) > 0:
                try:
                    nxt = self._queue.get(timeout=left)
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)  # stop once this batch is answered
                    break
                batch.append(nxt)
            by_spec: dict[str, list[_Pending]] = {}
            for p in batch:
                by_spec.setdefault(repr(replace(p.sampling, max_tokens=0, n=1)), []).append(p)
            for group in by_spec.values():
                self._run(group)

    def _run(self, group: list[_Pending]) -> None:
        spec = replace(group[0].sampling, n=1, max_tokens=max(p.sampling.max_tokens for p in group))
        try:
            outs = self.generate([p.prompt_ids for p in group], spec)
        except BaseException as e:
            if len(group) > 1:  # one prompt the engine refuses must not fail the calls batched with it
                for p in group:
                    self._run([p])
                return
            group[0].done.set_exception(e)
            return
        for p, out in zip(group, outs, strict=True):
            p.done.set_result(self._cut(out[0], p.sampling.max_tokens))

    def _cut(self, c: Completion, budget: int) -> Completion:
        if len(c.response_ids) <= budget:
            return c
        ids = c.response_ids[:budget]
        return Completion(c.prompt_ids, ids, c.response_logprobs[:budget], "length", self.decode(ids))
