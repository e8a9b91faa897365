"""Serving a run's ledgers (kvdoctor.formats.live.fleet) on `/metrics` with prometheus_client, fed by
following the run's trace from a thread of the `kvdoctor run` / `attach` process."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from kvdoctor.errors import KvdoctorError
from kvdoctor.formats.live.fleet import FleetState
from kvdoctor.formats.live.prometheus import parse_address
from kvdoctor.trace import schema
from kvdoctor.trace.reader import TraceTail

FOLLOW_INTERVAL_S = 0.5  # how often the trace is read for new lines: a census reaches /metrics this much later at most
FOLLOWED = frozenset(
    {
        schema.HEADER,
        schema.MEMORY_COUNTER,
        schema.MEMORY_CLASSES,
        schema.LEDGER_COUNTER,
        schema.CENSUS,
        schema.VIOLATION,
        schema.PROBE_STATUS,
        schema.HICACHE_COUNTER,
        schema.L3_COUNTER,
    }
)


class _Collector:
    """prometheus_client's view of a FleetState: the families are built at each scrape."""

    def __init__(self, state: FleetState) -> None:
        self.state = state

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for name, kind, help_text, samples in self.state.families():
            family_type = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            labels = list(samples[0][0]) if samples else []
            family = family_type(name, help_text, labels=labels)
            for sample_labels, value in samples:
                family.add_metric([sample_labels[key] for key in labels], value)
            yield family


class FleetExporter:
    """Follows `trace_path` into a FleetState and serves it on `http://HOST:PORT/metrics` until `stop()`."""

    def __init__(self, address: str, trace_path: str, *, public: bool = False) -> None:
        self.host, self.port = parse_address(address, public=public, option="--metrics")
        self.state = FleetState()
        self.tail = TraceTail(trace_path, names=FOLLOWED)
        self._stop = threading.Event()
        self._server: Any = None
        self._follower: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def start(self) -> FleetExporter:
        try:
            from prometheus_client import CollectorRegistry, start_http_server
        except ImportError:
            raise KvdoctorError("--metrics needs prometheus_client", "pip install 'kvdoctor[export]'") from None
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(self.state))
        try:
            self._server, _thread = start_http_server(self.port, self.host, registry)
        except OSError as exc:
            raise KvdoctorError(
                f"cannot serve metrics on {self.host}:{self.port}: {exc.strerror or exc}",
                "choose another --metrics address (port 0 picks a free one)",
            ) from None
        self.port = int(self._server.server_address[1])
        self._follower = threading.Thread(target=self._follow, name="kvdoctor-metrics-follow", daemon=True)
        self._follower.start()
        return self

    def _follow(self) -> None:
        while True:
            self.poll()
            if self._stop.wait(FOLLOW_INTERVAL_S):
                self.poll()  # what the run wrote last
                return

    def poll(self) -> None:
        """Reads what the trace gained since the last poll into the state."""
        try:
            while True:
                events = self.tail.poll()
                if not events:
                    return
                self.state.feed(events)
        except Exception:
            return  # the metrics never take the run down with them

    def stop(self) -> None:
        self._stop.set()
        if self._follower is not None:
            self._follower.join(timeout=5.0)
            self._follower = None
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
