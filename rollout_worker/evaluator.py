"""The evaluator: greedy scores of the trainer's published weight versions, as a process of its own.

    python -P -m rollout_worker --eval --run-dir RUN [--once] [--eval.every 5 ...]

It runs beside the supervisor and the trainer (started by the same job or a separate one) and only reads what they
publish, so it never holds the trainer up.  Each ``eval.every``-th version (and version 0, the base model, first with
``eval.base``) is verified against its manifest, loaded into the run's engine (vLLM, or transformers) and scored
greedily (temperature 0) on the held-out prompts (``eval.prompts_file``, else the held-out split of ``data.task`` where
it has one, else the run's own prompts) with the run's reward function.  With ``env.tools`` each prompt is a whole
episode, as the workers run it (``rollout_worker.envs``: the tools are called, every turn greedy, the episode's
limits), scored on its last reply.  One record per version goes to RUN/metrics/eval.jsonl: ``version``, ``step``,
``reward_mean``, and ``accuracy`` (the fraction of responses scoring at least the task's full score; left out where
no full score is defined).  A version that fails to verify or load is skipped with one log line.  Versions already
in eval.jsonl are not scored again, so a restarted evaluator resumes.  ``--once`` scores what is due and the latest
version, then exits (the demo's final figure); so does an evaluator that finds the run finished (RUN/finished.json).
SIGTERM/SIGINT end it after the version in hand.  A run of a verifiers environment (``env.verifiers``) is refused
with one line: its episodes need the workers' chat endpoint, which the evaluator does not serve, and the workers'
own metrics already record the rubric's reward of every batch.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

from buffer import metrics, weights
from buffer.config import ConfigError, DataConfig, ShardRLConfig
from buffer.localcache import NodeCache
from buffer.logs import logger
from buffer.records import RecordError
from buffer.run import Run
from buffer.status import read_finished
from buffer.weights import WeightsError, latest_version, published_versions
from rollout_worker.engines.base import Engine, EngineError, SamplingSpec
from rollout_worker.envs import ToolTask
from rollout_worker.envs.episode import group_rows, run_episodes
from rollout_worker.prompts import EncodedPrompt, Prompt, load_prompts, make_encoder
from rollout_worker.rewards import REGISTRY, Scorer, make_scorer
from rollout_worker.tasks import TOOL_TASKS, task_prompts

log = logger("eval")
EVAL_METRICS = "eval"  # RUN/metrics/eval.jsonl


# ---------------------------------------------------------------------------------------------- what to score


def eval_prompts(cfg: ShardRLConfig) -> list[Prompt]:
    """The held-out prompts: ``eval.prompts_file`` (read like data.prompts_file), else the held-out split of a
    built-in task that has one (the tool task's codes never drawn in training), else the run's own prompts."""
    data = cfg.data
    if cfg.env.verifiers is not None:
        raise ConfigError(
            f"env.verifiers ({cfg.env.verifiers!r}): the evaluator (--eval) does not run verifiers environments; "
            "the workers' metrics record the rubric's reward (reward_mean)"
        )
    if cfg.eval.prompts_file:
        prompts = load_prompts(
            data.model_copy(update={"task": "file", "prompts_file": cfg.eval.prompts_file})
        )
    elif data.task in TOOL_TASKS:
        prompts = _held_out(data)
    else:
        prompts = load_prompts(data)
    return prompts[: cfg.eval.max_prompts] if cfg.eval.max_prompts else prompts


def _held_out(data: DataConfig) -> list[Prompt]:
    """The held-out split of a built-in task, rendered as load_prompts renders the task's training prompts."""
    out = []
    for i, t in enumerate(task_prompts(data.task, split="eval")):
        text = t.prompt if data.prompt_template is None else data.prompt_template.format(prompt=t.prompt)
        messages = None
        if data.chat_template:
            system = [] if data.system_prompt is None else [{"role": "system", "content": data.system_prompt}]
            messages = (*system, {"role": "user", "content": text})
        out.append(Prompt(i, text, t.answer, messages))
    return out


def full_score(cfg: ShardRLConfig) -> float | None:
    """The reward of a correct response: eval.full_score, else 1.0 for the registered rewards (all of them give 1.0
    to a right answer); None for a user function, whose scale is unknown."""
    if cfg.eval.full_score is not None:
        return cfg.eval.full_score
    return 1.0 if cfg.reward.function in REGISTRY else None


def is_due(version: int, cfg: ShardRLConfig) -> bool:
    if version == 0:
        return cfg.eval.base
    return version % cfg.eval.every == 0


def pending(run: Run, done: set[int], *, latest_too: bool = False) -> list[int]:
    """Versions to score, oldest first: the due ones still published (or LATEST) and not yet scored."""
    latest = latest_version(run.layout)
    candidates = {v for v in published_versions(run.layout) if v <= latest} | {latest, 0}
    due = {v for v in candidates if is_due(v, run.config)}
    if latest_too:
        due.add(latest)
    return sorted(due - done)


def summarize(rewards: list[float], full: float | None) -> dict[str, float]:
    """``reward_mean`` and, where a full score is defined, ``accuracy``: the fraction scoring at least it."""
    if not rewards:
        return {}
    out = {"reward_mean": sum(rewards) / len(rewards)}
    if full is not None:
        out["accuracy"] = sum(1 for r in rewards if r >= full) / len(rewards)
    return out


# ---------------------------------------------------------------------------------------------- scoring


@dataclass
class Evaluator:
    """One engine, the encoded held-out prompts and the scorer; ``score(version)`` gives one eval record."""

    run: Run
    engine: Engine
    prompts: list[EncodedPrompt]
    scorer: Scorer
    tool_task: ToolTask | None = None  # with env.tools: the workers' episodes, run greedily
    serving: int = 0  # the version the engine holds (0: the base it was built on)
    # the node-local copies the workers load from: one read of shared storage per node, delta versions rebuilt
    _cache: NodeCache | None = None

    def sampling(self) -> SamplingSpec:
        cfg = self.run.config
        s = cfg.rollout.sampling
        return SamplingSpec(
            temperature=0.0,
            max_tokens=cfg.eval.max_response_length or s.max_response_length,
            n=1,
            stop=list(s.stop),
            seed=0,
        )

    def load(self, version: int) -> int:
        """Verify and load ``version``; its trainer step.  WeightsError/EngineError when it cannot be used."""
        if version == 0:
            if self.serving != 0:
                raise EngineError("the base model is only scored before any version is loaded")
            return 0
        if self._cache is None:
            self._cache = NodeCache.of_run(self.run.layout)
        wv = self._cache.materialise(version)  # verified, a delta version rebuilt: what an engine loads
        self.engine.load_weights(wv.path)
        self.serving = version
        return wv.step

    def score(self, version: int) -> tuple[int, dict[str, Any]]:
        """(trainer step, record) of ``version``, scored greedily on every held-out prompt."""
        start = time.monotonic()
        step = self.load(version)
        batch = max(1, self.run.config.rollout.prompts_per_batch)
        rewards: list[float] = []
        failed = 0
        for i in range(0, len(self.prompts), batch):
            chunk = self.prompts[i : i + batch]
            scored = self._episodes(chunk, version) if self.tool_task else self._responses(chunk)
            for got in scored:
                if got is None:
                    failed += 1
                else:
                    rewards.extend(got)
        record: dict[str, Any] = {
            "version": version,
            **summarize(rewards, full_score(self.run.config)),
            "prompts": len(self.prompts),
            "eval_s": round(time.monotonic() - start, 3),
        }
        if failed:
            record["reward_errors"] = failed
        return step, record

    def _responses(self, chunk: list[EncodedPrompt]) -> list[list[float] | None]:
        """One greedy response per prompt, scored: its reward, or None where the reward function failed."""
        outputs = self.engine.generate([p.ids for p in chunk], self.sampling())
        return [group.rewards for group in self.scorer.score_batch(chunk, outputs)]

    def _episodes(self, chunk: list[EncodedPrompt], version: int) -> list[list[float] | None]:
        """One greedy episode per prompt, run to its end as a worker runs it, scored on its last reply (a reward
        function that fails scores 0 with the error in the row, as in training); None where it left no room."""
        task = self.tool_task
        assert task is not None
        limits = task.limits
        if self.run.config.eval.max_response_length:
            limits = replace(limits, max_response=self.run.config.eval.max_response_length)
        episodes = [task.episode(p.prompt) for p in chunk]
        run_episodes(self.engine.generate, episodes, self.sampling(), limits, lambda: version)
        out: list[list[float] | None] = []
        for e, p in zip(episodes, chunk, strict=True):
            rows, _ = group_rows([e], "eval", p.prompt)
            out.append(None if rows is None else [float(rows[0]["reward"])])
        return out


def encode_prompts(run: Run, prompts: list[Prompt], tokenizer: Any) -> list[EncodedPrompt]:
    """The prompts as token ids; those longer than the engine's prompt budget are left out (one log line)."""
    cfg = run.config
    limit = min(cfg.data.max_prompt_length, cfg.context_length() - 1)
    encode = make_encoder(tokenizer, cfg.data.chat_template, cfg.data)
    out = []
    for p in prompts:
        text, ids = encode(p)
        if len(ids) <= limit:
            out.append(EncodedPrompt(p, ids, text))
    if len(out) < len(prompts):
        log.info("eval: %d prompts longer than %d tokens left out", len(prompts) - len(out), limit)
    return out


# ---------------------------------------------------------------------------------------------- the process


def _line(record: dict[str, Any], step: int) -> str:
    acc = record.get("accuracy")
    reward = record.get("reward_mean")
    return (
        f"eval v{record['version']} (step {step}) | reward {'-' if reward is None else f'{reward:.3f}'} | "
        f"accuracy {'-' if acc is None else f'{acc:.3f}'} | {record['prompts']} prompts | {record['eval_s']:.1f} s"
    )


def _keep_if_best(run: Run, version: int, record: dict[str, Any]) -> None:
    """A version that scores above the recorded best becomes ``weights/BEST.json``, which garbage collection keeps:
    the best version stays exportable however many versions follow it.  Accuracy where the task defines one, else
    the mean reward."""
    score = record.get("accuracy", record.get("reward_mean"))
    if version <= 0 or not isinstance(score, (int, float)):
        return
    best = weights.best_version(run.layout)
    if best is None or score > best[1]:
        try:
            weights.record_best(run.layout, version, float(score))
        except OSError as e:  # the version may go with garbage collection; the scores are in the metrics
            log.warning("eval: could not record v%d as the best (%s)", version, e)


def _run_finished(run: Run) -> bool:
    """The trainer recorded the end of the run's budget: nothing more will be published."""
    try:
        return read_finished(run.layout) is not None
    except RecordError:
        return False  # not a valid record (yet): keep following


def _stop_flag() -> threading.Event:
    stop = threading.Event()

    def handler(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def build(run: Run) -> Evaluator:
    """Prompts, reward and engine, built once (user errors first, before the engine starts)."""
    from transformers import AutoTokenizer

    from rollout_worker.engines import EngineSpec, build_engine
    from rollout_worker.prompts import derive_seed

    cfg = run.config
    prompts, scorer = eval_prompts(cfg), make_scorer(cfg.reward)
    tokenizer = AutoTokenizer.from_pretrained(str(run.tokenizer_dir))
    encoded = encode_prompts(run, prompts, tokenizer)
    engine = build_engine(EngineSpec.of_run(run, derive_seed(cfg.run.seed, "eval")))
    tool_task = ToolTask(cfg, tokenizer) if cfg.env.tools else None
    return Evaluator(run, engine, encoded, scorer, tool_task)


def run_evaluator(run: Run, *, once: bool = False) -> int:
    """Score due versions as they are published until stopped (``once``: what is due now and the latest)."""
    stop = _stop_flag()
    path = run.layout.metrics_file(EVAL_METRICS)
    done = {int(r["version"]) for r in metrics.read_all(path) if isinstance(r.get("version"), int)}
    ev = build(run)
    sink = metrics.open_sinks(path, wandb=metrics.wandb_target(run, EVAL_METRICS))
    skipped: set[int] = set()
    log.info("eval: %d prompts, every %d versions, engine up", len(ev.prompts), run.config.eval.every)
    try:
        while not stop.is_set():
            last_round = once or _run_finished(run)
            for version in pending(run, done | skipped, latest_too=last_round):
                if stop.is_set():
                    break
                try:
                    step, record = ev.score(version)
                except (WeightsError, EngineError, OSError) as e:
                    log.warning("eval: weights v%d skipped (%s)", version, e)
                    skipped.add(version)
                    continue
                sink.log(record, step)
                done.add(version)
                log.info("%s", _line(record, step))
                _keep_if_best(run, version, record)
            if last_round:
                break
            stop.wait(run.config.eval.poll_s)
    finally:
        sink.close()
        ev.engine.close()
    return 0
