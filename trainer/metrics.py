"""The one fixed-field line per step that rank 0 prints.

Logging itself is set up by ``buffer.logs.setup_logging``; the metric sinks (JSONL always, TensorBoard when
installed) are ``buffer.metrics.open_sinks``.
"""

from __future__ import annotations

from typing import Any


def _time(m: dict[str, Any]) -> str:
    """The step's wall time and where it went besides computing (only the parts that took 1% or more)."""
    parts = [
        f"{name} {100 * m.get(f'{name}_frac', 0):.0f}%"
        for name in ("wait", "plan", "load", "publish", "checkpoint")
        if name == "wait" or m.get(f"{name}_frac", 0) >= 0.01
    ]
    return f"{m.get('step_s', 0):.2f} s ({', '.join(parts)})"


def step_line(step: int, m: dict[str, Any]) -> str:
    """The fixed-field console line of a step (PPO runs add the critic's error; a step that trained nothing says
    what it did instead)."""
    if not m.get("samples"):
        missing = f", {m['replay_missing']} replayed samples unreadable" if m.get("replay_missing") else ""
        return f"step {step} | no samples: dropped {m.get('dropped_stale', 0)} stale{missing} | {_time(m)}"
    value = f"value mse {m['value_mse']:.4f} | " if "value_mse" in m else ""
    entropy = f"{m['entropy']:.3f}" if "entropy" in m else "-"
    missing = f" | {m['replay_missing']} unreadable" if m.get("replay_missing") else ""
    # a KL or a clip fraction never measured (no reference model, truncated IS) is left out, not shown as 0
    kl = f"kl {m['kl_ref']:.4f} | " if "kl_ref" in m else ""
    clip = f"clip {m['clip_frac']:.3f} | " if "clip_frac" in m else ""
    return (
        f"step {step} | loss {m.get('loss', 0):.4f} | reward {m.get('reward_mean', 0):.3f} | "
        f"{kl}entropy {entropy} | {clip}"
        f"grad-norm {m.get('grad_norm', 0):.3f} | lr {m.get('lr', 0):.2e} | {value}"
        f"stale {m.get('staleness_mean', 0):.2f} (dropped {m.get('dropped_stale', 0)}){missing} | "
        f"{m.get('tokens_per_s', 0):.0f} tok/s | {_time(m)} | peak {m.get('peak_mem_gib', 0):.2f} GiB"
    )
