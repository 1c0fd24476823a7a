"""The trainer tests' retry is confined to a native crash inside torch's collectives: the crash site is read from
the faulthandler stack of the crashing thread, not from whichever thread the log shows first."""

from __future__ import annotations

from tests.integration._trainer_helpers import COLLECTIVES, native_crash_site

GLOO = """[rank0] step 2
Fatal Python error: Segmentation fault

Thread 0x00007f0000000001 (most recent call first):
  File "/work/trainer/versions.py", line 120 in _write
  File "/usr/lib/python3.11/threading.py", line 975 in run

Current thread 0x00007f0000000002 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2800 in all_reduce
  File "/work/trainer/step.py", line 300 in train_step
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: exitcode -11 (SIGSEGV)
"""


def test_a_crash_in_a_collective_is_the_known_cause() -> None:
    site = native_crash_site(GLOO)
    assert site is not None and COLLECTIVES in site and "all_reduce" in site


def test_a_crash_in_our_code_is_not_retried() -> None:
    ours = GLOO.replace(
        "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", "/work/trainer/x.py"
    ).replace("/work/trainer/versions.py", "/venv/lib/python3.11/site-packages/torch/distributed/c10d.py")
    site = native_crash_site(ours)
    assert site is not None and COLLECTIVES not in site  # the other thread's torch frames do not count


def test_no_crash_no_site() -> None:
    assert native_crash_site("step 1\nstep 2\n") is None
