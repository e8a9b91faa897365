"""What a fleet's monitoring takes from kvdoctor: Prometheus alert and recording rules
(`alerts.yml`, over the series `kvdoctor run --metrics` serves) and a Grafana dashboard
(`dashboard.json`). Data only; `rules_path()` and `dashboard_path()` say where they are installed."""

from __future__ import annotations

import os

HERE = os.path.dirname(os.path.abspath(__file__))


def rules_path() -> str:
    return os.path.join(HERE, "alerts.yml")


def dashboard_path() -> str:
    return os.path.join(HERE, "dashboard.json")
