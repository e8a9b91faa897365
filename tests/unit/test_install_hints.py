"""Every `pip install 'kvdoctor[EXTRA]'` kvdoctor tells a user names an extra pyproject.toml has, and
the extras a user would guess for the optional parts are there."""

import os
import re

from conftest import REPO

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib


def _extras() -> set[str]:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as fh:
        return set(tomllib.load(fh)["project"]["optional-dependencies"])


def test_every_install_hint_names_an_extra_that_exists():
    named = {}
    for folder, _dirs, files in os.walk(os.path.join(REPO, "kvdoctor")):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                for extra in re.findall(r"kvdoctor\[([a-z0-9_,-]+)\]", open(path).read()):
                    named.setdefault(extra, os.path.relpath(path, REPO))
    assert named, "no hint found: the pattern no longer matches how hints are written"
    missing = {extra: where for extra, where in named.items() if not set(extra.split(",")) <= _extras()}
    assert not missing, missing


def test_the_extras_are_named_as_users_guess_them():
    assert {"export", "memray", "gpu", "fast", "dev"} <= _extras()
