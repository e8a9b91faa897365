"""The command line: parse, call, map a KvdoctorError to an exit code and one helpful line."""

from __future__ import annotations

import functools
import sys
from typing import Callable, List, Optional

import typer

from kvdoctor.errors import EXIT_UNUSABLE, KvdoctorError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="A memory-leak and memory-safety doctor for LLM serving processes (SGLang, vLLM).",
    pretty_exceptions_enable=False,
)

FORMAT_HELP = "text, json or html"


def _guarded(fn: Callable[..., int]) -> Callable[..., None]:
    """Every command ends in an exit code; a KvdoctorError is one line on stderr, no traceback."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs) -> None:
        try:
            code = fn(*args, **kwargs)
        except KvdoctorError as exc:
            print(exc.one_line(), file=sys.stderr)
            raise typer.Exit(exc.exit_code)
        except KeyboardInterrupt:
            print("kvdoctor: interrupted", file=sys.stderr)
            raise typer.Exit(130)
        except (typer.Exit, SystemExit):
            raise
        except Exception as exc:  # our bug: still one line, and the exit code for "could not judge"
            print(f"kvdoctor: internal error: {type(exc).__name__}: {exc} (please report it with the command you ran)", file=sys.stderr)
            raise typer.Exit(EXIT_UNUSABLE)
        raise typer.Exit(code or 0)

    return wrapper


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@_guarded
def run(
    ctx: typer.Context,
    trace: Optional[str] = typer.Option(None, "--trace", help="where to write the trace (default: ./kvdoctor-<time>.kvtrace.json)"),
    fix: List[str] = typer.Option([], "--fix", help="turn on an optional fix by name (see `kvdoctor fixes`)"),
    output_format: str = typer.Option("text", "--format", help="summary format: text or json"),
    sample_interval: float = typer.Option(1.0, "--sample-interval", help="seconds between memory samples of CMD's process tree (0: off)"),
) -> int:
    """Run CMD (after --) with the probe in every Python process it starts; exit with CMD's code."""
    from kvdoctor.runner import analyze_recorded as analyze_trace
    from kvdoctor.commands.run import run_command
    from kvdoctor.reporters import render

    from kvdoctor.probe.fixes import FIXES, unknown

    if unknown(list(fix)):
        raise KvdoctorError(f"unknown fix {', '.join(unknown(list(fix)))}", f"`kvdoctor fixes` lists them: {', '.join(FIXES)}")
    code, trace_path = run_command(list(ctx.args), trace, list(fix), sample_interval)
    analysis = analyze_trace(trace_path)
    print(render(analysis, "json" if output_format == "json" else "text"), file=sys.stderr)
    print(f"kvdoctor: trace {trace_path}", file=sys.stderr)
    return code


@app.command()
@_guarded
def replay(
    trace: str = typer.Argument(..., help="a trace written by kvdoctor run/watch/demo"),
    output_format: str = typer.Option("text", "--format", help=FORMAT_HELP),
    output: Optional[str] = typer.Option(None, "-o", "--output", help="write the report here instead of stdout"),
) -> int:
    """Analyse a recorded trace: exit 0 clean, 1 error findings, 2 unusable input."""
    from kvdoctor.commands.replay import replay as do_replay

    if output_format not in ("text", "json", "html"):
        raise KvdoctorError(f"unknown format {output_format!r}", f"choose {FORMAT_HELP}")
    return do_replay(trace, output_format, output)


@app.command()
@_guarded
def demo(
    fault: str = typer.Option("leak", "--fault", help="none, leak, double-free, stale-last-loc, relocate, index-out-of-range, double-alloc"),
    page_size: Optional[int] = typer.Option(None, "--page-size", help="KV page size (default 1; 4 for stale-last-loc and relocate)"),
    trace: Optional[str] = typer.Option(None, "--trace", help="where to write the trace"),
    output_format: str = typer.Option("text", "--format", help="text or json"),
) -> int:
    """Drive SGLang's real allocator and radix tree with a planted fault and show the diagnosis."""
    from kvdoctor.commands.demo import run_demo

    return run_demo(fault, page_size, trace, output_format)


@app.command()
@_guarded
def watch(
    pid: int = typer.Argument(..., help="the serving process (its children are followed too)"),
    interval: float = typer.Option(1.0, "--interval", help="seconds between samples"),
    duration: Optional[float] = typer.Option(None, "--duration", help="stop after this many seconds"),
    trace: Optional[str] = typer.Option(None, "--trace", help="where to write the trace"),
    output_format: str = typer.Option("auto", "--format", help="auto (live view on a TTY), text or json"),
    attach: bool = typer.Option(False, "--attach", help="also put the probe into the running process"),
    prometheus: Optional[str] = typer.Option(None, "--prometheus", metavar="HOST:PORT", help="serve Prometheus metrics on /metrics there while watching (HOST defaults to 127.0.0.1; port 0 picks a free one)"),
    prometheus_public: bool = typer.Option(False, "--prometheus-public", help="allow --prometheus on an address that is not loopback"),
) -> int:
    """Watch a live server's process tree: memory by class over time, growth and its rate."""
    from kvdoctor.commands.watch import watch as do_watch

    if prometheus is not None:
        return do_watch(pid, interval_s=interval, duration_s=duration, trace_path=trace, output_format=output_format, attach=attach,
                        prometheus=prometheus, prometheus_public=prometheus_public)
    return do_watch(pid, interval_s=interval, duration_s=duration, trace_path=trace, output_format=output_format, attach=attach)


@app.command()
@_guarded
def export(
    trace: str = typer.Argument(..., help="a trace written by kvdoctor run/watch/demo"),
    output_format: str = typer.Option("csv", "--format", help="csv or parquet"),
    output: Optional[str] = typer.Option(None, "-o", "--output", help="where to write (default: the trace's name with .csv/.parquet; - for CSV on stdout)"),
) -> int:
    """Write a trace's counters (kv_slots, memory, hicache, probe_stats) as a CSV or Parquet table, one row per event."""
    from kvdoctor.commands.export import export as do_export

    return do_export(trace, output_format, output)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@_guarded
def gate(
    ctx: typer.Context,
    max_growth: str = typer.Option("500MiB/h", "--max-growth", help="fail if any memory class grows faster (e.g. 500MiB/h, 10MB/s)"),
    max_orphan_slots: int = typer.Option(0, "--max-orphan-slots", help="fail if more KV slots are orphaned at the census"),
    fail_on: str = typer.Option("double_free,double_alloc,stale_last_loc,index_out_of_range", "--fail-on", help="finding kinds that fail the gate (comma-separated)"),
    junit: Optional[str] = typer.Option(None, "--junit", help="write a JUnit XML report here"),
    baseline: Optional[str] = typer.Option(None, "--baseline", help="a previous trace; fail on regressions over it"),
    html: Optional[str] = typer.Option(None, "--html", help="write a self-contained HTML report here"),
    trace: Optional[str] = typer.Option(None, "--trace", help="where to write the trace when running a command"),
) -> int:
    """Judge TRACE.json, or run CMD (after --) under the probe, against budgets: exit 0 pass, 1 fail, 2 could not judge."""
    from kvdoctor.commands.gate import gate as do_gate

    return do_gate(list(ctx.args), max_growth=max_growth, max_orphan_slots=max_orphan_slots, fail_on=fail_on,
                   junit=junit, baseline=baseline, html=html, trace=trace)


@app.command()
@_guarded
def attach(
    pid: int = typer.Argument(..., help="a running Python server process"),
    trace: Optional[str] = typer.Option(None, "--trace", help="where the probe writes its trace (default: ./kvdoctor-attach-PID.kvtrace.json)"),
    fix: List[str] = typer.Option([], "--fix", help="turn on an optional fix by name (see `kvdoctor fixes`)"),
    attribution: bool = typer.Option(False, "--attribution", help="also name the file:line and thread where host memory grows (short tracemalloc windows)"),
) -> int:
    """Put the probe into a running Python server without restarting it."""
    from kvdoctor.commands.attach import attach_command

    return attach_command(pid, trace, list(fix), attribution=attribution)


@app.command()
@_guarded
def fixes() -> int:
    """List the optional fixes, what each changes, and its risk (all are off by default)."""
    from kvdoctor.probe.fixes import FIXES

    for fix in FIXES.values():
        print(f"{fix.name}\n  fixes:   {fix.fixes}\n  changes: {fix.changes}\n  risk:    {fix.risk}\n")
    return 0


def main() -> None:
    app()


if __name__ == "__main__":
    main()
