"""kvdoctor's help screens, beyond what typer draws: usage lines that name what each command takes
(`-- CMD ...`, `PID`, `TRACE`), on/off options shown as flags with no value after them, and the
examples that close each screen. kvdoctor.cli declares the commands with these classes.
"""

from __future__ import annotations

from typing import Any

from typer.core import TyperCommand, TyperGroup


class _Teaching:
    """What every help screen of kvdoctor does beyond typer's: its usage lines name what the command
    takes (`-- CMD ...`, `PID`, `TRACE`; USAGE below), an on/off option is shown as a flag
    with no value after it, and the examples (the command's epilog) close the screen."""

    def get_params(self, ctx: Any) -> list[Any]:
        params: list[Any] = super().get_params(ctx)  # type: ignore[misc]
        for param in params:
            if getattr(param, "is_bool_flag", False) and param.metavar is None:
                param.metavar = ""  # `--force`, not `--force <bool>`: it takes no value
        return params

    def get_usage(self, ctx: Any) -> str:
        forms = USAGE.get(str(getattr(self, "name", "")))
        if forms is None:
            return str(super().get_usage(ctx))  # type: ignore[misc]
        heads = ["Usage:", *["      "] * (len(forms) - 1)]
        return "\n".join(f"{head} {ctx.command_path} {form}".rstrip() for head, form in zip(heads, forms, strict=True))


class TeachingCommand(_Teaching, TyperCommand):
    pass


class TeachingGroup(_Teaching, TyperGroup):
    pass


# Each command's usage line(s), after `kvdoctor NAME`; a test holds them to what the command parses.
USAGE = {
    "run": ["[OPTIONS] -- CMD ..."],
    "gate": ["[OPTIONS] -- CMD ...", "[OPTIONS] TRACE"],
    "watch": ["[OPTIONS] PID"],
    "attach": ["[OPTIONS] PID"],
    "replay": ["[OPTIONS] TRACE"],
    "export": ["[OPTIONS] TRACE"],
    "demo": ["[OPTIONS]"],
    "fixes": [""],
    "probes": ["[OPTIONS]"],
}
SGLANG_SERVER = "python -m sglang.launch_server --model-path Qwen/Qwen3-0.6B"


def examples(*lines: str) -> str:
    """The closing lines of a help screen: `  $ kvdoctor ...` one a line, each with what it does."""
    return "\nExamples:\n" + "\n".join(f"  {line}" for line in lines)  # a first line of its own: the indent stays
