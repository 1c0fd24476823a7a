"""`shardrl-rollout` (``python -m rollout_worker``): the node supervisor of a run's rollout workers.

One per node (``deploy/rollout_only.sh`` uses ``srun --ntasks-per-node=1``).  ``--help`` imports no torch or vLLM.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from buffer.config import PER_PROCESS_FIELDS, ConfigError, ShardRLConfig, parse_overrides


def _field_help(dotted: str) -> str:
    model: Any = ShardRLConfig
    *sections, leaf = dotted.split(".")
    for name in sections:
        model = model.model_fields[name].annotation
    f = model.model_fields[leaf]
    return f"  --{dotted} VALUE  {f.description or ''} (default {f.get_default(call_default_factory=True)!r})"


def _parser() -> argparse.ArgumentParser:
    overrides = "\n".join(_field_help(k) for k in sorted(PER_PROCESS_FIELDS) if k.startswith("rollout."))
    return argparse.ArgumentParser(
        prog="shardrl-rollout",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Node supervisor: runs as many rollout workers on this node as RUN's control state asks for and the "
            "node holds (one per GPU, or rollout.cpu_workers on CPU), restarts the ones that die, drains them on "
            "SIGTERM/SIGINT within rollout.drain_deadline_s.  Scale with "
            '`echo \'{"action":"add","count":2}\' > RUN/control.json` or `shardrl scale RUN --add 2`.'
        ),
        epilog=(
            "Per-process overrides (everything else is fixed by RUN/config.json, written by `shardrl init`):\n"
            f"{overrides}\n\nExit status: 0 after a drain, 2 for a configuration error (one line on stderr)."
        ),
    )


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    p.add_argument("--run", type=Path, required=True, help="the run directory (created by `shardrl init`)")
    p.add_argument(
        "--max-local-workers",
        type=int,
        default=None,
        metavar="N",
        help="worker slots on this node (= --rollout.max_local_workers; default: visible GPUs, or "
        "rollout.cpu_workers without GPUs)",
    )
    args, rest = p.parse_known_args(argv)
    from buffer.run import open_run
    from rollout_worker.supervisor import run_supervisor
    from rollout_worker.worker import USER_ERRORS, preflight

    try:
        overrides = parse_overrides(rest)
        if args.max_local_workers is not None:
            overrides["rollout.max_local_workers"] = str(args.max_local_workers)
        run = open_run(args.run, overrides)
        preflight(run)
    except (ConfigError, *USER_ERRORS) as e:
        print(f"shardrl-rollout: {e}", file=sys.stderr)
        return 2
    return run_supervisor(run, overrides)


if __name__ == "__main__":
    sys.exit(main())
