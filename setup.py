"""The native path: one extension, `kvdoctor.probe.native._native`, from the C units in
kvdoctor/probe/native/csrc/ (module.c says what each does). Optional: where it does not build, the
package installs without it and the probe runs its pure-Python path, and says so: the build's
failure is kept beside the package (BUILD_ERROR_NOTE) for the probe to name."""

import os
import re

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
UNITS = "kvdoctor/probe/native/csrc"
SOURCES = [
    f"{UNITS}/module.c",
    f"{UNITS}/generic.c",
    f"{UNITS}/slot_ops.c",
    f"{UNITS}/tree_ops.c",
    f"{UNITS}/row_ops.c",
    f"{UNITS}/context.c",
    f"{UNITS}/ledger.c",
    f"{UNITS}/tensors.c",
    f"{UNITS}/callsites.c",
    f"{UNITS}/lock.c",
    f"{UNITS}/launch.c",
]
BUILD_ERROR_NOTE = "_native.build-error"  # read by kvdoctor/probe/native/loader.py
# Installed beside the packages (site-packages), so every interpreter of that environment reads it
# at start-up, as coverage.py's hook does: it costs one environment lookup, and only where
# `kvdoctor run`/`gate` set KVDOCTOR_AUTOPROBE does it load kvdoctor/probe/core/entry.py, which turns
# the probe on when an engine is imported (a server script that replaced PYTHONPATH keeps it).
AUTOPROBE_PTH = "kvdoctor-autoprobe.pth"
AUTOPROBE_LINE = (
    "import os; os.environ.get('KVDOCTOR_AUTOPROBE') and exec('try:\\n import kvdoctor.probe.core.entry\\nexcept Exception:\\n pass')\n"
)


class BuildPyWithHook(build_py):
    """build_py that also writes the start-up hook at the top of the build, where a wheel's
    top-level files come from."""

    def run(self) -> None:
        super().run()
        with open(os.path.join(self.build_lib, AUTOPROBE_PTH), "w") as fh:
            fh.write(AUTOPROBE_LINE)


class BuildNative(build_ext):
    """build_ext that leaves a note where the extension would have gone when its build fails (and
    removes it when the build succeeds), in the build output and, for an in-place or editable
    build, in the source package."""

    def run(self) -> None:
        self._in_place = bool(self.inplace)
        super().run()

    def build_extension(self, ext: Extension) -> None:
        notes = [os.path.join(os.path.dirname(self.get_ext_fullpath(ext.name)), BUILD_ERROR_NOTE)]
        if getattr(self, "_in_place", False):
            notes.append(os.path.join(HERE, "kvdoctor", "probe", "native", BUILD_ERROR_NOTE))
        try:
            super().build_extension(ext)
        except Exception as exc:  # the compiler's or the linker's failure: optional=True goes on without it
            _write_notes(notes, _summary(exc))
            raise
        _write_notes(notes, None)


def _summary(exc: Exception) -> str:
    """`gcc exited with status 1 on kvdoctor/probe/native/csrc/tensors.c`, not the whole command line."""
    found = re.search(r"Command '\[(.*)\]' returned non-zero exit status (\d+)", str(exc))
    missing = re.search(r"No such file or directory: '([^']+)'", str(exc))
    if found is None and missing is not None:
        return f"no C compiler: {missing.group(1)} is not installed; install gcc or clang, then kvdoctor again"
    if found is None:
        return f"{type(exc).__name__}: {exc}"
    words = [w.strip("'\" ") for w in found.group(1).split(", ")]
    source = next((w for w in words if w.endswith(".c")), "")
    return f"{words[0]} exited with status {found.group(2)}" + (f" on {source}" if source else " linking it")


def _write_notes(paths: list, text: str | None) -> None:
    for path in paths:
        try:
            if text is None:
                if os.path.exists(path):
                    os.remove(path)
            else:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w") as fh:
                    fh.write(text.strip().splitlines()[0] if text.strip() else "the build failed")
        except OSError:
            pass  # a read-only tree: the probe then says "not built"


setup(
    ext_modules=[
        Extension(
            "kvdoctor.probe.native._native",
            SOURCES,
            depends=[f"{UNITS}/native.h"],
            optional=True,
            # hidden: the units share symbols with each other, not with the host's libraries
            extra_compile_args=["-O2", "-std=c11", "-fvisibility=hidden"],
            libraries=["dl"],  # launch.c finds libcuda's cuLaunchKernel at its first call
        )
    ],
    cmdclass={"build_ext": BuildNative, "build_py": BuildPyWithHook},
)
