"""Which engine the sampler says a process runs, from its title: an engine's own title, a `-m`
module of its package or its console script; a path that only mentions an engine is not one."""

from __future__ import annotations

import pytest

from kvdoctor.collect.procfs import guess_engine


@pytest.mark.parametrize(
    "title,engine",
    [
        ("sglang::scheduler_TP0", "sglang"),
        ("VLLM::EngineCore", "vllm"),
        ("python -m sglang.launch_server --model-path /m", "sglang"),
        ("/venv/bin/python3 -m vllm.entrypoints.openai.api_server --model /m", "vllm"),
        ("/usr/local/bin/vllm serve /m", "vllm"),
        ("python -m kvdoctor.cli run -- python -m sglang.launch_server", "sglang"),
        ("vllm bench serve --tokenizer /models/sglang-tiny-model", "vllm"),
        ("python -m vllm.benchmarks.serve --tokenizer /x/.venv/sglang-tiny-model", "vllm"),
        ("bash vllm-bench.sh", ""),
        ("python bench.py --tokenizer /x/.venv/sglang-tiny-model", ""),
        ("sleep 2", ""),
        ("", ""),
    ],
)
def test_the_engine_comes_from_the_title_not_from_any_mention(title, engine):
    assert guess_engine(title) == engine
