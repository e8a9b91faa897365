"""A planted KV-block leak for the vLLM tests: put this folder on PYTHONPATH (after kvdoctor's
inject folder, whose sitecustomize chains here) and vLLM's `BlockPool.free_blocks` skips exactly
one call: the Nth call that returns at least one block (N from KVDOCTOR_TEST_SKIP_FREE). The
skipped blocks keep their reference and are never freed, as when a code path forgets to return a
finished request's blocks. What was skipped is written as JSON to KVDOCTOR_TEST_FAULT_OUT so the
test knows the exact count.

The wrapper is installed when vllm.v1.core.block_pool is imported, around whatever is there then
(kvdoctor's hook included), so the probe sees the call as the host made it: never.
"""

import importlib.abc
import json
import os
import sys
import threading

_N = int(os.environ.get("KVDOCTOR_TEST_SKIP_FREE", "0") or 0)
_OUT = os.environ.get("KVDOCTOR_TEST_FAULT_OUT", "")
_MODULE = "vllm.v1.core.block_pool"


def _patch(module):
    cls = getattr(module, "BlockPool", None)
    if cls is None or getattr(cls.free_blocks, "__planted_fault__", False):
        return
    original = cls.free_blocks
    lock = threading.Lock()
    seen = [0]

    def free_blocks(self, ordered_blocks):
        blocks = list(ordered_blocks)
        real = [b for b in blocks if not getattr(b, "is_null", False)]
        if real:
            with lock:
                seen[0] += 1
                skip = seen[0] == _N
            if skip:
                ids = sorted({b.block_id for b in real})
                if _OUT:
                    with open(_OUT, "w") as fh:
                        json.dump(
                            {
                                "call": _N,
                                "blocks": len(ids),
                                "block_ids": ids,
                                "hash_block_size": getattr(self, "hash_block_size", None),
                                "pid": os.getpid(),
                            },
                            fh,
                        )
                return None
        return original(self, blocks)

    free_blocks.__planted_fault__ = True
    cls.free_blocks = free_blocks


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    """Asks the finders after it (kvdoctor's among them, which asks the others in turn, this one
    included: the guard answers None to that inner question) and wraps the loader found."""

    def __init__(self):
        self.busy = threading.local()

    def find_spec(self, fullname, path, target=None):
        if fullname != _MODULE or getattr(self.busy, "on", False):
            return None
        self.busy.on = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                        spec.loader = _Loader(spec.loader)
                    return spec
        finally:
            self.busy.on = False
        return None


if _N > 0:
    if _MODULE in sys.modules:
        _patch(sys.modules[_MODULE])
    else:
        sys.meta_path.insert(0, _Finder())
