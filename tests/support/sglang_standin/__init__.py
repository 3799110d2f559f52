"""A small SGLang server stand-in for tests and benchmarks (docs/design/sglang.md, SGLang contract).

It keeps SGLang 0.5's HTTP contract (`/generate` with `input_ids`, `/health`,
`/health_generate`, `/model_info`, `/server_info` and their `/get_` names, `/metrics`,
and the OpenAI `/v1/chat/completions` without streaming, chat.py), answers with real
tokens of a real tokenizer, bounds concurrency like SGLang's scheduler, reports
`meta_info.cached_tokens` from a bounded prefix cache of its own (prefix_cache.py), and
can be told to fail through `POST /_fault`. `POST /abort_request` ends a request with
its output so far, as strictly as SGLang does, which another stand-in continues
exactly (aborts.py, continuations.py). The `version` option picks the SGLang release
whose shapes it imitates (versions.py); `api_key` and `admin_api_key` guard it as
SGLang's do (auth.py). `GET /_stats` gives the counters a benchmark needs; `GET
/_served` the last requests completed (rid, prompt and cached tokens).

Run it with `python -m tests.support.sglang_standin --port P`, or from a test with
`run_standin(...)`, which owns a real subprocess.
"""

from tests.support.sglang_standin.process import StandinHandle, run_standin, start_standin

__all__ = ["StandinHandle", "run_standin", "start_standin"]
