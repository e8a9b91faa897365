"""The compiled hot path (kvdoctor/probe/_hotpath.c). Optional: where it does not build, the
package installs without it and the probe runs its pure-Python path."""

from setuptools import Extension, setup

setup(
    ext_modules=[Extension("kvdoctor.probe._hotpath", ["kvdoctor/probe/_hotpath.c"], optional=True, extra_compile_args=["-O2", "-std=c11"])]
)
