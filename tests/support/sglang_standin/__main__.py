"""`python -m tests.support.sglang_standin --port P [options]`: run the stand-in until
SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import signal

from tests.support.sglang_standin.completer import (
    Completer,
    default_tokenizer_source,
    load_tokenizer,
)
from tests.support.sglang_standin.config import StandinConfig, from_argv
from tests.support.sglang_standin.continuations import ContinuationStore
from tests.support.sglang_standin.server import Standin, serve


async def main(config: StandinConfig) -> None:
    source = config.tokenizer or default_tokenizer_source()
    tokenizer = load_tokenizer(source, trust_remote_code=config.trust_remote_code)
    completer = Completer(
        tokenizer,
        config.output_len_dist,
        eos_id=config.eos_id,
        think=config.think,
        seed=config.seed,
        suffix=config.answer_suffix,
        length_from_prompt=config.answer_length_from_prompt,
        continuations=ContinuationStore(config.continuations_path()),
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await serve(Standin(config, completer, config.model_path or source), stop)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main(from_argv()))
