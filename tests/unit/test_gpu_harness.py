"""CPU checks of the pure logic behind the GPU checks (bench/gpu/common.py, tests/gpu) and of the page-aware
clamp-last-loc fix they exercised (0.5.9's alloc_extend part 1 writes last_loc + 1 + i)."""

import os
import sys

import pytest
from conftest import REPO

torch = pytest.importorskip("torch")

sys.path[:0] = [os.path.join(REPO, "bench", "gpu"), os.path.join(REPO, "tests", "gpu", "bugs")]


def test_slope():
    import common

    assert common.slope([0, 1, 2, 3], [1, 3, 5, 7]) == pytest.approx(2.0)
    assert common.slope([1], [5]) == 0.0
    assert common.slope([2, 2], [1, 9]) == 0.0


def test_summary_rates_per_backup_and_minute():
    import sglang_19332_hicache

    samples = [
        {"t": t, "RssAnon": (1000 + 2 * t) * 2**20, "RssShmem": 0, "VmRSS": 0, "backups": 10 * t, "storage_sets": t} for t in range(40)
    ]
    s = sglang_19332_hicache.summarize(samples)
    assert s["RssAnon_MiB_per_1000_backups"] == pytest.approx(200.0)
    assert s["RssAnon_MiB_per_min"] == pytest.approx(120.0)


@pytest.mark.parametrize("page_size", [4, 16])
def test_page_aware_clamp_keeps_part1_inside(page_size):
    from kvdoctor.probe.base.fixes import clamp_last_loc

    size = 64 * page_size
    rows = size + page_size
    prefix = torch.arange(1, 3 * page_size, dtype=torch.int64)
    for bad in (rows, rows + 5, -7, 10**9):
        last = torch.full_like(prefix, bad)
        fixed = clamp_last_loc(last, rows, page_size, prefix)
        part1 = (-prefix) % page_size  # slots alloc_extend writes at last_loc + 1 + i
        assert bool(((fixed + part1) <= rows - 1).all())
        assert bool(((fixed + 1) % page_size == prefix % page_size).all())
    good = torch.tensor([-1, 0, 5, rows - 1])
    assert torch.equal(clamp_last_loc(good, rows, page_size, torch.tensor([0, 1, 6, page_size])), good)
    assert torch.equal(clamp_last_loc(torch.tensor([rows, -1]), rows), torch.tensor([rows - 1, -1]))  # no prefix given


def test_decode_handler_uses_the_prefix_before_the_new_token():
    from kvdoctor.probe.engines.sglang.roles import ROLES

    seq_lens = torch.tensor([21, 32])
    assert torch.equal(ROLES["alloc_decode"].prefix_lens((seq_lens, seq_lens, None), {}), seq_lens - 1)
    assert ROLES["alloc_extend"].prefix_lens((seq_lens,), {}) is seq_lens
    assert ROLES["alloc"].prefix_lens((8,), {}) is None
