"""CPU dry run of sglang_19332_hicache.py (no CUDA): CUDA streams and events, pinning and host
registration are replaced by no-ops, and cuda_graph_runner (which set_kv_buffer imports on CPU) by a
one-function module. For checking the harness before spending GPU time, not for results.

    PYTHONPATH=.venv/sglang-0.5.9:tests/support:. .venv/bin/python tests/gpu/bugs/sglang_19332_cpu.py \
        --device cpu --trace /tmp/h.json --out /tmp/h.out.json --seconds 20 --long-lived-s 1
"""

import contextlib
import runpy
import sys
import types

import torch


class Ev:
    def record(self, *a):
        pass

    def query(self):
        return True

    def synchronize(self):
        pass

    def wait(self, *a):
        pass


class St:
    def wait_event(self, e):
        pass


class St2(St):
    def __init__(self, *a, **k):
        pass


torch.cuda.Stream = St2


class Ev2(Ev):
    def __init__(self, *a, **k):
        pass


torch.cuda.Event = Ev2
torch.cuda.stream = lambda s: contextlib.nullcontext()
torch.cuda.current_stream = lambda *a: St()
_empty = torch.empty


def empty(*a, **k):
    k.pop("pin_memory", None)
    return _empty(*a, **k)


torch.empty = empty


class _RT:
    def cudaHostRegister(self, *a):
        return 0

    def cudaHostUnregister(self, *a):
        return 0


torch.cuda.cudart = lambda: _RT()
_m = types.ModuleType("sglang.srt.model_executor.cuda_graph_runner")
_m.get_is_capture_mode = lambda: False
sys.modules[_m.__name__] = _m
sys.argv = ["x"] + sys.argv[1:]
runpy.run_path(__import__("os").path.join(__import__("os").path.dirname(__file__), "sglang_19332_hicache.py"), run_name="__main__")
