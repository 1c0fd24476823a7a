"""`shardrl`: the umbrella command line, one function per subcommand (see ``COMMANDS``).

Importing this module (and ``shardrl --help``) imports no torch: heavy imports happen inside the subcommands.  Every
run command takes the run as ``--run-dir RUN`` (or ``$SHARDRL_RUN``); the positional ``RUN`` and the demo's
``--run`` are the same option.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from buffer.config import (
    OVERRIDES_HELP,
    PER_PROCESS_FIELDS,
    RUN_ENV,
    ConfigError,
    load_toml,
    split_overrides,
)

_NO_OVERRIDES = "Takes no --section.key overrides: the run's config is RUN/config.json."
_INIT_OVERRIDES = (
    f"{OVERRIDES_HELP}  Here every key may be set: the result becomes the run's config.  Later processes may "
    "change only the per-process settings: " + ", ".join(sorted(PER_PROCESS_FIELDS)) + "."
)


def _sub(
    sub: Any, name: str, text: str, epilog: str = _NO_OVERRIDES, run: bool = True
) -> argparse.ArgumentParser:
    s = sub.add_parser(name, help=text, description=text, epilog=epilog)
    if run:
        s.add_argument("run_pos", nargs="?", type=Path, metavar="RUN", help="the run directory (= --run-dir)")
        s.add_argument(
            "--run-dir", dest="run_dir", type=Path, default=None, metavar="RUN", help=f"default ${RUN_ENV}"
        )
    return s


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shardrl",
        description="RL post-training with rollout and training jobs that meet on shared storage.",
        epilog=f"The run directory: RUN, --run-dir RUN or ${RUN_ENV}.  `init` and `demo` take config overrides "
        "(--section.key VALUE); see `shardrl init --help`.",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    s = _sub(sub, "init", "create a run directory from a TOML config (idempotent)", _INIT_OVERRIDES)
    s.add_argument(
        "--config", type=Path, required=True, help="TOML config, e.g. deploy/configs/qwen2.5-1.5b-grpo.toml"
    )
    s = _sub(sub, "status", "show desired/actual workers, weights, trainer and shards")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s = _sub(
        sub,
        "scale",
        "write a control command (same as echo ... > RUN/control.json), checked first against run.max_workers "
        "and the current desired count",
    )
    g = s.add_mutually_exclusive_group(required=True)
    g.add_argument("--add", type=int, metavar="N")
    g.add_argument("--remove", type=int, metavar="N")
    g.add_argument("--set", type=int, metavar="N")
    s = _sub(sub, "fsck", "check shards, plans, weights and leases; exit 1 on problems")
    s.add_argument(
        "--repair", action="store_true", help="quarantine bad shards, remove abandoned temporaries"
    )
    s.add_argument(
        "--tmp-age-s", type=float, default=3600.0, help="temporaries older than this are abandoned"
    )
    s = _sub(
        sub,
        "audit",
        "the run's sample ledger from its files: generated, consumed once, dropped as stale, quarantined, waiting "
        "and lost per writer incarnation; exit 1 on a duplicate or a loss",
    )
    s.add_argument("--json", action="store_true", help="the ledger as JSON")
    s = _sub(sub, "synth", "write N valid synthetic shards of M samples through the real writer")
    s.add_argument("--shards", type=int, required=True)
    s.add_argument("--samples", type=int, required=True)
    s.add_argument("--seed", type=int, default=0)
    s = _sub(
        sub,
        "tiny-model",
        "build the tiny Qwen2 model + tokenizer (HF format) into OUT, e.g. as model.path of your own run",
        "Takes no --section.key overrides.",
        run=False,
    )
    s.add_argument("out", type=Path, metavar="OUT", help="a new directory")
    s.add_argument("--tied", action="store_true", help="tie input and output embeddings")
    s.add_argument("--seed", type=int, default=0)
    s = _sub(sub, "demo", "the CPU demo: rollout supervisor + trainer", _INIT_OVERRIDES, run=False)
    s.add_argument(
        "--run-dir",
        "--run",
        dest="run",
        type=Path,
        default=Path(os.environ.get(RUN_ENV) or "runs/demo"),
        metavar="RUN",
        help=f"the demo's run directory (default ${RUN_ENV}, else runs/demo)",
    )
    s.add_argument("--workers", type=int, default=1, help="workers; the 2nd joins mid-run via control.json")
    s.add_argument("--engine", choices=["vllm", "hf"], default=None)
    s.add_argument(
        "--task",
        choices=["max_digit", "mod_add", "lookup"],
        default="max_digit",
        help="max_digit, mod_add, or lookup: the tool task (its own config, shardrl/configs/lookup.toml)",
    )
    s.add_argument(
        "--lora",
        type=int,
        nargs="?",
        const=16,
        default=0,
        metavar="RANK",
        help="train LoRA adapters of rank RANK (default 16) on the frozen base instead of every weight; the tiny "
        "base is pretrained on the other task first (model.tiny_pretrain_steps)",
    )
    s.add_argument(
        "--steps", type=int, default=None, help="trainer steps (default from the packaged demo.toml)"
    )
    s.add_argument(
        "--until-accuracy",
        type=float,
        default=None,
        metavar="A",
        help="stop early, once the evaluator scores a published version at greedy accuracy >= A (the trainer "
        "finishes its step and checkpoints: `shardrl demo --run RUN` again resumes)",
    )
    s = _sub(sub, "check-env", "pre-flight checks of this node (deploy/check_env.sh runs it on every node)")
    s.add_argument(
        "--wait-s", type=float, default=60.0, help="how long to wait for the other nodes under srun"
    )
    s = _sub(sub, "report", "write PNG plots of a run's metrics into RUN/plots")
    s = _export_sub(sub, "export", "copy a published weight version out as a standalone HF model directory")
    which = s.add_mutually_exclusive_group(required=True)
    which.add_argument("--version", help="a published version number, or `latest`")
    which.add_argument(
        "--step", type=int, help="a step with a complete trainer checkpoint: its actor, published anew"
    )
    s = _export_sub(sub, "export-shards", "write each ready shard as Parquet (one file per shard) into OUT")
    s.add_argument("--format", choices=["parquet"], default="parquet")
    return p


def _export_sub(sub: Any, name: str, text: str) -> argparse.ArgumentParser:
    """``[RUN] OUT``: the run as every command takes it (RUN, --run-dir RUN or $SHARDRL_RUN), then OUT."""
    s = sub.add_parser(
        name, help=text, description=text, epilog=_NO_OVERRIDES, usage=f"shardrl {name} [RUN] OUT [options]"
    )
    s.add_argument(
        "paths",
        nargs="+",
        type=Path,
        metavar="[RUN] OUT",
        help="the run directory (= --run-dir), "
        "then OUT: "
        + (
            "a new directory"
            if name == "export"
            else "a directory of Parquet files; shards already there are skipped"
        ),
    )
    s.add_argument(
        "--run-dir", dest="run_dir", type=Path, default=None, metavar="RUN", help=f"default ${RUN_ENV}"
    )
    return s


def main(argv: list[str] | None = None) -> int:
    try:
        overrides, rest = split_overrides(sys.argv[1:] if argv is None else argv)
        parser = _parser()
        args, extra = parser.parse_known_args(rest)
        if extra and hasattr(args, "paths") and not any(a.startswith("-") for a in extra):
            # `RUN --version V OUT`: argparse ends a positional list at the first option
            args.paths += map(Path, extra)
        elif extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        _resolve_run(args)
        return _dispatch(args, overrides)
    except ConfigError as e:
        print(f"shardrl: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a run directory where none can be made (read-only, under a file): the path and why
        print(f"shardrl: {e.filename or ''}: {e.strerror or e}", file=sys.stderr)
        return 2


def _resolve_run(args: argparse.Namespace) -> None:
    """``args.run`` from RUN, --run-dir or $SHARDRL_RUN, for the commands that take a run."""
    if hasattr(args, "paths"):  # export commands: [RUN] OUT
        if len(args.paths) > 2:
            raise ConfigError(
                f"command line: `shardrl {args.cmd}` takes [RUN] OUT, got {len(args.paths)} paths"
            )
        args.out = args.paths[-1]
        args.run_pos = args.paths[0] if len(args.paths) == 2 else None
    if not hasattr(args, "run_pos"):
        return
    pos, opt, env = args.run_pos, args.run_dir, os.environ.get(RUN_ENV)
    if pos is not None and opt is not None and pos != opt:
        raise ConfigError(f"command line: RUN ({pos}) and --run-dir ({opt}) name different run directories")
    run = pos or opt or (Path(env) if env else None)
    if run is None:
        raise ConfigError(
            f"command line: `shardrl {args.cmd}` needs the run directory: RUN, --run-dir RUN or ${RUN_ENV}"
        )
    args.run = run


def _dispatch(args: argparse.Namespace, overrides: dict[str, str]) -> int:
    if overrides and args.cmd not in ("init", "demo"):
        raise ConfigError(f"command line: `shardrl {args.cmd}` takes no --section.key overrides")
    return COMMANDS[args.cmd](args, overrides)


def _init(args: argparse.Namespace, overrides: dict[str, str]) -> int:
    import shutil

    from .runs import init_run

    cfg = load_toml(args.config, overrides)
    _refuse_hub_id(cfg.model.path, f"{args.config}: field model.path", overrides, "model.path")
    warning = _missing_answers(cfg)
    existed = args.run.exists()
    try:
        run = init_run(args.run, cfg)
    except BaseException:
        # A run that failed to initialise leaves nothing behind (its directory held no run.json yet).
        if not existed and not (args.run / "run.json").exists():
            shutil.rmtree(args.run, ignore_errors=True)
        raise
    if warning:
        print(f"shardrl: warning: {warning}", file=sys.stderr)
    print(f"run {run.run_id} ready at {run.layout.root}")
    return 0


def _refuse_hub_id(path: str, where: str, overrides: dict[str, str], key: str) -> None:
    """A model.path like ``Qwen/Qwen2.5-1.5B`` that is no directory here: a hub id, which nothing downloads."""
    import re

    if Path(path).exists() or not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", path):
        return
    if key in overrides:
        where = f"command line: --{key}"
    raise ConfigError(
        f"{where}: {path!r} is no directory here and looks like a Hugging Face hub id; hub ids are not supported "
        f"(jobs download nothing): download it first (`hf download {path} --local-dir DIR`) and give that "
        "directory"
    )


def _missing_answers(cfg: Any) -> str | None:
    """A warning when some (not all: init refuses that) rows of the prompts file lack the answer the reward needs."""
    from rollout_worker.prompts import load_prompts
    from rollout_worker.rewards import needs_answers

    if cfg.data.task != "file" or not needs_answers(cfg.reward.function):
        return None
    prompts = load_prompts(cfg.data)
    missing = [p for p in prompts if p.answer is None]
    if not missing or len(missing) == len(prompts):
        return None
    first = missing[0]
    return (
        f"{cfg.data.prompts_file}: {len(missing)} of {len(prompts)} rows have no answer at "
        f"{cfg.data.answer_field!r} (data.answer_field), which reward.function = {cfg.reward.function!r} needs; "
        f"workers drop their groups (counted in `shardrl status`); the first is row {first.index + 1}: "
        f"{first.text[:60]!r}"
    )


def _status(args: argparse.Namespace, _: dict[str, str]) -> int:
    from buffer.status import snapshot

    from .status_view import render

    snap = snapshot(_existing(args.run))
    if args.json:
        print(json.dumps(snap, indent=1, default=str))
    else:
        render(snap)
    return 0


def _scale_cmd(args: argparse.Namespace, _: dict[str, str]) -> int:
    action = next(a for a in ("add", "remove", "set") if getattr(args, a) is not None)
    return _scale(args.run, action, getattr(args, action))


def _fsck(args: argparse.Namespace, _: dict[str, str]) -> int:
    from buffer.fsck import fsck
    from buffer.run import open_run

    run = open_run(args.run)
    rep = fsck(run.layout, run.config, repair=args.repair, tmp_age_s=args.tmp_age_s)
    for line in rep.problems:
        print(f"PROBLEM {line}")
    for line in rep.repaired:
        print(f"REPAIRED {line}")
    print(f"checked {dict(rep.checked)}: {len(rep.problems)} problem(s)")
    return 0 if rep.ok else 1


def _audit(args: argparse.Namespace, _: dict[str, str]) -> int:
    from buffer.audit import audit
    from buffer.layout import RunLayout

    layout = RunLayout.of(args.run)  # the files alone: a run whose config no longer loads is audited too
    if not (layout.shards_ready.is_dir() or layout.plans.is_dir()):
        print(
            f"shardrl audit: {layout.root}: not a run directory (no shards/ready, no plans)", file=sys.stderr
        )
        return 2
    led = audit(layout)
    if args.json:
        print(json.dumps(led.to_json(), indent=1))
        return 0 if led.ok else 1
    t = led.totals()
    print(
        f"{len(led.writers)} writer incarnations, {led.steps} steps: generated {t['generated']}, consumed "
        f"{t['consumed']} ({t['dropped_stale']} dropped as stale), quarantined {t['quarantined']}, waiting "
        f"{t['waiting']}, consumed from shards since deleted {t['consumed_gone']}, lost {t['lost']}, duplicated "
        f"{len(led.duplicates)}"
    )
    for line in [*led.duplicates, *led.problems]:
        print(f"PROBLEM {line}")
    for name, w in sorted(led.writers.items()):
        if w.lost:
            print(f"PROBLEM writer {name}: published {w.published} samples, {w.lost} in no shard")
    return 0 if led.ok else 1


def _synth(args: argparse.Namespace, _: dict[str, str]) -> int:
    from buffer.run import open_run

    from .synth import synth_shards

    paths = synth_shards(open_run(args.run), args.shards, args.samples, seed=args.seed)
    print(f"wrote {len(paths)} shards of {args.samples} samples")
    return 0


def _tiny_model(args: argparse.Namespace, _: dict[str, str]) -> int:
    from .tiny_model import build_tiny_model

    print(build_tiny_model(args.out, tied=args.tied, seed=args.seed))
    return 0


def _demo(args: argparse.Namespace, overrides: dict[str, str]) -> int:
    from .demo import run_demo

    return run_demo(args, overrides)


def _check_env(args: argparse.Namespace, _: dict[str, str]) -> int:
    from .check_env import check_env

    return check_env(args.run, wait_s=args.wait_s)


def _report(args: argparse.Namespace, _: dict[str, str]) -> int:
    from .report import main as report_main

    return report_main(_existing(args.run))


def _export(args: argparse.Namespace, _: dict[str, str]) -> int:
    from .export import main as export_main

    return export_main(
        args.cmd, args.run, args.out, getattr(args, "version", None), getattr(args, "step", None)
    )


COMMANDS: dict[str, Callable[[argparse.Namespace, dict[str, str]], int]] = {
    "init": _init,
    "status": _status,
    "scale": _scale_cmd,
    "fsck": _fsck,
    "audit": _audit,
    "synth": _synth,
    "tiny-model": _tiny_model,
    "demo": _demo,
    "check-env": _check_env,
    "report": _report,
    "export": _export,
    "export-shards": _export,
}


def _scale(root: Path, action: str, count: int) -> int:
    """Write a control command after the checks a supervisor would make, so a bad one fails here, not later."""
    from buffer.control import ControlError, command_key, parse_command, read_state, write_command
    from buffer.run import open_run

    run = open_run(root)
    state = read_state(run.layout)
    problem = getattr(state, "problem", None)  # the newest control generation is unreadable
    if problem:
        raise ConfigError(str(problem))
    cmd = {"action": action, "count": count}
    try:
        source = f"command line (--{action} {count})"
        bound = run.config.run.max_workers
        _, desired = parse_command(json.dumps(cmd).encode(), state.desired, bound, source)
    except ControlError as e:
        raise ConfigError(str(e)) from None
    control = run.layout.control_file
    try:
        raw, st = control.read_bytes(), control.stat()
        if command_key(raw, st) not in state.history:
            print(
                f"shardrl: warning: {control} holds {' '.join(raw.decode(errors='replace').split())}, which no "
                "supervisor has applied yet; it is replaced (the desired count is computed without it)",
                file=sys.stderr,
            )
    except FileNotFoundError:
        pass
    write_command(run.layout, action, count)
    print(f"wrote {json.dumps(cmd)} to {control}: desired workers {state.desired} -> {desired} once applied")
    return 0


def _existing(run: Path):  # type: ignore[no-untyped-def]
    """The layout of a run this shardrl can read, without judging its config (status and report show any run)."""
    from buffer.layout import RunLayout
    from buffer.run import read_run_json

    layout = RunLayout.of(run)
    if not layout.run_json.exists():
        raise ConfigError(f"{layout.run_json}: missing; is {run} a run directory (`shardrl init`)?")
    read_run_json(layout)
    return layout


if __name__ == "__main__":
    sys.exit(main())
