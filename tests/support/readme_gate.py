"""The CI gate examples of the docs (docs/ci-gate.md), taken out of the page as they stand and run
on this CPU machine.

Each example is a `bench.sh` block (the fenced block whose first line is `# <name>`) and the
`kvdoctor gate` lines of the block after it. Only what this machine needs is changed, each change
an exact string that must be in the page (so an edit there that the test no longer matches fails
loudly, never silently runs something else): the model, the port, the server flags of a CPU with a
small pool, and fewer prompts.
"""

from __future__ import annotations

import os
import re
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = os.path.join(REPO, "docs", "ci-gate.md")  # the page the README links for its CI gate


def fenced_blocks(text: str) -> list[str]:
    return re.findall(r"```(?:bash|sh)\n(.*?)```", text, flags=re.S)


def example(first_line: str) -> tuple[str, list[str]]:
    """The script whose block starts with `first_line`, and the gate command lines after it."""
    with open(PAGE) as fh:
        blocks = fenced_blocks(fh.read())
    for index, block in enumerate(blocks):
        if block.startswith(first_line + "\n") or block.startswith(first_line + ":"):
            following = blocks[index + 1] if index + 1 < len(blocks) else ""
            gates = [line for line in following.replace("\\\n", " ").splitlines() if line.startswith("kvdoctor gate ")]
            assert gates, f"no `kvdoctor gate` line in the block after {first_line!r}"
            return block, gates
    raise AssertionError(f"docs/ci-gate.md has no block starting {first_line!r}")


def substituted(text: str, changes: dict[str, str]) -> str:
    for old, new in changes.items():
        assert old in text, f"docs/ci-gate.md's example no longer has {old!r}: update the test's substitutions with it"
        text = text.replace(old, new)
    return text


def run_gate(
    gate_line: str, script: str, workdir: str, env: dict[str, str], changes: dict[str, str], timeout_s: float = 900.0
) -> subprocess.CompletedProcess:
    """Writes the script into `workdir` under the name its first line gives (`# bench.sh: ...`) and
    runs the page's gate line there, as a CI job would (kvdoctor and the engine's python first on PATH)."""
    name = script.splitlines()[0].lstrip("# ").split(":", 1)[0]
    assert name and name in gate_line, f"the gate line does not run {name!r}: {gate_line}"
    with open(os.path.join(workdir, name), "w") as fh:
        fh.write(script)
    command = substituted(gate_line, changes)
    proc = subprocess.run(
        ["bash", "-c", command], cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout_s, start_new_session=True
    )
    for stream, text in (("gate.stdout", proc.stdout), ("gate.stderr", proc.stderr)):  # kept for a failure's reader
        with open(os.path.join(workdir, stream), "w") as fh:
            fh.write(text)
    return proc
