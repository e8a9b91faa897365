"""Help that teaches: every command's help screen, as `kvdoctor CMD --help` draws it.

Its usage line names what the command takes (`-- CMD ...` where it runs one, PID, TRACE); an
on/off option shows no value after it; the screen ends with examples, and each example is one
the command line accepts; the metrics address has one name everywhere; the default trace path a
screen names is the one kvdoctor writes; no internal wording reaches the user.
"""

from __future__ import annotations

import os
import re
import shlex

import pytest
import typer
from typer import rich_utils
from typer.testing import CliRunner

from kvdoctor.cli import app
from kvdoctor.runner import default_trace_path

RUNNER = CliRunner()
GROUP = typer.main.get_command(app)
COMMANDS = sorted(GROUP.commands)  # type: ignore[attr-defined]
TAKES_A_COMMAND = {"run", "gate"}
WRITES_A_TRACE = {"run": "run", "gate": "run", "demo": "demo", "watch": "watch", "attach": "attach"}
INTERNAL_WORDING = re.compile(r"\bseed \d|\bissue #|#\d{2,}\b(?<!sglang#\d{5})|\bcensus\b|\bledgers?\b|\bprobe maps?\b", re.IGNORECASE)


@pytest.fixture(autouse=True)
def wide_plain_help(monkeypatch):
    """Help drawn 200 columns wide without colour, so a line is a line (CI sets FORCE_COLOR)."""
    monkeypatch.setattr(rich_utils, "MAX_WIDTH", 200)
    monkeypatch.setattr(rich_utils, "FORCE_TERMINAL", False)


def help_of(*args: str) -> str:
    result = RUNNER.invoke(app, [*args, "--help"], prog_name="kvdoctor", catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def lines_of(text: str) -> list[str]:
    return [line.strip().strip("│").strip() for line in text.splitlines() if line.strip().strip("│").strip()]


def examples_of(text: str) -> list[str]:
    lines = lines_of(text)
    assert "Examples:" in lines, text
    return lines[lines.index("Examples:") + 1 :]


def test_every_command_is_covered():
    assert set(COMMANDS) == {"run", "gate", "watch", "attach", "replay", "export", "demo", "fixes", "probes"}


@pytest.mark.parametrize("name", COMMANDS)
def test_usage_names_what_the_command_takes(name):
    command = GROUP.commands[name]  # type: ignore[attr-defined]
    lines = lines_of(help_of(name))
    usage = lines[:1] + [line for line in lines[1:3] if line.startswith(f"kvdoctor {name} ")]  # gate has two forms
    assert usage[0].startswith(f"Usage: kvdoctor {name}"), usage
    takes_a_command = bool(command.context_settings.get("allow_extra_args"))
    assert takes_a_command == (name in TAKES_A_COMMAND)
    assert any(line.endswith(f"kvdoctor {name} [OPTIONS] -- CMD ...") for line in usage) == takes_a_command, usage
    for param in command.params:
        if isinstance(param, typer.core.TyperArgument):
            assert param.metavar and param.metavar in usage[0].split(), (param.name, usage)  # PID, TRACE: not {pid}
    if name == "gate":
        assert usage[1] == "kvdoctor gate [OPTIONS] TRACE", usage  # it judges a trace too


@pytest.mark.parametrize("name", [None, *COMMANDS])
def test_help_ends_with_examples_the_command_line_accepts(name):
    text = help_of(*([name] if name else []))
    found = examples_of(text)
    assert found and (name is None or found[0].startswith(f"kvdoctor {name}")), text
    for example in found:
        args = shlex.split(example.split(" | ")[0].split(" > ")[0])
        assert args[0] == "kvdoctor" and args[1] in COMMANDS, example
        if args[-1] == "--help":
            continue
        ctx = GROUP.make_context("kvdoctor", args[1:], resilient_parsing=False)
        sub = GROUP.commands[args[1]]  # type: ignore[attr-defined]
        with sub.make_context(args[1], args[2:], parent=ctx) as sub_ctx:  # parses every option and value, runs nothing
            if "--" in args:
                assert sub_ctx.args == args[args.index("--") + 1 :], example  # CMD reaches the command whole


@pytest.mark.parametrize("name", [None, *COMMANDS])
def test_on_off_options_show_no_value(name):
    text = help_of(*([name] if name else []))
    assert "<bool>" not in text, text
    command = GROUP.commands[name] if name else GROUP  # type: ignore[attr-defined]
    for param in command.get_params(command.make_context(name or "kvdoctor", [], resilient_parsing=True)):
        if not isinstance(param, typer.core.TyperOption):
            continue
        option = param.opts[-1]
        row = next(line for line in lines_of(text) if line.split()[0] == option)
        words = [word for word in row.split() if word not in param.opts]  # `--output -o PATH`: the names, then the value
        if param.is_bool_flag:
            assert words[0] == param.help.split()[0], row  # straight on to what it does
        else:
            assert re.fullmatch(r"[A-Z][A-Z:\[\],]*", words[0]), row  # SECONDS, HOST:PORT, KIND[,KIND]


def test_an_on_off_option_takes_no_value(tmp_path):
    replay = GROUP.commands["replay"]  # type: ignore[attr-defined]
    with replay.make_context("replay", ["--force", "t.kvtrace.json"]) as ctx:
        assert ctx.params["force"] is True and ctx.params["trace"] == "t.kvtrace.json"


def test_the_metrics_address_has_one_name():
    for name in COMMANDS:
        options = {opt for param in GROUP.commands[name].params for opt in getattr(param, "opts", [])}  # type: ignore[attr-defined]
        serves = {opt for opt in options if "metric" in opt or "prometheus" in opt}
        if serves:
            assert {"--metrics", "--metrics-public"} <= serves, (name, serves)
            assert serves - {"--metrics", "--metrics-public"} <= ({"--prometheus", "--prometheus-public"} if name == "watch" else set())
    rows = [line for line in lines_of(help_of("watch")) if line.startswith("--prometheus")]
    assert len(rows) == 2 and all("older name of --metrics" in row for row in rows), rows


@pytest.mark.parametrize("given,named", [("--metrics", "--metrics-public"), ("--prometheus", "--prometheus-public")])
def test_a_refusal_names_the_option_the_user_wrote(given, named, tmp_path):
    result = RUNNER.invoke(
        app, ["watch", str(os.getpid()), "--duration", "1", given, "0.0.0.0:0", "--trace", str(tmp_path / "w.json")], prog_name="kvdoctor"
    )
    assert result.exit_code == 2 and f"add {named} to serve on it" in result.output, result.output


@pytest.mark.parametrize("name", sorted(WRITES_A_TRACE))
def test_help_says_where_the_trace_goes_by_default(name):
    row = " ".join(line for line in lines_of(help_of(name)) if "kvtrace.json" in line or line.startswith("--trace"))
    documented = re.search(r"default: \./(\S+\.kvtrace\.json) in the current directory", row)
    assert documented, row
    pid = 4242
    pattern = re.escape(documented.group(1)).replace(re.escape("<YYYYmmdd-HHMMSS>"), r"\d{8}-\d{6}")
    pattern = pattern.replace(re.escape("<PID>"), str(pid)).replace(re.escape("<pid>"), str(os.getpid()))
    written = default_trace_path(WRITES_A_TRACE[name], pid if "<PID>" in documented.group(1) else None)
    assert os.path.dirname(written) == os.getcwd() and re.fullmatch(pattern, os.path.basename(written)), (written, pattern)


def test_no_internal_wording_reaches_the_user():
    screens = {name or "kvdoctor": help_of(*([name] if name else [])) for name in [None, *COMMANDS]}
    screens["kvdoctor fixes"] = RUNNER.invoke(app, ["fixes"], prog_name="kvdoctor").output
    for name, text in screens.items():
        assert not INTERNAL_WORDING.search(text), (name, INTERNAL_WORDING.search(text))
