"""`shardrl`: the umbrella command line (init, status, scale, fsck, synth, tiny-model, demo, report).

Importing this module (and ``shardrl --help``) imports no torch: heavy imports happen inside the subcommands.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from buffer.config import ConfigError, load_toml, parse_overrides


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shardrl",
        description="RL post-training with rollout and training jobs that meet on shared storage.",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("init", help="create a run directory from a TOML config (idempotent)")
    s.add_argument("run", type=Path)
    s.add_argument(
        "--config", type=Path, required=True, help="TOML config, e.g. deploy/configs/qwen2.5-1.5b-grpo.toml"
    )
    s = sub.add_parser("status", help="show desired/actual workers, weights, trainer and shards")
    s.add_argument("run", type=Path)
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s = sub.add_parser("scale", help="write a control command (same as echo ... > RUN/control.json)")
    s.add_argument("run", type=Path)
    g = s.add_mutually_exclusive_group(required=True)
    g.add_argument("--add", type=int, metavar="N")
    g.add_argument("--remove", type=int, metavar="N")
    g.add_argument("--set", type=int, metavar="N")
    s = sub.add_parser("fsck", help="check shards, plans, weights and leases; exit 1 on problems")
    s.add_argument("run", type=Path)
    s.add_argument(
        "--repair", action="store_true", help="quarantine bad shards, remove abandoned temporaries"
    )
    s.add_argument(
        "--tmp-age-s", type=float, default=3600.0, help="temporaries older than this are abandoned"
    )
    s = sub.add_parser("synth", help="write N valid synthetic shards of M samples through the real writer")
    s.add_argument("run", type=Path)
    s.add_argument("--shards", type=int, required=True)
    s.add_argument("--samples", type=int, required=True)
    s.add_argument("--seed", type=int, default=0)
    s = sub.add_parser("tiny-model", help="build the tiny Qwen2 model + tokenizer (HF format)")
    s.add_argument("out", type=Path)
    s.add_argument("--tied", action="store_true", help="tie input and output embeddings")
    s.add_argument("--seed", type=int, default=0)
    s = sub.add_parser("demo", help="the CPU demo: rollout supervisor + trainer on the max-digit task")
    s.add_argument("--run", type=Path, default=Path("runs/demo"))
    s.add_argument("--workers", type=int, default=1, help="workers; the 2nd joins mid-run via control.json")
    s.add_argument("--engine", choices=["vllm", "hf"], default=None)
    s.add_argument("--task", choices=["max_digit", "mod_add"], default="max_digit")
    s.add_argument(
        "--lora",
        type=int,
        nargs="?",
        const=8,
        default=0,
        metavar="RANK",
        help="train LoRA adapters of rank RANK (default 8) on the frozen base instead of every weight",
    )
    s.add_argument(
        "--steps", type=int, default=None, help="trainer steps (default from the packaged demo.toml)"
    )
    s = sub.add_parser("report", help="write PNG plots of a run's metrics into RUN/plots")
    s.add_argument("run", type=Path)
    s = sub.add_parser(
        "export", help="copy a published weight version out as a standalone HF model directory"
    )
    s.add_argument("run", type=Path)
    s.add_argument("--version", required=True, help="a published version number, or `latest`")
    s.add_argument("out", type=Path, help="a new directory")
    s = sub.add_parser(
        "export-shards", help="write each ready shard as Parquet (one file per shard) into OUT"
    )
    s.add_argument("run", type=Path)
    s.add_argument("--format", choices=["parquet"], default="parquet")
    s.add_argument("out", type=Path, help="directory of Parquet files; shards already there are skipped")
    return p


def main(argv: list[str] | None = None) -> int:
    args, rest = _parser().parse_known_args(argv)
    try:
        return _dispatch(args, parse_overrides(rest))
    except ConfigError as e:
        print(f"shardrl: {e}", file=sys.stderr)
        return 2


def _dispatch(args: argparse.Namespace, overrides: dict[str, str]) -> int:
    from buffer.layout import RunLayout

    if overrides and args.cmd not in ("init", "demo"):
        raise ConfigError(f"command line: `shardrl {args.cmd}` takes no --section.key overrides")
    if args.cmd == "init":
        from .runs import init_run

        run = init_run(args.run, load_toml(args.config, overrides))
        print(f"run {run.run_id} ready at {run.layout.root}")
        return 0
    if args.cmd == "status":
        from buffer.status import snapshot

        from .status_view import render

        snap = snapshot(_existing(args.run))
        if args.json:
            print(json.dumps(snap, indent=1, default=str))
        else:
            render(snap)
        return 0
    if args.cmd == "scale":
        from buffer.control import write_command

        action = next(a for a in ("add", "remove", "set") if getattr(args, a) is not None)
        write_command(_existing(args.run), action, getattr(args, action))
        print(
            f"wrote {{'action': '{action}', 'count': {getattr(args, action)}}} to {RunLayout.of(args.run).control_file}"
        )
        return 0
    if args.cmd == "fsck":
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
    if args.cmd == "synth":
        from buffer.run import open_run

        from .synth import synth_shards

        paths = synth_shards(open_run(args.run), args.shards, args.samples, seed=args.seed)
        print(f"wrote {len(paths)} shards of {args.samples} samples")
        return 0
    if args.cmd == "tiny-model":
        from .tiny_model import build_tiny_model

        print(build_tiny_model(args.out, tied=args.tied, seed=args.seed))
        return 0
    if args.cmd == "demo":
        try:
            from .demo import run_demo
        except ImportError:
            print("shardrl demo: not built yet")
            return 0
        return run_demo(args, overrides)
    if args.cmd == "report":
        from .report import write_report

        for p in write_report(_existing(args.run)):
            print(p)
        return 0
    if args.cmd in ("export", "export-shards"):
        from .export import main as export_main

        return export_main(args.cmd, args.run, args.out, getattr(args, "version", None))
    raise AssertionError(args.cmd)


def _existing(run: Path):  # type: ignore[no-untyped-def]
    from buffer.layout import RunLayout

    layout = RunLayout.of(run)
    if not layout.run_json.exists():
        raise ConfigError(f"{layout.run_json}: missing; is {run} a run directory (`shardrl init`)?")
    return layout


if __name__ == "__main__":
    sys.exit(main())
