"""The fault matrix as a table: runs the fault tests (FILES; Ray cases included) and counts outcomes.

Every case of the matrix asserts its documented outcome (a one-line error naming the file and
key, before anything runs; or the recovery: a recorded row, an honest status and exit code, a
resumed run equal to an uninterrupted one) and that nothing finished is lost. This script runs
them, one pytest session, and writes per kind of case: cases, ended as documented, lost nothing,
and the wall time per case (the time to the error, or to the end of the recovered run).

    python benchmarks/fault_matrix.py            # writes benchmarks/results/fault_matrix.json
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = {  # test function -> kind of case
    "test_bad_input_is_one_line_naming_file_and_key": "bad input (exit 2, one line)",
    "test_fault_is_recorded_with_honest_status": "fault during a run (in-process)",
    "test_probe_over_memory_is_split_to_fit_the_device": "fault during a run (in-process)",
    "test_kill_9_after_round_2_then_resume_gives_identical_tables": "kill -9 of the driver, then resume",
    "test_kill_9_with_rounds_kept_for_a_later_write_then_resume_gives_identical_tables": "kill -9 of the driver, then resume",
    "test_checkpoint_is_loaded_with_weights_only": "malicious checkpoint refused",
    "test_ray_dead_and_hung_clients_are_retried_or_timed_out_and_the_pool_recovers": "Ray: dead + hung client",
    "test_full_disk_fails_the_run_in_one_line_and_csv_and_parquet_agree": "full disk during a run",
    "test_table_append_is_all_or_nothing": "full disk during a table write",
    "test_run_ids_are_unique_when_many_start_in_one_second": "25 runs started in one second",
    "test_report_draws_empty_and_non_finite_runs": "report of empty / NaN / inf runs",
    "test_a_stopped_runtime_ends_the_server_wait_at_once": "Flower runtime stops under the server",
    "test_compare_resume_skips_finished_cells_and_resumes_a_killed_one": "comparison interrupted, then --resume",
    # tests/integration/test_signals.py
    "test_a_signal_after_round_2_writes_the_rounds_marks_the_run_and_exits_with_its_code": "SIGINT / SIGTERM of the driver",
    "test_sigterm_writes_the_rounds_kept_for_a_later_write": "SIGINT / SIGTERM of the driver",
    "test_sigterm_on_ray_writes_the_rounds_and_exits_143": "SIGINT / SIGTERM of the driver",
    # tests/integration/test_chaos.py, tests/unit/results/test_results_append.py (issue 36)
    "test_killed_at_random_instants_and_resumed_the_tables_equal_an_uninterrupted_run": "chaos: kill -9 at random instants, resumed",
    "test_a_reload_killed_at_any_step_loses_no_finished_round": "kill -9 of a resume while it rewrites a table",
    "test_a_table_killed_before_its_first_rows_reloads_as_empty_and_takes_new_rows": "kill -9 before the first rows, then resume",
    "test_a_start_killed_before_its_folder_was_filled_starts_again_with_its_id": "kill -9 before the first rows, then resume",
    "test_a_merge_killed_at_any_step_leaves_the_old_parts_or_the_merged_one_never_both": "kill -9 while a table merges its parts",
    # tests/integration/test_diverged_runs.py
    "test_a_barely_trained_run_whose_predictions_collapse_is_not_diverged": "divergence: sound run not called diverged",
}
FILES = (
    "tests/integration/test_faults.py",
    "tests/integration/test_signals.py",
    "tests/integration/test_untrusted.py",
    "tests/integration/test_bad_input.py",
    "tests/integration/test_chaos.py",
    "tests/unit/results/test_results_append.py::test_a_reload_killed_at_any_step_loses_no_finished_round",
    "tests/unit/results/test_results_append.py::test_a_table_killed_before_its_first_rows_reloads_as_empty_and_takes_new_rows",
    "tests/unit/results/test_results_append.py::test_a_merge_killed_at_any_step_leaves_the_old_parts_or_the_merged_one_never_both",
    "tests/integration/test_diverged_runs.py",
)
KIND_OF_FILE = {  # every case of these files is one kind
    "test_untrusted": "untrusted run folder or model file (refused before its code runs)",
    "test_diverged_runs": "divergence: status, exit 4, advice",
    "test_chaos": "chaos: kill -9 at random instants, resumed",
    "test_bad_input": "bad input (exit 2, one line)",
}


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        start = time.time()
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *FILES, f"--junitxml={report}"],
            cwd=ROOT, capture_output=True, text=True,
        )  # fmt: skip
        total_s = time.time() - start
        cases = ET.parse(report).getroot().iter("testcase")
        rows: dict[str, dict] = {}
        for case in cases:
            func = case.get("name", "").split("[")[0]
            module = case.get("classname", "").rsplit(".", 1)[-1]
            kind = KINDS.get(func) or KIND_OF_FILE.get(module) or func
            ok = not any(child.tag in ("failure", "error", "skipped") for child in case)
            row = rows.setdefault(kind, {"cases": 0, "as_documented": 0, "lost_nothing": 0, "times_s": []})
            row["cases"] += 1
            row["as_documented"] += ok
            row["lost_nothing"] += ok  # each case asserts nothing finished was lost, with its outcome
            row["times_s"].append(float(case.get("time", "nan")))
    for row in rows.values():
        times = row.pop("times_s")
        row["median_s"], row["max_s"] = statistics.median(times), max(times)
    out = {"pytest_exit": proc.returncode, "total_s": total_s, "kinds": rows, "tail": proc.stdout.splitlines()[-1:]}
    path = ROOT / "benchmarks" / "results" / "fault_matrix.json"
    path.write_text(json.dumps(out, indent=2))
    print("| kind of case | cases | ended as documented | lost nothing | time per case, median (max) |")
    print("|---|---|---|---|---|")
    for kind, r in rows.items():
        print(f"| {kind} | {r['cases']} | {r['as_documented']} | {r['lost_nothing']} | {r['median_s']:.2f} s ({r['max_s']:.2f} s) |")
    print(f"\npytest exit {proc.returncode}, {total_s:.0f} s in all; written to {path}")


if __name__ == "__main__":
    main()
