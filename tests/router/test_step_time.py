"""The step time model and its online fit: the fit finds an engine's own curves from the
steps it ran, stays at its prior without data, and the curves cross the wire intact."""

from __future__ import annotations

import random

import msgspec
import pytest

from orchestrator.runtime.protocol import LoadReport, StepCurves
from router.step_time import StepTime, StepTimeFit

# An engine 3x slower than the default at prefill, with a cheaper decode.
ENGINE = StepTime(prefill_ms=(40.0, 0.05, 2e-6), decode_ms=(3.0, 20.0, 5.0))


def run_steps(fit: StepTimeFit, steps: int, rng: random.Random, noise: float = 0.05) -> None:
    for _ in range(steps):
        prefill = rng.choice([0, 0, 0, rng.randint(16, 8192)])
        decoding = prefill == 0 or rng.random() < 0.5
        usage = rng.random()
        ms = ENGINE.step_ms(prefill, decoding, usage) * (1 + rng.uniform(-noise, noise))
        fit.observe(prefill, decoding, usage, ms)


def test_the_fit_finds_the_engines_curves() -> None:
    fit = StepTimeFit()
    assert fit.curve() == StepTime()  # no steps yet: the prior
    run_steps(fit, 512, random.Random(0))
    curve = fit.curve()
    for tokens in (64, 1024, 4096, 8192):
        assert curve.prefill(tokens) == pytest.approx(ENGINE.prefill(tokens), rel=0.05)
    for usage in (0.1, 0.5, 0.9):
        assert curve.decode(usage) == pytest.approx(ENGINE.decode(usage), rel=0.1)
    assert fit.samples == 512


def test_steps_of_one_kind_leave_the_other_curve_at_the_prior() -> None:
    fit = StepTimeFit(refit_every=8)
    for i in range(64):
        fit.observe(0, True, i / 64, ENGINE.decode(i / 64))
    assert fit.curve().decode(0.5) == pytest.approx(ENGINE.decode(0.5), rel=0.1)
    assert fit.curve().prefill_ms == StepTime().prefill_ms


def test_curves_cross_the_wire_in_a_load_report() -> None:
    curves = ENGINE.curves(samples=7)

    def wire(report: LoadReport) -> LoadReport:
        return msgspec.msgpack.decode(msgspec.msgpack.encode(report), type=LoadReport)

    back = wire(LoadReport(worker_id="w", step_time=curves))
    assert isinstance(back.step_time, StepCurves) and back.step_time == curves
    assert StepTime.from_curves(back.step_time) == ENGINE
    assert wire(LoadReport(worker_id="w")).step_time is None
