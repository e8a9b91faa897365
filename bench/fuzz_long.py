"""Long fuzz run of the trace reader + detectors, outside CI.

    .venv/bin/python bench/fuzz_long.py --examples 100000

Feeds the same hostile inputs as tests/unit/test_hostile_input.py (arbitrary bytes, mutated valid
traces, truncated traces, odd header schemas) through iter_events + analyze, and prints the
number of inputs, the exceptions by type (only TraceError is acceptable), and the slowest input.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import sys
import tempfile
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))
sys.path.insert(0, os.path.join(REPO, "tests", "unit"))

import hostile_events  # noqa: E402
import test_hostile_input as h  # noqa: E402
from hypothesis import HealthCheck, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvdoctor.analysis.analyzer import analyze  # noqa: E402
from kvdoctor.errors import TraceError  # noqa: E402
from kvdoctor.trace.reader import ReadStats, iter_events  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=100000, help="inputs in all (default 100000)")
    parser.add_argument("--seed", type=int, default=None)
    opts = parser.parse_args()

    workdir = tempfile.mkdtemp(prefix="kvdoctor-fuzz-")
    path = os.path.join(workdir, "fuzz.kvtrace.json")
    exceptions: collections.Counter = collections.Counter()
    samples: dict[str, str] = {}
    state = {"inputs": 0, "max_s": 0.0, "max_size": 0}

    def check(data: bytes) -> None:
        h.write_bytes(path, data)
        state["inputs"] += 1
        started = time.perf_counter()
        try:
            analyze(iter_events(path, ReadStats()), source=path)
        except TraceError:
            exceptions["TraceError"] += 1
        except Exception as exc:  # everything else is a bug: record where
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            key = f"{type(exc).__name__} at {os.path.relpath(frame.filename, REPO)}:{frame.lineno}"
            exceptions[key] += 1
            samples.setdefault(key, repr(data[:300]))
        elapsed = time.perf_counter() - started
        if elapsed > state["max_s"]:
            state["max_s"], state["max_size"] = elapsed, len(data)

    def mutated(seed):
        rng = random.Random(seed)  # the events and their damage, as the test draws them
        return hostile_events.mutate(h.build_trace(path, hostile_events.events(rng)), rng)

    def truncated(seed, cut):
        data = h.build_trace(path, hostile_events.clean_events(random.Random(seed)))
        start = data.index(b"\n", 2) + 1
        return data[: cut.draw(st.integers(min_value=start, max_value=len(data)))]

    def header(value, seed):
        events = hostile_events.clean_events(random.Random(seed))
        head = h.default_header()
        if value is h.MISSING:
            del head.args["schema"]
        else:
            head.args["schema"] = value
        return h.build_trace(path, events, header=head)

    inputs = st.one_of(
        st.binary(max_size=2048),
        st.binary(max_size=2048).map(lambda b: b"[\n" + b),
        st.builds(mutated, h.SEEDS),
        st.builds(truncated, h.SEEDS, st.data()),
        st.builds(header, st.one_of(h.SCHEMAS, st.just(h.MISSING)), h.SEEDS),
    )

    @settings(max_examples=opts.examples, deadline=None, database=None, derandomize=False, suppress_health_check=list(HealthCheck))
    @given(data=inputs)
    def run(data):
        check(data)

    if opts.seed is not None:
        run = seed(opts.seed)(run)
    started = time.time()
    run()
    took = time.time() - started
    print(f"inputs: {state['inputs']} in {took:.1f} s")
    print(f"max time per input: {state['max_s'] * 1000:.1f} ms (input of {state['max_size']} bytes)")
    print("exceptions by type:")
    for key, count in exceptions.most_common():
        print(f"  {count:8d}  {key}")
    bugs = {k: v for k, v in exceptions.items() if k != "TraceError"}
    for key in bugs:
        print(f"  sample for {key}: {samples[key]}")
    return 1 if bugs else 0


if __name__ == "__main__":
    sys.exit(main())
