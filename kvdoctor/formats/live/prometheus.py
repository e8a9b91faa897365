"""Prometheus metrics for `kvdoctor watch --prometheus HOST:PORT`, named in SGLang's style.

While a watch runs, `GET /metrics` on the given address returns, in the Prometheus text format:

    kvdoctor:memory_bytes{pid,title,class}                 each process's memory by class
    kvdoctor:memory_growth_bytes_per_second{pid,class}     while a memory_growth finding stands
    kvdoctor:kv_slots{pid,allocator,state}                 KV-slot ledger sizes (probe counters,
                                                           present only when the probe's events
                                                           reach the watch, e.g. with --attach)
    kvdoctor:findings_total{kind,severity}                 findings raised since the watch began
    kvdoctor:processes_left_out                            live processes not exported: past the first MAX_PROCESSES

At most MAX_PROCESSES processes are exported, as `run --metrics` exports them, and a process that
exited leaves the metrics: a batch that carries the sampler's memory counters is one round over
the process tree, so a process with none in it is gone. A label value from a trace (a title, an
allocator) is written as `kvdoctor.outputs.printable` writes it, so a lone surrogate in it never
fails a scrape. The watch thread feeds events and findings in; the HTTP server (a daemon thread) only reads a
snapshot taken under a lock, so a scrape never touches the detectors. The text is rendered by
`prometheus_client` when it is installed (`pip install 'kvdoctor[export]'`), else by a small
writer of the same format here. The server binds to loopback unless told otherwise.
"""

from __future__ import annotations

import ipaddress
import math
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvdoctor.errors import KvdoctorError
from kvdoctor.outputs import printable
from kvdoctor.trace import schema
from kvdoctor.units import finite_number, short_title

DEFAULT_HOST = "127.0.0.1"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TITLE_LIMIT = 120
MAX_PROCESSES = 64  # as `run --metrics` (kvdoctor/formats/live/fleet.py): the series a scrape returns stay bounded

MEMORY_BYTES = "kvdoctor:memory_bytes"
MEMORY_GROWTH = "kvdoctor:memory_growth_bytes_per_second"
KV_SLOTS = "kvdoctor:kv_slots"
FINDINGS = "kvdoctor:findings"  # a counter: exposed as kvdoctor:findings_total
LEFT_OUT = "kvdoctor:processes_left_out"

# memory counter argument -> the `class` label
MEMORY_ARGS = {
    "rss_bytes": "rss",
    "anon_bytes": "anon",
    "shmem_bytes": "shmem",
    "file_bytes": "file",
    "swap_bytes": "swap",
    "pinned_bytes": "pinned",
    "gpu_bytes": "gpu",
}

HELP = {
    MEMORY_BYTES: "Memory of one watched process by class (rss, anon, shmem, file, swap, pinned, gpu), in bytes.",
    MEMORY_GROWTH: "Sustained growth rate of one process's memory class while a memory_growth finding stands, in bytes per second.",
    KV_SLOTS: "KV slots of one allocator by ledger state (total, free, owned, tree, ...), from the probe's counters.",
    FINDINGS: "Findings raised since the watch began, by kind and severity.",
    LEFT_OUT: f"Live processes not exported: past the first {MAX_PROCESSES}.",
}


def parse_address(text: str, *, public: bool = False, option: str = "--prometheus") -> tuple[str, int]:
    """`HOST:PORT`, `:PORT` or `PORT` -> (host, port); the host defaults to 127.0.0.1.

    A host that is not a loopback address is refused unless `public` is set: the metrics name
    processes and their command lines, which should not reach the network by accident.
    """
    raw = (text or "").strip()
    if raw.startswith("["):  # [::1]:9400
        host, _, rest = raw[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif raw.count(":") == 1 or ":" not in raw:
        host, _, port_text = raw.rpartition(":")
    else:
        raise KvdoctorError(f"cannot read the address {text!r}", "write HOST:PORT, e.g. 127.0.0.1:9400, or [::1]:9400")
    host = host or DEFAULT_HOST
    try:
        port = int(port_text)
    except ValueError:
        raise KvdoctorError(f"{option} needs a port, not {text!r}", "write HOST:PORT, e.g. 127.0.0.1:9400") from None
    if not 0 <= port <= 65535:
        raise KvdoctorError(f"{option} port {port} is out of range", "use a port from 1 to 65535 (0 picks a free one)")
    if not public and not _is_loopback(host):
        raise KvdoctorError(
            f"{option} {host} is not a loopback address; the metrics would be open to the network",
            f"use 127.0.0.1, or add {option}-public to serve on it anyway",
        )
    return host, port


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)


class MetricsState:
    """The latest value of every series, fed from the watch thread, read by the HTTP thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._titles: dict[int, str] = {}
        self._memory: dict[tuple[int, str], float] = {}
        self._kv: dict[tuple[int, str, str], float] = {}
        self._growth: dict[tuple[int, str], float] = {}
        self._seen_findings: set[tuple[Any, ...]] = set()
        self._finding_counts: dict[tuple[str, str], int] = {}
        self._exported: set[int] = set()  # the processes with series, at most MAX_PROCESSES
        self._left_out: set[int] = set()  # live processes past them

    def _takes(self, pid: int) -> bool:
        if pid in self._exported:
            return True
        if len(self._exported) < MAX_PROCESSES:
            self._exported.add(pid)
            self._left_out.discard(pid)
            return True
        if len(self._left_out) < 1 << 16:
            self._left_out.add(pid)
        return False

    def _forget_exited(self, alive: set[int]) -> None:
        for pid in self._exported - alive:
            self._exported.discard(pid)
            self._titles.pop(pid, None)
            for key in [k for k in self._memory if k[0] == pid]:
                del self._memory[key]
            for key in [k for k in self._growth if k[0] == pid]:
                del self._growth[key]
            for kv_key in [k for k in self._kv if k[0] == pid]:
                del self._kv[kv_key]
        self._left_out &= alive

    def feed(self, events: Iterable[schema.Event]) -> None:
        events = list(events)
        sampled = {e.pid for e in events if e.ph == "C" and e.name == schema.MEMORY_COUNTER}
        with self._lock:
            if sampled:  # one round over the tree: what it did not sample has exited
                self._forget_exited(sampled)
            for event in events:
                if event.ph != "C" or not self._takes(event.pid):
                    continue
                if event.name == schema.MEMORY_COUNTER:
                    args = event.args
                    title = args.get("title")
                    if isinstance(title, str) and title:
                        self._titles[event.pid] = short_title(title, TITLE_LIMIT)
                    for arg, memory_class in MEMORY_ARGS.items():
                        value = finite_number(args.get(arg))
                        if value is not None:
                            self._memory[(event.pid, memory_class)] = value
                elif event.name == schema.LEDGER_COUNTER:
                    allocator = str(event.args.get("allocator", ""))
                    for key, raw in event.args.items():
                        value = finite_number(raw)
                        if value is not None and key.endswith("_slots"):
                            self._kv[(event.pid, allocator, key[: -len("_slots")])] = value

    def set_findings(self, findings: Iterable[Any]) -> None:
        """The findings as they stand now: growth rates are replaced, counts only ever grow
        (a finding is counted once per kind, severity, pid and memory class)."""
        growth: dict[tuple[int, str], float] = {}
        with self._lock:
            for finding in findings:
                evidence = finding.evidence if isinstance(finding.evidence, dict) else {}
                memory_class = evidence.get("memory_class")
                if finding.kind == schema.MEMORY_GROWTH and isinstance(memory_class, str) and finding.pid in self._exported:
                    rate = finite_number(evidence.get("bytes_per_s"))
                    if rate is not None:
                        growth[(finding.pid, memory_class)] = rate
                key = (finding.kind, finding.severity, finding.pid, memory_class if isinstance(memory_class, str) else "")
                if key not in self._seen_findings:
                    self._seen_findings.add(key)
                    counted = (finding.kind, finding.severity)
                    self._finding_counts[counted] = self._finding_counts.get(counted, 0) + 1
            self._growth = growth

    def snapshot(self) -> list[tuple[str, str, list[tuple[dict[str, str], float]]]]:
        """[(family name, type, [(labels, value)])], in a stable order."""
        with self._lock:
            memory = [
                ({"pid": str(pid), "title": self._titles.get(pid, ""), "class": cls}, value)
                for (pid, cls), value in sorted(self._memory.items())
            ]
            growth = [({"pid": str(pid), "class": cls}, value) for (pid, cls), value in sorted(self._growth.items())]
            kv = [
                ({"pid": str(pid), "allocator": allocator, "state": state}, value)
                for (pid, allocator, state), value in sorted(self._kv.items())
            ]
            findings = [
                ({"kind": kind, "severity": severity}, float(count)) for (kind, severity), count in sorted(self._finding_counts.items())
            ]
            left_out: list[tuple[dict[str, str], float]] = [({}, float(len(self._left_out)))] if self._left_out else []
        families = [
            (MEMORY_BYTES, "gauge", memory),
            (MEMORY_GROWTH, "gauge", growth),
            (KV_SLOTS, "gauge", kv),
            (FINDINGS, "counter", findings),
        ]
        return [(name, kind, label_safe(samples)) for name, kind, samples in families] + [(LEFT_OUT, "gauge", left_out)]


def label_safe(samples: list[tuple[dict[str, str], float]]) -> list[tuple[dict[str, str], float]]:
    """The samples with every label value as `printable` writes it: a lone surrogate or a control
    byte from a trace is escaped, and the scrape's UTF-8 never fails on it."""
    return [({key: printable(str(value)) for key, value in labels.items()}, number) for labels, number in samples]


# -- rendering ------------------------------------------------------------------------------------
def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _format_value(value: float) -> str:
    if value == math.floor(value) and abs(value) < 1e15:
        return f"{value:.1f}"
    return repr(float(value))


def render_text(state: MetricsState) -> bytes:
    """The Prometheus text format (0.0.4), written by hand: used without prometheus_client."""
    lines: list[str] = []
    for name, kind, samples in state.snapshot():
        exposed = name + "_total" if kind == "counter" else name
        if not samples:
            continue
        lines.append(f"# HELP {exposed} {HELP[name]}")
        lines.append(f"# TYPE {exposed} {kind}")
        for labels, value in samples:
            label_text = ",".join(f'{key}="{_escape_label(val)}"' for key, val in labels.items())
            lines.append(f"{exposed}{{{label_text}}} {_format_value(value)}")
    return ("\n".join(lines) + "\n").encode() if lines else b""


def _client_renderer(state: MetricsState) -> Callable[[], bytes] | None:
    """A renderer backed by prometheus_client, or None when it is not installed."""
    try:
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    except ImportError:
        return None

    class _Collector:
        def collect(self) -> Iterator[Any]:
            for name, kind, samples in state.snapshot():
                if not samples:
                    continue
                labels = list(samples[0][0])
                family_type = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                family = family_type(name, HELP[name], labels=labels)
                for sample_labels, value in samples:
                    family.add_metric([sample_labels[key] for key in labels], value)
                yield family

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector())
    return lambda: generate_latest(registry)


# -- serving ---------------------------------------------------------------------------------------
class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class PrometheusExporter:
    """Serves `state` on `GET /metrics` from a daemon thread until `stop()`."""

    def __init__(self, host: str, port: int, state: MetricsState | None = None) -> None:
        self.state = state or MetricsState()
        self.host = host
        self.port = port
        self._render = _client_renderer(self.state) or (lambda: render_text(self.state))
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def start(self) -> PrometheusExporter:
        render = self._render

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path not in ("/metrics", "/"):
                    self.send_error(404, "only /metrics is served")
                    return
                try:
                    body = render()
                except Exception as exc:  # never take the watch down over a scrape
                    self.send_error(500, f"{type(exc).__name__}: {exc}")
                    return
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return

        server_class: type[_Server] = _Server6 if ":" in self.host else _Server
        try:
            self._server = server_class((self.host, self.port), Handler)
        except OSError as exc:
            raise KvdoctorError(
                f"cannot serve Prometheus metrics on {self.host}:{self.port}: {exc.strerror or exc}",
                "choose another --prometheus address (port 0 picks a free one)",
            ) from None
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.2}, name="kvdoctor-prometheus", daemon=True
        )
        self._thread.start()
        return self

    def feed(self, events: Iterable[schema.Event]) -> None:
        self.state.feed(events)

    def set_findings(self, findings: Iterable[Any]) -> None:
        self.state.set_findings(findings)

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
