"""The demo's sampling: the model's own, as its generation_config says (#29)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from regen.cli import main
from regen.common import defaults
from regen.demo import DemoOptions
from regen.producer.spec import prepare_job


def demo_options(monkeypatch: pytest.MonkeyPatch, *args: str) -> DemoOptions:
    """The options `regen demo ARGS` runs with (the run itself left out)."""
    seen: list[DemoOptions] = []
    monkeypatch.setattr("regen.demo.run_demo", seen.append)
    result = CliRunner().invoke(main, ["demo", *args])
    assert result.exit_code == 0, result.output
    return seen[0]


def test_the_demo_samples_as_the_models_generation_config_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # With temperature 0.2 and top_p 0.9 set, SmolLM2 looped on the first bundled prompt.
    prepared = prepare_job(demo_options(monkeypatch).job)
    assert prepared.spec.sampling == {"max_new_tokens": defaults.DEMO_MAX_NEW_TOKENS}
    made_by = prepared.provenance
    assert made_by["effective_sampling"] == {
        **made_by["model_sampling_defaults"], "max_new_tokens": defaults.DEMO_MAX_NEW_TOKENS
    }  # fmt: skip


def test_the_demos_sampling_can_still_be_set(monkeypatch: pytest.MonkeyPatch) -> None:
    options = demo_options(monkeypatch, "--temperature", "0.7", "--top-p", "0.95")
    assert prepare_job(options.job).spec.sampling == {
        "max_new_tokens": defaults.DEMO_MAX_NEW_TOKENS, "temperature": 0.7, "top_p": 0.95
    }  # fmt: skip
