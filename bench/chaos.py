"""Long kill storms: the harness of tests/integration/test_storm.py, run for as long as asked.

    python bench/chaos.py --minutes 3                      # seed drawn and printed
    python bench/chaos.py --minutes 10 --seed 7 --ranks 2  # replay a seed; torchrun trainer with two gloo ranks
    python bench/chaos.py --minutes 3 --dir /tmp/chaos --keep

One run directory (tiny model, transformers engine), two node supervisors, two workers, a trainer; for ``--minutes``
random SIGKILL/SIGTERM of workers, supervisors and trainer ranks (killed supervisors and trainers are started again,
as a requeue would) and random ``echo`` rescaling of control.json; then the run settles and is audited from its files
(tests/integration/storm.py says what is checked).  Prints the storm's log lines, then one JSON object: the
figures (kills by kind, samples produced / consumed / dropped / duplicated / lost, steps, versions...) and the
problems found.  Exit status 1 when the audit found a problem.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration.storm import StormSpec, run_storm  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--minutes", type=float, default=3.0, help="length of the storm itself (settling comes after)"
    )
    p.add_argument("--seed", type=int, default=None, help="default: drawn at random (and printed)")
    p.add_argument("--ranks", type=int, choices=(1, 2), default=1, help="trainer ranks (2: torchrun, gloo)")
    p.add_argument(
        "--settle-steps", type=int, default=2, help="steps the last trainer trains after the storm"
    )
    p.add_argument(
        "--dir", type=Path, default=None, help="where to create the run (default: a temporary dir)"
    )
    p.add_argument("--keep", action="store_true", help="keep the run directory")
    args = p.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    base = Path(tempfile.mkdtemp(prefix="chaos-", dir=args.dir))
    spec = StormSpec(
        seed=seed,
        root=base / "run",
        ranks=args.ranks,
        storm_s=args.minutes * 60,
        settle_steps=args.settle_steps,
        log=lambda line: print(line, file=sys.stderr, flush=True),
    )
    _, result = run_storm(spec)
    print(json.dumps({**result.figures, "problems": result.problems, "run": str(spec.root)}, indent=1))
    if not args.keep and not result.problems:
        shutil.rmtree(base, ignore_errors=True)
    return 1 if result.problems else 0


if __name__ == "__main__":
    sys.exit(main())
