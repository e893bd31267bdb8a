"""kalos.server.cohort: whom a pass waits for (the policy alone, with a fake slot table)."""
from __future__ import annotations

import numpy as np

from kalos.server.cohort import Cohort


class FakeSlots:
    """Requests that appear when the policy looks for the n-th time (one look per sched_yield)."""

    def __init__(self, n_slots: int) -> None:
        self.requested_now = np.zeros(n_slots, dtype=bool)
        self.arrive_after: dict[int, int] = {}  # slot -> looks until its request appears
        self.active = np.ones(n_slots, dtype=bool)
        self.looks = 0

    def _tick(self) -> None:
        self.looks += 1
        for slot, after in list(self.arrive_after.items()):
            if self.looks >= after:
                self.requested_now[slot] = True
                del self.arrive_after[slot]

    def requested(self, slots: np.ndarray) -> np.ndarray:
        self._tick()
        return self.requested_now[slots]

    def pending(self) -> tuple[np.ndarray, np.ndarray]:
        slots = np.flatnonzero(self.requested_now)
        return slots, np.ones(len(slots), dtype=np.uint64)


def _gather(cohort: Cohort, fake: FakeSlots) -> np.ndarray:
    slots, seqs = fake.pending()
    slots, _ = cohort.gather(slots, seqs, fake.pending, fake.requested, fake.active)
    return slots


def test_a_quick_client_of_the_last_pass_is_waited_for_and_joins() -> None:
    fake, cohort = FakeSlots(8), Cohort(8, window_s=5.0)
    cohort.answered(np.array([0, 1]))
    fake.requested_now[1] = True  # slot 1 is back; slot 0 comes a few looks later
    fake.arrive_after[0] = 3
    assert _gather(cohort, fake).tolist() == [0, 1]
    assert cohort.joined == 1 and cohort.waits == 1


def test_a_client_that_does_not_come_back_in_the_window_is_not_waited_for_again() -> None:
    fake, cohort = FakeSlots(8), Cohort(8, window_s=0.002)
    cohort.answered(np.array([0, 1]))
    fake.requested_now[1] = True  # slot 0 is an agent thinking: it never comes
    assert _gather(cohort, fake).tolist() == [1]
    assert not cohort.quick[0]
    cohort.answered(np.array([0, 1]))
    waits = cohort.waits
    assert _gather(cohort, fake).tolist() == [1]
    assert cohort.waits == waits  # nobody quick was missing: no wait at all


def test_a_slow_client_back_before_the_next_pass_is_quick_again() -> None:
    fake, cohort = FakeSlots(8), Cohort(8, window_s=5.0)
    cohort.quick[0] = False
    cohort.answered(np.array([0]))
    fake.requested_now[0] = True
    assert _gather(cohort, fake).tolist() == [0]
    assert cohort.quick[0]


def test_no_wait_for_clients_that_left_or_when_the_window_is_zero() -> None:
    fake, cohort = FakeSlots(8), Cohort(8, window_s=5.0)
    fake.active[0] = False
    cohort.answered(np.array([0, 1]))
    fake.requested_now[1] = True
    assert _gather(cohort, fake).tolist() == [1] and cohort.waits == 0
    off = Cohort(8, window_s=0.0)
    off.answered(np.array([0, 1]))
    assert _gather(off, fake).tolist() == [1] and off.waits == 0


def test_each_pass_waits_only_for_the_clients_of_the_pass_before() -> None:
    fake, cohort = FakeSlots(8), Cohort(8, window_s=0.002)
    cohort.answered(np.array([0]))
    fake.requested_now[1] = True
    _gather(cohort, fake)  # slot 0 missed the window
    waits = cohort.waits
    cohort.quick[0] = True
    assert _gather(cohort, fake).tolist() == [1]  # no pass published since: no one awaited
    assert cohort.waits == waits


def test_gathering_stops_when_told_to_go_now() -> None:
    """With a pass in flight the sweep passes ``stop`` (that pass landed: the GPU would idle):
    the wait ends at the first look that says so, whoever is still awaited."""
    cohort, fake = Cohort(8, window_s=10.0), FakeSlots(8)
    cohort.answered(np.array([1, 2]))
    fake.requested_now[1] = True
    fake.arrive_after = {2: 10**9}  # never back within the test
    looks = []
    slots, _ = cohort.gather(*fake.pending(), fake.pending, fake.requested, fake.active,
                             stop=lambda: looks.append(1) or len(looks) >= 3)
    assert slots.tolist() == [1]
    assert len(looks) == 3
    assert cohort.quick[2]  # cut short, not out of time: still waited for next time
