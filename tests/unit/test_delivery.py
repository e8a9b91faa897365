"""What `run` puts on PYTHONPATH: the folder holding the sitecustomize alone (any other module in it
would shadow one of the server's own imports), first, and kept first when the host had its own."""

from __future__ import annotations

import os

from kvdoctor.delivery import launch


def test_the_folder_on_pythonpath_holds_the_sitecustomize_alone() -> None:
    names = sorted(n for n in os.listdir(launch.INJECT_DIR) if n != "__pycache__")
    assert names == ["sitecustomize.py"], names


def test_the_probes_environment_puts_that_folder_first(tmp_path) -> None:
    trace = str(tmp_path / "t.kvtrace.json")
    env = launch.probe_environment(trace, [], base={"PYTHONPATH": "/srv/app"})
    assert env["PYTHONPATH"].split(os.pathsep) == [launch.INJECT_DIR, "/srv/app"]
    assert os.path.isfile(os.path.join(env["PYTHONPATH"].split(os.pathsep)[0], "sitecustomize.py"))
