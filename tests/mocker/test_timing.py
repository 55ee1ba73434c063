"""The default timing model is Dynamo mocker's polynomial; others load from JSON."""

from __future__ import annotations

from pathlib import Path

import pytest

from backends.mocker.timing import TimingModel


def test_default_curves_match_dynamo() -> None:
    t = TimingModel()
    # 4.209989e-7 * 1000^2 + 1.518344e-2 * 1000 + 16.50142
    assert t.prefill(1000) == pytest.approx(32.1058589, abs=1e-9)
    assert t.prefill(8192) == pytest.approx(4.209989e-7 * 8192**2 + 1.518344e-2 * 8192 + 16.50142)
    assert t.prefill(0) == 0.0
    assert t.decode(0.5) == pytest.approx(-25.74 * 0.25 + 54.01 * 0.5 + 5.74)
    assert t.decode(0.0) == pytest.approx(5.74)
    assert t.decode(1.0) == pytest.approx(34.01)


def test_a_mixed_step_costs_prefill_plus_decode() -> None:
    t = TimingModel()
    assert t.step_ms(512, True, 0.25) == pytest.approx(t.prefill(512) + t.decode(0.25))
    assert t.step_ms(512, False, 0.25) == pytest.approx(t.prefill(512))
    assert t.step_ms(0, True, 0.25) == pytest.approx(t.decode(0.25))


def test_decode_is_floored_at_one_millisecond() -> None:
    t = TimingModel(decode_ms=(0.2, -5.0))
    assert t.decode(0.0) == 1.0 and t.decode(0.9) == 1.0


def test_models_load_from_json(tmp_path: Path) -> None:
    path = tmp_path / "linear.json"
    path.write_text('{"prefill_ms": [2.0, 0.01], "decode_ms": [3.0], "min_decode_ms": 0.5}')
    t = TimingModel.from_json(path)
    assert t.prefill(100) == pytest.approx(3.0)
    assert t.decode(0.7) == pytest.approx(3.0)


@pytest.mark.parametrize(
    "text",
    [
        '{"prefill_ms": [1.0]}',
        '{"prefill_ms": [], "decode_ms": [1]}',
        '{"prefill_ms": [1], "decode_ms": [1], "x": 1}',
        "{",
    ],
)
def test_bad_timing_files_are_refused(tmp_path: Path, text: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError):
        TimingModel.from_json(path)


def test_a_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read timing model"):
        TimingModel.from_json(tmp_path / "nope.json")


def test_loads_pipeline_with_the_layers_of_the_step() -> None:
    with_loads = TimingModel.with_loads
    assert with_loads(20.0, 0.0, 32) == 20.0
    # Compute-bound: one layer's copy before the first layer can start, the rest hidden.
    assert with_loads(20.0, 10.0, 4) == pytest.approx(22.5)
    # Copy-bound: the whole copy, then the last layer's compute.
    assert with_loads(4.0, 40.0, 4) == pytest.approx(41.0)
    # One layer: nothing to overlap with.
    assert with_loads(20.0, 10.0, 1) == pytest.approx(30.0)
