"""Node supervisors with real worker processes (transformers engine, tiny model) on one run directory.

Elastic scale through ``echo ... > RUN/control.json``, a rejected command that disturbs nobody, scale-down draining
the highest slot, a SIGKILLed worker restarted, SIGTERM draining everything within the deadline with no partial
shard and no orphan process; two supervisors splitting the desired count without overlap, pausing at the backlog
bound, and one taking over the other's slots after it was SIGKILLed; a SIGSTOPped supervisor whose worker stops by
itself before another supervisor takes its slot over (never two publishers of one worker id); a damaged control
generation reported without reverting the desired count; a full disk for logs and status records survived; a crash
loop giving the slot up; and the one-line errors of a bad prompts file, a missing model and an unknown reward function.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from buffer import control, heartbeats, plans, shards
from buffer.fsio import create_json_exclusive
from buffer.run import Run
from buffer.status import snapshot
from rollout_worker.supervisor import worker_log

from ._rollout_helpers import (
    ROOT,
    alive,
    assert_ready_shards_valid,
    make_run,
    spawn,
    stop,
    tail,
    wait_for,
    worker,
)

N = 2
DRAIN_S = 10.0
LIVE = ("running", "paused")


@pytest.fixture(scope="module")
def model(tiny_model_untied: Path) -> Path:
    return Path(tiny_model_untied)


def _run(root: Path, model: Path, *, run: dict[str, Any] | None = None, **sections: dict[str, Any]) -> Run:
    rollout = {
        "engine": "hf",
        "prompts_per_batch": 2,
        "shard_samples": 8,
        "flush_interval_s": 0.5,
        "weights_poll_s": 0.5,
        "threads_per_worker": 1,
        "drain_deadline_s": DRAIN_S,
        "restart_backoff_s": 0.5,
        "max_backlog_samples": 1_000_000,
        # no trainer consumes here: with the default bound, three workers of three steps of backlog would pause as
        # too stale, and these tests need them generating for their whole length
        "max_staleness": 1000,
        "sampling": {"n": N, "max_response_length": 4},
        **sections.pop("rollout", {}),
    }
    sections["trainer"] = {"max_staleness": 1000, **sections.get("trainer", {})}
    base_run = {
        "heartbeat_interval_s": 0.5,
        "control_poll_s": 0.3,
        "lease_timeout_s": 3.0,
        "control_settle_s": 0.5,
        **(run or {}),
    }
    return make_run(root, model, run=base_run, rollout=rollout, **sections)


def _supervise(run: Run, capacity: int, log: Path) -> subprocess.Popen:
    return spawn(["rollout_worker", "--run", str(run.layout.root), "--max-local-workers", str(capacity)], log)


def _record(run: Run, sup: subprocess.Popen) -> dict[str, Any]:
    return next((r for r in heartbeats.read_supervisors(run.layout) if r.get("pid") == sup.pid), {})


def _beats(read: Callable[[], dict[str, Any]], what: str, n: int = 3) -> None:
    """Wait until the record ``read`` returns was written ``n`` more times: the process's loop turned that often (a
    supervisor polls control.json more often than it beats), so "nothing changed" is checked after it had every
    chance to act, not after a guessed sleep."""
    beat = int(read().get("beat", -1))
    wait_for(f"{n} more beats of {what}", lambda: int(read().get("beat", -1)) >= beat + n, 30)


def _running(run: Run, sup: subprocess.Popen, slots: set[int], log: Path) -> dict[int, int] | None:
    """{slot: worker pid} once ``sup`` holds exactly ``slots`` and each of their workers is up; else None."""
    if sup.poll() is not None:
        raise AssertionError(f"supervisor exited with {sup.returncode}:\n{tail(log)}")
    rec = _record(run, sup)
    if set(rec.get("slots", [])) != slots:
        return None
    pids = {}
    for slot in slots:
        w = worker(run, f"w{slot}")
        if w.get("state") not in LIVE or w.get("supervisor") != rec["id"]:
            return None
        if w.get("pid") != rec["workers"][str(slot)]["pid"]:
            return None
        pids[slot] = int(w["pid"])
    return pids


def _echo(run: Run, text: str) -> None:
    """What a person types: `echo TEXT > RUN/control.json` (truncate and rewrite in place)."""
    subprocess.run(["sh", "-c", f"echo '{text}' > '{run.layout.control_file}'"], check=True)


def _ready(run: Run) -> int:
    return shards.ready_sample_count(shards.list_ready(run.layout))


def _sigterm_and_check(run: Run, sup: subprocess.Popen, worker_pids: set[int], log: Path) -> None:
    start = time.monotonic()
    sup.send_signal(signal.SIGTERM)
    rc = sup.wait(timeout=DRAIN_S + 10)
    elapsed = time.monotonic() - start
    assert rc == 0, tail(log)
    assert elapsed < DRAIN_S, f"drain took {elapsed:.1f}s"
    assert not [p for p in worker_pids if alive(p)], "orphan worker processes"
    assert not control.all_leases(run.layout)
    assert _record(run, sup)["state"] == "stopped"
    assert assert_ready_shards_valid(run, N) > 0


def _consume(run: Run, trainer: plans.PlanLog, step: int) -> None:
    """What a trainer step does to the backlog: a plan that consumes every ready sample not consumed yet."""
    done = plans.Consumption.load(run.layout)
    names = [s.name for s in shards.list_ready(run.layout)]
    rows = [(n, r) for s in shards.list_ready(run.layout) for n, r in ((s.name, r) for r in range(s.rows))]
    trainer.write_plan(step, names, [(n, r) for n, r in rows if not done.is_consumed(n, r)])


def _kill_all(pids: set[int]) -> None:
    for p in pids:
        if alive(p):
            os.kill(p, signal.SIGKILL)


@pytest.mark.slow
def test_scale_by_control_file_restart_and_drain(model: Path, tmp_path: Path) -> None:
    run = _run(tmp_path / "run", model, run={"initial_workers": 1})
    log = tmp_path / "supervisor.log"
    sup = _supervise(run, 3, log)
    seen: set[int] = set()
    try:
        pids = wait_for("w0", lambda: _running(run, sup, {0}, log), 90)
        _echo(run, '{"action":"add","count":2}')
        pids = wait_for("w0, w1, w2", lambda: _running(run, sup, {0, 1, 2}, log), 120)
        seen |= set(pids.values())

        # a command that does not parse is rejected once settled; the workers do not notice
        _echo(run, '{"action":"add","count":')
        reason = wait_for("the rejection", lambda: control.read_state(run.layout).last_rejection, 20)
        assert "not valid JSON" in reason["reason"]
        assert snapshot(run.layout)["control"]["last_rejection"]["reason"] == reason["reason"]
        assert control.read_state(run.layout).desired == 3
        _beats(lambda: _record(run, sup), "the supervisor")
        assert _running(run, sup, {0, 1, 2}, log) == pids

        # scale down: the highest slot drains, exits and gives its lease back
        _echo(run, '{"action":"remove","count":1}')

        def drained() -> bool:
            return (
                worker(run, "w2").get("state") == "stopped"
                and not alive(pids[2])
                and 2 not in control.all_leases(run.layout)
                and _running(run, sup, {0, 1}, log) == {0: pids[0], 1: pids[1]}
            )

        wait_for("w2 drained", drained, 60)

        # the newest control generation damaged on disk: reported, the desired count kept, the loop still turning;
        # a command echoed meanwhile waits, and applies once the generation is restored
        newest = run.layout.control_generation(control.read_state(run.layout).generation)
        good = newest.read_bytes()
        newest.write_text('{"desired": 9, "hist')
        _echo(run, '{"action":"set","count":2}')
        problem = wait_for("the problem reported", lambda: _record(run, sup).get("control_problem"), 20)
        assert newest.name in problem
        beat = _record(run, sup)["beat"]
        wait_for("more status beats", lambda: _record(run, sup)["beat"] >= beat + 3, 20)
        assert _record(run, sup)["desired"] == 2 and _running(run, sup, {0, 1}, log) == {
            0: pids[0],
            1: pids[1],
        }
        assert sorted(os.listdir(run.layout.control_dir))[-1] == newest.name  # nothing committed on top
        newest.write_bytes(good)
        wait_for("the repair noticed", lambda: _record(run, sup).get("control_problem") is None, 20)
        state = wait_for(
            "the waiting command applied",
            lambda: (
                (s := control.read_state(run.layout)).last_applied
                and s.last_applied["command"] == {"action": "set", "count": 2}
                and s
            ),
            20,
        )
        assert state.desired == 2 and _running(run, sup, {0, 1}, log) == {0: pids[0], 1: pids[1]}

        # a worker killed outright is restarted
        os.kill(pids[1], signal.SIGKILL)

        def restarted() -> dict[int, int] | None:
            now = _running(run, sup, {0, 1}, log)
            return now if now and now[1] != pids[1] else None

        now = wait_for("w1 restarted", restarted, 60)
        seen |= set(now.values())
        assert now[0] == pids[0] and _record(run, sup)["workers"]["1"]["restarts"] == 1
        wait_for("samples from the restarted w1", lambda: worker(run, "w1").get("samples", 0) > 0, 60)

        # another supervisor takes slot 1 over (as if we had looked dead): our w1 stops; the intruder never
        # renews, so after the lease timeout the slot is reclaimed and a new w1 starts
        gen = control.read_lease(run.layout, 1)["generation"] + 1
        intruder = {
            "slot": 1,
            "generation": gen,
            "holder": "intruder",
            "counter": 1,
            "host": "elsewhere",
            "pid": 1,
        }
        assert create_json_exclusive(run.layout.lease(1, gen), intruder)
        wait_for("w1 stopped", lambda: not alive(now[1]), 30)
        again = wait_for(
            "w1 back", lambda: (p := _running(run, sup, {0, 1}, log)) and p[1] != now[1] and p, 60
        )
        seen |= set(again.values())
        assert control.all_leases(run.layout)[1]["holder"] == _record(run, sup)["id"]

        _sigterm_and_check(run, sup, seen, log)
        assert {worker(run, f"w{k}")["state"] for k in range(3)} == {"stopped"}
    finally:
        stop(sup)
        _kill_all(seen)


@pytest.mark.slow
def test_two_supervisors_share_pause_at_backlog_and_take_over(model: Path, tmp_path: Path) -> None:
    bound = 40
    run = _run(
        tmp_path / "run",
        model,
        run={"initial_workers": 3},
        rollout={"max_backlog_samples": bound},
        trainer={"samples_per_step": bound},
    )
    log_a, log_b = tmp_path / "a.log", tmp_path / "b.log"
    a = _supervise(run, 2, log_a)
    b: subprocess.Popen | None = None
    seen: set[int] = set()
    try:
        on_a = wait_for("A's two workers", lambda: _running(run, a, {0, 1}, log_a), 90)
        b = _supervise(run, 3, log_b)
        on_b = wait_for("B's one worker", lambda: _running(run, b, {2}, log_b), 90)
        seen |= set(on_a.values()) | set(on_b.values())
        holders = {k: v["holder"] for k, v in control.all_leases(run.layout).items()}
        assert holders == {0: _record(run, a)["id"], 1: _record(run, a)["id"], 2: _record(run, b)["id"]}

        # nobody consumes: every worker pauses and the backlog stops near the bound
        wait_for(
            "all paused",
            lambda: all(worker(run, f"w{k}").get("state") == "paused" for k in range(3)),
            90,
        )
        held = _ready(run)
        for k in range(3):  # every worker looked at the backlog again, and still held
            _beats(lambda k=k: worker(run, f"w{k}"), f"w{k}")
        assert _ready(run) == held
        per_worker_slack = 4 * 2 + 8  # a batch that passed the check + what it had buffered
        assert bound < held <= bound + 3 * per_worker_slack
        assert {worker(run, f"w{k}")["paused_reason"] for k in range(3)} == {"backlog"}

        # the trainer consumes what is there (a plan naming every ready sample): the workers resume
        trainer = plans.PlanLog.claim(run.layout)
        _consume(run, trainer, 1)
        wait_for("generation to resume", lambda: _ready(run) > held + 8, 60)

        # A vanishes without a word: its workers follow it, and B takes its slots after the lease timeout
        a.kill()
        a.wait()
        wait_for("A's workers gone", lambda: not any(alive(p) for p in on_a.values()), 30)
        _consume(run, trainer, 2)
        now = wait_for("B on all slots", lambda: _running(run, b, {0, 1, 2}, log_b), 90)
        assert now[2] == on_b[2]
        seen |= set(now.values())
        b_id = _record(run, b)["id"]
        assert {v["holder"] for v in control.all_leases(run.layout).values()} == {b_id}

        _sigterm_and_check(run, b, seen, log_b)
    finally:
        stop(a)
        if b is not None:
            stop(b)
        _kill_all(seen)


@pytest.mark.slow
def test_crash_loop_fails_the_worker_and_frees_its_slot(model: Path, tmp_path: Path) -> None:
    run = _run(
        tmp_path / "run",
        model,
        run={"initial_workers": 1},
        reward={"function": "tests.integration._rollout_rewards:exit_hard"},
        rollout={"max_restarts": 2, "restart_backoff_s": 0.2, "restart_window_s": 120.0},
    )
    log = tmp_path / "supervisor.log"
    sup = _supervise(run, 1, log)
    try:
        w = wait_for("w0 given up", lambda: worker(run, "w0").get("gave_up") and worker(run, "w0"), 120)
        assert w["state"] == "failed"
        assert w["last_error"] == "engine exploded: simulated crash"
        assert w["gave_up"] == "2 restarts within 120s"
        rec = wait_for(
            "the failure in the supervisor's record", lambda: _record(run, sup).get("failed_slots"), 10
        )
        assert rec == {"0": "engine exploded: simulated crash"}
        assert not control.all_leases(run.layout)
        _beats(
            lambda: _record(run, sup), "the supervisor"
        )  # the slot is left for other nodes, not retaken here
        assert _record(run, sup)["slots"] == [] and not control.all_leases(run.layout)
        assert stop(sup) == 0
    finally:
        stop(sup)


@pytest.mark.slow
def test_sigterm_kills_a_worker_that_cannot_drain_in_time(model: Path, tmp_path: Path) -> None:
    deadline = 4.0
    run = _run(
        tmp_path / "run",
        model,
        run={"initial_workers": 1},
        reward={"function": "tests.integration._rollout_rewards:sleepy"},
        rollout={"drain_deadline_s": deadline},
    )
    log = tmp_path / "supervisor.log"
    sup = _supervise(run, 1, log)
    pid = 0
    try:
        pid = wait_for("w0", lambda: _running(run, sup, {0}, log), 90)[0]
        wait_for("w0 busy scoring", lambda: "sleepy reward" in tail(worker_log(run.layout, "w0")), 60)
        start = time.monotonic()
        sup.send_signal(signal.SIGTERM)
        assert sup.wait(timeout=deadline + 10) == 0, tail(log)
        elapsed = time.monotonic() - start
        assert elapsed < deadline, elapsed
        assert not alive(pid) and not control.all_leases(run.layout)
        assert "did not drain in time; killing it" in log.read_text()
        assert not shards.list_ready(run.layout)  # the batch it was scoring never reached a shard
    finally:
        stop(sup)
        _kill_all({pid} if pid else set())


def _cli(*args: str, module: str = "rollout_worker") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_user_errors_are_one_line(model: Path, tmp_path: Path) -> None:
    """Each run is valid when made (``shardrl init`` checks all this too), then broken the way a user might."""

    def prompts(name: str) -> Path:
        path = tmp_path / name
        path.write_text('{"prompt": "1+1=", "answer": "2"}\n')
        return path

    def bad_reward(run: Run) -> None:
        cfg = json.loads(run.layout.config_json.read_text())
        cfg["reward"]["function"] = "nope"
        run.layout.config_json.write_text(json.dumps(cfg))

    gone, bad, no_field = prompts("nope.jsonl"), prompts("bad.jsonl"), prompts("nofield.jsonl")
    gone_model = tmp_path / "gone_model"
    shutil.copytree(model, gone_model)
    cases: dict[str, tuple[dict[str, Any], Callable[[Run], Any], list[str]]] = {
        "missing prompts file": (
            {"data": {"task": "file", "prompts_file": str(gone)}},
            lambda run: gone.unlink(),
            ["nope.jsonl", "prompts file not found", "JSONL", "Parquet"],
        ),
        "bad JSON line": (
            {"data": {"task": "file", "prompts_file": str(bad)}},
            lambda run: bad.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": oops}\n'),
            ["bad.jsonl", "line 2"],
        ),
        "missing field": (
            {"data": {"task": "file", "prompts_file": str(no_field)}},
            lambda run: no_field.write_text('{"question": "1+1=", "answer": "2"}\n'),
            ["nofield.jsonl", "line 1", "'prompt' missing", "question"],
        ),
        "missing model": (
            {"model_dir": gone_model},
            lambda run: shutil.rmtree(gone_model),
            ["gone_model", "not found"],
        ),
        "unknown reward": (
            {},
            bad_reward,
            [
                "reward.function",
                "'nope'",
                "math_answer, exact_match, max_digit, mod_add",
                "package.module:function",
            ],
        ),
    }
    for i, (name, (sections, damage, expected)) in enumerate(cases.items()):
        sections = dict(sections)
        model_dir = sections.pop("model_dir", model)
        run = _run(tmp_path / f"run{i}", model_dir, **sections)
        damage(run)
        for module in ("rollout_worker", "rollout_worker.worker"):
            extra = ["--slot", "0"] if module == "rollout_worker.worker" else []
            p = _cli("--run", str(run.layout.root), *extra, module=module)
            lines = p.stderr.strip().splitlines()
            assert p.returncode == 2 and len(lines) == 1, (name, module, p.returncode, p.stderr)
            for text in expected:
                assert text in lines[0], (name, text, lines[0])


def test_help_documents_the_options_without_importing_torch() -> None:
    code = (
        "import sys\nfrom rollout_worker.__main__ import main\ntry:\n main(['--help'])\nexcept SystemExit:\n pass\n"
        "print(sorted(m for m in ('torch', 'vllm', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip().endswith("[]")
    for option in (
        "--run",
        "--max-local-workers",
        "--rollout.drain_deadline_s",
        "--rollout.engine",
        "control.json",
    ):
        assert option in out


def test_local_devices_one_worker_per_gpu_group_or_cpu_share(monkeypatch: pytest.MonkeyPatch) -> None:
    from buffer.config import ShardRLConfig
    from rollout_worker.supervisor import local_devices

    def cfg(**rollout: Any) -> ShardRLConfig:
        return ShardRLConfig.model_validate({"rollout": rollout, "reward": {"function": "max_digit"}})

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,5,7")
    gpus = local_devices(cfg(engine="hf"))
    assert gpus.capacity == 4 and gpus.env(1, {})["CUDA_VISIBLE_DEVICES"] == "3"
    assert "OMP_NUM_THREADS" not in gpus.env(1, {})
    if importlib.util.find_spec("vllm") is not None:
        tp2 = local_devices(cfg(engine="vllm", vllm={"tensor_parallel_size": 2}))
        assert tp2.capacity == 2 and tp2.env(1, {})["CUDA_VISIBLE_DEVICES"] == "5,7"
    assert local_devices(cfg(engine="hf", max_local_workers=1)).capacity == 1

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    cpu = local_devices(cfg(engine="hf", cpu_workers=2, threads_per_worker=1))
    assert cpu.capacity == 2 and not cpu.gpu_groups
    env0, env1 = cpu.env(0, {}), cpu.env(1, {})
    assert env0["OMP_NUM_THREADS"] == env1["OMP_NUM_THREADS"] == "1"
    if len(os.sched_getaffinity(0)) >= 2:
        assert env0["VLLM_CPU_OMP_THREADS_BIND"] != env1["VLLM_CPU_OMP_THREADS_BIND"]  # own cores each
    assert cpu.env(0, {"VLLM_CPU_OMP_THREADS_BIND": "nobind"})["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


def _shards_by_incarnation(run: Run, worker_id: str) -> dict[str, list[float]]:
    """incarnation -> mtimes of the ready shards it published."""
    out: dict[str, list[float]] = {}
    for s in shards.list_ready(run.layout):
        if s.worker_id == worker_id:
            out.setdefault(s.incarnation, []).append(run.layout.ready_shard(s.name).stat().st_mtime)
    return out


@pytest.mark.slow
def test_a_stalled_supervisors_worker_stops_before_another_supervisor_takes_its_slot(
    model: Path, tmp_path: Path
) -> None:
    timeout_s = 6.0
    run = _run(tmp_path / "run", model, run={"initial_workers": 1, "lease_timeout_s": timeout_s})
    log_a, log_b = tmp_path / "a.log", tmp_path / "b.log"
    a = _supervise(run, 1, log_a)
    b: subprocess.Popen | None = None
    old = 0
    try:
        old = wait_for("w0 on A", lambda: _running(run, a, {0}, log_a), 90)[0]
        old_inc = worker(run, "w0")["incarnation"]
        wait_for("shards of A's w0", lambda: _shards_by_incarnation(run, "w0").get(old_inc), 60)
        b = _supervise(run, 1, log_b)
        wait_for("B up, with no slot", lambda: _record(run, b).get("state") == "running", 60)
        assert _record(run, b)["slots"] == []

        os.kill(a.pid, signal.SIGSTOP)  # A stalls: it renews nothing and can stop nobody
        b_id = _record(run, b)["id"]

        def b_holds() -> bool:
            return control.all_leases(run.layout).get(0, {}).get("holder") == b_id

        while not b_holds():  # by the time B can take the slot over, A's worker has stopped by itself
            assert b.poll() is None, tail(log_b)
            time.sleep(0.05)
        assert not alive(old), "A's worker still runs while B takes its slot over"
        wlog = worker_log(run.layout, "w0").read_text()
        assert "not renewed for 3s (lease_timeout_s / 2)" in wlog and "stopping without publishing" in wlog

        new = wait_for("w0 on B", lambda: _running(run, b, {0}, log_b), 90)[0]
        new_inc = worker(run, "w0")["incarnation"]
        published = wait_for(
            "shards of B's w0", lambda: (m := _shards_by_incarnation(run, "w0")).get(new_inc) and m, 60
        )
        assert new != old and new_inc != old_inc and set(published) == {old_inc, new_inc}
        assert max(published[old_inc]) < min(published[new_inc])  # never two publishers of w0 at once

        # A comes back: it finds the slot taken, and neither restarts its worker nor disturbs B's
        os.kill(a.pid, signal.SIGCONT)
        wait_for(
            "A without slots",
            lambda: _record(run, a).get("slots") == [] and "lost the lease" in log_a.read_text(),
            30,
        )
        _beats(lambda: _record(run, a), "supervisor A")
        assert _running(run, b, {0}, log_b) == {0: new} and _record(run, a)["slots"] == []
        assert len(_shards_by_incarnation(run, "w0")) == 2
        assert stop(a) == 0
        _sigterm_and_check(run, b, {old, new}, log_b)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(a.pid, signal.SIGCONT)
        stop(a)
        if b is not None:
            stop(b)
        _kill_all({old} if old else set())


def _fill(path: Path) -> None:
    """Write zeros into ``path`` until its file system is full."""
    with open(path, "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 65536)
            f.flush()


@pytest.mark.slow
def test_a_full_disk_for_logs_and_status_does_not_stop_the_supervisor(model: Path, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    run = _run(tmp_path / "run", model, run={"initial_workers": 1})
    small = [run.layout.logs, run.layout.supervisor_status_dir]  # the log header and the status record
    mounted: list[Path] = []
    sup: subprocess.Popen | None = None
    try:
        for d in small:
            if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)]).returncode != 0:
                pytest.skip("cannot mount a tmpfs here")
            mounted.append(d)
            _fill(d / "filler")
        log = tmp_path / "supervisor.log"
        sup = _supervise(run, 1, log)
        wait_for(
            "both writes to fail",
            lambda: all(
                w in log.read_text() for w in ("starting w0 failed", "writing the status record failed")
            ),
            60,
        )
        time.sleep(1.0)  # it keeps retrying, and keeps running
        assert sup.poll() is None, tail(log)
        assert not heartbeats.read_workers(run.layout)  # no worker could start without its log
        for d in small:
            (d / "filler").unlink()
        rec = wait_for("a status record", lambda: _record(run, sup), 30)
        assert "[Errno 28] No space left on device" in rec["last_error"]
        pid = wait_for("w0 started once there is room", lambda: _running(run, sup, {0}, log), 90)[0]
        _sigterm_and_check(run, sup, {pid}, log)
    finally:
        if sup is not None:
            stop(sup)
        for d in mounted:
            subprocess.run(["umount", "-l", str(d)], check=False)
