"""Does a demo stay learnt?  The same `shardrl demo` run several times, each judged on its held-out greedy accuracy.

    python bench/stability.py                                   # 5 runs of `shardrl demo --task lookup`
    python bench/stability.py --runs 3 --steps 150 --out /tmp/stab -- --trainer.lr 2e-4

Each run is a fresh run directory (``OUT/run-N``) made by the demo itself, one after the other so that runs do not
share the cores; everything after ``--`` goes to ``shardrl demo`` unchanged (config overrides).  The runs differ
only in what the processes' timing makes of them (which version each batch is drawn from), which is exactly what
varied between the collapsed and the healthy runs of the tool demo.

For each run, from its files: the evaluator's accuracy by version (``metrics/eval.jsonl``), the first version at
``--hold`` or above, the lowest accuracy after it, the final one, and whether the run met the bar (final >= ``--final``
and never below ``--hold`` after first reaching it); and the trainer steps that stood out (``metrics/trainer.jsonl``:
a KL to the reference, a behaviour/trainer mismatch or a gradient norm above ``--spike`` times the run's median), the
trace to read around a flip.  For the lookup task also the call's margins: over 30 held-out prompts, the smallest
logit margin (the format's token minus the runner-up) over the call's fixed part (``<tool_call>{"name":"lookup",
"arguments":{"code":``), base against the last version: how close the run's format came to breaking, a figure that
moves long before a greedy call flips.  ``--judge RUN ...`` judges finished run directories instead of running.
Prints a table, writes ``OUT/stability.json``, exits 0 either way: it measures only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from buffer import metrics  # noqa: E402
from buffer.layout import RunLayout  # noqa: E402

TRACED = ("kl_ref", "mismatch_kl", "grad_norm")
MISMATCH = 0.01  # per-token KL between the sampler's and the trainer's logprobs: about 1e-4 in a quiet step


def main(argv: list[str] | None = None) -> int:
    args, demo_args = _parse(sys.argv[1:] if argv is None else argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for i, run in enumerate(args.judge):
        result = judge(RunLayout.of(run), args)
        result.update(run=str(run), rc=None, wall_s=None)
        results.append(result)
        print(_line(i, result), flush=True)
    for i in range(0 if args.judge else args.runs):
        run = args.out / f"run-{i}"
        cmd = [sys.executable, "-m", "shardrl.cli", "demo", "--task", args.task, "--run", str(run)]
        cmd += ["--steps", str(args.steps)] if args.steps else []
        t0 = time.monotonic()
        done = subprocess.run([*cmd, *demo_args], cwd=ROOT, capture_output=True, text=True, check=False)
        result = judge(RunLayout.of(run), args)
        result.update(run=str(run), rc=done.returncode, wall_s=round(time.monotonic() - t0, 1))
        if done.returncode != 0:
            result["stderr_tail"] = done.stderr[-1500:]
        results.append(result)
        print(_line(i, result), flush=True)
    met = sum(r["met"] for r in results)
    summary = {"command": " ".join(sys.argv), "runs": results, "met": met, "of": len(results)}
    (args.out / "stability.json").write_text(json.dumps(summary, indent=1))
    print(
        f"{met} of {len(results)} runs met the bar (final >= {args.final}, never below {args.hold} after "
        f"first reaching it); {args.out / 'stability.json'}"
    )
    return 0


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--task", default="lookup")
    p.add_argument("--steps", type=int, default=None, help="trainer steps (default: the demo config's)")
    p.add_argument("--hold", type=float, default=0.8, help="never below this after first reaching it")
    p.add_argument("--final", type=float, default=0.9, help="the last evaluated version at least this")
    p.add_argument(
        "--spike", type=float, default=10.0, help="a traced step: a figure this many times its median"
    )
    p.add_argument("--out", type=Path, default=Path("runs/stability"))
    p.add_argument(
        "--judge", type=Path, nargs="*", default=[], metavar="RUN", help="judge these runs, run none"
    )
    split = argv.index("--") if "--" in argv else len(argv)
    return p.parse_args(argv[:split]), argv[split + 1 :]


def judge(layout: RunLayout, args: argparse.Namespace) -> dict[str, Any]:
    """The run's accuracy by version, whether it met the bar, and its standing-out trainer steps."""
    evals = [
        (r["version"], r["accuracy"])
        for r in metrics.read_all(layout.metrics_file("eval"))
        if "accuracy" in r
    ]
    reached = next((v for v, a in evals if a >= args.hold), None)
    after = [a for v, a in evals if reached is not None and v >= reached]
    final = evals[-1][1] if evals else None
    met = bool(after) and min(after) >= args.hold and final is not None and final >= args.final
    return {
        "accuracy_by_version": evals,
        "first_at_hold": reached,
        "min_after": min(after) if after else None,
        "final": final,
        "met": met,
        "spikes": spikes(list(metrics.read_all(layout.metrics_file("trainer"))), args.spike),
        "call_margin": call_margins(layout) if _task(layout) == "lookup" else None,
    }


def _task(layout: RunLayout) -> str | None:
    try:
        return str(json.loads(layout.config_json.read_text())["data"]["task"])
    except (OSError, KeyError, ValueError):
        return None


CALL_PREFIX = '<tool_call>{"name":"lookup","arguments":{"code":'


def call_margins(layout: RunLayout, prompts: int = 30) -> dict[str, float] | None:
    """The smallest margin over the call's fixed part, mean over held-out prompts, of the base and the last version
    (exported from the run, so that a delta version is rebuilt the way users get it)."""
    out = layout.root.with_name(layout.root.name + "-last")
    if not out.exists():
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "shardrl.cli",
                "export",
                str(layout.root),
                "--version",
                "latest",
                str(out),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            return None
    return {"base": _margin(layout.root / "base_model", prompts), "last": _margin(out, prompts)}


def _margin(model_dir: Path, prompts: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout_worker.envs.episode import ChatRenderer
    from rollout_worker.envs.tools import resolve_tools
    from rollout_worker.tasks import TOOL_TASKS, lookup_codes, lookup_prompt

    renderer = ChatRenderer(AutoTokenizer.from_pretrained(model_dir))  # the prompt as the worker renders it
    tools = resolve_tools([TOOL_TASKS["lookup"]])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    smallest = []
    for code in lookup_codes("eval")[:prompts]:
        user = {"role": "user", "content": lookup_prompt(code)}
        ids = renderer.encode(renderer.render([user], tools, generation_prompt=True))
        call = renderer.encode(CALL_PREFIX)
        with torch.no_grad():
            logits = model(torch.tensor([ids + call])).logits[0, len(ids) - 1 : -1].float()
        target = torch.tensor(call)
        chosen = logits.gather(1, target[:, None])[:, 0]
        runner_up = logits.scatter(1, target[:, None], float("-inf")).max(1).values
        smallest.append(float((chosen - runner_up).min()))
    return round(sum(smallest) / len(smallest), 2)


def spikes(steps: list[dict[str, Any]], factor: float) -> list[dict[str, Any]]:
    """The trainer steps that stand out: a KL to the reference or a gradient norm above ``factor`` times its run's
    median, a behaviour/trainer mismatch above ``MISMATCH`` (its median is about 0), or a mean response length below
    the run's median (broken episodes end early); with the step's reward."""
    med = {
        k: statistics.median(s[k] for s in steps if k in s)
        for k in ("kl_ref", "grad_norm", "response_len_mean")
        if any(k in s for s in steps)
    }
    out = []
    for s in steps:
        hot: list[str] = [
            k for k in ("kl_ref", "grad_norm") if k in med and s.get(k, 0.0) > factor * med[k] > 0
        ]
        hot += ["mismatch_kl"] if s.get("mismatch_kl", 0.0) > MISMATCH else []
        short = (
            "response_len_mean" in med
            and s.get("response_len_mean", med["response_len_mean"]) < 0.97 * med["response_len_mean"]
        )
        if hot or short:
            keep = ("step", "reward_mean", "response_len_mean", *TRACED)
            out.append({k: round(s[k], 4) if isinstance(s[k], float) else s[k] for k in keep if k in s})
    return out


def _line(i: int, r: dict[str, Any]) -> str:
    acc = " ".join(f"v{v}:{a:.2f}" for v, a in r["accuracy_by_version"])
    margin = r.get("call_margin")
    margins = f"  call margin {margin['base']} -> {margin['last']}" if margin else ""
    return (
        f"run {i}: {'met' if r['met'] else 'MISSED'}  first >= hold v{r['first_at_hold']}  min after "
        f"{r['min_after']}  final {r['final']}  {r['wall_s']} s  rc {r['rc']}{margins}  spikes at "
        f"{[s['step'] for s in r['spikes']]}\n    {acc}"
    )


if __name__ == "__main__":
    sys.exit(main())
