"""The command line: parse, call the command, map a KvdoctorError to an exit code and one line.

Every option is declared here, once; the commands in kvdoctor/commands/ do the work and return
the exit code. Options more than one command takes (--trace, --fix) are defined once below.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import typer

import kvdoctor
from kvdoctor.analysis.budgets import DEFAULT_FAIL_ON, DEFAULT_MAX_GROWTH
from kvdoctor.cli_help import SGLANG_SERVER, TeachingCommand, TeachingGroup, examples
from kvdoctor.demo.workload import FAULTS as DEMO_FAULTS
from kvdoctor.errors import EXIT_UNUSABLE, KvdoctorError
from kvdoctor.formats.table import format_help
from kvdoctor.outputs import tolerant_streams

PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}  # CMD after --


app = typer.Typer(
    cls=TeachingGroup,
    add_completion=False,
    no_args_is_help=True,
    help="A memory-leak and memory-safety doctor for LLM serving processes (SGLang, vLLM).",
    epilog=examples("kvdoctor demo", f"kvdoctor run -- {SGLANG_SERVER}", "kvdoctor watch 4242", "kvdoctor gate -- bash bench.sh"),
    pretty_exceptions_enable=False,
)


def _command(*example_lines: str, takes_command: bool = False) -> Callable[[Callable[..., Any]], Any]:
    """`app.command` with kvdoctor's help screen: the usage of USAGE, the examples at its end, the
    docstring's first paragraph as the line in `kvdoctor --help`, and (`takes_command`) everything
    after `--` left to the command as CMD."""

    def register(fn: Callable[..., Any]) -> Any:
        summary = inspect.cleandoc(fn.__doc__ or "").split("\n\n")[0].replace("\n", " ")
        settings = PASS_THROUGH if takes_command else None
        return app.command(cls=TeachingCommand, epilog=examples(*example_lines), short_help=summary, context_settings=settings)(fn)

    return register


REPORT_FORMAT_HELP = format_help("replay")
TRACE_HELP = "where the trace goes (default: {} in the current directory)"
TIME_NAME = "<YYYYmmdd-HHMMSS>"


def trace_option(default_name: str) -> Any:
    """--trace PATH, its help naming the file the command writes when none is given (as
    kvdoctor.runner.default_trace_path names it)."""
    return typer.Option(None, "--trace", metavar="PATH", help=TRACE_HELP.format(f"./kvdoctor-{default_name}-{TIME_NAME}.kvtrace.json"))


FIX_OPTION: Any = typer.Option(
    [],
    "--fix",
    metavar="NAME",
    help="turn on an optional fix by name; repeat for more (`kvdoctor fixes` lists them; all are off by default)",
)
FORCE_OPTION: Any = typer.Option(False, "--force", help="replace a file already at a path given (never a device or a directory)")
ATTRIBUTION_OPTION: Any = typer.Option(
    False,
    "--attribution",
    help="also name the file:line and thread where host memory grows (short windows: memray where installed, else tracemalloc)",
)
ATTRIBUTION_ENGINE_OPTION: Any = typer.Option(
    None,
    "--attribution-engine",
    metavar="ENGINE",
    help="auto (memray where installed, else tracemalloc), memray or tracemalloc; implies --attribution",
)
METRICS_OPTION: Any = typer.Option(
    None,
    "--metrics",
    metavar="HOST:PORT",
    help="serve the KV slots and memory of the probed processes as Prometheus metrics on http://HOST:PORT/metrics "
    "(HOST defaults to 127.0.0.1; port 0 picks a free one)",
)
METRICS_PUBLIC_OPTION: Any = typer.Option(False, "--metrics-public", help="allow --metrics on an address that is not loopback")


DEBUG_ENV = "KVDOCTOR_DEBUG"
_debug_option = False  # `kvdoctor --debug COMMAND`


def _debugging() -> bool:
    """Whether an internal error prints its traceback: `--debug`, or KVDOCTOR_DEBUG set (not to 0)."""
    return _debug_option or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _guarded(fn: Callable[..., int]) -> Callable[..., None]:
    """Every command ends in an exit code; a KvdoctorError is one line on stderr, no traceback.
    An internal error (kvdoctor's own bug) is one line too, with its traceback before it when
    debugging, so a report of it can say where."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        tolerant_streams()
        try:
            code = fn(*args, **kwargs)
        except KvdoctorError as exc:
            print(exc.one_line(), file=sys.stderr)
            raise typer.Exit(exc.exit_code) from None
        except KeyboardInterrupt:
            print("kvdoctor: interrupted", file=sys.stderr)
            raise typer.Exit(130) from None
        except (typer.Exit, SystemExit):
            raise
        except Exception as exc:  # our bug: still one line, and the exit code for "could not judge"
            if _debugging():
                traceback.print_exc(file=sys.stderr)
                how = "please report it with the command you ran and the traceback above"
            else:
                how = f"please report it with the command you ran; {DEBUG_ENV}=1 or --debug prints its traceback"
            print(f"kvdoctor: internal error: {type(exc).__name__}: {exc} ({how})", file=sys.stderr)
            raise typer.Exit(EXIT_UNUSABLE) from None
        raise typer.Exit(code or 0)

    return wrapper


def _print_version(value: bool) -> None:
    if value:
        print(f"kvdoctor {kvdoctor.__version__}")
        raise typer.Exit(0)


@app.callback()
def _options(
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version, help="print the version and exit"),
    debug: bool = typer.Option(False, "--debug", help=f"print the traceback of an internal error (as {DEBUG_ENV}=1 does)"),
) -> None:
    """A memory-leak and memory-safety doctor for LLM serving processes (SGLang, vLLM)."""
    global _debug_option
    _debug_option = debug


@_command(
    f"kvdoctor run -- {SGLANG_SERVER}",
    "kvdoctor run --trace leak.kvtrace.json --format json -- vllm serve facebook/opt-125m",
    takes_command=True,
)
@_guarded
def run(
    ctx: typer.Context,
    trace: str | None = trace_option("run-<pid>"),
    fix: list[str] = FIX_OPTION,
    output_format: str = typer.Option("text", "--format", metavar="FORMAT", help=f"summary format (on stderr): {REPORT_FORMAT_HELP}"),
    sample_interval: float = typer.Option(
        1.0, "--sample-interval", metavar="SECONDS", help="seconds between memory samples of CMD's process tree (0: off)"
    ),
    attribution: bool = ATTRIBUTION_OPTION,
    attribution_engine: str | None = ATTRIBUTION_ENGINE_OPTION,
    metrics: str | None = METRICS_OPTION,
    metrics_public: bool = METRICS_PUBLIC_OPTION,
    force: bool = FORCE_OPTION,
) -> int:
    """Run CMD with the probe in every Python process it starts, then say what it found.

    Everything after -- is CMD. The findings go to stderr when CMD ends (CMD's own output stays
    its own); kvdoctor exits with CMD's exit code."""
    from kvdoctor.commands.run import run as run_command

    return run_command(
        list(ctx.args),
        trace,
        list(fix),
        output_format,
        sample_interval,
        force=force,
        attribution=(attribution, attribution_engine),
        metrics=metrics,
        metrics_public=metrics_public,
    )


@_command(
    "kvdoctor replay kvdoctor-run-4242-20261201-101500.kvtrace.json", "kvdoctor replay --format html -o report.html leak.kvtrace.json"
)
@_guarded
def replay(
    trace: str = typer.Argument(..., metavar="TRACE", help="a trace written by kvdoctor run, gate, watch, attach or demo"),
    output_format: str = typer.Option("text", "--format", metavar="FORMAT", help=REPORT_FORMAT_HELP),
    output: str | None = typer.Option(None, "-o", "--output", metavar="PATH", help="write the report here instead of stdout"),
    pprof: str | None = typer.Option(
        None,
        "--pprof",
        metavar="DIR",
        help="also write where host memory grew (the trace's --attribution windows) as pprof profiles into DIR",
    ),
    slot: int | None = typer.Option(None, "--slot", metavar="N", help="instead, print the history the trace holds of KV slot N"),
    force: bool = FORCE_OPTION,
) -> int:
    """Analyse a recorded trace again: exit 0 clean, 1 error findings, 2 unusable input."""
    from kvdoctor.commands.replay import replay as replay_command

    return replay_command(trace, output_format, output, force=force, pprof=pprof, slot=slot)


@_command("kvdoctor demo", "kvdoctor demo --fault double-free --format json")
@_guarded
def demo(
    fault: str = typer.Option("leak", "--fault", metavar="FAULT", help=", ".join(DEMO_FAULTS)),
    page_size: int | None = typer.Option(
        None, "--page-size", metavar="N", help="KV page size (default 1; 4 for stale-last-loc and relocate)"
    ),
    trace: str | None = trace_option("demo-<pid>"),
    output_format: str = typer.Option("text", "--format", metavar="FORMAT", help=REPORT_FORMAT_HELP),
    force: bool = FORCE_OPTION,
) -> int:
    """Plant a fault in SGLang's real allocator and radix tree and show the diagnosis.

    No GPU, no model, no download: it needs torch and SGLang installed."""
    from kvdoctor.commands.demo import demo as demo_command

    return demo_command(fault, page_size, trace, output_format, force=force)


WATCH_FORMAT_HELP = format_help("watch")


@_command("kvdoctor watch 4242", "kvdoctor watch 4242 --interval 5 --metrics 127.0.0.1:9400 | tee watch.jsonl")
@_guarded
def watch(
    pid: int = typer.Argument(..., metavar="PID", help="the serving process (its children are followed too)"),
    interval: float = typer.Option(1.0, "--interval", metavar="SECONDS", help="seconds between samples"),
    duration: float | None = typer.Option(
        None, "--duration", metavar="SECONDS", help="stop after this many seconds (default: at Ctrl-C or when PID exits)"
    ),
    trace: str | None = trace_option("watch-<PID>"),
    output_format: str = typer.Option("auto", "--format", metavar="FORMAT", help=WATCH_FORMAT_HELP),
    attach: bool = typer.Option(False, "--attach", help="also put the probe into the running process (as kvdoctor attach does)"),
    metrics: str | None = typer.Option(
        None,
        "--metrics",
        metavar="HOST:PORT",
        help="serve the watched processes' memory and the findings as Prometheus metrics on http://HOST:PORT/metrics "
        "while watching (HOST defaults to 127.0.0.1; port 0 picks a free one)",
    ),
    metrics_public: bool = METRICS_PUBLIC_OPTION,
    prometheus: str | None = typer.Option(None, "--prometheus", metavar="HOST:PORT", help="the older name of --metrics (still works)"),
    prometheus_public: bool = typer.Option(False, "--prometheus-public", help="the older name of --metrics-public (still works)"),
    force: bool = FORCE_OPTION,
) -> int:
    """Watch a running server's memory, by process and class, and say when it grows.

    From outside: no restart, and nothing is put into the server unless --attach. It stops at
    --duration, at Ctrl-C or when PID exits. On a terminal it draws a live table; piped into a
    file or a log collector it writes a JSON line each interval and one for each finding as it
    arises, each flushed, then the summary line (--format json keeps the single JSON document at
    the end). Exit 0 no error findings, 1 error findings, 2 nothing could be sampled."""
    from kvdoctor.commands.watch import watch as watch_command
    from kvdoctor.commands.watch import watch_metrics

    address, public, option = watch_metrics(metrics, metrics_public, prometheus, prometheus_public)
    return watch_command(
        pid, interval, duration, trace, output_format, attach, prometheus=address, prometheus_public=public, force=force, option=option
    )


@_command("kvdoctor export leak.kvtrace.json", "kvdoctor export --format parquet -o counters.parquet leak.kvtrace.json")
@_guarded
def export(
    trace: str = typer.Argument(..., metavar="TRACE", help="a trace written by kvdoctor run, gate, watch, attach or demo"),
    output_format: str = typer.Option("csv", "--format", metavar="FORMAT", help=format_help("export")),
    output: str | None = typer.Option(
        None, "-o", "--output", metavar="PATH", help="where to write (default: the trace's name with .csv/.parquet; - for CSV on stdout)"
    ),
    force: bool = FORCE_OPTION,
) -> int:
    """Write a trace's counters as a CSV or Parquet table, one row per event.

    The counters: KV slots, memory, HiCache and the probe's own statistics."""
    from kvdoctor.commands.export import export as export_command

    return export_command(trace, output_format, output, force=force)


@_command(
    "kvdoctor gate --max-growth 200MiB/h --junit kvdoctor.xml -- bash bench.sh",
    "kvdoctor gate --baseline main.kvtrace.json pr.kvtrace.json",
    takes_command=True,
)
@_guarded
def gate(
    ctx: typer.Context,
    max_growth: str = typer.Option(
        DEFAULT_MAX_GROWTH,
        "--max-growth",
        metavar="RATE",
        help="fail if any memory class grows faster (e.g. 500MiB/h, 10MB/s); off: judge no growth (a job too short for it)",
    ),
    max_orphan_slots: int = typer.Option(
        0,
        "--max-orphan-slots",
        metavar="N",
        help="fail if more than N KV slots belong to nothing (no request, no cache entry, not free) when the probe counts them at idle or exit",
    ),
    fail_on: str = typer.Option(
        ",".join(DEFAULT_FAIL_ON),
        "--fail-on",
        metavar="KIND[,KIND]",
        help="finding kinds checked one by one (every error finding fails the gate anyway)",
    ),
    allow: str = typer.Option("", "--allow", metavar="KIND[,KIND]", help="error finding kinds that do not fail the gate"),
    engine: str = typer.Option("any", "--engine", metavar="ENGINE", help="the engine whose probe must report: sglang, vllm or any"),
    junit: str | None = typer.Option(None, "--junit", metavar="PATH", help="write a JUnit XML report here"),
    baseline: str | None = typer.Option(None, "--baseline", metavar="TRACE", help="a previous trace; fail on regressions over it"),
    html: str | None = typer.Option(None, "--html", metavar="PATH", help="write a self-contained HTML report here"),
    trace: str | None = trace_option("run-<pid>"),
    force: bool = FORCE_OPTION,
) -> int:
    """Judge a TRACE, or run CMD under the probe, against budgets (for CI).

    Everything after -- is CMD; it runs as under kvdoctor run. The verdict goes to stdout. Exit 0
    pass, 1 fail (CMD's own failure included), 2 could not judge."""
    from kvdoctor.commands.gate import budgets_from
    from kvdoctor.commands.gate import gate as gate_command

    budgets = budgets_from(max_growth, max_orphan_slots, fail_on, allow, engine)
    return gate_command(list(ctx.args), budgets, junit=junit, baseline=baseline, html=html, trace=trace, force=force)


@_command(
    "kvdoctor attach 4242", "kvdoctor attach 4242 --metrics 127.0.0.1:9400", "kvdoctor attach 4242 --gdb /usr/local/cuda/bin/cuda-gdb"
)
@_guarded
def attach(
    pid: int = typer.Argument(..., metavar="PID", help="a running Python server process (needs ptrace permission and gdb)"),
    trace: str | None = trace_option("attach-<PID>"),
    fix: list[str] = FIX_OPTION,
    attribution: bool = ATTRIBUTION_OPTION,
    attribution_engine: str | None = ATTRIBUTION_ENGINE_OPTION,
    metrics: str | None = METRICS_OPTION,
    metrics_public: bool = METRICS_PUBLIC_OPTION,
    force: bool = FORCE_OPTION,
    gdb: str | None = typer.Option(None, "--gdb", metavar="PATH", help="the gdb to use (default: gdb on PATH), e.g. a cuda-gdb"),
) -> int:
    """Put the probe into a running Python server without restarting it.

    It needs gdb and permission to ptrace PID (the same user, and kernel.yama.ptrace_scope 0, or
    CAP_SYS_PTRACE in a container). The probe then writes its trace until the server exits;
    `kvdoctor replay TRACE` judges it. With --metrics, kvdoctor stays and serves its metrics until
    PID exits."""
    from kvdoctor.commands.attach import attach_command

    return attach_command(
        pid,
        trace,
        list(fix),
        attribution=(attribution, attribution_engine),
        force=force,
        metrics=metrics,
        metrics_public=metrics_public,
        gdb=gdb,
    )


@_command("kvdoctor fixes", f"kvdoctor run --fix dedup-free -- {SGLANG_SERVER}")
@_guarded
def fixes() -> int:
    """List the optional fixes, what each changes, and its risk (all are off by default)."""
    from kvdoctor.commands.fixes import list_fixes

    return list_fixes()


@_command("kvdoctor probes", "kvdoctor probes --table > supported.md")
@_guarded
def probes(table: bool = typer.Option(False, "--table", help="print the supported-releases table (Markdown)")) -> int:
    """Which SGLang and vLLM releases kvdoctor supports, and what it would do with the ones here."""
    from kvdoctor.commands.probes import probes as show_probes

    return show_probes(table)


def main() -> None:
    app(prog_name="kvdoctor")


if __name__ == "__main__":
    main()
