"""`shardrl status`: the human view of a run snapshot (``buffer.status.snapshot``).

It explains what it shows: whether the run is finished, why fewer workers run than desired, a control command no
supervisor has applied yet, what the trainer waits for (and a warning when its status stopped moving), each
supervisor's capacity and heartbeat, why each paused worker is paused, the whole error of a failed or restarting
worker, and the groups dropped because their reward failed, with the first error.  Records that cannot be read are
listed as problems at the end.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from buffer.status import version_name

if TYPE_CHECKING:
    from rich.console import Console


def render(snap: dict[str, Any], console: Console | None = None) -> None:
    from rich.console import Console
    from rich.markup import escape

    con = console or Console()
    con.print(f"[bold]run[/bold] {escape(snap['run'])}", highlight=False)
    _finished(con, snap)
    _control(con, snap)
    _trainer(con, snap)
    if snap.get("eval"):  # the evaluator's latest score (rollout_worker --eval)
        ev, fmt = snap["eval"], lambda x: "-" if x is None else f"{x:.3f}"
        con.print(
            f"eval weights v{ev.get('version')} (step {ev.get('step')}): accuracy {fmt(ev.get('accuracy'))}   "
            f"reward mean {fmt(ev.get('reward_mean'))}",
            highlight=False,
        )
    sh = snap["shards"]
    con.print(
        f"shards ready {sh['ready']} ({sh['ready_samples']} samples)   consumed {_n(sh['consumed_samples'])} "
        f"(dropped as stale {_n(sh['dropped_samples'])})   unconsumed {_n(sh['unconsumed_samples'])}   "
        f"quarantined {sh['quarantined']}",
        highlight=False,
    )
    _supervisors(con, snap["supervisors"])
    _workers(con, snap["workers"])
    _worker_errors(con, snap["workers"])
    _reward_failures(con, snap.get("reward_failures"))
    for problem in snap["problems"]:
        con.print(f"[red]problem:[/red] {escape(problem)}", highlight=False)


def _finished(con: Console, snap: dict[str, Any]) -> None:
    done = snap.get("finished")
    if done:
        con.print(
            f"[bold green]finished[/bold green]: trained step {done['step']} of trainer.total_steps "
            f"{done['total_steps']} (weights {version_name(done['published_version'])}); "
            "trainers and supervisors started on this run exit at once",
            highlight=False,
        )


def _control(con: Console, snap: dict[str, Any]) -> None:
    from rich.markup import escape

    ctl = snap["control"]
    con.print(
        f"desired workers {snap['desired_workers']} (control generation {ctl['generation']})   "
        f"latest weights {version_name(snap['latest_weights_version'])}",
        highlight=False,
    )
    if snap.get("workers_why"):
        con.print(
            f"[yellow]running workers {snap.get('running_workers')} of {snap['desired_workers']}:[/yellow] "
            f"{escape(snap['workers_why'])}",
            highlight=False,
        )
    if ctl.get("pending"):
        p = ctl["pending"]
        con.print(
            f"[yellow]pending command:[/yellow] control.json holds {escape(p['text'])}, written {p['age_s']:.0f}s "
            "ago, not applied by any supervisor yet",
            highlight=False,
        )
    if ctl["last_applied"]:
        applied = ctl["last_applied"]
        con.print(f"last command applied: {applied['command']} -> {applied['desired']}", highlight=False)
    if ctl["last_rejection"]:
        con.print(
            f"[red]last command rejected:[/red] {escape(ctl['last_rejection']['reason'])}", highlight=False
        )


def _trainer(con: Console, snap: dict[str, Any]) -> None:
    from rich.markup import escape

    tr = snap["trainer"]
    budget = "" if tr.get("total_steps") is None else f" of {tr['total_steps']}"
    age = tr["heartbeat_age_s"]
    beat = "" if age is None else f", status written {age:.1f}s ago"
    weights = version_name(tr["published_version"])
    if tr.get("publishing") is not None:  # a version in flight is counted in published_version already
        weights = f"{version_name(tr['publishing'] - 1)}, {version_name(tr['publishing'])} being written"
    con.print(
        f"trainer step {tr['step']}{budget} ({tr['state']}{beat}), published weights {weights}",
        highlight=False,
    )
    if tr.get("heartbeat_stale"):
        con.print(
            f"[red]warning:[/red] the trainer's status has not changed for {age:.0f}s (more than "
            f"{tr['stale_after_s']:.0f}s): a very long step, or the trainer is gone",
            highlight=False,
        )
    if tr.get("state") == "waiting" and tr.get("waiting"):
        con.print(f"trainer waits for: {escape(tr['waiting'])}", highlight=False)
    if tr.get("last_error"):
        con.print(f"[red]trainer error (kept going):[/red] {escape(tr['last_error'])}", highlight=False)


def _supervisors(con: Console, supervisors: list[dict[str, Any]]) -> None:
    from rich.table import Table

    if not supervisors:
        return
    table = Table("supervisor", "host", "state", "workers / capacity", "slots", "heartbeat age", "last error")
    for s in supervisors:
        table.add_row(
            str(s["id"]),
            str(s["host"]),
            str(s["state"]),
            f"{s.get('workers', len(s['slots']))} / {s['capacity']}",
            ",".join(map(str, s["slots"])) or "-",
            _age(s["heartbeat_age_s"]),
            (s.get("last_error") or "")[:60],
        )
    con.print(table)


def _workers(con: Console, workers: list[dict[str, Any]]) -> None:
    from rich.table import Table

    table = Table(
        "worker",
        "state",
        "weights",
        "heartbeat age",
        "samples",
        "tok/s",
        "engine",
        "why paused / last error",
    )
    for w in workers:
        table.add_row(
            str(w["id"]),
            str(w["state"]),
            version_name(w["weights_version"]),
            _age(w["heartbeat_age_s"]),
            str(w["samples"]),
            "-" if w["tokens_per_s"] is None else f"{w['tokens_per_s']:.0f}",
            _engine(w),
            (w.get("paused_why") or w["last_error"] or "")[:90],
        )
    con.print(table)
    for w in workers:
        e = w.get("episodes")
        if e:
            con.print(
                f"{w['id']} episodes: {e['episodes']}, {e['turns_per_episode']} turns and "
                f"{e['tool_calls_per_episode']} tool calls each; tool errors {e['tool_errors']}, time-outs "
                f"{e['tool_timeouts']}; truncated {e['truncated']}",
                highlight=False,
            )


def _engine(w: dict[str, Any]) -> str:
    """A streaming worker's engine: requests in flight, busy share, weight versions loaded under requests, and
    samples stopped in flight as too stale to train on (when any)."""
    if w.get("requests_in_flight") is None:
        return "-"
    busy = w.get("engine_busy")
    aborted = w.get("aborted_stale_samples") or 0
    return (
        f"{w['requests_in_flight']} in flight, busy {'-' if busy is None else f'{busy:.0%}'}, "
        f"{w.get('reloads_in_flight', 0)} reloads" + (f", {aborted} stopped as stale" if aborted else "")
    )


def _worker_errors(con: Console, workers: list[dict[str, Any]]) -> None:
    """The whole last error of each worker that failed or is restarting: the table keeps only its start."""
    from rich.markup import escape

    for w in workers:
        if w["state"] in ("failed", "restarting") and w.get("last_error"):
            again = f" (restarts {w['restarts']})" if w.get("restarts") else ""
            con.print(f"[red]{w['id']} {w['state']}{again}:[/red] {escape(w['last_error'])}", highlight=False)


def _reward_failures(con: Console, failures: dict[str, Any] | None) -> None:
    from rich.markup import escape

    if not failures:
        return
    first = failures.get("first_error") or "?"
    con.print(
        f"[red]reward failed[/red] for {failures['groups']} group(s) ({failures['samples']} samples, dropped whole) "
        f"on {', '.join(failures['workers'])}; first error: {escape(first)}",
        highlight=False,
    )


def _age(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}s"


def _n(count: int | None) -> str:
    return "?" if count is None else str(count)
