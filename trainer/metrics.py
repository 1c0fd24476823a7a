"""Metric sinks behind one ``log(metrics, step)`` interface (JSONL always, TensorBoard when installed) and the
one fixed-field line per step that rank 0 prints."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
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


class MetricSink:
    def __init__(self, jsonl: Path, tensorboard_dir: Path | None = None):
        self.jsonl = jsonl
        jsonl.parent.mkdir(parents=True, exist_ok=True)
        self.tb: Any = None
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(tensorboard_dir))
            except ImportError:
                self.tb = None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        rec = {"step": step, "time": time.time(), **metrics}
        with open(self.jsonl, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, int | float):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


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
