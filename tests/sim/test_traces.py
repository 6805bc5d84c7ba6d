"""The trace scenario's workload has the published trace's shape; rates share random numbers."""

from __future__ import annotations

import numpy as np
import pytest

from neuralgrid.sim import traces
from neuralgrid.sim.scenarios import SCENARIOS, make_workload, poisson_times, with_overrides


def test_lengths_follow_the_azure_trace_quantiles() -> None:
    rng = np.random.default_rng(1)
    for shape in traces.SHAPES:
        prompts = traces.draw_lengths(shape.prompt_tokens, rng, 50_000)
        outputs = traces.draw_lengths(shape.output_tokens, rng, 50_000)
        for values, table in ((prompts, shape.prompt_tokens), (outputs, shape.output_tokens)):
            for q in (0.25, 0.5, 0.9, 0.99):
                assert np.quantile(values, q) == pytest.approx(
                    table[traces.QUANTILES.index(q)], rel=0.05, abs=1
                )
    assert traces.CONVERSATION.prompt_tokens[5] == 1020 and traces.CODE.output_tokens[5] == 13


def test_code_arrivals_come_in_bursts_and_conversation_drifts() -> None:
    rng = np.random.default_rng(2)
    duration, rate = 3600.0, 2.57  # the code trace's hour and rate
    times, cum = traces.intensity(traces.CODE, duration, rng)
    code = poisson_times(times, cum, rate, rng)
    counts = np.bincount(code.astype(int), minlength=int(duration))
    assert len(code) / duration == pytest.approx(rate, rel=0.25)
    assert np.mean(counts == 0) == pytest.approx(0.73, abs=0.1)  # 73% of the trace's seconds are empty
    times, cum = traces.intensity(traces.CONVERSATION, duration, rng)
    conv = poisson_times(times, cum, 5.53, rng)
    per_minute = np.bincount((conv // 60).astype(int))
    assert np.std(per_minute) / np.mean(per_minute) == pytest.approx(0.25, abs=0.1)


def test_the_trace_scenario_mixes_conversation_and_code() -> None:
    scenario = with_overrides(SCENARIOS["trace"], duration_s=900.0, rps=10.0)
    workload = make_workload(scenario)
    assert len(workload) / 900 == pytest.approx(10, rel=0.25)
    chat = np.array([(p, o) for _, _, _, p, o in workload if o > 0])
    # Code answers are short (median 13), conversation's long (median 129): the mix sits between.
    assert 13 < np.median(chat[:, 1]) < 129
    assert np.median(chat[:, 0]) == pytest.approx(1100, rel=0.25)


def test_a_higher_rate_keeps_the_requests_of_a_lower_one() -> None:
    low = make_workload(with_overrides(SCENARIOS["default"], rps=10.0, duration_s=120.0))
    high = make_workload(with_overrides(SCENARIOS["default"], rps=11.0, duration_s=120.0))
    assert len(high) > len(low)
    assert [r[1:] for r in high[: len(low) // 2]] == [r[1:] for r in low[: len(low) // 2]]
    assert all(h[0] <= lo[0] for h, lo in zip(high, low, strict=False))  # the same requests, sooner
