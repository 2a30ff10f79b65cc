"""Ray start-up: the run-folder check before Ray starts, Ray's
init arguments, the prompt wait for the raylet, and the client actors created early."""

import os
from pathlib import Path

import pandas as pd
import pytest

from fedelastic import api, orchestrate
from fedelastic.errors import ConfigError, FedelasticError
from fedelastic.fl import raypool
from fedelastic.runtime import backend, lifecycle, raystart


def _no_ray_start(monkeypatch) -> list:
    """Record every attempt to start Ray early (none expected)."""
    calls: list = []
    monkeypatch.setattr(raypool, "start_ray_early", lambda *a, **k: calls.append(a) or False)
    return calls


@pytest.mark.parametrize(
    ("overrides", "run_id", "error", "match"),
    [
        ({}, "../up", ConfigError, "key '--run-id': expected a plain folder name"),
        ({}, "taken", FedelasticError, "a run with this id exists"),
    ],
)
def test_a_bad_run_folder_fails_before_ray_starts(make_scenario, monkeypatch, overrides, run_id, error, match):
    sc = make_scenario(simulation={"backend": "ray"}, **overrides)
    (Path(sc.output_dir) / "tiny" / "taken").mkdir(parents=True)
    (Path(sc.output_dir) / "tiny" / "taken" / "config.toml").write_text("")  # a run's (an empty folder is free)
    calls = _no_ray_start(monkeypatch)
    with pytest.raises(error, match=match):
        api.run(sc, run_id=run_id)
    assert calls == []


def test_an_output_dir_behind_a_file_fails_before_ray_starts(make_scenario, monkeypatch, tmp_path):
    (tmp_path / "file").write_text("not a folder")
    sc = make_scenario(output_dir=str(tmp_path / "file" / "runs"), simulation={"backend": "ray"})
    calls = _no_ray_start(monkeypatch)
    with pytest.raises(ConfigError, match=r"key 'output_dir': expected a folder \(a file is in the way\)"):
        api.run(sc)
    assert calls == []


def test_a_file_where_the_run_id_folder_goes_is_not_called_a_run(make_scenario, monkeypatch, tmp_path):
    sc = make_scenario(output_dir=str(tmp_path), simulation={"backend": "ray"})
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "mine").write_text("not a run")
    calls = _no_ray_start(monkeypatch)
    with pytest.raises(ConfigError, match=r"expected a folder \(a file is in the way\)"):
        api.run(sc, run_id="mine")
    assert calls == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_an_output_dir_that_cannot_be_written_fails_before_ray_starts(make_scenario, monkeypatch, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    sc = make_scenario(output_dir=str(locked / "runs"), simulation={"backend": "ray"})
    calls = _no_ray_start(monkeypatch)
    try:
        with pytest.raises(ConfigError, match="key 'output_dir': expected a folder fedelastic can write to"):
            api.run(sc)
    finally:
        locked.chmod(0o700)
    assert calls == []


def test_the_check_lets_a_new_output_dir_and_a_free_run_id_through(make_scenario, tmp_path):
    sc = make_scenario(output_dir=str(tmp_path / "not" / "yet" / "there"))
    orchestrate.check_run_folder(sc, "free")  # no error, and nothing made
    assert not (tmp_path / "not").exists()


def test_a_local_cluster_gets_quick_socket_retries_and_a_running_one_keeps_its_settings(
    make_scenario, monkeypatch, tmp_path
):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))  # Ray's temp dir: no cluster recorded by `ray start` there
    local = lifecycle.ray_init_args(make_scenario(simulation={"backend": "ray"}).simulation)
    config = local["_system_config"]
    assert config["worker_niceness"] == os.nice(0)  # not Ray's nice 15
    # the same 10 s in all as Ray's default (1000 ms x 10 attempts), tried every 50 ms
    assert config["raylet_client_connect_timeout_milliseconds"] * config["raylet_client_num_connect_attempts"] == 10_000
    assert config["raylet_client_connect_timeout_milliseconds"] == 50
    given = lifecycle.ray_init_args(make_scenario(simulation={"backend": "ray", "ray_address": "10.0.0.1:6379"}).simulation)
    assert "_system_config" not in given and given["address"] == "10.0.0.1:6379"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # ray.init would connect there, where _system_config is refused
    assert "_system_config" not in lifecycle.ray_init_args(make_scenario(simulation={"backend": "ray"}).simulation)
    monkeypatch.delenv("RAY_ADDRESS")
    # a cluster `ray start --head` recorded: ray.init() with no address connects to it (and would refuse the config)
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text("10.0.0.2:6379")
    assert "_system_config" not in lifecycle.ray_init_args(make_scenario(simulation={"backend": "ray"}).simulation)


def test_prompt_node_wait_swaps_rays_get_node_and_restores_it():
    import ray._private.services as services

    before = services.get_node
    with raystart.prompt_node_wait() as used:
        assert used and services.get_node is not before
    assert services.get_node is before


def test_prompt_node_wait_leaves_a_ray_without_the_function_alone(monkeypatch):
    import ray._private.services as services

    monkeypatch.delattr(services, "get_node")
    with raystart.prompt_node_wait() as used:
        assert not used
    assert not hasattr(services, "get_node")


def test_the_early_actors_join_only_a_flower_build_this_module_knows(monkeypatch):
    from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend

    assert backend._same_build(RayBackend.build)  # Flower 1.42.0's, as pinned

    def other_build(self, app_fn):  # a Flower whose build does something else
        self.pool = None

    assert not backend._same_build(other_build)


@pytest.mark.ray
@pytest.mark.patched
def test_api_run_on_ray_takes_the_early_actors_and_computes_what_the_in_process_run_does(make_scenario, monkeypatch):
    """The actors made as Ray came up (warmed with the driver's model description) are the ones
    Flower's pool runs the clients on, and the tables equal the in-process run's. Every process
    of the cluster, the workers included, runs at the driver's niceness (Ray's default is nice 15
    for its workers)."""
    import ray

    from tests.support import frames

    taken: list[int] = []
    real = backend.early_actors
    monkeypatch.setattr(backend, "early_actors", lambda resources: taken.append(len(out := real(resources))) or out)
    ray_sc = make_scenario(simulation={"backend": "ray", "num_cpus_per_client": 1})
    nice: dict[int, int] = {}  # pid -> niceness (field 19 of /proc/PID/stat) of the cluster's processes in round 1

    def niceness(row: dict) -> None:
        for pid in lifecycle.ray_processes() if row["round"] == 1 else ():
            with open(f"/proc/{pid}/stat") as fh:
                nice[pid] = int(fh.read().rsplit(")", 1)[1].split()[16])

    on_ray = api.run(ray_sc, run_id="ray", progress=niceness)
    assert not ray.is_initialized()
    assert len(taken) == 1 and taken[0] >= 1  # the pool was built from early actors
    assert len(nice) >= 2 + taken[0] and set(nice.values()) == {os.nice(0)}  # GCS, raylet, workers
    local = api.run(make_scenario(), run_id="local")
    for ray_frame, local_frame in zip(frames(on_ray.run_dir), frames(local.run_dir)):  # host timings left out
        pd.testing.assert_frame_equal(ray_frame, local_frame)


def _flower_actor():
    from flwr.simulation.ray_transport.ray_actor import ClientAppActor

    return ClientAppActor.__ray_metadata__.modified_class


def test_the_light_client_actor_compiles_to_flowers_own_methods():
    flower, light = _flower_actor(), backend.light_actor()
    for method in backend._ACTOR_METHODS:
        assert backend._same_code(getattr(light, method), getattr(flower, method))

    def run(self, client_app_fn, message, cid, context):  # Flower's run, less its LoadClientAppError branch
        try:
            app = client_app_fn()
            out_message = app(message=message, context=context)
        except Exception as ex:
            raise ValueError(str(ex)) from ex
        return cid, out_message, context

    assert not backend._same_code(run, flower.run)
    assert not backend._same_code(flower.terminate, flower.run)

    class Other:
        def __init__(self, on_actor_init_fn=print):  # Flower's __init__ with another default
            super().__init__()
            if on_actor_init_fn:
                on_actor_init_fn()

    assert backend._same_code(Other.__init__, backend.light_actor().__init__) is False
    Other.__init__.__defaults__ = (None,)
    assert backend._same_code(Other.__init__, flower.__init__)  # the default was all that differed


def test_a_flower_whose_actor_differs_keeps_its_own_actor_class(monkeypatch):
    from flwr.simulation.ray_transport.ray_actor import ClientAppActor

    monkeypatch.setattr(backend, "_ACTORS", [])
    assert backend.actor_class() is not ClientAppActor  # Flower 1.42.0's, as pinned: the light copy
    monkeypatch.setattr(backend, "_ACTORS", [])
    monkeypatch.setattr(_flower_actor(), "run", lambda self, *a: None)  # a Flower whose run does something else
    assert backend.actor_class() is ClientAppActor


@pytest.mark.parametrize("actor", ["light", "flower"])
def test_the_light_client_actor_runs_an_app_as_flowers_does(actor):
    """Each class, called as Ray's worker calls it: the same replies and errors (checked by hand)."""
    from flwr.clientapp.client_app import ClientAppException, LoadClientAppError

    cls = backend.light_actor() if actor == "light" else _flower_actor()
    inits: list[int] = []
    node = cls(on_actor_init_fn=lambda: inits.append(1))
    assert inits == [1]
    assert node.run(lambda: lambda message, context: (message, context), "msg", "3", "ctx") == ("3", ("msg", "ctx"), "ctx")
    with pytest.raises(ClientAppException, match="Message: division by zero") as caught:
        node.run(lambda: lambda message, context: 1 / 0, "msg", "3", "ctx")
    assert isinstance(caught.value.__cause__, ZeroDivisionError)

    def unloadable():
        raise LoadClientAppError("no app")

    with pytest.raises(LoadClientAppError, match="no app"):
        node.run(unloadable, "msg", "3", "ctx")


@pytest.mark.ray
@pytest.mark.patched
def test_a_light_actors_worker_never_imports_flowers_simulation_package():
    """Ray ships the light class by value: its worker imports flwr.clientapp, not flwr.simulation
    (whose package brings Flower's CLI, SQL state and web stack), and a failing app is Flower's
    ClientAppException through Ray as with Flower's own actor."""
    import ray
    from flwr.clientapp.client_app import ClientAppException

    def loaded(message, context):
        import sys

        return [m for m in ("flwr.simulation", "sqlalchemy", "fastapi", "flwr.clientapp") if m in sys.modules]

    def failing(message, context):
        raise ValueError("boom")

    ray.init(num_cpus=1, include_dashboard=False)
    try:
        node = backend.actor_class().options(num_cpus=1).remote()
        assert ray.get(node.run.remote(lambda: loaded, "msg", "0", "ctx")) == ("0", ["flwr.clientapp"], "ctx")
        with pytest.raises(ClientAppException, match="boom"):
            ray.get(node.run.remote(lambda: failing, "msg", "0", "ctx"))
    finally:
        lifecycle.quick_shutdown()
