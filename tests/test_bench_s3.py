"""The S3 benchmark's summary over rounds (bench/s3_bench.py): a case's ratio is taken against its
baseline in the same round, so a round where the whole machine was slow moves both sides alike."""

from __future__ import annotations

import pytest

from bench.s3_bench import summarize


def _run(case: str, wall: float, baseline: str | None = None, *, peak: int = 1, s3_cpu: float | None = None) -> dict:
    return {
        "case": case,
        "wall_s": wall,
        "peak_rss": peak,
        "estimate": None,
        "baseline": baseline,
        "s3_cpu_s": s3_cpu,
        "workers_cpu_s": None,
        "disk_busy": None,
    }


def _round(up: float, down: float, to_local: float, to_s3: float, *, peak: int = 1) -> list[dict]:
    return [
        _run("s5cmd upload (local -> s3)", up, s3_cpu=1.0),
        _run("s5cmd download (s3 -> local)", down),
        _run("ckptconv s3 st -> local cs-h5", to_local, "download", peak=peak),
        _run("ckptconv s3 st -> s3 cs-h5", to_s3, "down+up"),
    ]


def test_ratios_are_taken_against_the_same_rounds_baseline() -> None:
    # The second round ran on a machine twice as slow: the baselines and the cases alike.
    rounds = [_round(20.0, 5.0, 6.0, 30.0, peak=300), _round(40.0, 10.0, 12.0, 60.0, peak=350)]
    by_case = {r["case"]: r for r in summarize(rounds)}

    to_local = by_case["ckptconv s3 st -> local cs-h5"]
    assert to_local["ratios"] == pytest.approx([1.2, 1.2])
    assert to_local["runs"] == [6.0, 12.0]
    assert to_local["wall_s"] == pytest.approx(9.0)
    assert to_local["peak_rss"] == 350  # the largest, not a median: a peak is a bound
    assert by_case["ckptconv s3 st -> s3 cs-h5"]["ratios"] == pytest.approx([1.2, 1.2])
    # A case slow in the fast round is slow there, whatever the other round's walls.
    rounds[0][2]["wall_s"] = 10.0
    to_local = {r["case"]: r for r in summarize(rounds)}["ckptconv s3 st -> local cs-h5"]
    assert to_local["ratios"] == pytest.approx([2.0, 1.2])
    assert by_case["s5cmd upload (local -> s3)"]["ratios"] == []
    assert by_case["s5cmd upload (local -> s3)"]["s3_cpu_s"] == pytest.approx(1.0)


def test_one_round_summarizes_to_its_own_figures() -> None:
    (only,) = [r for r in summarize([_round(20.0, 5.0, 6.5, 31.0)]) if r["case"] == "ckptconv s3 st -> local cs-h5"]
    assert only["wall_s"] == 6.5
    assert only["ratios"] == pytest.approx([1.3])
