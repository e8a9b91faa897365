"""The Mamba slot census runs on the scheduler's thread after `get_new_batch_prefill`, which the
scheduler calls at every step of its loop: it reads the whole pool, tree and rows, so it runs at
most once a period, and the period can be set (tests run it at every pick)."""

from kvdoctor.probe.engines.sglang import mamba_pool


def test_a_census_is_due_at_most_once_a_period(monkeypatch):
    monkeypatch.delenv("KVDOCTOR_MAMBA_CENSUS_PERIOD_S", raising=False)
    state = mamba_pool.MambaSlotLedger()
    assert state.period_s == mamba_pool.CENSUS_PERIOD_S == 1.0
    assert state.census_due()
    assert not any(state.census_due() for _ in range(1000))  # a thousand steps within the second
    state.last_census -= mamba_pool.CENSUS_PERIOD_S
    assert state.census_due()


def test_the_period_can_be_set_and_a_bad_value_keeps_the_default(monkeypatch):
    monkeypatch.setenv("KVDOCTOR_MAMBA_CENSUS_PERIOD_S", "0")
    every = mamba_pool.MambaSlotLedger()
    assert all(every.census_due() for _ in range(3))
    monkeypatch.setenv("KVDOCTOR_MAMBA_CENSUS_PERIOD_S", "often")
    assert mamba_pool.MambaSlotLedger().period_s == mamba_pool.CENSUS_PERIOD_S
