"""The key references in docs/reference/ are generated from the code's help text and kept current."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fedelastic import docgen
from fedelastic.config import field
from fedelastic.devices import profile as devices
from fedelastic.scenario import Scenario
from tests.support import ROOT


@dataclass(frozen=True)
class _Inner:
    depth: int = field(3, help="how deep")


@dataclass(frozen=True)
class _Outer:
    name: str = field(help="a name")
    mode: Literal["a", "b"] = field("a", help="which mode")
    sizes: tuple[int, ...] = field((1, 2), help="some sizes")
    inner: _Inner = field(default_factory=_Inner, help="nested")
    maybe: _Inner | None = field(None, help="optional nested")
    flag: bool = field(False, help="a flag")


def test_rows_of_a_hand_built_config():
    assert docgen.key_rows(_Outer) == [
        (
            "",
            [
                ("name", "str", "required", "a name"),
                ("mode", '"a" | "b"', '`"a"`', "which mode"),
                ("sizes", "list of int", "`[1, 2]`", "some sizes"),
                ("flag", "bool", "`false`", "a flag"),
            ],
        ),
        ("inner", [("inner.depth", "int", "`3`", "how deep")]),
        ("maybe", [("maybe.depth", "int", "`3`", "how deep")]),
    ]


def test_a_pipe_in_a_cell_is_escaped():
    assert docgen._table([("k", '"a" | "b"')], ("key", "type"))[-1] == '| `k` | "a" \\| "b" |'


def test_every_scenario_key_is_documented():
    text = docgen.scenario_keys()
    for key in (
        "train.lr",
        "server.deadline_quantile",
        "simulation.write_every_s",
        "stream.buffer_policy",
        "compare.tune.lr",
    ):
        assert f"| `{key}` |" in text
    assert text.count("| `") >= 100  # about 110 keys today; a lost section would drop far below
    assert "## `[data.shift]`" in text and Scenario.__dataclass_fields__["train"].metadata["help"]


def test_every_profile_key_has_help():
    quantity_keys = {f"{s}.{k}" for s, spec in devices._QUANTITIES.items() for k in spec}
    kernel_keys = {f"kernels.<class>.{k}" for k in devices._KERNEL_KEYS}
    assert quantity_keys | kernel_keys | devices._TOP_KEYS <= set(devices.KEY_HELP)
    text = docgen.profile_keys()
    assert "| `memory.train` | bytes | yes |" in text and "| `availability.probability` | ratio | no |" in text


def test_generated_files_are_current():
    """Fails when a help text changed without `python -m fedelastic.docgen` being run."""
    for path, text in docgen.generated(ROOT).items():
        assert path.exists(), f"{path} is missing: run `python -m fedelastic.docgen`"
        assert path.read_text(encoding="utf-8") == text, f"{path} is not current: run `python -m fedelastic.docgen`"
    assert docgen.main(["--root", str(ROOT), "--check"]) == 0


def test_check_reports_a_stale_file(tmp_path, capsys):
    assert docgen.main(["--root", str(tmp_path), "--check"]) == 1  # nothing generated there yet
    assert not (tmp_path / "docs").exists()  # --check writes nothing
    assert docgen.main(["--root", str(tmp_path)]) == 0
    assert docgen.main(["--root", str(tmp_path), "--check"]) == 0


def test_every_results_column_has_a_row_with_its_help():
    from fedelastic.sim.records import client_columns, round_columns

    text = docgen.results_columns()
    for name in client_columns() + round_columns(validation=True):
        assert f"| `{name}` | " in text, name
    assert "| `emulated_comm_time_s` | download and upload time on the client's links (priced by the engine) |" in text
    assert "| `val_loss` | loss on the validation shares" in text and "| `summary` |" not in text  # flattened


def test_the_results_page_keeps_its_hand_written_text():
    page = "intro\n" + docgen.BEGIN_COLUMNS + "\nold tables\n" + docgen.END_COLUMNS + "\noutro\n"
    new = docgen.results_page(page)
    assert new.startswith("intro\n" + docgen.BEGIN_COLUMNS) and new.endswith(docgen.END_COLUMNS + "\noutro\n")
    assert "old tables" not in new and "## Columns of `rounds.*`" in new
