"""Every path by which slots change hands, on SGLang's real allocators: free groups (frees held
until the group ends), staged/release pages with need_sort, merge_and_sort_free, free_segment,
free_page_ids, clear, and the tree's reset."""

import json
import subprocess
import sys
import warnings

import pytest
from conftest import REPO, sglang_env

warnings.filterwarnings("ignore")

SCRIPT = r"""
import json, sys, tempfile, warnings
warnings.filterwarnings("ignore")
import torch
from kvdoctor.probe.core import runtime
from kvdoctor.probe.engines.sglang.state import sglang_state
from kvdoctor.probe.base.vocabulary import FREE, OWNED
path = tempfile.mktemp(suffix=".json")
probe = runtime.activate(path)
try:
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
except ImportError:
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator, PagedTokenToKVPoolAllocator
out = {}

def state(alloc, slots):
    led = sglang_state(probe).ledger_for(alloc)
    return [int(led.state[s // led.page_size]) for s in slots]

for need_sort in (False, True):
    a = TokenToKVPoolAllocator(64, dtype=torch.float16, device="cpu", kvcache=None, need_sort=need_sort)
    x = a.alloc(8)
    a.free_group_begin()
    a.free(x[:4])
    a.free(x[4:])
    mid = state(a, x.tolist())                       # still owned: the group holds the frees
    a.free_group_end()
    end = state(a, x.tolist())
    a.free(x[:2])                                    # a double free, outside any group
    y = a.alloc(60)                                  # needs the released pages: merge_and_sort_free
    a.clear()
    out[f"token-sort{int(need_sort)}"] = {"mid": mid, "end": end, "after_clear": state(a, [1, 2, 63])}

if hasattr(PagedTokenToKVPoolAllocator, "free_page_ids"):  # 0.5.23
    p = PagedTokenToKVPoolAllocator(64, 4, dtype=torch.float16, device="cpu", kvcache=None, need_sort=True)
    x = p.alloc(16)
    p.free_group_begin()
    p.free_page_ids(x[::4][:2] // 4)                 # pages staged in the group
    p.free_segment(x[8:16], start_pos=8)
    mid = state(p, x.tolist())
    p.free_group_end()
    end = state(p, x.tolist())
    p.free_page_ids(x[:1] // 4)                      # page freed twice: counts page_size slots
    p.merge_and_sort_free()
    out["paged"] = {"mid": mid, "end": end}
runtime.deactivate()
from kvdoctor.analysis.analyzer import analyze
from kvdoctor.trace.reader import iter_events
out["findings"] = [[f.kind, f.count] for f in analyze(iter_events(path)).errors]
print("RESULT " + json.dumps(out))
"""

OWNED, FREE = 2, 1


def run(version):
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=sglang_env(version), cwd=REPO, timeout=300)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    return json.loads(line[-1][7:])


@pytest.mark.parametrize("version", ["0.5.23", "0.5.9"])
def test_free_groups_staging_and_clear(version):
    out = run(version)
    for key in ("token-sort0", "token-sort1"):
        assert out[key]["mid"] == [OWNED] * 8  # frees inside a group are not frees yet
        assert out[key]["end"] == [FREE] * 8
        assert out[key]["after_clear"] == [FREE] * 3
    if version == "0.5.23":
        assert out["paged"]["mid"] == [OWNED] * 16
        assert out["paged"]["end"] == [FREE] * 16
        # 2 + 2 token double frees (two token allocators) and one page (4 slots) freed twice
        assert sorted(out["findings"]) == [["double_alloc", 2], ["double_free", 2], ["double_free", 2], ["double_free", 4]]
    else:
        assert sorted(out["findings"]) == [["double_alloc", 2], ["double_free", 2], ["double_free", 2]]
    # The two slots freed twice are on a free list twice; where alloc(60) reaches both copies (the
    # sorting allocator puts them side by side) it hands each out twice in that one call.
