"""kalos.server.expiry.ExpirySchedule against a plain dict model: random notes (new times,
re-timed rows, NaN for "never"), forgets and due sweeps; the schedule must agree with the
model after every step, stale heap entries included."""
from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kalos.server.expiry import ExpirySchedule

ids = st.integers(0, 30)
times = st.one_of(st.floats(0, 100, allow_nan=False), st.just(math.nan))
steps = st.lists(
    st.one_of(
        st.tuples(st.just("note"), st.lists(st.tuples(ids, times), min_size=1, max_size=6, unique_by=lambda p: p[0])),
        st.tuples(st.just("never"), st.lists(ids, min_size=1, max_size=4, unique=True)),
        st.tuples(st.just("forget"), st.lists(ids, min_size=1, max_size=4, unique=True)),
        st.tuples(st.just("due"), st.floats(0, 100, allow_nan=False)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(steps)
def test_the_schedule_agrees_with_a_dict(script):
    schedule, model = ExpirySchedule(), {}
    for step in script:
        if step[0] == "note":
            before = min(model.values(), default=None)
            for i, t in step[1]:
                if math.isnan(t):
                    model.pop(i, None)
                else:
                    model[i] = t
            pairs = np.array([p[0] for p in step[1]]), np.array([p[1] for p in step[1]])
            earlier = schedule.note(*pairs)
            after = min(model.values(), default=None)
            assert earlier == (after is not None and (before is None or after < before))
        elif step[0] in ("never", "forget"):
            for i in step[1]:
                model.pop(i, None)
            if step[0] == "never":
                assert schedule.note(np.array(step[1]), None) is False
            else:
                schedule.forget(np.array(step[1]))
        else:
            now = step[1]
            expected = sorted(i for i, t in model.items() if t <= now)
            assert sorted(schedule.due(now)) == expected
            for i in expected:
                del model[i]
        assert len(schedule) == len(model)
        assert schedule.earliest() == min(model.values(), default=None)
        for i in range(31):
            assert schedule.expires_at(i) == model.get(i)


def test_stale_entries_are_compacted():
    schedule = ExpirySchedule()
    for round_ in range(3000):  # one row re-timed over and over leaves one stale entry each time
        schedule.note(np.array([7]), np.array([float(round_)]))
    assert len(schedule._heap) <= 2 * len(schedule) + 1024
    assert schedule.due(5000.0) == [7] and schedule.earliest() is None
