"""``complete(prompt_ids, sampling) -> Completion`` on a streaming engine, callable from many threads at once.

Episodes (tool loops, agents behind the endpoint) each wait on their own turn; with this over a streaming engine
each turn is its own request, so while one episode waits on a slow tool the engine generates the others' turns
(continuous batching), instead of every episode waiting for the slowest one's tool at each round.  One waiting
thread at a time collects the engine's finished requests and hands each to the thread that asked for it.
"""

from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future
from dataclasses import replace

from rollout_worker.engines.base import Completion, SamplingSpec, StreamingEngine

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
