"""The compiled hot path: one extension, `kvdoctor.probe._hotpath`, from the C units in
kvdoctor/probe/csrc/ (module.c says what each does). Optional: where it does not build, the
package installs without it and the probe runs its pure-Python path."""

from setuptools import Extension, setup

UNITS = "kvdoctor/probe/csrc"
SOURCES = [
    f"{UNITS}/module.c",
    f"{UNITS}/generic.c",
    f"{UNITS}/sglang_paths.c",
    f"{UNITS}/ledger.c",
    f"{UNITS}/tensors.c",
    f"{UNITS}/callsites.c",
    f"{UNITS}/lock.c",
]

setup(
    ext_modules=[
        Extension(
            "kvdoctor.probe._hotpath",
            SOURCES,
            depends=[f"{UNITS}/hotpath.h"],
            optional=True,
            # hidden: the units share symbols with each other, not with the host's libraries
            extra_compile_args=["-O2", "-std=c11", "-fvisibility=hidden"],
        )
    ]
)
