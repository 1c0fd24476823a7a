"""`python -m trainer --run-dir RUN [--max-steps N] [--section.key value ...]` (also `shardrl-train`): the torchrun
target.

    torchrun --nproc_per_node=G [--nnodes=N --rdzv_backend=c10d --rdzv_endpoint=HOST:PORT --rdzv_id=ID] \\
        -m trainer --run-dir RUN [--max-steps N]

NCCL on GPUs, gloo on CPU, chosen automatically; one process without torchrun also works.  The run's config comes
from RUN/config.json; only per-process settings may be overridden here.  A restarted trainer resumes from the newest
complete checkpoint and replays the recorded plans after it.  A second trainer on a run whose trainer is alive
refuses to start unless given ``--takeover``; then it fences out the first, which stops cleanly.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import io
import logging
import os
import sys
from typing import NoReturn

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

PROG = "python -m trainer"


def _epilog() -> str:
    keys = section_fields("trainer") + section_fields("algorithm")
    per_process = [(k, f) for k, f in keys if k in PER_PROCESS_FIELDS]
    run_wide = [(k, f) for k, f in keys if k not in PER_PROCESS_FIELDS]
    return (
        f"{OVERRIDES_HELP}\n\nPer-process settings, which this command may override:\n{options_help(per_process)}"
        "\n\nRun-wide settings, fixed in RUN/config.json by `shardrl init` (shown for reference; an override that "
        f"changes one is refused, and --rollout.* is not read here):\n{options_help(run_wide)}"
        "\n\nExit status: 0 done (max steps, SIGTERM/SIGINT: the step is finished and checkpointed), "
        "also 0 when a newer trainer incarnation took over (--takeover; it goes on from here), "
        "1 a storage error (the run directory could not be read or written), "
        "2 bad config or command line or another trainer alive on the run (see --takeover), "
        "4 no samples within trainer.step_wait_timeout_s, "
        "5 a step's data failed the trainer (out of memory; marked poisoned, a restart replays it without it)."
    )


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_epilog()
    )
    # torchrun's own parser reads `--run` as an ambiguous abbreviation of its `--run-path`, so under torchrun the
    # run directory is passed as `--run-dir` (or SHARDRL_RUN); `--run` works when started without torchrun.
    add_run_dir_option(p, "--run")
    p.add_argument(
        "--max-steps", type=int, default=None, help="stop cleanly after N steps in this invocation"
    )
    p.add_argument(
        "--takeover",
        action="store_true",
        help="start even though another trainer is alive on the run: it is fenced out and stops (without this "
        "flag a live trainer makes this one refuse to start)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    # A crash in native code (gloo, a kernel) kills a rank with SIGSEGV and no trace; this prints every thread's
    # Python stack to the rank's stderr first, so its log says where it was.  (A stderr that is no file, as under a
    # caller that captures it, has nowhere to write it.)
    with contextlib.suppress(io.UnsupportedOperation, AttributeError, ValueError):
        faulthandler.enable()
    args, rest = _parser().parse_known_args(argv)
    try:
        overrides = parse_overrides(rest)
        refuse_sections(
            overrides, ("rollout",), PROG, "pass it to the rollout supervisor (python -m rollout_worker)"
        )
        if args.max_steps is not None:
            overrides["trainer.max_steps"] = str(args.max_steps)
        from buffer.run import open_run

        run = open_run(args.run_dir, overrides)
        from trainer.takeover import refuse_live_trainer

        refusal = refuse_live_trainer(run, args.takeover)
        if refusal is not None:
            raise ConfigError(refusal)
    except ConfigError as e:
        print(f"trainer: {e}", file=sys.stderr)
        return 2
    from trainer.loop import run_trainer

    return run_trainer(run)


def leave(code: int) -> NoReturn:
    """Exit with ``code`` once the work is done, skipping the interpreter's finalization: there, objects that
    outlive the process group (FSDP's modules sit in reference cycles, freed only by the last collection) drop
    gloo work handles from gloo's own threads, and a finished rank has been seen to abort ("terminate called
    without an active exception") after everything it writes was written, turning a clean run into a failed job."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


def cli() -> NoReturn:
    """The ``shardrl-train`` entry point: ``main`` with ``leave``'s exit."""
    leave(main())


if __name__ == "__main__":
    cli()
