"""benchmarks/reproduce/beyond_common.py: the ratios the "beyond the paper" figures plot, on hand-built run summaries."""

from __future__ import annotations

import importlib.util
import math

from tests.support import ROOT


def _load_beyond_common():
    path = ROOT / "benchmarks" / "reproduce" / "beyond_common.py"
    spec = importlib.util.spec_from_file_location("beyond_common", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bc = _load_beyond_common()


def _summary(status: str, rows: list[tuple[float, float, float]], **extra) -> dict:
    """Rounds from (sim_time_s, round_time_s, test_accuracy); row 0 is the initial model."""
    rounds = [{"round": float(i), "sim_time_s": t, "round_time_s": rt, "test_accuracy": a, "clients_counted": 4.0}
              for i, (t, rt, a) in enumerate(rows)]  # fmt: skip
    return {"status": status, "rounds": rounds, "devices": {}, **extra}


FULL = _summary("completed", [(0, 0, 0.31), (2.4, 2.4, 0.50), (4.8, 2.4, 0.64), (7.2, 2.4, 0.75)])
FAST = _summary("completed", [(0, 0, 0.31), (1.3, 1.3, 0.61), (2.5, 1.2, 0.55), (3.7, 1.2, 0.66)])
NEVER = _summary("completed", [(0, 0, 0.31), (1.0, 1.0, 0.40), (2.0, 1.0, 0.45)])


def test_time_to_is_the_first_round_at_or_above_the_target_never_the_initial_model():
    assert bc.time_to(FULL, 0.6) == 4.8
    assert bc.time_to(FAST, 0.6) == 1.3
    assert bc.time_to(FULL, 0.3) == 2.4  # row 0 (0.31) is the starting point, not a reached target
    assert math.isinf(bc.time_to(NEVER, 0.6))


def test_mean_round_time_leaves_out_the_initial_row():
    assert bc.mean_round_time(FAST) == (1.3 + 1.2 + 1.2) / 3


def test_ratio_marks_who_never_got_there():
    assert bc.ratio(4.8, 1.3) == 4.8 / 1.3
    assert bc.ratio(4.8, math.inf) == 0.0  # the method never reached it: the claim stops holding
    assert math.isinf(bc.ratio(math.inf, 1.3))  # only the reference never did
    assert math.isnan(bc.ratio(math.inf, math.inf))


def test_failed_or_diverged_runs_give_no_value():
    diverged = _summary("diverged", [(0, 0, 0.31), (1.3, 1.3, 0.1)])
    assert bc.value_ratio(FULL, FAST, bc.mean_round_time) == 2.4 / ((1.3 + 1.2 + 1.2) / 3)
    assert bc.value_ratio(FULL, diverged, bc.mean_round_time) is None
    assert bc.value_ratio({"status": "failed"}, FAST, bc.mean_round_time) is None
    assert bc.ok(_summary("completed_with_errors", [])) and not bc.ok(diverged)


def test_recovery_time_reads_the_first_shift():
    assert bc.recovery_time({"continual": {"shifts": [{"time_to_recover_s": 3.5}]}}) == 3.5
    assert math.isinf(bc.recovery_time({"continual": {"shifts": [{"time_to_recover_s": float("nan")}]}}))
    assert math.isnan(bc.recovery_time({}))


def test_scenario_applies_the_arm_and_dotted_changes_without_touching_the_base():
    sc = bc.scenario("elastic_tensor_0.5", {"server.policy": "deadline_drop", "fleet": {"jetson_nano": 2}})
    assert sc["train"]["strategy"] == "elastic_tensor" and sc["train"]["options"]["rho"] == 0.5
    assert sc["server"]["policy"] == "deadline_drop" and sc["server"]["rounds"] == bc.BASE["server"]["rounds"]
    assert sc["fleet"] == {"jetson_nano": 2}
    assert "policy" not in bc.BASE["server"] and bc.BASE["fleet"] == {"jetson_tx2": 4}
