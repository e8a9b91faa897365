"""The table of outputs (kvdoctor/formats/table.py) says what the CLI does: each row's renderer
exists, each option it names is one the command has, and --help and the refusals say its choices."""

from __future__ import annotations

import re

import pytest
import typer
from typer.testing import CliRunner

from kvdoctor.cli import app
from kvdoctor.errors import KvdoctorError
from kvdoctor.formats import table

COMMANDS = typer.main.get_command(app).commands  # type: ignore[attr-defined]


@pytest.mark.parametrize("row", table.FORMATS, ids=lambda r: f"{r.name}-{r.entry}")
def test_every_row_names_a_renderer_under_formats(row: table.OutputFormat) -> None:
    assert row.module.startswith("kvdoctor.formats."), row
    assert callable(row.load()), row
    assert row.suffix == "" or row.suffix.startswith("."), row


def test_every_option_a_row_names_is_the_commands_own() -> None:
    named = {where for row in table.FORMATS for where in row.offered_by if "(" not in where}
    assert named
    for where in sorted(named):
        command, option = where.split()
        options = {opt for param in COMMANDS[command].params for opt in param.opts}
        assert option in options, where


def test_one_row_for_each_choice_of_a_command() -> None:
    for command in ("run", "replay", "demo", "watch", "export"):
        names = table.choices(command)
        assert names and len(names) == len(set(names)), command


def test_help_says_the_choices_as_it_did() -> None:
    assert table.format_help("replay") == (
        "text, json, jsonl (a JSON line a finding, labelled as the Prometheus metrics are) or html (one self-contained page)"
    )
    assert table.format_help("watch") == (
        "auto: the live table on a terminal, else jsonl; "
        "jsonl: a JSON line each interval and one for each finding as it arises, flushed, then the summary line; "
        "text: a line for each finding as it arises, then the summary; "
        "json: one JSON document when the watch ends"
    )
    assert table.format_help("export") == "csv or parquet"


@pytest.mark.parametrize("command", ["run", "replay", "demo", "watch", "export"])
def test_help_screen_shows_the_tables_choices(command: str) -> None:
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "400", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    flat = re.sub(r"[\s│|]+", " ", result.output)
    assert table.format_help(command) in flat, flat


@pytest.mark.parametrize(
    ("command", "choices"),
    [
        ("run", "text, json, jsonl, html"),
        ("replay", "text, json, jsonl, html"),
        ("demo", "text, json, jsonl, html"),
        ("watch", "auto, jsonl, text, json"),
    ],
)
def test_a_format_outside_the_table_is_refused_naming_the_choices(command: str, choices: str) -> None:
    with pytest.raises(KvdoctorError) as refused:
        table.check_format("yaml", command)
    assert refused.value.one_line() == f"kvdoctor: unknown format 'yaml' (choose {choices})"
