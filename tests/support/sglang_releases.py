"""The SGLang releases of the release matrix (`probes/releases.toml`, status "tested"), each in its
own folder under .venv/sglang-releases/ that a test puts first on PYTHONPATH.

    python tests/support/sglang_releases.py install   # what .ci/setup runs (idempotent)
    python tests/support/sglang_releases.py list      # the releases, one per line

Each folder holds the release's wheel (--no-deps) and, where its own transformers pin differs from
the environment's enough to break its imports, that transformers with a tokenizers and
huggingface-hub it accepts. 0.5.23 is the environment's own SGLang and needs no folder.
"""

from __future__ import annotations

import os
import subprocess
import sys

import tomllib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FOLDER = os.path.join(REPO, ".venv", "sglang-releases")
INSTALLED = "0.5.23"  # installed into .venv itself by .ci/setup
BESIDE_TRANSFORMERS = ["tokenizers==0.22.2", "huggingface_hub==1.33.0"]


def tested() -> dict[str, dict]:
    with open(os.path.join(REPO, "probes", "releases.toml"), "rb") as fh:
        table = tomllib.load(fh)["sglang"]
    return {v: e for v, e in table.items() if e.get("status") == "tested"}


def folder(version: str) -> str:
    return os.path.join(FOLDER, version)


def install() -> None:
    for version, entry in tested().items():
        target = folder(version)
        stamp = os.path.join(target, ".kvdoctor-complete")
        if version == INSTALLED or os.path.exists(stamp):
            continue
        specs = [f"sglang=={version}"]
        if entry.get("transformers"):
            specs += [f"transformers=={entry['transformers']}", *BESIDE_TRANSFORMERS]
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", "--upgrade"]
        subprocess.run([*cmd, "--target", target, *specs], check=True)
        open(stamp, "w").close()
        print(f"sglang-releases: {version} installed", flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["install"]:
        install()
    elif sys.argv[1:] == ["list"]:
        print("\n".join(tested()))
    else:
        sys.exit(__doc__)
