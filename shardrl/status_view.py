"""`shardrl status`: the human view of a run snapshot (``buffer.status.snapshot``); records that cannot be read are
listed as problems at the end."""

from __future__ import annotations

from typing import Any


def render(snap: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    con = Console()
    sh, tr, ctl = snap["shards"], snap["trainer"], snap["control"]
    con.print(f"[bold]run[/bold] {snap['run']}")
    con.print(
        f"desired workers {snap['desired_workers']} (generation {ctl['generation']})   "
        f"latest weights v{_n(snap['latest_weights_version'])}   trainer step {tr['step']} ({tr['state']})"
    )
    con.print(
        f"shards ready {sh['ready']} ({sh['ready_samples']} samples)   consumed {_n(sh['consumed_samples'])} "
        f"(dropped as stale {_n(sh['dropped_samples'])})   unconsumed {_n(sh['unconsumed_samples'])}   "
        f"quarantined {sh['quarantined']}"
    )
    if ctl["last_applied"]:
        con.print(
            f"last command applied: {ctl['last_applied']['command']} -> {ctl['last_applied']['desired']}"
        )
    if ctl["last_rejection"]:
        con.print(f"[red]last command rejected:[/red] {ctl['last_rejection']['reason']}")
    table = Table("worker", "state", "weights", "heartbeat age", "samples", "tok/s", "last error")
    for w in snap["workers"]:
        age = w["heartbeat_age_s"]
        table.add_row(
            str(w["id"]),
            str(w["state"]),
            f"v{w['weights_version']}",
            "-" if age is None else f"{age:.1f}s",
            str(w["samples"]),
            "-" if w["tokens_per_s"] is None else f"{w['tokens_per_s']:.0f}",
            (w["last_error"] or "")[:60],
        )
    con.print(table)
    for problem in snap["problems"]:
        con.print(f"[red]problem:[/red] {escape(problem)}", highlight=False)


def _n(count: int | None) -> str:
    return "?" if count is None else str(count)
