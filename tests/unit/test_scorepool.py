"""The score pool: real child processes running real reward functions, with time-outs, crashes and close()."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from multiprocessing import resource_tracker
from pathlib import Path

import psutil
import pytest

from buffer.config import RewardConfig
from rollout_worker.engines.base import Completion
from rollout_worker.prompts import EncodedPrompt, Prompt
from rollout_worker.rewards import GroupRewards, RewardConfigError, Scorer
from rollout_worker.scorepool import CALL_SAMPLES, ScorePool, ScorePoolClosed

pytestmark = pytest.mark.proc  # the pool is reward processes

FNS = "tests.unit._scorepool_rewards"
LIMIT_S = 1.0  # for the functions that hang; the others get a limit a loaded test machine cannot reach


def _prompt(answer: str | None = "9", extra: dict | None = None, index: int = 0) -> EncodedPrompt:
    return EncodedPrompt(
        Prompt(index, "max digit of 19?", answer, None, extra or {}), [1, 2], "<max digit of 19?>"
    )


def _outs(*responses: str, cut: tuple[int, ...] = ()) -> list[Completion]:
    return [
        Completion([1, 2], [5] * (j + 1), [-0.5] * (j + 1), "length" if j in cut else "stop", r)
        for j, r in enumerate(responses)
    ]


@contextmanager
def _pool(
    function: str, *, processes: int = 1, timeout_s: float = 60.0, **reward: float
) -> Iterator[ScorePool]:
    with ScorePool(
        RewardConfig(function=function, **reward), processes=processes, timeout_s=timeout_s
    ) as pool:
        yield pool


def _pool_pids() -> set[int]:
    """Live (not zombie) descendants of this process: the pool's children and whatever they started."""
    # spawn starts multiprocessing's resource tracker once per process, for good: not the pool's to stop
    resource_tracker.ensure_running()
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _gone(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize(
    ("function", "prompt", "outs", "reward"),
    [
        ("max_digit", _prompt("9"), _outs("9", " 9", "3", "x", "9", cut=(1, 4)), {}),
        ("max_digit", _prompt("9"), _outs("9", " 9", "3", "x", "9", cut=(1, 4)), {"truncated_reward": -1.0}),
        # every response cut off: nothing for the function to score
        ("max_digit", _prompt("9"), _outs("9", "3", cut=(0, 1)), {"truncated_reward": -0.5}),
        (f"{FNS}:length", _prompt(None), _outs("ab", "abcd", "a"), {}),
        (f"{FNS}:with_extra", _prompt(None, {"weight": 2}), _outs("ab", "abc"), {}),
        (f"{FNS}:group_size", _prompt(None), _outs("a", "b", "c", cut=(2,)), {"truncated_reward": 0.0}),
        (f"{FNS}:raises_on_bad", _prompt(None), _outs("a", "bad", "a"), {}),
        (f"{FNS}:nan_on_bad", _prompt(None), _outs("a", "bad"), {}),
        ("exact_match", _prompt(None), _outs("a"), {}),  # a registered function that raises: needs an answer
    ],
)
def test_the_pool_scores_a_group_as_the_scorer_does(
    function: str, prompt: EncodedPrompt, outs: list[Completion], reward: dict
) -> None:
    want = Scorer(RewardConfig(function=function, **reward)).score_batch([prompt], [outs])[0]
    with _pool(function, **reward) as pool:
        got = pool.submit(prompt, outs).result(timeout=30)
    assert got == want and got.timed_out == 0 and got.note is None
    if got.rewards is None:  # a failed group says why in one line
        assert got.error and "\n" not in got.error


def test_golden_values_of_a_batched_function_and_truncated_reward() -> None:
    with _pool(f"{FNS}:group_size", truncated_reward=-1.0) as pool:
        got = pool.submit(_prompt(None), _outs("a", "b", "c", "d", cut=(1,))).result(timeout=30)
    # one call per group, of the 3 responses that were not cut off
    assert got == GroupRewards([3.0, -1.0, 3.0, 3.0])


def test_a_sample_past_the_limit_scores_zero_and_the_rest_go_on_in_a_fresh_child() -> None:
    with _pool(f"{FNS}:hangs_on_slow", timeout_s=LIMIT_S) as pool:
        start = time.monotonic()
        got = pool.submit(_prompt(None), _outs("ab", "slow", "abc", "a")).result(timeout=30)
        assert time.monotonic() - start < LIMIT_S + 10
        assert got.rewards == [2.0, 0.0, 3.0, 1.0] and got.error is None and got.timed_out == 1
        assert got.note == "reward function timed out after 1 s on sample 1 (0-based); scored 0.0"
        # the pool goes on with its replacement child
        assert pool.submit(_prompt(None), _outs("abcd")).result(timeout=30) == GroupRewards([4.0])


def test_a_child_that_dies_mid_call_is_treated_like_a_time_out() -> None:
    with _pool(f"{FNS}:exits_on_die") as pool:
        got = pool.submit(_prompt(None), _outs("die", "ab", "die")).result(timeout=30)
        assert got.rewards == [0.0, 2.0, 0.0] and got.timed_out == 2
        assert got.note == "reward process exited with code 1 on sample 0 (0-based); scored 0.0"
        assert pool.submit(_prompt(None), _outs("abc")).result(timeout=30) == GroupRewards([3.0])


def test_a_batched_call_past_the_limit_scores_the_whole_group_zero() -> None:
    with _pool(f"{FNS}:batch_hangs_on_slow", timeout_s=LIMIT_S) as pool:
        got = pool.submit(_prompt(None), _outs("a", "slow", "b")).result(timeout=30)
        assert got.rewards == [0.0, 0.0, 0.0] and got.timed_out == 3
        assert got.note == "reward function timed out after 1 s on the group's call (3 samples); scored 0.0"
        assert pool.submit(_prompt(None), _outs("a", "b")).result(timeout=30) == GroupRewards([1.0, 1.0])


def test_the_kill_at_the_limit_takes_what_the_function_started(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    with _pool(f"{FNS}:hangs_with_a_child", timeout_s=LIMIT_S) as pool:
        got = pool.submit(_prompt(None, {"pid_file": str(pid_file)}), _outs("slow", "a")).result(timeout=30)
    assert got.rewards == [0.0, 1.0] and got.timed_out == 1
    assert _gone(int(pid_file.read_text()))


def test_children_are_persistent_and_many_concurrent_groups_all_complete() -> None:
    with _pool(f"{FNS}:pid", processes=2) as pool:
        futures: list[Future[GroupRewards]] = []
        lock = threading.Lock()

        def submit_many() -> None:
            for _ in range(50):
                f = pool.submit(_prompt(None), _outs(*"abcd"))
                with lock:
                    futures.append(f)

        threads = [threading.Thread(target=submit_many) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results = [f.result(timeout=60) for f in futures]
    assert len(results) == 200 and all(r.rewards is not None and r.timed_out == 0 for r in results)
    # 800 samples, scored by the same two processes throughout
    assert len({x for r in results for x in r.rewards or []}) <= 2


def test_a_group_larger_than_one_call_is_scored_in_several() -> None:
    outs = _outs(*("x" * (k % 7 + 1) for k in range(CALL_SAMPLES + 44)))
    with _pool(f"{FNS}:length") as pool:
        got = pool.submit(_prompt(None), outs).result(timeout=30)
    assert got == GroupRewards([float(k % 7 + 1) for k in range(CALL_SAMPLES + 44)])


def test_a_child_that_died_while_idle_is_replaced_at_no_sample_s_cost() -> None:
    with _pool(f"{FNS}:pid") as pool:
        first = pool.submit(_prompt(None), _outs("a")).result(timeout=30).rewards
        assert first is not None
        os.kill(int(first[0]), signal.SIGKILL)
        assert _gone(int(first[0]))
        again = pool.submit(_prompt(None), _outs("a", "b")).result(timeout=30)
    assert again.timed_out == 0 and again.rewards is not None and again.rewards[0] != first[0]


def test_close_fails_pending_futures_and_leaves_no_process() -> None:
    before = _pool_pids()
    pool = ScorePool(RewardConfig(function=f"{FNS}:hangs_on_slow"), processes=1, timeout_s=30)
    futures = [pool.submit(_prompt(None), _outs("slow"))] + [
        pool.submit(_prompt(None), _outs("a")) for _ in range(3)
    ]
    time.sleep(1.5)  # the first group is now in its (hanging) call
    assert _pool_pids() - before
    start = time.monotonic()
    pool.close()
    assert time.monotonic() - start < 5
    for f in futures:
        with pytest.raises(ScorePoolClosed, match="closed before the group was scored"):
            f.result(timeout=5)
    assert _pool_pids() - before == set()
    pool.close()  # a second close does nothing
    with pytest.raises(ScorePoolClosed):
        pool.submit(_prompt(None), _outs("a"))


def test_close_from_a_future_s_callback_does_not_wait_for_itself() -> None:
    before = _pool_pids()
    pool = ScorePool(RewardConfig(function=f"{FNS}:hangs_on_slow"), processes=1, timeout_s=60)
    first = pool.submit(_prompt(None), _outs("ab"))
    later = pool.submit(_prompt(None), _outs("slow"))  # queued behind the first: the pool has one process
    # runs on the dispatcher thread, once the child has started
    first.add_done_callback(lambda _: pool.close())
    assert first.result(timeout=30) == GroupRewards([2.0])
    with pytest.raises(ScorePoolClosed):
        later.result(timeout=5)
    deadline = time.monotonic() + 5
    while _pool_pids() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _pool_pids() - before == set()


@pytest.mark.parametrize(
    ("function", "line"),
    [
        ("no_such_module_for_the_pool:fn", "cannot import 'no_such_module_for_the_pool'"),
        (f"{FNS}:missing", "has no function 'missing'"),
    ],
)
def test_a_function_that_cannot_be_resolved_fails_every_future_with_one_line(
    function: str, line: str
) -> None:
    before = _pool_pids()
    with _pool(function, processes=2) as pool:
        first = [pool.submit(_prompt(None), _outs("a")) for _ in range(3)]
        for f in first:
            with pytest.raises(RewardConfigError, match=line) as e:
                f.result(timeout=30)
            assert "\n" not in str(e.value)
        # broken for good: a later group fails at once, and no child is restarted
        with pytest.raises(RewardConfigError, match=line):
            pool.submit(_prompt(None), _outs("a")).result(timeout=0.1)
        time.sleep(0.5)
        assert _pool_pids() - before == set()
