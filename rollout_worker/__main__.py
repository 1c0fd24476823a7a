"""`shardrl-rollout` (``python -m rollout_worker --run-dir RUN``): the node supervisor of a run's rollout workers.

One per node (``deploy/rollout_only.sh`` uses ``srun --ntasks-per-node=1``).  With ``--eval`` the same command is the
evaluator instead (``rollout_worker.evaluator``): greedy scores of every ``eval.every``-th published weight version.
``--help`` imports no torch or vLLM.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from buffer.config import (
    OVERRIDES_HELP,
    PER_PROCESS_FIELDS,
    ConfigError,
    add_run_dir_option,
    options_help,
    parse_overrides,
    refuse_sections,
    section_fields,
)

PROG = "shardrl-rollout"  # also `python -m rollout_worker`


def _epilog() -> str:
    keys = section_fields("rollout")
    per_process = [(k, f) for k, f in keys if k in PER_PROCESS_FIELDS]
    run_wide = [(k, f) for k, f in keys if k not in PER_PROCESS_FIELDS]
    return (
        f"{OVERRIDES_HELP}\n\nPer-process settings, which this command may override:\n{options_help(per_process)}"
        "\n\nRun-wide settings, fixed in RUN/config.json by `shardrl init` (shown for reference; an override that "
        f"changes one is refused, and --trainer.* is not read here):\n{options_help(run_wide)}"
        f"\n\nEvaluator settings (--eval):\n{options_help(section_fields('eval'))}"
        "\n\nExit status: 0 after a drain, 2 for a configuration error (one line on stderr)."
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Node supervisor: runs as many rollout workers on this node as RUN's control state asks for and the "
            "node holds (one per GPU, or rollout.cpu_workers on CPU), restarts the ones that die, drains them on "
            "SIGTERM/SIGINT within rollout.drain_deadline_s.  Scale with "
            '`echo \'{"action":"add","count":2}\' > RUN/control.json` or `shardrl scale --run-dir RUN --add 2`.'
        ),
        epilog=_epilog(),
    )
    add_run_dir_option(p, "--run")
    p.add_argument(
        "--max-local-workers",
        type=int,
        default=None,
        metavar="N",
        help="worker slots on this node (= --rollout.max_local_workers; default: visible GPUs, or "
        "rollout.cpu_workers without GPUs)",
    )
    p.add_argument(
        "--eval",
        action="store_true",
        help="run the evaluator instead of the supervisor: score every eval.every-th published weight version "
        "greedily into RUN/metrics/eval.jsonl",
    )
    p.add_argument(
        "--once", action="store_true", help="with --eval: score what is due and the latest version, then exit"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args, rest = _parser().parse_known_args(argv)
    from buffer.run import open_run
    from rollout_worker.supervisor import run_supervisor
    from rollout_worker.worker import USER_ERRORS, preflight

    try:
        # the supervisor never stops by itself: a --once meant for the evaluator would be silently ignored
        if args.once and not args.eval:
            raise ConfigError(
                "command line: --once is an option of --eval (the evaluator); the supervisor has none"
            )
        overrides = parse_overrides(rest)
        refuse_sections(overrides, ("trainer",), PROG, "pass it to the trainer (python -m trainer)")
        if args.max_local_workers is not None:
            overrides["rollout.max_local_workers"] = str(args.max_local_workers)
        run = open_run(args.run_dir, overrides)
        preflight(run)
        if args.eval:
            return _evaluate(run, args.once)
    except (ConfigError, *USER_ERRORS) as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    return run_supervisor(run, overrides)


def _evaluate(run: Any, once: bool) -> int:
    from buffer.logs import setup_logging
    from rollout_worker.evaluator import eval_prompts, run_evaluator

    setup_logging("eval")
    eval_prompts(run.config)  # a bad eval.prompts_file is one line, before any engine starts
    return run_evaluator(run, once=once)


if __name__ == "__main__":
    sys.exit(main())
