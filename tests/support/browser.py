"""Headless Chromium (Debian's package, installed by .ci/setup) for tests that look at what we draw."""

import subprocess

CHROMIUM = "/usr/bin/chromium"


def chromium(tmp_path, *args):
    """One headless Chromium run on a fresh profile; returns stdout. Virtual time makes it return once
    the page has loaded and laid out (the report has no scripts), without wall-clock waits."""
    profile = tmp_path / f"profile-{len(list(tmp_path.glob('profile-*')))}"
    proc = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            "--force-device-scale-factor=1",
            "--virtual-time-budget=5000",
            f"--user-data-dir={profile}",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout
