"""What `fedelastic run` says at its end and on bad input: only files that exist, and the command that fits."""

from __future__ import annotations

import json

from fedelastic.cli import exit_code


def _status(run_dir, **doc) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "status.json").write_text(json.dumps({"status": "completed_with_errors", **doc}))


def test_empty_rounds_are_listed_and_no_missing_errors_log_is_named(tmp_path, capsys):
    _status(tmp_path, empty_rounds=[7, 8, 9, 10, 11, 19], over_threshold=True, client_results=20)
    assert exit_code(tmp_path) == 3
    out = " ".join(capsys.readouterr().out.split())
    assert "6 round(s) with no client trained (rounds 7-11, 19)" in out
    assert "errors.log" not in out  # no client failed: the run wrote none
    assert "allow_empty_rounds" in out


def test_errors_log_is_named_when_it_was_written(tmp_path, capsys):
    _status(tmp_path, clients_failed=1, client_results=4, over_threshold=True)
    (tmp_path / "errors.log").write_text("--- boom\n")
    assert exit_code(tmp_path) == 3
    out = " ".join(capsys.readouterr().out.split())
    assert f"details in {tmp_path}/errors.log" in out and "allow_empty_rounds" not in out


def test_run_on_a_comparison_file_points_at_compare(tmp_path, capsys):
    import tomli_w

    from fedelastic.cli import main
    from tests.support import small_scenario_dict

    raw = {**small_scenario_dict(tmp_path), "compare": {"strategies": ["full", "last_layer"]}}
    path = tmp_path / "cmp.toml"
    path.write_text(tomli_w.dumps(raw))
    assert main(["run", str(path)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "key 'compare'" in line and f"run it with `fedelastic compare {path}`" in line
    assert not (tmp_path / "runs").exists()


def test_flower_errors_about_calls_cut_off_at_the_run_end_are_not_shown():
    """Ctrl-C on Ray: Flower logged each client call the stopping run cut off as an ERROR, with its
    traceback (vce_api's worker); those two lines go, every other error stays."""
    import logging

    from fedelastic.fl.runner import _flwr_quiet
    from fedelastic.runtime.backend import ClientTimeout

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(str(record.msg))  # type: ignore[method-assign]
    logger = logging.getLogger("flwr")
    logger.addHandler(handler)
    cut = ClientTimeout("the run ended before this client replied")
    traceback_text = f"Traceback (most recent call last):\n  ...\nfedelastic.runtime.backend.ClientTimeout: {cut}\n"
    try:
        with _flwr_quiet():
            logger.error(cut)
            logger.error(traceback_text)
            logger.error("ClientAppException: boom")
        logger.error(cut)  # outside a run, the filter is gone
    finally:
        logger.removeHandler(handler)
    assert seen == ["ClientAppException: boom", str(cut)]
