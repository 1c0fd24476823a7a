"""End-to-end benchmark of the real system: decoupled rollout/training against synchronous, same devices and prompts.

    python bench/e2e.py                                    # CPU: the demo model and task, sync vs staleness 1
    python bench/e2e.py --modes sync,1,2 --steps 12 --out e2e.json
    python bench/e2e.py --engine hf --model PATH --response-length 256 --samples-per-step 256 \\
        --trainer-device cuda:0 --worker-device cuda:1 --set model.dtype=bfloat16
    python bench/e2e.py --engine hf --shape qwen2.5-0.5b --workers 3 --worker-device cuda:1,1,1 ...

For each mode, a fresh run directory made by ``shardrl init`` from the packaged demo.toml with overrides (the same
seed, prompts, batch shape and step count in every mode), then the processes the demo starts, meeting only in that
directory: one rollout node supervisor with ``--workers`` workers and a one-process trainer, each with its own
``CUDA_VISIBLE_DEVICES``.  The modes differ only in their staleness bounds and the backlog that follows from them:

- ``sync``: rollout.max_staleness = trainer.max_staleness = 0.  Every consumed sample was generated with the
  trainer's newest weights; the trainer waits for them, and the workers wait while it trains a step that will
  publish and while a new version is still being written (``rollout_worker/following.py``), so generation and
  training alternate.  A batch a worker had started before the step began is one version old when it ends and is
  dropped (reported).  The backlog is unbounded (``Shape.backlog`` says why).  The JSON also gives a serial
  estimate: samples per step over (training time per step + one worker batch), the time of a loop that generates,
  then trains.
- ``K`` (1, 2, ...): both bounds K, and the workers may run up to K steps of samples ahead of the trainer.

Measured over the steps after ``--warmup-steps`` (engine start and the first fill are left out), from the run's
files: samples/s consumed (plans, and the trainer's metrics timestamps), trainer idle fraction (the ``wait_s`` the
trainer logs per step; the trainer's polled status when it does not), worker paused fraction (the workers' status
records, polled by this process, split by reason) and generating fraction (``batch_s`` of the rollout metrics), the
staleness histogram of consumed samples (each plan's samples, their ``policy_version`` read from the shards, against
the trainer's version at that step), dropped samples, and the samples/s of each mode over sync's.  Prints a table and
writes JSON (``--out``).  It measures only: nothing about timings is asserted.

On a machine with few cores the workers and the trainer share them, so overlap gains little there; the figures that
judge the design come from separate devices (``--trainer-device cuda:0 --worker-device cuda:1``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shapes import SHAPES

from buffer.config import ConfigError, load_toml
from buffer.layout import RunLayout
from buffer.metrics import read_all
from buffer.plans import sample_ids_of, valid_plans

POLL_S = 0.1  # how often this process samples the status records
UNBOUNDED = 10**9  # a backlog bound no run reaches
GENERATED = "generated_samples_per_s"  # a mode's samples/s generated inside its window (generated_samples)


def demo_config() -> Path:
    return Path(str(resources.files("shardrl") / "configs" / "demo.toml"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument(
        "--modes", default="sync,1", help="comma-separated: sync and/or staleness bounds (1, 2, ...)"
    )
    p.add_argument("--steps", type=int, default=6, help="trainer steps per mode")
    p.add_argument(
        "--warmup-steps", type=int, default=1, help="first steps left out of the measurement (>= 1)"
    )
    p.add_argument("--engine", choices=["auto", "vllm", "hf"], default="auto")
    p.add_argument(
        "--model", default=None, help="tiny, tiny-tied or a HF model directory (default: demo.toml's)"
    )
    p.add_argument(
        "--shape",
        default=None,
        choices=sorted(SHAPES),
        help="build a random model of this bench/shapes.py shape with the demo's tokenizer and run on it (--model "
        "is then ignored): a published model's compute on the demo task",
    )
    p.add_argument(
        "--response-length", type=int, default=None, help="max response tokens (default: demo.toml's)"
    )
    p.add_argument(
        "--lengths",
        choices=["natural", "loguniform"],
        default="natural",
        help="rollout.sampling.lengths: loguniform draws each response's length between --min-response-length "
        "and --response-length (a long-tailed mix)",
    )
    p.add_argument("--min-response-length", type=int, default=16)
    p.add_argument(
        "--engine-alone",
        action="store_true",
        help="also measure the streaming engine alone on the same prompts and lengths (bench/engine_alone.py): "
        "the tokens/s limit the workers are judged against",
    )
    p.add_argument("--samples-per-step", type=int, default=512, help="trainer.samples_per_step")
    p.add_argument("--workers", type=int, default=1, help="rollout workers under the one supervisor")
    p.add_argument("--trainer-device", default="cpu", help="cpu or cuda:K")
    p.add_argument(
        "--worker-device", default="cpu", help="cpu or cuda:K[,K...] (one GPU per worker, in turn)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--poll-s", type=float, default=0.1, help="trainer and worker polling intervals")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra config override")
    p.add_argument(
        "--dir", type=Path, default=None, help="where the run directories go (default: a temp dir)"
    )
    p.add_argument("--keep", action="store_true", help="keep the run directories")
    p.add_argument("--timeout-s", type=float, default=1800.0, help="give up on a mode after this")
    p.add_argument(
        "--stall-s",
        type=float,
        default=60.0,
        help="give up on a mode once the trainer has waited this long while every worker paused for backlog",
    )
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    try:
        args.mode_list = [parse_mode(m) for m in args.modes.split(",") if m.strip()]
        args.trainer_gpus = gpus_of(args.trainer_device)
        args.worker_gpus = gpus_of(args.worker_device)
        args.overrides = dict(parse_set(s) for s in args.set)
    except ValueError as e:
        p.error(str(e))
    if not args.mode_list:
        p.error("--modes: give at least one mode")
    if not 1 <= args.warmup_steps < args.steps:
        p.error("--warmup-steps must be at least 1 and below --steps")
    return args


def parse_mode(token: str) -> tuple[str, int, bool]:
    """(name, staleness bound, streaming): ``sync``, ``K`` (batch by batch, bound K) or ``sK`` (streaming workers,
    rollout.streaming, bound K)."""
    token = token.strip()
    if token == "sync":
        return "sync", 0, False
    streaming = token.startswith("s") and token[1:].isdigit()
    bound = token[1:] if streaming else token
    if bound.isdigit() and int(bound) >= 1:
        return token, int(bound), streaming
    raise ValueError(f"--modes: {token!r} is neither 'sync', a staleness bound K >= 1, nor sK (streaming)")


def parse_set(item: str) -> tuple[str, str]:
    key, eq, value = item.partition("=")
    if not eq or "." not in key:
        raise ValueError(f"--set {item!r}: expected section.key=VALUE, e.g. model.dtype=bfloat16")
    return key, value


def gpus_of(device: str) -> str:
    """The CUDA_VISIBLE_DEVICES value of a device argument ('' = no GPU)."""
    if device == "cpu":
        return ""
    if device.startswith("cuda:") and all(d.isdigit() for d in device[5:].split(",")):
        return device[5:]
    raise ValueError(f"device {device!r}: expected cpu or cuda:K[,K...]")


# ---------------------------------------------------------------------------------------------------- configs


@dataclass(frozen=True)
class Shape:
    """What every mode shares: samples per step, group size and one worker's batch."""

    samples_per_step: int
    n: int
    prompts_per_batch: int

    @property
    def batch(self) -> int:
        return self.prompts_per_batch * self.n

    def backlog(self, staleness: int) -> int:
        """K >= 1: the smallest backlog bound with which the workers, one batch past it, still fill a step (the
        config rule), plus a step per staleness level beyond the first: how far ahead the workers may run.
        sync: unbounded, as what a worker generates while the trainer trains is one version old once the step ends
        and counts in the backlog until a step that can fill drops it: a bound would stall the run there."""
        if staleness == 0:
            return UNBOUNDED
        return max(1, self.samples_per_step - self.batch) + (staleness - 1) * self.samples_per_step

    def streaming_backlog(self, staleness: int) -> int:
        """Streaming workers count their requests in flight as coming: a bound of one step would let them start
        the next step's samples only once the last straggler of this one is in, idling the engine on the tail.
        K + 1 steps leave the staleness bound (checked per group) to decide."""
        return (staleness + 1) * self.samples_per_step


def common_overrides(args: argparse.Namespace) -> dict[str, str]:
    o = {
        "run.seed": str(args.seed),
        "run.initial_workers": str(args.workers),
        "run.max_workers": str(max(args.workers, 1)),
        "rollout.engine": args.engine,
        "rollout.cpu_workers": str(args.workers),
        "rollout.weights_poll_s": str(args.poll_s),
        "trainer.poll_interval_s": str(args.poll_s),
        "trainer.publish_every": "1",
        "trainer.save_every": "1000000",  # one checkpoint, after the last step: outside the measurement
        "trainer.tensorboard": "false",
    }
    if args.model is not None:
        o["model.path"] = args.model
    if args.response_length is not None:
        o["rollout.sampling.max_response_length"] = str(args.response_length)
        if args.engine != "hf":  # an hf run has no vLLM section; the context is the prompt + response budget
            o["rollout.vllm.max_model_len"] = "null"
    o["trainer.samples_per_step"] = str(args.samples_per_step)
    if args.lengths != "natural":
        o["rollout.sampling.lengths"] = args.lengths
        o["rollout.sampling.min_response_length"] = str(args.min_response_length)
    return o | args.overrides


def plan_shape(args: argparse.Namespace) -> Shape:
    """One round of batches, one per worker, makes one step (rounded up to whole prompts)."""
    cfg = load_toml(demo_config(), common_overrides(args))
    s, n = cfg.trainer.samples_per_step, cfg.rollout.sampling.n
    if s % n:
        raise ConfigError(f"--samples-per-step {s}: must be a multiple of rollout.sampling.n = {n}")
    return Shape(s, n, math.ceil(s / (args.workers * n)))


def mode_overrides(
    args: argparse.Namespace, shape: Shape, staleness: int, streaming: bool = False
) -> dict[str, str]:
    mode = {
        "rollout.streaming": str(streaming).lower(),
        "rollout.max_staleness": str(staleness),
        "trainer.max_staleness": str(staleness),
        "rollout.max_backlog_samples": str(
            shape.streaming_backlog(staleness) if streaming else shape.backlog(staleness)
        ),
        "rollout.prompts_per_batch": str(shape.prompts_per_batch),
        "rollout.shard_samples": str(shape.batch),  # one shard per batch, published as soon as it is scored
        "trainer.samples_per_step": str(shape.samples_per_step),
    }
    return common_overrides(args) | mode | args.overrides


# -------------------------------------------------------------------------------------------------- processes


def python() -> list[str]:
    return [sys.executable, "-P"]


def env_for(gpus: str) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": gpus}


def init(root: Path, overrides: dict[str, str]) -> RunLayout:
    flags = [a for k, v in overrides.items() for a in (f"--{k}", v)]
    cmd = [*python(), "-m", "shardrl.cli", "init", str(root), "--config", str(demo_config()), *flags]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env_for(""), check=False)
    if done.returncode != 0:
        raise SystemExit(f"e2e: shardrl init failed: {(done.stderr or done.stdout).strip()}")
    return RunLayout.of(root)


def spawn(cmd: list[str], log: Path, gpus: str) -> subprocess.Popen:
    with open(log, "ab") as f:
        return subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, env=env_for(gpus), start_new_session=True
        )


def stop(proc: subprocess.Popen, deadline_s: float) -> None:
    """SIGTERM (workers drain), then SIGKILL of the process group after the deadline."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=deadline_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def tail(path: Path, lines: int = 5) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class Poller(threading.Thread):
    """Samples the trainer's and the workers' status records: the states a metrics file does not keep."""

    def __init__(self, layout: RunLayout):
        super().__init__(daemon=True, name="status-poller")
        self.layout = layout
        # (wall time, trainer state, worker id -> (state, paused reason))
        self.samples: list[tuple[float, Any, dict[str, tuple[Any, Any]]]] = []
        self.done = threading.Event()

    def run(self) -> None:  # thread body
        while not self.done.wait(POLL_S):
            trainer = read_json(self.layout.trainer_status)
            workers = {}
            for path in sorted(self.layout.worker_status_dir.glob("*.json")):
                rec = read_json(path)
                if rec:
                    workers[str(rec.get("id", path.stem))] = (rec.get("state"), rec.get("paused_reason"))
            self.samples.append((time.time(), trainer.get("state"), workers))


def read_json(path: Path) -> dict[str, Any]:
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return rec if isinstance(rec, dict) else {}


class ModeFailed(Exception):
    """A mode that did not finish its steps: the reason, and the end of the trainer's log."""


def run_mode(
    args: argparse.Namespace, root: Path, overrides: dict[str, str]
) -> tuple[RunLayout, Poller, float]:
    """One mode end to end; returns when the trainer has done its steps and the workers have drained."""
    layout = init(root, overrides)
    poller = Poller(layout)
    poller.start()
    start = time.monotonic()
    run = str(layout.root)
    supervisor = spawn(
        [*python(), "-m", "rollout_worker", "--run", run, "--max-local-workers", str(args.workers)],
        layout.logs / "bench-rollout.log",
        args.worker_gpus,
    )
    trainer = spawn(
        [*python(), "-m", "trainer", "--run", run, "--max-steps", str(args.steps)],
        layout.logs / "bench-trainer.log",
        args.trainer_gpus,
    )
    try:
        problem = wait_trainer(trainer, supervisor, poller, start + args.timeout_s, args.stall_s)
    finally:
        stop(trainer, 60.0)
        stop(supervisor, 60.0)
        poller.done.set()
        poller.join()
    if problem:
        raise ModeFailed(
            f"{problem}; trainer log {layout.logs / 'bench-trainer.log'}:\n{tail(layout.logs / 'bench-trainer.log')}"
        )
    return layout, poller, time.monotonic() - start


def wait_trainer(
    trainer: subprocess.Popen, supervisor: subprocess.Popen, poller: Poller, deadline: float, stall_s: float
) -> str | None:
    stalled_since: float | None = None
    while trainer.poll() is None:
        if supervisor.poll() is not None:
            return f"the rollout supervisor exited ({supervisor.returncode}) before the trainer finished"
        if time.monotonic() > deadline:
            return "timed out (--timeout-s)"
        stalled_since = (stalled_since or time.monotonic()) if stalled(poller) else None
        if stalled_since is not None and time.monotonic() - stalled_since > stall_s:
            backlog = read_json(poller.layout.trainer_status).get("unconsumed_samples")
            return (
                f"stalled: the trainer waited {stall_s:.0f}s for samples while every worker paused for backlog "
                f"({backlog} unconsumed samples, all too old for the trainer)"
            )
        time.sleep(0.2)
    return None if trainer.returncode == 0 else f"the trainer exited with status {trainer.returncode}"


def stalled(poller: Poller) -> bool:
    """The trainer waits for samples while every worker holds back because of the backlog."""
    if not poller.samples:
        return False
    _, trainer, workers = poller.samples[-1]
    return (
        trainer == "waiting"
        and bool(workers)
        and all(st == "paused" and why == "backlog" for st, why in workers.values())
    )


# --------------------------------------------------------------------------------------------------- analysis


def stamp(rec: dict[str, Any]) -> float | None:
    for key in ("time", "timestamp", "t"):
        if isinstance(rec.get(key), int | float):
            return float(rec[key])
    return None


def trainer_steps(layout: RunLayout) -> dict[int, dict[str, Any]]:
    """step -> the trainer's metrics record of it (the last one, should a step appear twice)."""
    return {int(r["step"]): r for r in read_all(layout.metrics_file("trainer")) if "step" in r}


def shard_versions(layout: RunLayout, names: list[str], cache: dict[str, dict[str, int]]) -> dict[str, int]:
    """sample_id -> policy_version of the samples in ``names`` (read once per shard)."""
    import pyarrow as pa
    from pyarrow import ipc

    out: dict[str, int] = {}
    for name in names:
        if name not in cache:
            with pa.memory_map(str(layout.ready_shard(name))) as src:
                t = ipc.open_file(src).read_all().select(["sample_id", "policy_version"])
            cache[name] = dict(zip(t.column(0).to_pylist(), t.column(1).to_pylist(), strict=True))
        out.update(cache[name])
    return out


def staleness(
    layout: RunLayout, plans: dict[int, Any], steps: list[int], metrics: dict[int, dict]
) -> Counter:
    """Histogram of (trainer version at the step - policy version) over the consumed samples of ``steps``."""
    hist: Counter = Counter()
    cache: dict[str, dict[str, int]] = {}
    for s in steps:
        plan = plans[s]
        trainer_version = plan.extra.get("trainer_version", metrics.get(s, {}).get("version", s - 1))
        versions = shard_versions(layout, plan.shards, cache)
        hist.update(int(trainer_version) - versions[sid] for sid in sample_ids_of(layout, plan))
    return hist


def overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def worker_figures(layout: RunLayout, poller: Poller, t0: float, t1: float) -> dict[str, Any]:
    """Paused fraction per reason (polled status records) and generating fraction (rollout metrics)."""
    window = [w for t, _, w in poller.samples if t0 < t <= t1]
    ids = sorted({wid for w in window for wid in w})
    paused: Counter = Counter()
    for w in window:
        for state, reason in w.values():
            if state == "paused":
                paused[reason or "other"] += 1
    polls = max(1, len(window) * max(1, len(ids)))
    busy, batch_s, tokens, engine_busy, aborted = 0.0, [], 0.0, [], 0
    for path in sorted(layout.metrics.glob("rollout-*.jsonl")):
        records = read_all(path)
        # streaming workers: samples stopped in flight as too stale to train on (a running count per worker)
        aborted += max((int(r.get("aborted_stale_samples") or 0) for r in records), default=0)
        for r in records:
            end, dur = stamp(r), r.get("batch_s")
            if end is not None and isinstance(dur, int | float) and overlap(end - dur, end, t0, t1) > 0:
                busy += overlap(end - dur, end, t0, t1)
                batch_s.append(float(dur))
            span = r.get("interval_s")
            if end is not None and isinstance(span, int | float) and span > 0:
                # a streaming worker's line covers its interval: the share of it inside the window
                tokens += int(r.get("tokens") or 0) * overlap(end - span, end, t0, t1) / span
            elif end is not None and t0 < end <= t1:
                tokens += int(r.get("tokens") or 0)
                if isinstance(r.get("engine_busy"), int | float):
                    engine_busy.append(float(r["engine_busy"]))
    return {
        "workers_seen": ids,
        "worker_paused_frac": sum(paused.values()) / polls,
        "worker_paused_frac_by_reason": {k: v / polls for k, v in sorted(paused.items())},
        "worker_generating_frac": busy / ((t1 - t0) * max(1, len(ids))),
        "worker_batch_s_mean": sum(batch_s) / len(batch_s) if batch_s else None,
        "worker_batches": len(batch_s),
        # response tokens scored per second per worker (what the workers turn out; engine_alone is the limit)
        "worker_tokens_per_s": tokens / ((t1 - t0) * max(1, len(ids))),
        # streaming workers: the engine's busy share of the time they were not paused (their metrics lines)
        "engine_busy_frac": sum(engine_busy) / len(engine_busy) if engine_busy else None,
        "aborted_stale_samples": aborted,
    }


def trainer_idle(
    metrics: dict[int, dict], steps: list[int], poller: Poller, t0: float, t1: float
) -> tuple[float, str]:
    """Seconds the trainer waited for samples over the window: its own ``wait_s`` per step, or, where a step has
    none, the share of the polled status records that say ``waiting``."""
    waits = [metrics[s].get("wait_s") for s in steps]
    if all(isinstance(w, int | float) for w in waits):
        return sum(float(w) for w in waits if w is not None) / (t1 - t0), "trainer metrics wait_s"
    states = [st for t, st, _ in poller.samples if t0 < t <= t1]
    waiting = sum(st == "waiting" for st in states) / max(1, len(states))
    return waiting, "polled trainer status (no wait_s logged)"


def measured_steps(metrics: dict[int, dict], plans: dict[int, Any], warmup: int) -> tuple[int, list[int]]:
    """The step the window opens on (the ``warmup``-th that trained samples) and the steps after it up to the last
    that trained; steps that only dropped stale samples fall in between and count for waits and drops."""
    trained = [s for s in sorted(metrics) if s in plans and plans[s].samples]
    if len(trained) <= warmup:
        raise ModeFailed(f"{len(trained)} trained steps, not more than --warmup-steps {warmup}")
    first = trained[warmup - 1]
    return first, [s for s in range(first + 1, trained[-1] + 1) if s in plans and s in metrics]


def analyse(layout: RunLayout, poller: Poller, warmup: int) -> dict[str, Any]:
    metrics, plans = trainer_steps(layout), valid_plans(layout)
    first, steps = measured_steps(metrics, plans, warmup)
    t0, t1 = stamp(metrics[first]), stamp(metrics[steps[-1]])
    if t0 is None or t1 is None or t1 <= t0:
        raise ModeFailed(f"no timestamps on the steps in {layout.metrics_file('trainer')}")
    trained = [s for s in steps if plans[s].samples]
    consumed = sum(plans[s].samples for s in steps)
    idle, idle_source = trainer_idle(metrics, steps, poller, t0, t1)
    workers = worker_figures(layout, poller, t0, t1)
    busy = (1 - idle) * (t1 - t0) / len(trained)
    batch_s = workers["worker_batch_s_mean"]
    hist = staleness(layout, plans, trained, metrics)
    tokens = consumed_tokens(metrics, plans, trained, t1 - t0)
    return {
        "measured_steps": [steps[0], steps[-1]],
        "trained_steps": len(trained),
        "window_s": t1 - t0,
        "samples_consumed": consumed,
        "samples_per_s": consumed / (t1 - t0),
        "trainer_idle_frac": idle,
        "trainer_idle_source": idle_source,
        "trainer_busy_s_per_step": busy,
        **workers,
        "serial_estimate_samples_per_s": None
        if batch_s is None
        else consumed / len(trained) / (busy + batch_s),
        "staleness_hist": {str(k): hist[k] for k in sorted(hist)},
        "dropped_samples": sum(plans[s].dropped for s in steps),
        "dropped_samples_all_steps": sum(p.dropped for p in plans.values()),
        **tokens,
        GENERATED: generated_samples(workers, tokens["consumed_response_len_mean"]),
    }


def generated_samples(workers: dict[str, Any], mean_len: float | None) -> float | None:
    """Samples the workers generated per second inside the window, counted as their response tokens over the
    consumed samples' mean length: the rate a long run settles at.  Over a short window a decoupled trainer also
    eats the backlog its workers built before the window, so its samples/s runs above this; a synchronous worker
    has no backlog and the two agree."""
    if not mean_len:
        return None
    return workers["worker_tokens_per_s"] * max(1, len(workers["workers_seen"])) / mean_len


def consumed_tokens(
    metrics: dict[int, dict], plans: dict[int, Any], trained: list[int], window_s: float
) -> dict:
    """Response tokens the trainer consumed per second, from each step's ``response_len_mean``: with long-tailed
    lengths a streaming worker hands in short groups first, so samples/s alone would favour it."""
    lens = [(metrics[s].get("response_len_mean"), plans[s].samples) for s in trained]
    if not lens or any(not isinstance(m, int | float) for m, _ in lens):
        return {"consumed_tokens_per_s": None, "consumed_response_len_mean": None}
    tokens = sum(float(m) * n for m, n in lens)
    return {
        "consumed_tokens_per_s": tokens / window_s,
        "consumed_response_len_mean": tokens / sum(n for _, n in lens),
    }


def engine_of(layout: RunLayout) -> str | None:
    for path in sorted(layout.worker_status_dir.glob("*.json")):
        engine = read_json(path).get("engine")
        if engine:
            return str(engine)
    return None


# ------------------------------------------------------------------------------------------------------ report


def ratios(
    results: dict[str, dict[str, Any]], baseline: str = "samples_per_s", key: str = "samples_per_s"
) -> dict[str, float]:
    """``key`` (samples/s, or the samples/s generated inside the window) of each mode over sync's ``baseline`` (its
    measured figure, or its serial estimate)."""
    sync = results.get("sync", {}).get(baseline)
    if not sync:
        return {}
    return {name: r[key] / sync for name, r in results.items() if name != "sync" and r.get(key) is not None}


def streaming_ratios(results: dict[str, dict[str, Any]], key: str = "samples_per_s") -> dict[str, float]:
    """``key`` (samples/s, or consumed response tokens/s) of each streaming mode ``sK`` over the batch-by-batch
    mode ``K`` of the same bound."""
    out = {}
    for name, r in results.items():
        batch = results.get(name[1:], {}) if name.startswith("s") and name[1:].isdigit() else {}
        if r.get(key) and batch.get(key):
            out[f"{name} vs {name[1:]}"] = r[key] / batch[key]
    return out


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def table(results: dict[str, dict[str, Any]], ratio: dict[str, float], vs_serial: dict[str, float]) -> str:
    head = (
        f"{'mode':6} {'samples/s':>10} {'vs sync':>8} {'trainer idle':>13} {'worker paused':>14} "
        f"{'generating':>11} {'dropped':>8} {'train s/step':>13} {'batch s':>8}  staleness of consumed"
    )
    rows = [head, "-" * len(head)]
    for name, r in results.items():
        if name == "engine_alone":
            continue
        if "error" in r:
            rows.append(f"{name:6} failed: {r['error']}")
            continue
        by = ", ".join(f"{k} {pct(v)}" for k, v in r["worker_paused_frac_by_reason"].items())
        batch = r["worker_batch_s_mean"]
        rows.append(
            f"{name:6} {r['samples_per_s']:10.1f} {ratio.get(name, 1.0 if name == 'sync' else math.nan):8.2f} "
            f"{pct(r['trainer_idle_frac']):>13} {pct(r['worker_paused_frac']):>14} "
            f"{pct(r['worker_generating_frac']):>11} {r['dropped_samples']:8d} "
            f"{r['trainer_busy_s_per_step']:13.2f} {'-' if batch is None else f'{batch:.2f}':>8}  "
            + " ".join(f"{k}:{v}" for k, v in r["staleness_hist"].items())
            + (f"   (paused: {by})" if by else "")
        )
    for name, r in results.items():
        if "worker_tokens_per_s" in r:
            busy, alone = r.get("engine_busy_frac"), r.get("worker_tokens_vs_engine_alone")
            rows.append(
                f"{name}: worker output {r['worker_tokens_per_s']:.0f} tokens/s"
                + ("" if alone is None else f" = {alone:.2f}x the engine alone")
                + ("" if busy is None else f"; engine busy {pct(busy)} of unpaused time")
                + (
                    f"; {r['aborted_stale_samples']} stopped in flight as too stale"
                    if r.get("aborted_stale_samples")
                    else ""
                )
            )
    for name, r in results.items():
        if r.get("consumed_tokens_per_s"):
            rows.append(
                f"{name}: the trainer consumed {r['consumed_tokens_per_s']:.0f} response tokens/s, "
                f"{r['consumed_response_len_mean']:.1f} a sample"
            )
        if r.get(GENERATED) is not None:
            rows.append(
                f"{name}: the workers generated {r[GENERATED]:.1f} samples/s inside the window "
                "(what the trainer consumed beyond that came from the backlog built before it)"
            )
    generated = ratios(results, GENERATED, GENERATED)
    if generated:
        rows.append(
            "generated samples/s over sync's: " + ", ".join(f"{k} {v:.2f}" for k, v in generated.items())
        )
    stream = streaming_ratios(results)
    if stream:
        by_tokens = streaming_ratios(results, "consumed_tokens_per_s")
        rows.append(
            "streaming over batch by batch: "
            + ", ".join(f"{k} {v:.2f}" for k, v in stream.items())
            + (" (consumed tokens/s: " + ", ".join(f"{k} {v:.2f}" for k, v in by_tokens.items()) + ")")
        )
    alone = results.get("engine_alone")
    if alone is not None:
        rows.append(f"engine alone: {alone}")
    if vs_serial:
        rows.append(
            "samples/s over sync's serial estimate (training time + one worker batch per step): "
            + ", ".join(f"{k} {v:.2f}" for k, v in vs_serial.items())
        )
    return "\n".join(rows)


def settings(args: argparse.Namespace, shape: Shape) -> dict[str, Any]:
    return {
        "engine": args.engine,
        "model": args.model or "demo.toml's",
        "shape": args.shape,
        "workers": args.workers,
        "trainer_device": args.trainer_device,
        "worker_device": args.worker_device,
        "steps": args.steps,
        "warmup_steps": args.warmup_steps,
        "samples_per_step": shape.samples_per_step,
        "n": shape.n,
        "prompts_per_batch": shape.prompts_per_batch,
        "seed": args.seed,
        "poll_s": args.poll_s,
        "extra_overrides": args.overrides,
        "cpu_count": os.cpu_count(),
    }


def measure_mode(
    args: argparse.Namespace, shape: Shape, root: Path, bound: int, streaming: bool = False
) -> dict[str, Any]:
    head = {
        "streaming": streaming,
        "rollout_max_staleness": bound,
        "trainer_max_staleness": bound,
        "max_backlog_samples": shape.streaming_backlog(bound) if streaming else shape.backlog(bound),
    }
    try:
        layout, poller, wall = run_mode(args, root, mode_overrides(args, shape, bound, streaming))
        return {
            **head,
            "engine": engine_of(layout),
            "wall_s_total": wall,
            **analyse(layout, poller, args.warmup_steps),
        }
    except ModeFailed as e:
        print(f"e2e: {root.name}: {e}", file=sys.stderr)
        return {**head, "error": str(e).splitlines()[0]}


def engine_alone(args: argparse.Namespace, shape: Shape, model: Path) -> dict[str, Any]:
    """The streaming engine by itself on the workers' device, prompts and lengths (``bench/engine_alone.py``), on
    the model the modes ran (``model``: a run directory's resolved model)."""
    cfg = load_toml(demo_config(), mode_overrides(args, shape, 1, True))
    cmd = [
        *python(),
        str(Path(__file__).with_name("engine_alone.py")),
        "--model",
        str(model),
        "--engine",
        args.engine,
        "--samples",
        str(2 * shape.samples_per_step),
        "--in-flight",
        str(cfg.rollout.max_in_flight or shape.batch),
        "--lengths",
        args.lengths,
        "--min-response-length",
        str(args.min_response_length),
        "--max-response-length",
        str(cfg.rollout.sampling.max_response_length),
        "--dtype",
        cfg.model.dtype,
    ]
    if cfg.rollout.vllm is not None:  # the workers' own engine settings, so the limit is the same engine's
        options = cfg.rollout.vllm.model_dump(exclude={"dtype", "max_model_len"})
        cmd += ["--vllm-options", json.dumps(options)]
    gpus = args.worker_gpus.split(",")[0] if args.worker_gpus else ""
    done = subprocess.run(cmd, capture_output=True, text=True, env=env_for(gpus), check=False)
    if done.returncode != 0:
        return {"error": (done.stderr or done.stdout).strip().splitlines()[-1:]}
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def add_engine_ratios(results: dict[str, dict[str, Any]]) -> None:
    """Each mode's worker output tokens/s against the engine alone's."""
    limit = results.get("engine_alone", {}).get("tokens_per_s")
    for name, r in results.items():
        if name != "engine_alone" and limit and isinstance(r.get("worker_tokens_per_s"), int | float):
            r["worker_tokens_vs_engine_alone"] = r["worker_tokens_per_s"] / limit


def drop_outputs(layout: RunLayout) -> None:
    """A measured mode's checkpoints and weight versions (its logs and metrics stay, for the table)."""
    for d in (layout.checkpoints, layout.weights):
        shutil.rmtree(d, ignore_errors=True)


def build_shaped_model(name: str, out: Path) -> Path:
    """A random model of the ``name`` shape with the tiny tokenizer (the demo task's tokens), built once for every
    mode; the usual initializer range (0.02), as a model trained from scratch would start."""
    from shardrl.tiny_model import build_tiny_model

    shape = {k: v for k, v in SHAPES[name].items() if k not in ("vocab_size", "tie_word_embeddings")}
    tied = bool(SHAPES[name]["tie_word_embeddings"])
    t0 = time.perf_counter()
    path = build_tiny_model(out, tied=tied, seed=0, init_std=0.02, shape=shape)
    print(f"e2e: built a random {name}-shaped model ({time.perf_counter() - t0:.0f} s): {path}", flush=True)
    return path


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # unwinds through run_mode, which stops the children


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        shape = plan_shape(args)
    except ConfigError as e:
        print(f"e2e: {e}", file=sys.stderr)
        return 2
    if args.dir is not None:
        args.dir.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="shardrl-e2e-", dir=args.dir))
    results: dict[str, dict[str, Any]] = {}
    try:
        if args.shape is not None:
            args.model = str(build_shaped_model(args.shape, base / f"model-{args.shape}"))
        # The limit first where the model is already built: a run cut short by a time limit still has it.
        alone_first = args.engine_alone and args.model is not None
        if alone_first:
            results["engine_alone"] = engine_alone(args, shape, Path(args.model))
            write_out(args, shape, results)
        for name, bound, streaming in args.mode_list:
            print(f"e2e: mode {name}: {args.steps} steps of {shape.samples_per_step} samples ...", flush=True)
            results[name] = measure_mode(args, shape, base / f"run-{name}", bound, streaming)
            # a 1.5B mode leaves ~20 GB of checkpoint and versions: the next would fill a disk
            if not args.keep:
                drop_outputs(RunLayout.of(base / f"run-{name}"))
            add_engine_ratios(results)
            write_out(args, shape, results)  # what is measured so far survives an interrupted run
        if args.engine_alone and not alone_first:
            first = args.mode_list[0][0]
            results["engine_alone"] = engine_alone(args, shape, base / f"run-{first}" / "base_model")
            add_engine_ratios(results)
            write_out(args, shape, results)
        print(table(results, ratios(results), ratios(results, "serial_estimate_samples_per_s")))
    except KeyboardInterrupt:
        print("e2e: interrupted", file=sys.stderr)
        return 130
    finally:
        if args.keep:
            print(f"e2e: run directories kept in {base}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    if args.out is not None:
        print(f"e2e: wrote {args.out}")
    return 1 if any("error" in r for r in results.values()) else 0


def write_out(args: argparse.Namespace, shape: Shape, results: dict[str, dict[str, Any]]) -> None:
    if args.out is None:
        return
    ratio = ratios(results)
    out = {
        "settings": settings(args, shape),
        "modes": results,
        "ratio_vs_sync": ratio,
        "ratio": next((ratio[n] for n, _, _ in args.mode_list if n in ratio), None),
        "ratio_vs_serial_estimate": ratios(results, "serial_estimate_samples_per_s"),
        "ratio_vs_sync_generated": ratios(results, GENERATED, GENERATED),
        "ratio_streaming_vs_batch": streaming_ratios(results),
        "ratio_streaming_vs_batch_tokens": streaming_ratios(results, "consumed_tokens_per_s"),
    }
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
