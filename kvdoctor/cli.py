"""The command line: parse, call the command, map a KvdoctorError to an exit code and one line.

Every option is declared here, once; the commands in kvdoctor/commands/ do the work and return
the exit code. Options more than one command takes (--trace, --fix) are defined once below.
"""

from __future__ import annotations

import functools
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import typer

import kvdoctor
from kvdoctor.analysis.budgets import DEFAULT_FAIL_ON, DEFAULT_MAX_GROWTH
from kvdoctor.errors import EXIT_UNUSABLE, KvdoctorError
from kvdoctor.outputs import tolerant_streams

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="A memory-leak and memory-safety doctor for LLM serving processes (SGLang, vLLM).",
    pretty_exceptions_enable=False,
)

REPORT_FORMAT_HELP = "text, json, jsonl (one finding a line, labelled as the metrics) or html"
PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}  # CMD after --
TRACE_OPTION: Any = typer.Option(
    None, "--trace", metavar="PATH", help="the trace file to write (default: ./kvdoctor-<command>-<pid>-<YYYYmmdd-HHMMSS>.kvtrace.json)"
)
FIX_OPTION: Any = typer.Option([], "--fix", metavar="NAME", help="turn on an optional fix by name (see `kvdoctor fixes`)")
FORCE_OPTION: Any = typer.Option(False, "--force", help="replace an existing file at the paths given (never a device or directory)")
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
    help="serve the probed processes' ledgers as Prometheus metrics on /metrics there (HOST defaults to 127.0.0.1; port 0 picks one)",
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


@app.command(context_settings=PASS_THROUGH)
@_guarded
def run(
    ctx: typer.Context,
    trace: str | None = TRACE_OPTION,
    fix: list[str] = FIX_OPTION,
    output_format: str = typer.Option("text", "--format", help=f"summary format (on stderr): {REPORT_FORMAT_HELP}"),
    sample_interval: float = typer.Option(1.0, "--sample-interval", help="seconds between memory samples of CMD's process tree (0: off)"),
    attribution: bool = ATTRIBUTION_OPTION,
    attribution_engine: str | None = ATTRIBUTION_ENGINE_OPTION,
    metrics: str | None = METRICS_OPTION,
    metrics_public: bool = METRICS_PUBLIC_OPTION,
    force: bool = FORCE_OPTION,
) -> int:
    """Run CMD (after --) with the probe in every Python process it starts; exit with CMD's code."""
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


@app.command()
@_guarded
def replay(
    trace: str = typer.Argument(..., help="a trace written by kvdoctor run/watch/demo"),
    output_format: str = typer.Option("text", "--format", help=REPORT_FORMAT_HELP),
    output: str | None = typer.Option(None, "-o", "--output", help="write the report here instead of stdout"),
    pprof: str | None = typer.Option(None, "--pprof", help="also write the trace's attribution windows as pprof files into this folder"),
    force: bool = FORCE_OPTION,
) -> int:
    """Analyse a recorded trace: exit 0 clean, 1 error findings, 2 unusable input."""
    from kvdoctor.commands.replay import replay as replay_command

    return replay_command(trace, output_format, output, force=force, pprof=pprof)


@app.command()
@_guarded
def demo(
    fault: str = typer.Option(
        "leak", "--fault", help="none, leak, double-free, stale-last-loc, relocate, index-out-of-range, double-alloc"
    ),
    page_size: int | None = typer.Option(None, "--page-size", help="KV page size (default 1; 4 for stale-last-loc and relocate)"),
    trace: str | None = TRACE_OPTION,
    output_format: str = typer.Option("text", "--format", help=REPORT_FORMAT_HELP),
    force: bool = FORCE_OPTION,
) -> int:
    """Drive SGLang's real allocator and radix tree with a planted fault and show the diagnosis."""
    from kvdoctor.commands.demo import demo as demo_command

    return demo_command(fault, page_size, trace, output_format, force=force)


@app.command()
@_guarded
def watch(
    pid: int = typer.Argument(..., help="the serving process (its children are followed too)"),
    interval: float = typer.Option(1.0, "--interval", help="seconds between samples"),
    duration: float | None = typer.Option(None, "--duration", help="stop after this many seconds"),
    trace: str | None = TRACE_OPTION,
    output_format: str = typer.Option("auto", "--format", help="auto (live view on a TTY), text or json"),
    attach: bool = typer.Option(False, "--attach", help="also put the probe into the running process"),
    prometheus: str | None = typer.Option(
        None,
        "--prometheus",
        metavar="HOST:PORT",
        help="serve Prometheus metrics on /metrics there while watching (HOST defaults to 127.0.0.1; port 0 picks a free one)",
    ),
    prometheus_public: bool = typer.Option(False, "--prometheus-public", help="allow --prometheus on an address that is not loopback"),
    force: bool = FORCE_OPTION,
) -> int:
    """Watch a live server's process tree: memory by class over time, growth and its rate."""
    from kvdoctor.commands.watch import watch as watch_command

    return watch_command(
        pid, interval, duration, trace, output_format, attach, prometheus=prometheus, prometheus_public=prometheus_public, force=force
    )


@app.command()
@_guarded
def export(
    trace: str = typer.Argument(..., help="a trace written by kvdoctor run/watch/demo"),
    output_format: str = typer.Option("csv", "--format", help="csv or parquet"),
    output: str | None = typer.Option(
        None, "-o", "--output", help="where to write (default: the trace's name with .csv/.parquet; - for CSV on stdout)"
    ),
    force: bool = FORCE_OPTION,
) -> int:
    """Write a trace's counters (kv_slots, memory, hicache, probe_stats) as a CSV or Parquet table, one row per event."""
    from kvdoctor.commands.export import export as export_command

    return export_command(trace, output_format, output, force=force)


@app.command(context_settings=PASS_THROUGH)
@_guarded
def gate(
    ctx: typer.Context,
    max_growth: str = typer.Option(
        DEFAULT_MAX_GROWTH, "--max-growth", help="fail if any memory class grows faster (e.g. 500MiB/h, 10MB/s)"
    ),
    max_orphan_slots: int = typer.Option(0, "--max-orphan-slots", help="fail if more KV slots are orphaned at the census"),
    fail_on: str = typer.Option(
        ",".join(DEFAULT_FAIL_ON), "--fail-on", help="finding kinds checked one by one (every error finding fails the gate anyway)"
    ),
    allow: str = typer.Option("", "--allow", metavar="KIND[,KIND]", help="error finding kinds that do not fail the gate"),
    engine: str = typer.Option("any", "--engine", help="the engine whose probe must report: sglang, vllm or any"),
    junit: str | None = typer.Option(None, "--junit", help="write a JUnit XML report here"),
    baseline: str | None = typer.Option(None, "--baseline", help="a previous trace; fail on regressions over it"),
    html: str | None = typer.Option(None, "--html", help="write a self-contained HTML report here"),
    trace: str | None = TRACE_OPTION,
    force: bool = FORCE_OPTION,
) -> int:
    """Judge TRACE.json, or run CMD (after --) under the probe, against budgets: exit 0 pass, 1 fail, 2 could not judge."""
    from kvdoctor.commands.gate import budgets_from
    from kvdoctor.commands.gate import gate as gate_command

    budgets = budgets_from(max_growth, max_orphan_slots, fail_on, allow, engine)
    return gate_command(list(ctx.args), budgets, junit=junit, baseline=baseline, html=html, trace=trace, force=force)


@app.command()
@_guarded
def attach(
    pid: int = typer.Argument(..., help="a running Python server process"),
    trace: str | None = TRACE_OPTION,
    fix: list[str] = FIX_OPTION,
    attribution: bool = ATTRIBUTION_OPTION,
    attribution_engine: str | None = ATTRIBUTION_ENGINE_OPTION,
    metrics: str | None = METRICS_OPTION,
    metrics_public: bool = METRICS_PUBLIC_OPTION,
    force: bool = FORCE_OPTION,
) -> int:
    """Put the probe into a running Python server without restarting it (with --metrics, serve its ledgers until it exits)."""
    from kvdoctor.commands.attach import attach_command

    return attach_command(
        pid, trace, list(fix), attribution=(attribution, attribution_engine), force=force, metrics=metrics, metrics_public=metrics_public
    )


@app.command()
@_guarded
def fixes() -> int:
    """List the optional fixes, what each changes, and its risk (all are off by default)."""
    from kvdoctor.commands.fixes import list_fixes

    return list_fixes()


@app.command()
@_guarded
def probes(table: bool = typer.Option(False, "--table", help="print the supported-releases table (Markdown, as in the README)")) -> int:
    """The releases each probe map covers and CI tests, and what the probe would do with the engine installed here."""
    from kvdoctor.commands.probes import probes as show_probes

    return show_probes(table)


def main() -> None:
    app(prog_name="kvdoctor")


if __name__ == "__main__":
    main()
