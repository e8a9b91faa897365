"""sgl_kernel.utils stand-in (bench/gpu/server_standins/sgl_kernel_bodies.py says why)."""


def is_arch_support_pdl():
    return False


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    from sgl_kernel import _Placeholder

    return _Placeholder()
