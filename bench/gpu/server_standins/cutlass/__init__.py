"""Inert stand-in for `cutlass` (NVIDIA's CuTe DSL, nvidia-cutlass-dsl), absent on the device machine.

SGLang 0.5.23's `sglang/kernels/ops/gemm/cutedsl_dual_gemm.py` imports it unconditionally, and
`layers/dual_gemm.py` imports that module for every Llama MLP on CUDA; its kernel is Blackwell's
(tcgen05), and `can_use_dual_gemm` answers False off SM100, so on an H200 nothing of it runs. Here
every name resolves at import to a placeholder: used as a decorator it hands the function back, and
any other call gives another placeholder. No code of the CuTe DSL runs; nothing of kvdoctor's path
goes near it.
"""

import importlib.abc
import importlib.machinery
import sys
import types


class _Placeholder:
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder()

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]) and not isinstance(args[0], _Placeholder):
            return args[0]  # a decorator: the function itself
        return _Placeholder()

    def __mro_entries__(self, bases):
        return (object,)

    def __getitem__(self, item):
        return _Placeholder()


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder()


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.startswith("cutlass."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = __getattr__
        return module

    def exec_module(self, module):
        pass


sys.meta_path.append(_Finder())
