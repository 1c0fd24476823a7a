"""The trainer, with step 2's compute made to run out of memory (``torch.OutOfMemoryError``) as a batch too big for
the device would: a stand-in, since no CPU runs out of device memory.  Everything else is the real trainer.

    python tests/integration/_oom_trainer.py --run-dir RUN [trainer flags]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch

import trainer.loop
from trainer.__main__ import main

real_step = trainer.loop.train_step
calls = {"n": 0}


def failing_step(*args, **kwargs):  # type: ignore[no-untyped-def]
    calls["n"] += 1
    if calls["n"] == 2:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80.00 GiB (a stand-in)")
    return real_step(*args, **kwargs)


trainer.loop.train_step = failing_step  # type: ignore[assignment]
sys.exit(main())
