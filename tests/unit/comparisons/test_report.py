"""The HTML report: its figures' numbers by hand, a self-contained page, and a real headless Chromium."""

from __future__ import annotations

import base64
import io
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import tomli_w
from PIL import Image

from fedelastic.comparisons.comparison import run_comparison
from fedelastic.comparisons.report import energy_by_class, memory_by_device, pareto_front, write_html
from fedelastic.fl.runner import run_scenario
from tests.support import small_scenario_dict

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


def test_pareto_front_by_hand():
    cost = [1.0, 2.0, 3.0, 2.0, 1.0]
    gain = [0.5, 0.7, 0.6, 0.5, 0.5]
    # 2 is beaten by 1 (cheaper and better), 3 by 0 (cheaper, as good); 0 and 4 tie: neither beats the other
    assert pareto_front(cost, gain).tolist() == [True, True, False, False, True]


def test_energy_and_memory_tables_by_hand():
    clients = pd.DataFrame(
        {
            "round": [1, 1, 1, 2, 2, 2],
            "partition_id": [0, 1, 2, 0, 1, 2],
            "device": ["nano", "nano", "mcu", "nano", "nano", "mcu"],
            "device_class": ["gpu-edge", "gpu-edge", "mcu", "gpu-edge", "gpu-edge", "mcu"],
            "emulated_energy_j": [1.0, 2.0, 0.5, 1.5, np.nan, 0.25],  # client 1 failed in round 2
            "emulated_idle_energy_j": [0.1, 0.0, 0.0, 0.2, np.nan, 0.0],
            "emulated_peak_memory_bytes": [100.0, 120.0, 50.0, 110.0, np.nan, 60.0],
            "device_memory_bytes": [1000.0, 1000.0, 40.0, 1000.0, np.nan, 40.0],
        }
    )
    e = energy_by_class(clients)
    assert e.loc["gpu-edge"].tolist() == pytest.approx([2, 1.0 + 2.0 + 1.5, 0.1 + 0.2])
    assert e.loc["mcu"].tolist() == pytest.approx([1, 0.75, 0.0])
    m = memory_by_device(clients)
    assert m.loc["nano"].tolist() == pytest.approx([120.0, 1000.0, 0.12])
    assert m.loc["mcu"].tolist() == pytest.approx([60.0, 40.0, 1.5])  # over budget


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny run, and a tiny comparison (2 strategies x 2 seeds)."""
    tmp = tmp_path_factory.mktemp("report")
    from fedelastic.scenario import parse_scenario

    run = run_scenario(
        parse_scenario(small_scenario_dict(tmp, server={"rounds": 2, "clients_per_round": 3}), str(tmp / "t.toml")),
        run_id="r",
    )
    raw = small_scenario_dict(tmp, name="cmp")
    raw["fleet"] = {"jetson_nano": 2}
    raw["compare"] = {"strategies": ["full", "last_layer"], "seeds": [0, 1], "target_accuracy": 0.5}
    (tmp / "cmp.toml").write_text(tomli_w.dumps(raw))
    comparison = run_comparison(tmp / "cmp.toml", output=tmp / "cmp-out")
    return run, comparison


def _images(page: str) -> list[Image.Image]:
    out = []
    for data in re.findall(r'src="data:image/png;base64,([^"]+)"', page):
        image = Image.open(io.BytesIO(base64.b64decode(data)))
        image.load()
        out.append(image)
    return out


def test_run_page_is_self_contained(folders):
    run, _ = folders
    page = write_html(run).read_text()
    for title in (
        "Accuracy against simulated time",
        "Energy per device class",
        "Memory against each device",
        "What was trained, per client and round",
        "Per device",
        "config.toml",
    ):
        assert title in page, title
    assert len(_images(page)) == 4 and all(im.size[0] > 300 for im in _images(page))
    # nothing to fetch: every src is inline, no stylesheet or script from elsewhere
    assert re.findall(r'src="(?!data:)', page) == [] and "<script" not in page and "<link" not in page
    assert "completed" in page


def test_comparison_page_has_pareto_plots_with_intervals(folders):
    _, comparison = folders
    page = write_html(comparison).read_text()
    assert "Pareto" in page and len(_images(page)) == 2
    table = pd.read_csv(comparison / "summary_by_strategy.csv")
    for row in table.itertuples():  # the summary shows each mean with its interval, clipped to [0, 1]
        m, ci = row.final_accuracy_mean, row.final_accuracy_ci95
        if 0 <= m - ci and m + ci <= 1:
            assert f"{m:.3f} ± {ci:.3f}" in page
        else:
            assert f"{m:.3f} [{max(m - ci, 0):.3f}, {min(m + ci, 1):.3f}]" in page
        assert f"<td>{row.seeds}/{row.seeds}</td>" in page  # seeds used / run


def test_a_folder_that_is_neither_is_a_config_error(tmp_path):
    from fedelastic.errors import ConfigError

    with pytest.raises(ConfigError, match="run folder"):
        write_html(tmp_path)


def _chromium(*args: str) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--enable-logging=stderr", "--v=0"]
    return subprocess.run([CHROMIUM, *flags, *args], capture_output=True, text=True, timeout=120)


def _console(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (apt-get install chromium)")
def test_console_check_catches_a_page_error(tmp_path):
    """The check below can fail: a page with an error logs it to the console."""
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><html><body><script>undefinedFunction();</script></body></html>")
    out = _chromium(f"--screenshot={tmp_path / 'bad.png'}", bad.as_uri())
    assert any("undefinedFunction" in line for line in _console(out.stderr)), out.stderr


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (apt-get install chromium)")
@pytest.mark.parametrize("which", ["run", "comparison"])
def test_pages_render_in_headless_chromium(folders, which, tmp_path):
    folder = folders[0] if which == "run" else folders[1]
    page = write_html(folder)
    artifacts = Path(os.environ.get("FEDELASTIC_TEST_ARTIFACTS", tmp_path))
    artifacts.mkdir(parents=True, exist_ok=True)
    shot = artifacts / f"report-{which}.png"
    out = _chromium("--window-size=1200,2400", f"--screenshot={shot}", page.as_uri())
    assert out.returncode == 0 and shot.exists(), out.stderr
    assert _console(out.stderr) == [], _console(out.stderr)
    image = np.asarray(Image.open(shot).convert("L"), float)
    assert image.std() > 10  # something was drawn (a blank page is one grey level)
    dom = _chromium("--dump-dom", page.as_uri())
    assert dom.stdout.count("<img") == (4 if which == "run" else 2) and "<h2>" in dom.stdout
