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


def test_a_ledger_is_named_with_the_rank_its_process_title_gives():
    from kvdoctor.probe.base.rank import rank_of

    assert rank_of("sglang::scheduler_TP1") == "tp1"
    assert rank_of("sglang::scheduler_DP0_TP1_PP0") == "dp0/tp1/pp0"
    assert rank_of("VLLM::EngineCore_DP1") == "dp1"
    assert rank_of("sglang::scheduler") == rank_of("python -m sglang.launch_server --tp 2") == ""
    assert rank_of("sglang::scheduler_TP0\0--tp-size\0TP3") == "tp0"  # arguments after the title are not the title
