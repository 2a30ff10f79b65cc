"""The one run path (fedelastic.orchestrate) as the Flower App's ServerApp takes it: the run folder is
checked before a model file named by the run config is imported, and a run on the App's own grid
starts no Ray of its own, whatever simulation.backend says."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import tomli_w
from flwr.app import Context, RecordDict

from fedelastic.app import client_app, server_app
from fedelastic.config import to_dict
from fedelastic.errors import ConfigError
from fedelastic.fl.grids import InProcessGrid


def _scenario_file(tmp_path: Path, scenario, **changes) -> Path:
    raw = {**to_dict(scenario), **changes}
    raw.pop("source", None)
    path = tmp_path / "tiny.toml"
    path.write_text(tomli_w.dumps(raw))
    return path


def _serve(run_config: dict, nodes: int = 4) -> None:
    grid = InProcessGrid(client_app, nodes)
    for ctx in grid.contexts.values():
        ctx.run_config = dict(run_config)
    server_app(grid=grid, context=Context(0, 0, {}, RecordDict(), dict(run_config)))


def test_the_server_app_refuses_a_bad_output_dir_before_the_model_file_runs(make_scenario, tmp_path):
    marker = tmp_path / "imported"
    (tmp_path / "evil_model.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n\n\n"
        "def f(num_classes, in_channels, input_size):\n    raise RuntimeError('never called')\n"
    )
    path = _scenario_file(tmp_path, make_scenario(), model={"name": f"{tmp_path / 'evil_model.py'}:f", "options": {}})
    (tmp_path / "file").write_text("not a folder")
    run_config = {"scenario": str(path), "output_dir": str(tmp_path / "file" / "runs")}
    with pytest.raises(ConfigError, match=r"key 'output_dir': expected a folder \(a file is in the way\)"):
        _serve(run_config)
    assert not marker.exists()


def test_a_run_on_the_apps_grid_starts_no_ray_even_with_the_ray_backend(make_scenario, tmp_path):
    import ray

    path = _scenario_file(tmp_path, make_scenario(), simulation={"backend": "ray"})
    run_config = {"scenario": str(path), "server.rounds": 1, "output_dir": str(tmp_path / "app-runs")}
    ray_up: list[bool] = []
    handler = logging.Handler()
    handler.emit = lambda record: ray_up.append(ray.is_initialized())  # type: ignore[method-assign]
    logging.getLogger("flwr").addHandler(handler)  # the ServerApp logs each round there
    try:
        _serve(run_config)
    finally:
        logging.getLogger("flwr").removeHandler(handler)
    assert ray_up and not any(ray_up)  # rounds 0 and 1 ran, none of them with a Ray of this process
    (run_dir,) = (tmp_path / "app-runs" / "tiny").iterdir()
    assert (run_dir / "rounds.parquet").exists()
