"""Debian's real Prometheus (2.42) and Alertmanager (0.25), unpacked by .ci/setup-tests into
.venv/prometheus-sysroot, started on loopback with kvdoctor's shipped rules (kvdoctor/fleet/alerts.yml)
and short scrape and evaluation intervals, for the fleet tests."""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.parse
import urllib.request
from datetime import datetime, timezone
from typing import Any

from servers import REPO, free_port

SYSROOT_ROOT = os.path.join(REPO, ".venv", "prometheus-sysroot")
SYSROOT = os.path.join(SYSROOT_ROOT, "usr", "bin")
PROMETHEUS = os.path.join(SYSROOT, "prometheus")
ALERTMANAGER = os.path.join(SYSROOT, "prometheus-alertmanager")
PROMTOOL = os.path.join(SYSROOT, "promtool")
RULES = os.path.join(REPO, "kvdoctor", "fleet", "alerts.yml")
DASHBOARD = os.path.join(REPO, "kvdoctor", "fleet", "dashboard.json")
SCRAPE_INTERVAL_S = 1


# Debian's Alertmanager reads its default notification templates from /usr/share/prometheus/alertmanager
# (a path built into it) and exits without them. It runs in a mount namespace of its own where the
# package's /usr/share, unpacked beside the binaries, lies over the machine's (an overlay that no
# other process sees); nothing is installed on the machine.
IN_OWN_SHARE = [
    "unshare",
    *([] if os.getuid() == 0 else ["--user", "--map-root-user"]),
    "--mount",
    "--propagation",
    "private",
    "sh",
    "-c",
    'mount -t overlay overlay -o lowerdir="$0"/usr/share:/usr/share /usr/share && exec "$@"',
    SYSROOT_ROOT,
]


def available() -> str:
    """'' when the binaries are here and Alertmanager can be given its templates, else why not."""
    missing = [p for p in (PROMETHEUS, ALERTMANAGER, PROMTOOL) if not os.access(p, os.X_OK)]
    if missing:
        return f"{missing[0]} is missing: run .ci/setup-tests (it unpacks Debian's prometheus and prometheus-alertmanager there)"
    try:
        probe = subprocess.run(
            [*IN_OWN_SHARE, "test", "-f", "/usr/share/prometheus/alertmanager/default.tmpl"], capture_output=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot give Alertmanager its templates in a mount namespace of its own (unshare): {exc}"
    if probe.returncode != 0:
        return f"cannot give Alertmanager its templates in a mount namespace of its own (unshare, overlay): {probe.stderr.decode()[-300:]}"
    return ""


def _get(url: str, timeout_s: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return json.loads(resp.read())


class Stack:
    """Prometheus scraping `target` (HOST:PORT) every second with the shipped rules, sending its
    alerts to an Alertmanager beside it; both write only under `workdir`."""

    def __init__(self, workdir: str, target: str) -> None:
        self.workdir = workdir
        self.target = target
        self.prometheus_port = free_port()
        self.alertmanager_port = free_port()
        self.prometheus_url = f"http://127.0.0.1:{self.prometheus_port}"
        self.alertmanager_url = f"http://127.0.0.1:{self.alertmanager_port}"
        self.procs: list[subprocess.Popen] = []
        self.logs: list[Any] = []

    def start(self, timeout_s: float = 60.0) -> Stack:
        am_config = os.path.join(self.workdir, "alertmanager.yml")
        with open(am_config, "w") as fh:
            fh.write("route:\n  receiver: none\n  group_wait: 0s\nreceivers:\n  - name: none\n")
        config = os.path.join(self.workdir, "prometheus.yml")
        with open(config, "w") as fh:
            fh.write(
                f"global:\n  scrape_interval: {SCRAPE_INTERVAL_S}s\n  evaluation_interval: {SCRAPE_INTERVAL_S}s\n"
                f"rule_files:\n  - {RULES}\n"
                f"alerting:\n  alertmanagers:\n    - static_configs:\n        - targets: ['127.0.0.1:{self.alertmanager_port}']\n"
                f"scrape_configs:\n  - job_name: kvdoctor\n    static_configs:\n      - targets: ['{self.target}']\n"
            )
        self._spawn(
            "alertmanager",
            [
                *IN_OWN_SHARE,
                ALERTMANAGER,
                f"--config.file={am_config}",
                f"--storage.path={os.path.join(self.workdir, 'am-data')}",
                f"--web.listen-address=127.0.0.1:{self.alertmanager_port}",
                "--cluster.listen-address=",
            ],
        )
        self._spawn(
            "prometheus",
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={os.path.join(self.workdir, 'prom-data')}",
                f"--web.listen-address=127.0.0.1:{self.prometheus_port}",
                "--web.enable-lifecycle",
            ],
        )
        deadline = time.monotonic() + timeout_s
        for url in (self.alertmanager_url + "/-/ready", self.prometheus_url + "/-/ready"):
            while True:
                try:
                    with urllib.request.urlopen(url, timeout=2) as resp:
                        if resp.status == 200:
                            break
                except OSError:
                    pass
                if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                    self.stop()
                    raise RuntimeError(f"{url} not ready; logs in {self.workdir}")
                time.sleep(0.2)
        return self

    def _spawn(self, name: str, command: list[str]) -> None:
        log = open(os.path.join(self.workdir, name + ".log"), "wb")
        self.logs.append(log)
        self.procs.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir))

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for log in self.logs:
            log.close()
        self.procs, self.logs = [], []

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector of `expr` (raises on a query Prometheus cannot parse)."""
        body = _get(self.prometheus_url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def firing(self) -> list[dict[str, Any]]:
        """Prometheus's own alerts that are firing (pending ones left out)."""
        return [a for a in _get(self.prometheus_url + "/api/v1/alerts")["data"]["alerts"] if a["state"] == "firing"]

    def alertmanager_alerts(self) -> list[dict[str, Any]]:
        """What Alertmanager's API (v2) lists as received."""
        return list(_get(self.alertmanager_url + "/api/v2/alerts"))

    def targets_up(self) -> bool:
        return any(r["value"][1] == "1" for r in self.query('up{job="kvdoctor"}'))

    def server_time(self) -> float:
        """Prometheus's own clock: a query's evaluation time."""
        body = _get(self.prometheus_url + "/api/v1/query?" + urllib.parse.urlencode({"query": "time()"}))
        return float(body["data"]["result"][0])

    def evaluated_after(self, moment: float) -> bool:
        """Whether every rule group was evaluated after `moment` (Prometheus's clock)."""
        groups = _get(self.prometheus_url + "/api/v1/rules")["data"]["groups"]
        return bool(groups) and all(_rfc3339(g["lastEvaluation"]) > moment for g in groups)


def _rfc3339(text: str) -> float:
    """Prometheus's RFC 3339 times (nanoseconds, Z) as seconds since the epoch."""
    head, _, rest = text.rstrip("Z").partition(".")
    fraction = float("0." + rest[:9]) if rest else 0.0
    return datetime.strptime(head, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc).timestamp() + fraction
