"""A root attach to another user's process gives that user nothing of root's.

When root attaches to a server that runs as another user, gdb runs as root and reads its command
file (whose `shell` lines it runs) from the attach's work directory. That user must never be able
to put a file there: the attack is to rename a file of their own over the command file between
kvdoctor writing it and gdb reading it. The tests run the attack as a real unprivileged user
(`nobody`) at exactly that moment, through a `gdb` on PATH that first lets the attacker act and
then hands over to the real gdb (where there is one), so it does not depend on winning a race.
They skip only where no second user can be had (not root, no `nobody`, or no system Python for it).
"""

from __future__ import annotations

import json
import os
import pathlib
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from kvdoctor.delivery.attach_guard import EXCHANGE, PROBE_TOKEN, STATUS
from kvdoctor.delivery.attach_inject import CancelSignals, Injection

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SYSTEM_PYTHON = "/usr/bin/python3"
TARGET_CODE = "import time\nprint('ready', flush=True)\nwhile True:\n    x = [0] * 10\n    time.sleep(0.01)\n"


def _other_user() -> int:
    if os.geteuid() != 0:
        pytest.skip("needs root: the case is root attaching to another user's process")
    if not os.path.exists(SYSTEM_PYTHON):
        pytest.skip(f"no {SYSTEM_PYTHON} to run a process as another user")
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        pytest.skip("no second user (nobody) on this machine")


@pytest.fixture
def target():
    uid = _other_user()
    proc = subprocess.Popen([SYSTEM_PYTHON, "-c", TARGET_CODE], user=uid, cwd="/", stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield proc.pid, uid
    finally:
        proc.kill()
        proc.wait()


def _as_user(uid: int, code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SYSTEM_PYTHON, "-I", "-c", code], user=uid, cwd="/", capture_output=True, text=True, timeout=60)


def test_the_target_user_can_write_only_the_exchange_and_read_only_the_script(target):
    """The layout the probe needs, as the target's user sees it: the script readable, the token
    renameable and the status writable in the exchange, and nothing at all writable beside gdb's files."""
    pid, uid = target
    with CancelSignals() as cancel, Injection(pid, None, cancel) as injection:
        script = injection.path("inject.py")
        with open(script, "w") as fh:
            fh.write("print('hello')\n")
        os.chmod(script, 0o644)
        with open(injection.path("attach.gdb"), "w") as fh:
            fh.write("p 1\n")
        with open(injection.exchange_path(PROBE_TOKEN), "w"):
            pass
        assert injection.exchange == os.path.join(injection.workdir, EXCHANGE)
        assert os.stat(injection.workdir).st_uid == 0 and stat.S_IMODE(os.stat(injection.workdir).st_mode) == 0o711
        probe_side = _as_user(
            uid,
            textwrap.dedent(
                f"""
                import os
                print("script", open({script!r}).read().strip())
                os.rename({injection.exchange_path(PROBE_TOKEN)!r}, {injection.exchange_path(PROBE_TOKEN + ".taken")!r})
                with open({injection.exchange_path(STATUS)!r}, "w") as fh:
                    fh.write('{{"ok": true}}')
                print("exchange ok")
                for attempt in ("create", "replace"):
                    try:
                        if attempt == "create":
                            open({os.path.join(injection.workdir, "mine")!r}, "w").close()
                        else:
                            os.rename({injection.exchange_path(STATUS)!r}, {injection.path("attach.gdb")!r})
                        print(attempt, "allowed")
                    except PermissionError:
                        print(attempt, "refused")
                try:
                    os.listdir({injection.workdir!r})
                    print("list allowed")
                except PermissionError:
                    print("list refused")
                """
            ),
        )
        assert probe_side.returncode == 0, probe_side.stderr
        assert probe_side.stdout.split("\n")[:5] == [
            "script print('hello')",
            "exchange ok",
            "create refused",
            "replace refused",
            "list refused",
        ]
        assert open(injection.path("attach.gdb")).read() == "p 1\n"
    assert not os.path.exists(injection.workdir)  # the guard removed both directories


FAKE_GDB = textwrap.dedent(
    """\
    #!{python} -I
    # Stands where gdb is looked up: lets the target's user attack the work directory at the moment
    # between kvdoctor writing gdb's command file and gdb reading it, then runs the real gdb.
    import json, os, sys
    uid, gid, evil_dir, pwned, report, real_gdb = {uid}, {gid}, {evil_dir!r}, {pwned!r}, {report!r}, {real_gdb!r}
    workdir = os.getcwd()
    script = next((a for a in sys.argv if a.endswith(".gdb")), "attach.gdb")
    pid = os.fork()
    if pid == 0:
        os.setgroups([]); os.setgid(gid); os.setuid(uid)
        results = {{}}
        evil = os.path.join(evil_dir, "evil.gdb")
        with open(evil, "w") as fh:
            fh.write("shell id -u > " + pwned + "\\n")
        for name in (script, "gdb-armed"):
            try:
                os.rename(evil, os.path.join(workdir, name))
                results[name] = "replaced"
                break
            except OSError as exc:
                results[name] = type(exc).__name__
        try:
            os.chmod(workdir, 0o777)
            results["chmod"] = "allowed"
        except OSError as exc:
            results["chmod"] = type(exc).__name__
        with open(report, "w") as fh:
            json.dump(results, fh)
        os._exit(0)
    os.waitpid(pid, 0)
    if real_gdb:
        os.execv(real_gdb, [real_gdb] + sys.argv[1:])
    for line in open(script):  # no gdb here: run the script's top-level shell lines as gdb would
        if line.startswith("shell "):
            os.system(line[len("shell "):])
    print("no gdb on this machine")
    sys.exit(1)
    """
)


def test_a_root_attach_runs_nothing_the_target_user_wrote(target, tmp_path, request):
    pid, uid = target
    evil_dir = tempfile.mkdtemp(prefix="kvdoctor-test-attacker-")  # the attacker's own, beside the attach's directory
    os.chown(evil_dir, uid, -1)
    request.addfinalizer(lambda: shutil.rmtree(evil_dir, ignore_errors=True))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    pwned, report = tmp_path / "pwned", pathlib.Path(evil_dir) / "attack.json"
    fake = bin_dir / "gdb"
    fake.write_text(
        FAKE_GDB.format(
            python=SYSTEM_PYTHON,
            uid=uid,
            gid=pwd.getpwuid(uid).pw_gid,
            evil_dir=evil_dir,
            pwned=str(pwned),
            report=str(report),
            real_gdb=shutil.which("gdb") or "",
        )
    )
    fake.chmod(0o755)
    if sys.version_info >= (3, 14):
        pytest.skip("Python 3.14 attaches with sys.remote_exec: no gdb command file")
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}")
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "kvdoctor", "attach", str(pid), "--trace", str(tmp_path / "t.kvtrace.json")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.exists(), f"the attacker never ran ({time.monotonic() - started:.0f} s): {out.stderr}"
    attack = json.loads(report.read_text())
    assert "replaced" not in attack.values(), attack
    assert attack["chmod"] == "PermissionError", attack
    assert not pwned.exists(), f"root ran the target user's command file: {pwned.read_text()}"
    assert "Traceback" not in out.stderr, out.stderr
    if out.returncode == 0:  # a gdb that can call functions here: the probe went in as that user, as before
        assert "probe attached" in out.stderr
