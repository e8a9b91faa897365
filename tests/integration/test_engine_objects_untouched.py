"""The probe reads the engine's objects without making CPython build their `__dict__`.

From CPython 3.11 an instance keeps its attributes inline; once anything asks for `obj.__dict__`,
CPython builds a dict for it for good, and the engine's own attribute reads on that object miss
their inline caches from then on (on SGLang's allocator loop, 1.3-2 % for the allocator, request
pool and tree). These tests run the probe on SGLang's real allocator, radix tree and request pool,
live and attached late (the adoption that searches the whole heap), and check each object the
probe read still keeps its attributes inline; and that what the probe reads is what `vars()` says.
"""

import functools
import gc
import sys

import pytest
from conftest import SUPPORT

from kvdoctor.demo.workload import Engine, WorkloadConfig, run_workload
from kvdoctor.probe.base import objects
from kvdoctor.probe.core import runtime
from kvdoctor.trace import schema
from kvdoctor.trace.reader import iter_events

sys.path.insert(0, SUPPORT)
from late_attach import attach_late, live_request

pytestmark = pytest.mark.skipif(sys.version_info < (3, 11), reason="instances keep their attributes inline from CPython 3.11")


def dict_built(obj) -> bool:
    """Whether CPython built `obj.__dict__`: the collector then sees the object hold one dict (its
    class aside) instead of its attribute values."""
    held = [r for r in gc.get_referents(obj) if r is not type(obj)]
    return len(held) == 1 and type(held[0]) is dict


def engine_objects(engine: Engine) -> dict:
    return {"allocator": engine.allocator, "request pool": engine.req_pool, "tree": engine.tree, "engine": engine}


def test_the_check_sees_a_dict_being_built():
    """The check itself: a fresh engine's objects keep their attributes inline until `__dict__` is
    asked for (what the probe's reads did before)."""
    engine = Engine(pool_tokens=256, page_size=1)
    assert not any(dict_built(o) for o in engine_objects(engine).values())
    assert objects.instance_dict(engine.allocator) is not None
    assert dict_built(engine.allocator)


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_probed_workload_leaves_the_engines_objects_inline(tmp_path, page_size):
    trace = tmp_path / "t.kvtrace.json"
    probe = runtime.activate(str(trace))
    try:
        assert probe is not None
        engine = Engine(pool_tokens=2048, page_size=page_size)
        result = run_workload(WorkloadConfig(page_size=page_size, conversations=8, turns=3), engine=engine)
        assert result.requests == 24 and probe.calls > 0
    finally:
        runtime.deactivate()
    statuses = [e.args for e in iter_events(str(trace)) if e.name == schema.PROBE_STATUS]
    assert any(s.get("component") == "ledger" and s.get("state") == "on" for s in statuses)  # it kept a ledger
    assert {name: dict_built(o) for name, o in engine_objects(engine).items()} == dict.fromkeys(engine_objects(engine), False)


def test_an_attach_that_searches_the_heap_leaves_requests_and_holders_inline(tmp_path):
    """Adoption reads every object the collector tracks, looking for the allocator's holders and the
    live requests: it finds them (its books verified) and builds none of their dicts."""
    engine = Engine(pool_tokens=4096, page_size=1)
    run_workload(WorkloadConfig(), engine=engine)  # no probe yet
    req, _slots = live_request(engine, 24)
    events = attach_late(engine, str(tmp_path / "late.kvtrace.json"))
    (adopted,) = [e.args for e in events if e.name == schema.PROBE_STATUS and e.args.get("adopted")]
    assert adopted["live_requests"] == 1 and adopted["verified"], adopted
    built = {name: dict_built(o) for name, o in {**engine_objects(engine), "request": req, "its state": req.kv}.items()}
    assert built == dict.fromkeys(built, False)


def _passthrough(function):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        return function(*args, **kwargs)

    return wrapper


class _Base:
    level = 0  # a class default an instance may shadow

    @property
    def computed(self):
        raise AssertionError("host code ran")

    @functools.cached_property
    def cached(self):
        raise AssertionError("host code ran")

    def method(self):
        raise AssertionError("host code ran")


class _Holder(_Base):
    def __init__(self):
        self.table = {"a": 1}
        self.rows = [1, 2]
        self.level = 3
        self.none = None

    def __getattr__(self, name):
        raise AssertionError("host code ran")


def test_reads_by_name_run_no_host_code_and_match_vars():
    holder = _Holder()
    assert objects.own(holder, "table") == {"a": 1} and objects.own(holder, "level") == 3
    for name in ("computed", "cached", "method", "absent", "none"):
        assert objects.own(holder, name) is None
    assert objects.own(_Base(), "level") is None  # a class attribute is not the instance's
    items = objects.instance_items(holder)
    assert not dict_built(holder)
    assert items == list(vars(holder).items())  # vars() builds the dict: asked last

    late = _Holder()
    late.extra = object()  # set from outside its class: its code does not name it
    assert objects.instance_items(late) == list(vars(late).items())

    assert objects.instance_items(_Holder) == [] and objects.instance_items([1, 2]) == []

    class Wrapped:  # a method behind a wrapper (a Python hook's, functools.wraps) stores an attribute
        def __init__(self):
            self.first = 1

        def later(self):
            self.second = 2

    Wrapped.later = _passthrough(Wrapped.later)
    wrapped = Wrapped()
    wrapped.later()
    assert objects.instance_items(wrapped) == [("first", 1), ("second", 2)] and not dict_built(wrapped)
    assert objects.has_attributes(holder) and not objects.has_attributes([1])
