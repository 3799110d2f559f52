"""`python -m tests.chaos`: run many chaos seeds, one line each, and a summary.

    python -m tests.chaos --seeds 0-199                    # both modes, 200 seeds each
    python -m tests.chaos --mode turns --seeds 17 --keep   # replay one, keep its folder

A failed seed keeps its folder (workers' logs, violations.txt) under --work; the exit
status is 1 when any seed failed. --json writes every outcome and the figures.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from tests.chaos.run import Outcome, environment, run_seed
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
    parser.add_argument("--mode", choices=MODES, action="append", help="default: both")
    parser.add_argument("--seeds", type=seed_list, required=True, help="e.g. 0-199 or 3,17")
    parser.add_argument("--work", type=Path, default=None, help="folder for the runs")
    parser.add_argument("--keep", action="store_true", help="keep every seed's folder")
    parser.add_argument("--json", type=Path, default=None, help="write the outcomes here")
    parser.add_argument("--describe", action="store_true", help="print each scenario first")
    args = parser.parse_args(argv)
    # Stopped from outside: unwind, so that the seed's Redis and workers stop too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = args.work or Path(tempfile.mkdtemp(prefix="regen-chaos-"))
    report = {}
    failed: list[Outcome] = []
    for mode in args.mode or MODES:
        outcomes, minutes = run_mode(mode, args.seeds, work, args.keep, args.describe)
        print(summary(mode, outcomes, minutes), flush=True)
        failed += [o for o in outcomes if not o.ok]
        report[mode] = {"minutes": minutes, "outcomes": [asdict(o) for o in outcomes]}
    for o in failed:
        print(
            f"  replay: python -m tests.chaos --mode {o.mode} --seeds {o.seed} --keep "
            f"(folder {work / f'{o.mode}-{o.seed}'})"
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 1 if failed else 0


def run_mode(
    mode: str, seeds: list[int], work: Path, keep: bool, describe: bool
) -> tuple[list[Outcome], float]:
    outcomes = []
    started = time.monotonic()
    with environment(mode, work) as env:
        for seed in seeds:
            scenario = draw(seed, mode)
            if describe:
                print(scenario.describe(), flush=True)
            outcome = run_seed(env, scenario, work / f"{mode}-{seed}", keep=keep)
            outcomes.append(outcome)
            print(outcome.line(), flush=True)
            for violation in outcome.violations[:20]:
                print(f"    {violation}", flush=True)
    return outcomes, (time.monotonic() - started) / 60


def summary(mode: str, outcomes: list[Outcome], minutes: float) -> str:
    passed = sum(o.ok for o in outcomes)
    faults = Counter(f.split("(")[0] for o in outcomes for f in o.faults)
    reasons: Counter[str] = Counter()
    for o in outcomes:
        reasons.update(o.dead_reasons)
    return (
        f"\n{mode}: {passed}/{len(outcomes)} seeds passed in {minutes:.1f} min; "
        f"{sum(o.ids for o in outcomes)} ids: {sum(o.records for o in outcomes)} records + "
        f"{sum(o.dead for o in outcomes)} dead letters {dict(reasons)}; "
        f"{sum(o.worker_exits for o in outcomes)} worker exits; faults {dict(faults)}\n"
    )


if __name__ == "__main__":
    sys.exit(main())
