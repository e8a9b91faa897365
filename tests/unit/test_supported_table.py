"""The README's supported-releases table is the one `kvdoctor probes --table` generates from the
maps and the release list, so it cannot drift from what the matrix tests."""

import os

from kvdoctor.runner.support import installed_line, markdown_table
from kvdoctor.trace.schema import SERVING_ENGINES

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BEGIN, END = "<!-- kvdoctor probes --table -->\n", "\n<!-- end of generated table -->"


def test_readme_table_is_generated():
    readme = open(os.path.join(REPO, "README.md")).read()
    copy = readme[readme.index(BEGIN) + len(BEGIN) : readme.index(END)]
    assert copy == "\n\n".join(markdown_table(engine) for engine in SERVING_ENGINES)


def test_the_table_names_why_a_release_is_not_run():
    table = markdown_table("sglang")
    row = [line for line in table.splitlines() if "sglang-0.5.1.toml" in line][0]
    assert "not run: 0.5.1, 0.5.1.post1, 0.5.1.post2, 0.5.1.post3" in row and "_is_amx_tile_supported" in row


def test_installed_line_for_the_environment_and_for_a_release_past_every_map(monkeypatch):
    assert installed_line("sglang") == "SGLang 0.5.23: map sglang-0.5.23.toml, 48/48 hooks resolve, tested in CI"
    monkeypatch.setenv("KVDOCTOR_SGLANG_VERSION", "0.5.99")
    assert installed_line("sglang") == (
        "SGLang 0.5.99: no map of its own; nearest sglang-0.5.23.toml, 48/48 hooks resolve, not in the release list"
    )
