"""benchmarks/heldout.py: the interleaved runs' pooling and noise floor, by hand."""

from __future__ import annotations

import importlib.util

import pytest

from tests.support import ROOT

_spec = importlib.util.spec_from_file_location("heldout", ROOT / "benchmarks" / "heldout.py")
heldout = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(heldout)


def _run(steps: dict[str, float], layers: dict[str, list[float]]) -> dict:
    """One interleaved run of one round: one model, two timed steps per selection."""
    return {
        "copy_bandwidth": 1e10,
        "rounds": [{"wall_s": 1.0, "load": 2.0}],
        "kernels": [{"cls": "relu", "cfg": {}, "feats": [1.0], "times": {"fwd": 1.0, "dx": 1.0}, "round": 0}],
        "tuning": {"mcu_net": [{"layers": {}, "unattributed": [0.0, 0.0]}]},
        "held": {"m": {"steps": [{k: [v, v] for k, v in steps.items()}], "layers": [layers]}},
    }


def test_two_runs_pool_round_by_round_and_the_truth_against_itself_by_hand():
    a = _run({"full": 100, "last": 40, "suffix": 60, "sparse": 70}, {"l1": [1, 2, 3], "l2": [2, 2, 2]})
    b = _run({"full": 110, "last": 40, "suffix": 66, "sparse": 56}, {"l1": [1, 2, 1], "l2": [2, 2, 2]})
    data = heldout.pooled([a, b])
    assert len(data["rounds"]) == 2 and len(data["kernels"]) == 2 and len(data["tuning"]["mcu_net"]) == 2
    assert len(data["held"]["m"]["steps"]) == 2 and len(a["held"]["m"]["steps"]) == 1  # the inputs untouched
    n = heldout.noise_floor(data)  # round 0 (even) against round 1 (odd)
    # cells: 100/110 - 1, 0, 60/66 - 1 (within 10%), 70/56 - 1 = +25% (not)
    assert n["within_10"] == 0.75 and n["median_abs"] == pytest.approx(1 / 11)
    # speedups: (40/100)/(40/110) - 1 = +10%, 0, (70/100)/(56/110) - 1 = +37.5%: one of three within 5%
    assert n["speedup_within_5"] == pytest.approx(1 / 3)
    # layers: l1 sums 6 against 4 (+50%), l2 equal: median 25%
    assert n["layer_median_abs"] == pytest.approx(0.25)
    # round-to-round sd / median per cell: 5/105, 0, 3/63, 7/63
    assert n["round_spread_median"] == pytest.approx(5 / 105) and n["round_spread_max"] == pytest.approx(7 / 63)
    rows = heldout.interleaved_rows(data)
    assert rows["m"]["real_s"]["full"] == 105 and rows["m"]["layers"]["l1"] == [1, 2, 2]
