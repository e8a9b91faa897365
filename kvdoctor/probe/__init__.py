"""The in-process probe. Runs inside the serving process: it keeps ledgers and emits events.

Nothing here imports kvdoctor's analysis, reporters or CLI (an import-linter contract in
pyproject.toml, run by .ci/lint, enforces it), never prints, and never lets its own failure reach
the host's call.
"""
