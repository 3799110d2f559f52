"""`python -m tests.chaos`: run many chaos seeds, one line each, and a summary.

    python -m tests.chaos --mode single --seeds 0-199      # a range of seeds
    python -m tests.chaos --mode turns --seeds 17 --keep   # replay one, keep its folder

A failed seed keeps its folder (workers' logs, violations.txt) under --work; the exit
status is 1 when any seed failed. --json writes every outcome and the figures.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from tests.chaos.run import environment, run_seed
from tests.chaos.scenario import MODES, draw


def seed_list(text: str) -> list[int]:
    seeds: list[int] = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        seeds += range(int(first), int(last or first) + 1)
    return seeds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.chaos",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--seeds", type=seed_list, required=True, help="e.g. 0-199 or 3,17")
    parser.add_argument("--work", type=Path, default=None, help="folder for the runs")
    parser.add_argument("--keep", action="store_true", help="keep every seed's folder")
    parser.add_argument("--json", type=Path, default=None, help="write the outcomes here")
    parser.add_argument("--describe", action="store_true", help="print each scenario first")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="regen-chaos-"))
    outcomes = []
    started = time.monotonic()
    with environment(args.mode, work) as env:
        for seed in args.seeds:
            scenario = draw(seed, args.mode)
            if args.describe:
                print(scenario.describe(), flush=True)
            outcome = run_seed(env, scenario, work / f"{args.mode}-{seed}", keep=args.keep)
            outcomes.append(outcome)
            print(outcome.line(), flush=True)
            for violation in outcome.violations[:20]:
                print(f"    {violation}", flush=True)
    failed = [o for o in outcomes if not o.ok]
    faults = Counter(f.split("(")[0] for o in outcomes for f in o.faults)
    reasons: Counter[str] = Counter()
    for o in outcomes:
        reasons.update(o.dead_reasons)
    elapsed = time.monotonic() - started
    print(
        f"\n{args.mode}: {len(outcomes) - len(failed)}/{len(outcomes)} seeds passed in "
        f"{elapsed / 60:.1f} min; {sum(o.ids for o in outcomes)} ids, "
        f"{sum(o.records for o in outcomes)} records, {sum(o.dead for o in outcomes)} dead "
        f"letters {dict(reasons)}; {sum(o.worker_exits for o in outcomes)} worker exits; "
        f"faults {dict(faults)}"
    )
    for o in failed:
        print(
            f"  replay: python -m tests.chaos --mode {o.mode} --seeds {o.seed} --keep "
            f"(folder {work / f'{o.mode}-{o.seed}'})"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "mode": args.mode,
                    "minutes": elapsed / 60,
                    "outcomes": [asdict(o) for o in outcomes],
                },
                indent=1,
            )
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
