"""The recompute-time estimate: the engine's seconds per token come from its own steps, and a load is
credited its tokens at that rate minus the time it took. A stepping clock stands in for wall time."""

from __future__ import annotations

import pytest

from kvconnect.offload.recompute import ComputeRate, saved_seconds


class _Clock:
    """A clock that reads what the test set."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_rate_is_a_steps_wall_time_per_scheduled_token() -> None:
    clock = _Clock()
    rate = ComputeRate(clock, decay=1.0)
    assert rate.seconds_per_token == 0.0
    rate.built(200, timed=True)
    clock.now += 0.5
    rate.ran()
    assert rate.seconds_per_token == pytest.approx(0.5 / 200)
    rate.built(100, timed=True)
    clock.now += 1.0
    rate.ran()
    assert rate.seconds_per_token == pytest.approx(1.5 / 300)  # weighted by tokens, not by steps


def test_steps_with_copies_or_no_tokens_leave_the_rate_alone() -> None:
    clock = _Clock()
    rate = ComputeRate(clock, decay=1.0)
    rate.built(100, timed=True)
    clock.now += 0.1
    rate.ran()
    for tokens, timed in ((100, False), (0, True)):
        rate.built(tokens, timed)
        clock.now += 7.0
        rate.ran()
    assert rate.seconds_per_token == pytest.approx(0.1 / 100)


def test_idle_time_before_a_step_is_not_counted() -> None:
    clock = _Clock()
    rate = ComputeRate(clock, decay=1.0)
    rate.built(10, timed=True)
    clock.now += 0.2
    rate.ran()
    clock.now += 60.0  # no request for a minute
    rate.built(10, timed=True)
    clock.now += 0.2
    rate.ran()
    assert rate.seconds_per_token == pytest.approx(0.4 / 20)


def test_overlapping_steps_count_each_from_the_previous_ones_end() -> None:
    clock = _Clock()
    rate = ComputeRate(clock, decay=1.0)
    rate.built(10, timed=True)  # step 1 handed out at 100.0
    clock.now += 0.1
    rate.built(30, timed=True)  # step 2 scheduled while step 1 runs, at 100.1
    clock.now += 0.2
    rate.ran()  # step 1 back at 100.3: 0.3 s
    clock.now += 0.3
    rate.ran()  # step 2 back at 100.6: 0.3 s since step 1's end, not 0.5 since it was handed out
    assert rate.seconds_per_token == pytest.approx(0.6 / 40)


def test_older_steps_weigh_less_as_the_decay_applies() -> None:
    clock = _Clock()
    rate = ComputeRate(clock, decay=0.5)
    rate.built(100, timed=True)
    clock.now += 1.0
    rate.ran()
    rate.built(100, timed=True)
    clock.now += 3.0
    rate.ran()
    assert rate.seconds_per_token == pytest.approx((0.5 * 1.0 + 3.0) / (0.5 * 100 + 100))


def test_a_report_without_a_step_handed_out_changes_nothing() -> None:
    rate = ComputeRate(_Clock())
    rate.ran()
    assert rate.seconds_per_token == 0.0


@pytest.mark.parametrize("tokens,seconds,rate,want", [(256, 0.01, 0.001, 0.246), (256, 0.5, 0.001, -0.244),
                                                      (0, 0.02, 0.001, -0.02)])
def test_a_load_saves_its_tokens_compute_time_less_its_own_time_which_may_be_negative(tokens, seconds, rate,
                                                                                        want) -> None:
    assert saved_seconds(tokens, seconds, rate) == pytest.approx(want)
