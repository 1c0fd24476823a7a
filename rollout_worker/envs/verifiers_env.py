"""Environments of PRIME-RL's ``verifiers`` library (0.4, its ``verifiers.v1`` API) as rollout episodes: each
rollout runs against the worker's own chat endpoint, and its rows are scored by the environment's rubric.

Installed by the ``verifiers`` extra (``pip install -e '.[cpu,dev,verifiers]'``); importing this module imports
nothing of verifiers, which is loaded when an environment is.

From the run config.  ``env.verifiers`` names the environment (``env.verifiers_args`` its config,
``env.verifiers_max_tasks`` the cut of its taskset) and ``data.task = "env"`` takes the prompts from it: the
worker's preflight lists them (``env_prompts``) and its ``_start`` builds the ``VerifiersTask`` on the same
environment and tasks (``configured_env`` loads them once per process).  The config's ``reward.function`` is then
``rubric_reward``, a name that says the rubric scores; it is never called.

Which environment.  ``load_env(spec, args)``: a ``package.module:function`` is called with ``args`` and must
return a ``verifiers.v1.Env``; any other ``spec`` is a taskset id, and ``args`` is the rest of the environment's
config (the ``[env]`` block of ``vf-eval``, e.g.
``{"taskset": {"num_tasks": 100}, "agent": {"runtime": {"type": "subprocess"}, "max_turns": 4}}``), loaded as
``vf.load_environment(vf.resolve_env_config(...))`` does.  verifiers' own defaults hold: the
agent's program is the taskset's harness (else ``bash``), run in the runtime that ``agent.runtime`` names (a
remote ``prime`` sandbox unless it is set; ``subprocess`` runs it on the worker's node).

One episode.  ``VerifiersTask`` is an ``agent.AgentTask`` whose agent, for each episode, runs
``env.run_episode(task, ctx)`` on one event loop that holds ``env.serving()`` (its interception server and shared
tool servers) for the task's life.  ``ctx`` points verifiers' eval client at the episode's base URL, so the chain
is harness -> verifiers' interception server -> the worker's endpoint, which records every call as ids and
logprobs; the rows are built from those records exactly as for any agent (``calls``), never from verifiers'
transcript.

Prompts.  ``prompts()`` gives the taskset's tasks as rollout prompts: ``index`` is the task's position in the
taskset, ``extra["verifiers_task"]`` its key, which the episode checks, so that a prompt from another source is
refused.

Scoring.  Every row of an episode gets its trace's reward, ``Trace.reward``: the weighted sum of the task's
``@vf.reward`` functions and plugged rewards and judges, as verifiers scored the trace (a stopped trace, e.g. at
``agent.max_turns``, is scored on what it has).  The run's ``reward.function`` and ``reward.truncated_reward``
are not used.  The ``episode`` record adds ``verifiers``: the task's key, the trace id, each reward (weighted) and
metric, the stop condition.  An episode that failed in verifiers (the harness crashed, a setup or scoring hook raised, a call
the endpoint refused for a limit: set verifiers' own ``agent.max_turns`` / ``max_output_tokens`` within
``env.max_turns`` and the token limits so that verifiers ends the trace itself) gets 0, with verifiers' error in
the record, as a failing agent does.

Covered of verifiers 0.4: tasksets (``Taskset``/``Task``/``TaskData``, finite, or cut by ``max_tasks``) and their
``@vf.reward`` / ``@vf.metric`` functions, plugged rewards and judges, ``@vf.stop`` and ``@vf.intercept`` hooks
(a rewritten reply makes the next call a new sample, ``calls``), rewards an ``Env.finalize`` records on the
trace, per-rollout and shared ``Toolset`` MCP servers, harnesses that speak Chat Completions (``null``, ``bash``
and other chat programs; tested: verifiers' chat program with an MCP tool, in the ``subprocess`` runtime),
``Env`` subclasses with one agent.  Not covered: environments with several agents (refused when built) or one
agent run several times per episode (``best-of-n``: the episode gets 0), since their calls would share one
sample; retries, of the episode (``env.retries``: ``run_episode`` is run once) or of an agent (``agent.retries``:
a retried attempt's calls would join the samples, so a trace whose answered calls differ in number from the
endpoint's gets 0); harnesses that speak the Responses or Anthropic Messages APIs (the endpoint serves Chat
Completions only: their calls fail); verifiers' ``TrainClient`` (the endpoint tokenises); a user who opens the
conversation (``Interaction``); verifiers' eval runner, env server and GEPA.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import itertools
import json
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from buffer.config import ConfigError, ShardRLConfig

from ..engines.base import SamplingSpec
from ..prompts import EncodedPrompt, Prompt
from ..scoring import ScoredBatch
from .agent import AgentRun, AgentTask
from .endpoint import Complete

TASK_KEY = "verifiers_task"  # the Prompt.extra field that names the task
# The eval client reads its API key from this variable: unset, it sends "EMPTY" (the endpoint needs none), and
# verifiers' fallback to a Prime Intellect account's key (for its default variable) never applies.
API_KEY_VAR = "SHARDRL_VERIFIERS_API_KEY"


class VerifiersConfigError(ConfigError):
    """A verifiers environment that cannot be loaded or run here; the message is one line."""


class VerifiersRolloutError(RuntimeError):
    """A verifiers episode that failed (its first error is the message): the episode's rows get 0."""


def _one_line(e: BaseException) -> str:
    """The error as one line; a pydantic validation error with every field it names and why (its own first line
    is only "N validation errors for X")."""
    errors = getattr(e, "errors", None)
    if callable(errors) and type(e).__name__ == "ValidationError":
        with contextlib.suppress(Exception):
            fields = "; ".join(
                f"{'.'.join(str(x) for x in err.get('loc', ())) or '(root)'}: {err.get('msg')}"
                for err in errors()
            )
            return f"{type(e).__name__} ({getattr(e, 'title', '')}): {fields}"[:1000]
    return f"{type(e).__name__}: {e}".strip().splitlines()[0][:500]


def _verifiers() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError:
        raise VerifiersConfigError(
            "env.verifiers: needs the verifiers extra (pip install -e '.[verifiers]')"
        ) from None
    _scripts_run_here()
    return vf


def _scripts_run_here() -> None:
    """verifiers' subprocess runtimes run their PEP 723 programs (the chat program of its built-in ``bash`` and
    ``null`` harnesses) with this interpreter, instead of an interpreter that ``uv`` provisions from the network.

    A cluster node often reaches no package index, and then every episode failed ("failed to prepare uv script:
    curl: (6) Could not resolve host") while the worker produced nothing; this interpreter already has the chat
    program's packages, which verifiers itself depends on.  Only subprocess runtimes change: the others (docker,
    remote sandboxes) run programs on their own machines, where this interpreter does not exist.
    """
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    if getattr(SubprocessRuntime.prepare_uv_script, "runs_here", False):
        return

    async def prepare_uv_script(
        self: Any, script: str | bytes, env: dict[str, str] | None = None, *, activate: bool = True
    ) -> list[str]:
        data = script.encode() if isinstance(script, str) else script
        folder = self.scripts_dir if self.user is None else f"{self.scripts_dir}-{self.user}"
        path = f"{folder}/{hashlib.sha256(data).hexdigest()}.py"
        await self.write(path, data)
        return [sys.executable, path]

    prepare_uv_script.runs_here = True  # type: ignore[attr-defined]
    SubprocessRuntime.prepare_uv_script = prepare_uv_script  # type: ignore[method-assign]


def load_env(spec: str, args: Mapping[str, Any] | None = None) -> Any:
    """The ``verifiers.v1.Env`` that ``spec`` names (module doc), or a one-line VerifiersConfigError."""
    vf = _verifiers()
    args = dict(args or {})
    at = f"verifiers environment {spec!r}"
    try:
        if ":" in spec:
            module_name, _, attr = spec.partition(":")
            fn = getattr(importlib.import_module(module_name), attr, None)
            if not callable(fn):
                raise VerifiersConfigError(f"{at}: {module_name!r} has no function {attr!r}")
            env = fn(**args)
        else:
            taskset = {**dict(args.pop("taskset", None) or {}), "id": spec}
            env = vf.load_environment(vf.resolve_env_config({**args, "taskset": taskset}))
    except VerifiersConfigError:
        raise
    except Exception as e:
        raise VerifiersConfigError(f"{at}: cannot load it ({_one_line(e)})") from None
    if not isinstance(env, vf.Env):
        raise VerifiersConfigError(f"{at}: got {type(env).__name__}, expected a verifiers.v1.Env")
    return env


def env_tasks(env: Any, max_tasks: int | None = None) -> list[Any]:
    """The tasks an environment of one agent is trained on: its taskset, cut at ``max_tasks``; one-line
    VerifiersConfigError for an environment of several agents, or an infinite taskset without ``max_tasks``."""
    roles = list(env.config.agent_harnesses())
    if len(roles) != 1:
        raise VerifiersConfigError(
            f"verifiers environment {env.config.env_id!r} declares {len(roles)} agents ({', '.join(roles)}); only "
            "environments of one agent are trained (the calls of all agents would share one sample)"
        )
    if max_tasks is None and not env.taskset.bounded:
        raise VerifiersConfigError(
            f"verifiers environment {env.config.env_id!r}: the taskset is infinite; set env.verifiers_max_tasks"
        )
    return list(itertools.islice(env.taskset, max_tasks))


# (spec, args as JSON, max_tasks) -> (env, tasks): the worker's preflight and its _start want the same environment,
# and loading one may read a dataset and import the environment's code, so a process pays for it once.
_LOADED: dict[tuple[str, str, int | None], tuple[Any, list[Any]]] = {}


def configured_env(cfg: ShardRLConfig) -> tuple[Any, list[Any]]:
    """The environment ``env.verifiers`` names and its tasks (``env_tasks``), loaded once per process."""
    e = cfg.env
    if e.verifiers is None:
        raise VerifiersConfigError(
            "config: field env.verifiers is not set; it names the verifiers environment"
        )
    key = (e.verifiers, json.dumps(e.verifiers_args, sort_keys=True, default=str), e.verifiers_max_tasks)
    if key not in _LOADED:
        env = load_env(e.verifiers, json.loads(key[1]))  # a copy: verifiers may change what it is given
        _LOADED[key] = env, env_tasks(env, e.verifiers_max_tasks)
    return _LOADED[key]


def env_prompts(cfg: ShardRLConfig) -> list[Prompt]:
    """The prompts of ``data.task = "env"``: the tasks of ``env.verifiers``, in taskset order (``task_prompt``)."""
    _, tasks = configured_env(cfg)
    if not tasks:
        raise VerifiersConfigError(f"env.verifiers ({cfg.env.verifiers!r}): the taskset has no tasks")
    return [task_prompt(i, t) for i, t in enumerate(tasks)]


def rubric_reward(response: str, answer: str | None, *, extra: Mapping[str, Any], sample: Any) -> float:
    """The ``reward.function`` of an ``env.verifiers`` run (``buffer.config.VERIFIERS_REWARD``): the environment's
    rubric scores its episodes (``VerifiersTask._reward``), so nothing calls this."""
    raise RuntimeError("env.verifiers runs are scored by the environment's rubric, not by reward.function")


def task_prompt(index: int, task: Any) -> Prompt:
    """A verifiers task as a rollout prompt (what the worker's prompt-side code and the row's columns see)."""
    data = task.data
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        messages.append({"role": "user", "content": data.prompt})
    else:
        messages += [_message(m) for m in data.prompt or []]
    answer = getattr(data, "answer", None)
    return Prompt(
        index,
        data.prompt_text,
        None if answer is None else str(answer),
        tuple(messages),
        {TASK_KEY: task.key},
    )


def _message(m: Any) -> dict[str, Any]:
    from verifiers.v1.types import content_text

    return {"role": m.role, "content": content_text(getattr(m, "content", None))}


class _Loop:
    """One event loop in a thread of its own, holding ``env.serving()`` from ``start()`` to ``close()``.

    verifiers' servers belong to the loop that started them, and the agents of ``AgentTask`` run in threads, so
    every episode is handed to this loop and waited for."""

    def __init__(self, env: Any):
        self.env = env
        self.loop = asyncio.new_event_loop()
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._serving: Future[None] | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="verifiers-loop")
        self._thread.start()
        ready: Future[None] = Future()
        self._serving = asyncio.run_coroutine_threadsafe(self._serve(ready), self.loop)
        self._serving.add_done_callback(lambda serving: _settle(ready, serving))
        try:
            ready.result()
        except BaseException:
            self.close()
            raise

    async def _serve(self, ready: Future[None]) -> None:
        self._stop = asyncio.Event()
        async with self.env.serving():  # entered and left in this one task, as its servers' scopes require
            ready.set_result(None)
            await self._stop.wait()

    def submit(self, coro: Any) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        if self._thread is None:
            return
        if self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        if self._serving is not None:
            with contextlib.suppress(Exception):  # a teardown failure must not hide what the run did
                self._serving.result(timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()
        self._thread = None


def _settle(ready: Future[None], serving: Future[None]) -> None:
    """The serving task ended: if that was before it was ready, it is ``start()``'s failure."""
    if not ready.done():
        error = None if serving.cancelled() else serving.exception()
        ready.set_exception(error or RuntimeError("verifiers' env.serving() ended before it was entered"))


class VerifiersTask(AgentTask):
    """Episodes of a verifiers environment against the task's own endpoint, scored by its rubric (module doc).

    ``env`` is a loaded ``verifiers.v1.Env`` or a ``load_env`` spec (with ``env_args``); ``tasks`` its tasks where
    they are listed already (``configured_env``), else its taskset cut at ``max_tasks``.  The run's ``env``
    section gives the limits and ``agent_timeout_s``; ``env.agent`` and ``env.tools`` are ignored.  ``model`` is the
    model name the harness is told (what the endpoint answers to), ``sampling`` verifiers' sampling overrides put on
    every request (the endpoint samples with the run's ``rollout.sampling`` whatever they say).
    """

    def __init__(
        self,
        cfg: ShardRLConfig,
        tokenizer: Any,
        env: Any,
        *,
        env_args: Mapping[str, Any] | None = None,
        max_tasks: int | None = None,
        tasks: Sequence[Any] | None = None,
        model: str = "policy",
        sampling: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ):
        vf = _verifiers()
        self.env = load_env(env, env_args) if isinstance(env, str) else env
        self.tasks = env_tasks(self.env, max_tasks) if tasks is None else list(tasks)
        # AgentTask runs the agent its config names; ours is a method, put in place once the base is built.
        agent_cfg = cfg.model_copy(
            update={
                "env": cfg.env.model_copy(
                    update={"agent": f"{__name__}:{_unbound.__name__}", "tools": [], "verifiers": None}
                )
            }
        )
        super().__init__(agent_cfg, tokenizer, chat_template=chat_template, host=host, port=port)
        self.name = f"verifiers:{self.env.config.env_id}"
        self.agent = self._play
        self.model = model
        self.sampling = vf.Sampling.model_validate(dict(sampling or {}))
        self._loop = _Loop(self.env)
        self._episodes: dict[str, Any] = {}  # base URL -> the verifiers episode it ran
        self._lock = threading.Lock()

    def prompts(self) -> list[Prompt]:
        """The taskset's tasks as rollout prompts, in taskset order (module doc)."""
        return [task_prompt(i, t) for i, t in enumerate(self.tasks)]

    def run_batch(
        self,
        complete: Complete,
        prompts: Sequence[EncodedPrompt],
        sampling: SamplingSpec,
        version: Callable[[], int],
        *,
        group_prefix: str,
        epoch: int = 0,
    ) -> tuple[ScoredBatch, int]:
        """As ``AgentTask.run_batch``, with the environment's servers up (started at the first batch)."""
        self._loop.start()
        try:
            return super().run_batch(
                complete, prompts, sampling, version, group_prefix=group_prefix, epoch=epoch
            )
        finally:
            with self._lock:
                self._episodes.clear()

    def close(self) -> None:
        self._loop.close()
        super().close()

    # ------------------------------------------------------------------------------------------ one episode

    def _task(self, row: dict[str, Any]) -> Any:
        i, key = row["index"], row["extra"].get(TASK_KEY)
        if not 0 <= i < len(self.tasks) or (key is not None and key != self.tasks[i].key):
            raise ValueError(
                f"prompt {i} is not task {i} of {self.name} ({len(self.tasks)} tasks); its prompts come from "
                "VerifiersTask.prompts()"
            )
        return self.tasks[i]

    def _play(self, base_url: str, row: dict[str, Any]) -> str | None:
        """The agent of one episode: the verifiers episode of the row's task, with the model behind ``base_url``."""
        vf = _verifiers()
        client = vf.EvalClientConfig(base_url=base_url, api_key_var=API_KEY_VAR)
        ctx = vf.ModelContext(model=self.model, client=client, sampling=self.sampling)
        running = self._loop.submit(self.env.run_episode(self._task(row), ctx))
        try:
            episode = running.result(timeout=self.timeout_s)
        except FutureTimeout:
            running.cancel()  # verifiers tears the rollout's runtime and servers down
            raise
        with self._lock:
            self._episodes[base_url] = episode
        if len(episode.traces) != 1:
            raise ValueError(
                f"the episode ran {len(episode.traces)} agents; only episodes of one agent run are trained"
            )
        (trace,) = episode.traces
        error = episode.last_error or trace.last_error
        if error is not None or not trace.ok:
            raise VerifiersRolloutError(f"{error.type}: {error.message}" if error else "the trace failed")
        return str(trace.last_reply)

    def _reward(self, run: AgentRun, finish: str, record: dict[str, Any]) -> float:
        """The trace's reward, as verifiers' rubric scored it (module doc)."""
        with self._lock:
            episode = self._episodes.pop(self.endpoint.base_url(run.episode_id), None)
        if (
            episode is None
        ):  # not expected: AgentTask scores only episodes whose agent returned, having stored it
            record["reward_error"] = "no verifiers episode was recorded"
            return 0.0
        (trace,) = episode.traces
        answered = sum(1 for c in trace.calls if c.error is None)
        record["verifiers"] = {
            "task": self.tasks[run.prompt.index].key,  # _play ran it, so the index is the taskset's
            "trace": trace.id,
            "rewards": {k: None if r is None else r.value for k, r in trace.rewards.items()},
            "metrics": dict(trace.metrics),
            "stop": trace.stop_condition,
            "turns": trace.num_turns,
        }
        calls = len(self._log(run).exchanges)
        if answered != calls:  # then the rows hold calls the rubric did not score, or lack some it did
            record["reward_error"] = f"verifiers recorded {answered} answered calls, the endpoint {calls}"
            return 0.0
        return float(trace.reward)


def _unbound(base_url: str, row: dict[str, Any]) -> str | None:
    """What a config's ``env.agent`` names while a ``VerifiersTask`` is built; the task replaces it with its own."""
    raise RuntimeError("rollout_worker.envs.verifiers_env runs its episodes through VerifiersTask")
