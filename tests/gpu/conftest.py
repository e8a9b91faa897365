"""Every test here runs on a CUDA device; without one each is skipped, saying so. A test that needs
an SGLang release is skipped, saying which and where it was looked for, where that release is not
installed (`bash tests/gpu/run.sh` installs the carried wheels first)."""

from __future__ import annotations

import pytest

from . import runs


@pytest.fixture(scope="session", autouse=True)
def _needs_cuda() -> None:
    """Session-wide, so that it is decided before any fixture of a narrower scope starts a check."""
    reason = runs.cuda_missing()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def sglang_env():
    """`sglang_env(release)`: the environment of a check process that imports that SGLang release;
    the test is skipped, saying where it was looked for, where it is not installed."""

    def env_or_skip(release: str) -> dict:
        env, reason = runs.release_env(release)
        if reason:
            pytest.skip(reason)
        return env

    return env_or_skip
