"""The in-process probe. Runs inside the serving process: it keeps ledgers and emits events.

Nothing here imports kvdoctor's analysis, reporters or CLI (tests/test_layers.py enforces it),
never prints, and never lets its own failure reach the host's call.
"""
