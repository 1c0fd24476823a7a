"""The trainer's logging setup and the one fixed-field line per step that rank 0 prints.

The metric sinks themselves (JSONL always, TensorBoard when installed) are ``buffer.metrics.open_sinks``.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("trainer")


def setup_logging(rank: int) -> None:
    """Rank 0 logs at INFO; the other ranks only warnings, so the console shows one line per step."""
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )


def step_line(step: int, m: dict[str, Any]) -> str:
    """The fixed-field console line of a step (PPO runs add the critic's error)."""
    value = f"value mse {m['value_mse']:.4f} | " if "value_mse" in m else ""
    entropy = f"{m['entropy']:.3f}" if "entropy" in m else "-"
    return (
        f"step {step} | reward {m.get('reward_mean', 0):.3f} | kl {m.get('kl_ref', 0):.4f} | "
        f"entropy {entropy} | clip {m.get('clip_frac', 0):.3f} | {value}"
        f"stale {m.get('staleness_mean', 0):.2f} (dropped {m.get('dropped_stale', 0)}) "
        f"| {m.get('tokens_per_s', 0):.0f} tok/s | wait {100 * m.get('wait_frac', 0):.0f}%"
    )
