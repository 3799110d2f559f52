"""A test talks to its own stand-in, never to another test's: tests run in parallel
processes, and a port picked by one and bound seconds later by its stand-in (after the
tokenizer loads) can be taken in between by another's (tests/support/sglang_standin/process.py)."""

from __future__ import annotations

import pytest

from tests.support.sglang_standin.process import run_standin, start_standin


def test_a_standin_binds_its_own_port_and_a_handle_refuses_a_port_another_serves() -> None:
    with run_standin() as first:
        assert first.port > 0 and first.url.endswith(f":{first.port}")
        assert first.get("/health").status_code == 200
        # A second stand-in asked for the same port: the first one answers there, and
        # the handle must not take that for its own server being ready.
        second = start_standin(port=first.port)
        try:
            with pytest.raises(RuntimeError, match=r"served by another process|exited before"):
                second.wait_ready(timeout_s=60)
        finally:
            second.close()
        assert first.get("/health").status_code == 200
