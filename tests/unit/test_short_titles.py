"""Process titles are shortened at word boundaries, the program's path cut to its name, never
mid-path (`processes: 7210 <checkout>/.venv/bin/python <checkout>/.` was what a run printed)."""

from kvdoctor.analysis.analyzer import Analysis
from kvdoctor.formats.reports.terminal import render_text
from kvdoctor.units import short_title

SERVER = "/work/main/.venv/bin/python -m sglang.launch_server --model-path /work/main/.venv/sglang-tiny-model --port 30000"


def test_a_title_is_cut_after_its_last_whole_word_with_the_programs_path_cut_to_its_name():
    assert short_title(SERVER, 48) == "python -m sglang.launch_server --model-path …"
    assert short_title("kvdoctor " + SERVER, 48) == "kvdoctor python -m sglang.launch_server …"
    assert short_title("sglang::scheduler_TP0", 48) == "sglang::scheduler_TP0"
    assert len(short_title("x" * 100, 48)) == 48  # one word longer than the limit: cut inside it
    for limit in range(8, 120, 7):
        assert len(short_title("kvdoctor " + SERVER, limit)) <= limit


def test_the_reports_process_line_names_whole_words():
    analysis = Analysis(findings=[], processes={7210: {"process_title": "kvdoctor " + SERVER}, 7211: {"process_title": SERVER}})
    first = render_text(analysis).splitlines()[0]
    assert "processes: 7210 kvdoctor python -m sglang.launch_server …, 7211 python -m sglang.launch_server --model-path …" in first
    assert "/work/main" not in first
