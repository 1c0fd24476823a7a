"""`python -m trainer --run RUN [--max-steps N] [--section.key value ...]` (also `shardrl-train`): the torchrun target.

    torchrun --nproc_per_node=G [--nnodes=N --rdzv_backend=c10d --rdzv_endpoint=HOST:PORT --rdzv_id=ID] \\
        -m trainer --run-dir RUN [--max-steps N]

NCCL on GPUs, gloo on CPU, chosen automatically; one process without torchrun also works.  The run's config comes
from RUN/config.json; only per-process settings may be overridden here.  A restarted trainer resumes from the newest
complete checkpoint and replays the recorded plans after it; starting a second trainer on a run fences out the first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pydantic import BaseModel

from buffer.config import PER_PROCESS_FIELDS, AlgorithmConfig, ConfigError, TrainerConfig, parse_overrides


def _options(prefix: str, model: type[BaseModel], only: frozenset[str] | None = None) -> str:
    rows = []
    for name, f in model.model_fields.items():
        key = f"{prefix}.{name}"
        if only is None or key in only:
            rows.append(
                f"  --{key:<34} {f.description} (default {json.dumps(f.get_default(call_default_factory=True))})"
            )
    return "\n".join(rows)


def _parser() -> argparse.ArgumentParser:
    per_process = frozenset(k for k in PER_PROCESS_FIELDS if k.startswith("trainer."))
    p = argparse.ArgumentParser(
        prog="python -m trainer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Per-process overrides accepted here (--section.key VALUE):\n"
        + _options("trainer", TrainerConfig, per_process)
        + "\n\nRun-wide settings, fixed in RUN/config.json at `shardrl init` (shown for reference; changing one "
        "here is refused):\n"
        + _options("trainer", TrainerConfig)
        + "\n"
        + _options("algorithm", AlgorithmConfig)
        + "\n\nExit status: 0 done (max steps, SIGTERM/SIGINT: the step is finished and checkpointed), "
        "2 bad config or command line, 3 fenced out by a newer trainer incarnation, "
        "4 no samples within trainer.step_wait_timeout_s.",
    )
    # torchrun's own parser reads `--run` as an ambiguous abbreviation of its `--run-path`, so under torchrun the
    # run directory is passed as `--run-dir` (or SHARDRL_RUN); `--run` works when started without torchrun.
    p.add_argument(
        "--run-dir",
        "--run",
        dest="run",
        type=Path,
        default=os.environ.get("SHARDRL_RUN"),
        help="run directory made by `shardrl init` (under torchrun write --run-dir; env SHARDRL_RUN)",
    )
    p.add_argument(
        "--max-steps", type=int, default=None, help="stop cleanly after N steps in this invocation"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.run is None:
        parser.error("--run-dir RUN (or --run RUN, or SHARDRL_RUN) is required")
    try:
        overrides = parse_overrides(rest)
        if args.max_steps is not None:
            overrides["trainer.max_steps"] = str(args.max_steps)
        from buffer.run import open_run

        run = open_run(args.run, overrides)
    except ConfigError as e:
        print(f"trainer: {e}", file=sys.stderr)
        return 2
    from trainer.loop import run_trainer

    return run_trainer(run)


if __name__ == "__main__":
    sys.exit(main())
