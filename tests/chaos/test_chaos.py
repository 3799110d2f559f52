"""The chaos harness: its checks catch what they must, and a fixed set of seeds, chosen
to cover every fault kind and crash point, passes. The full run, hundreds of seeds a
mode, is `python -m tests.chaos` (README, Chaos runs)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from regen.consumers.tokenize.job_folder import LocalFolder
from tests.chaos.invariant import (
    Found,
    ShardWatch,
    export_violations,
    placement_violations,
    token_violations,
)
from tests.chaos.scenario import (
    EXPORT_CRASHPOINT,
    FAULT_WEIGHTS,
    GENERATE_CRASHPOINTS,
    LATER_FAULTS,
    TOKENIZE_CRASHPOINTS,
    TURN_CRASHPOINTS,
    draw,
)

# Seeds whose runs together hold every fault kind, every crash point and a crashed export.
# single 30 and turns 5 run on Sentinel and fail over; single 230 and turns 201 draw a kill
# inside kombu's window; single 1 SIGKILLs a generate worker mid-drain, turns 3 sends a
# draining one a second SIGTERM.
CI_SEEDS = {"single": (1, 30, 104, 230), "turns": (3, 5, 56, 67, 201, 271)}


def test_a_seed_draws_the_same_run_and_seeds_differ() -> None:
    assert draw(5, "turns") == draw(5, "turns")
    assert len({draw(seed, "single").describe() for seed in range(50)}) == 50
    with pytest.raises(ValueError, match="mode"):
        draw(1, "all")


@pytest.mark.parametrize("mode", sorted(CI_SEEDS))
def test_the_ci_seeds_cover_every_fault_and_crash_point(mode: str) -> None:
    wanted = {
        *FAULT_WEIGHTS,
        *LATER_FAULTS,
        "drain_generate",
        *GENERATE_CRASHPOINTS,
        *TOKENIZE_CRASHPOINTS,
        EXPORT_CRASHPOINT,
    }
    if mode == "turns":
        wanted |= set(TURN_CRASHPOINTS)
    covered: set[str] = set()
    for seed in CI_SEEDS[mode]:
        scenario = draw(seed, mode)
        covered |= {fault.kind for fault in scenario.faults}
        covered |= {point for _, point in scenario.crashpoints}
        if scenario.export_crash:
            covered.add(EXPORT_CRASHPOINT)
    assert covered == wanted


def test_some_ci_seeds_write_their_shards_to_a_bucket() -> None:
    assert any(draw(seed, mode).bucket for mode, seeds in CI_SEEDS.items() for seed in seeds)


def test_placement_finds_lost_doubled_and_foreign_ids() -> None:
    found = Found(
        records={"a.zst": [{"id": "p1"}, {"id": "p2"}], "b.zst": [{"id": "p2"}, {"id": "x"}]},
        dead={"generate": {"p3": "server_error", "p1": "aborted"}, "input": {"p4": ""}},
    )
    problems = placement_violations({"p1", "p2", "p3", "p4", "p5"}, found)
    assert problems == [
        "p4: dead-lettered in input without a reason",
        "p5: lost (in no shard and no DLQ)",
        "p1: 2 places (shard a.zst, generate DLQ)",
        "p2: 2 places (shard a.zst, shard b.zst)",
        "x: not an id of the job, found in shard b.zst",
    ]
    clean = Found(records={"a.zst": [{"id": "p1"}]}, dead={"generate": {"p2": "aborted"}})
    assert placement_violations({"p1", "p2"}, clean) == []


def test_shard_watch_finds_a_changed_or_vanished_shard(tmp_path: Path) -> None:
    s1, s2 = tmp_path / "shard-000001.jsonl.zst", tmp_path / "shard-000002.jsonl.zst"
    s1.write_bytes(b"one")
    s2.write_bytes(b"two")
    watch = ShardWatch(LocalFolder(tmp_path))
    watch.look()
    assert watch.final() == []
    s1.write_bytes(b"ONE")
    s2.unlink()
    assert watch.final() == [
        f"shard {s1.name} changed after it was committed",
        f"shard {s2.name} vanished",
    ]


def test_token_check_finds_a_prompt_an_answer_or_a_mask_that_is_off() -> None:
    def render(messages: list[dict[str, object]], tools: object) -> list[int]:
        return [len(messages), 100]

    def answer(prompt: list[int], sampling: object) -> list[int]:
        return [sum(prompt), 2]

    def record(pid: str, ids: list[int], mask: list[int] | None = None) -> dict[str, object]:
        return {
            "id": pid,
            "prompt_tokens": 2,
            "completion_tokens": len(ids) - 2,
            "input_ids": ids,
            "messages": [{}, {}],
            "loss_mask": mask or [0, 0] + [1] * (len(ids) - 2),
            "sampling": {},
        }

    good = record("ok", [1, 100, 101, 2])
    assert token_violations([good], render, answer) == []
    bad = [
        record("prompt", [9, 100, 109, 2]),
        record("answer", [1, 100, 101, 3]),
        record("mask", [1, 100, 101, 2], [0, 1, 1, 1]),
    ]
    assert token_violations(bad, render, answer) == [
        "prompt: prompt ids are not its messages as rendered",
        "answer: answer ids are not the server's answer to its prompt",
        "mask: loss mask does not cover exactly the answer",
    ]


def test_export_check_finds_a_repeated_or_foreign_row() -> None:
    assert export_violations("e", ["a", "b"], {"a", "b"}) == []
    assert export_violations("e", ["a", "a", "z"], {"a"}) == [
        "e: a 2 times",
        "e: z is no record's",
    ]


@pytest.fixture(scope="module")
def environments(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    """One stand-in a mode, started when a seed of that mode first needs it."""
    from tests.chaos.run import environment

    work = tmp_path_factory.mktemp("chaos")
    with contextlib.ExitStack() as stack:
        opened: dict[str, object] = {}

        def get(mode: str) -> object:
            if mode not in opened:
                opened[mode] = stack.enter_context(environment(mode, work))
            return opened[mode]

        yield {"get": get, "work": work}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("mode", "seed"), [(mode, seed) for mode, seeds in CI_SEEDS.items() for seed in seeds]
)
def test_chaos_seed(environments: dict[str, object], mode: str, seed: int) -> None:
    from tests.chaos.run import Environment, run_seed

    get = environments["get"]
    assert callable(get)
    env = get(mode)
    assert isinstance(env, Environment)
    work = environments["work"]
    assert isinstance(work, Path)
    outcome = run_seed(env, draw(seed, mode), work / f"{mode}-{seed}")
    assert outcome.ok, (
        f"{outcome.line()}\n"
        + "\n".join(outcome.violations[:30])
        + f"\nreplay: python -m tests.chaos --mode {mode} --seeds {seed} --keep"
    )
    assert outcome.records > 0
