"""The Ray path's start-up and teardown pieces, most checked without starting Ray.

The real-Ray run in tests/integration/test_simulation.py checks them together: its results equal the
in-process run's, and no Ray process outlives it.
"""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from queue import Empty

import pytest
from ray import cloudpickle

import fedelastic
from fedelastic.fl.clientapp import make_client_app
from fedelastic.fl.rayrun import ShippedClientApp
from fedelastic.runtime.dispatch import StoppableQueue, fast_dispatch
from fedelastic.runtime.orphans import alive as _alive
from fedelastic.runtime.orphans import descendants
from fedelastic.runtime.raystart import no_autoscaler, no_dashboard

ROOT = Path(fedelastic.__file__).resolve().parent.parent

_WORKER = """
import os, pickle, sys
sys.path.insert(0, os.getcwd())  # what Ray does in its workers: the driver's working directory first
from flwr.app import Context, Message, MessageType, RecordDict
from flwr.supercore.task_identity import TaskIdentity

blob = open(sys.argv[1], "rb").read()
app = pickle.loads(blob)
assert pickle.loads(blob) is app  # the same app again: unpickled once per worker
import fedelastic
TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 0, 7, 0  # what Flower sets in a worker
msg = Message(content=RecordDict(), message_type=MessageType.QUERY, dst_node_id=7)
reply = app(msg, Context(0, 7, {"partition-id": 3, "num-partitions": 4}, RecordDict(), {}))
print(fedelastic.__file__, os.environ["FEDELASTIC_ROOT"], reply.content["metrics"]["partition-id"])
"""


def test_a_shipped_client_app_runs_the_drivers_fedelastic_beside_another_copy(make_scenario, tmp_path):
    """A worker that starts in a folder holding another fedelastic still runs the driver's, without a runtime_env."""
    shadow = tmp_path / "cwd"
    (shadow / "fedelastic").mkdir(parents=True)
    (shadow / "fedelastic" / "__init__.py").write_text(
        "raise ImportError('the shadow copy of fedelastic was imported')"
    )
    blob = tmp_path / "app.pkl"
    blob.write_bytes(cloudpickle.dumps(ShippedClientApp(make_client_app(make_scenario()))))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FEDELASTIC_ROOT")}  # only the shipped path
    out = subprocess.run(
        [sys.executable, "-c", _WORKER, str(blob)], cwd=shadow, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    module, root, partition = out.stdout.split()
    assert Path(module).resolve() == ROOT / "fedelastic" / "__init__.py" and Path(root) == ROOT
    assert partition == "3"  # the app answered the query (client.check_same_code passed)


def test_a_stopped_queue_wakes_its_waiting_readers_and_keeps_its_items():
    made_here = StoppableQueue()
    sibling = StoppableQueue()  # made by the same thread: Flower's message and reply queues of one run
    other: list[StoppableQueue] = []
    maker = threading.Thread(target=lambda: other.append(StoppableQueue()))
    maker.start()
    maker.join()
    made_here.put("queued before the stop")
    got: dict[str, object] = {}

    def read(name: str, q: StoppableQueue, timeout: float) -> None:
        t = time.monotonic()
        try:
            q.get(timeout=timeout)
            got[name] = "item"
        except Empty:
            got[name] = time.monotonic() - t

    readers = [threading.Thread(target=read, args=("sibling", sibling, 60.0))]
    readers.append(threading.Thread(target=read, args=("other", other[0], 0.5)))
    for r in readers:
        r.start()
    time.sleep(0.2)  # both readers are waiting
    made_here.stop()
    readers[0].join(10)
    assert not readers[0].is_alive() and got["sibling"] < 10  # woken long before its 60 s timeout
    readers[1].join(10)
    assert got["other"] >= 0.5  # another thread's queue waited out its own timeout
    assert made_here.get(timeout=60) == "queued before the stop"  # an item is still returned ...
    with pytest.raises(Empty):
        made_here.get(timeout=60)  # ... and then an empty stopped queue answers at once


def test_fast_dispatch_makes_flowers_run_queues_stoppable_and_restores_them():
    from queue import Queue

    from flwr.server.superlink.fleet.vce import vce_api

    with fast_dispatch():
        assert vce_api.Queue is StoppableQueue
    assert vce_api.Queue is Queue


def test_descendants_finds_a_process_tree_and_alive_sees_it_end():
    if not Path("/proc").is_dir():
        pytest.skip("no /proc")
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)",
        ]
    )
    try:
        deadline = time.monotonic() + 30
        while len(tree := descendants([parent.pid])) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(tree) == 2 and parent.pid in tree
        child = next(p for p in tree if p != parent.pid)
        os.kill(child, 9)
        deadline = time.monotonic() + 30
        while child in _alive(tree) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert set(_alive(tree)) == {parent.pid}  # the killed child (a zombie until reaped) no longer counts
    finally:
        parent.kill()
        parent.wait()


def test_no_autoscaler_sets_rays_no_monitor_default_and_restores_rays_class():
    import ray._private.parameter as parameter

    original = parameter.RayParams
    with no_autoscaler() as used:
        assert used
        assert parameter.RayParams(num_cpus=1).no_monitor is True  # what ray.init builds inside the block
        assert parameter.RayParams(no_monitor=False).no_monitor is False  # an explicit value is kept
    assert parameter.RayParams is original and original().no_monitor is False


def test_no_autoscaler_leaves_a_ray_without_the_parameter_alone(monkeypatch):
    import ray._private.parameter as parameter

    class OldRayParams:
        def __init__(self, num_cpus=None):
            self.num_cpus = num_cpus

    monkeypatch.setattr(parameter, "RayParams", OldRayParams)
    with no_autoscaler() as used:
        assert not used and parameter.RayParams is OldRayParams


def test_no_dashboard_skips_only_an_unwanted_dashboard_and_restores_rays_method(monkeypatch):
    from ray._private.node import Node

    calls: list = []
    monkeypatch.setattr(Node, "start_api_server", lambda self, *, include_dashboard, raise_on_failure: calls.append(include_dashboard))
    ours = Node.start_api_server

    class FakeNode:
        _webui_url = None

    node = FakeNode()
    with no_dashboard() as used:
        assert used
        for wanted in (False, True, None):  # None: Ray's default, which starts it
            Node.start_api_server(node, include_dashboard=wanted, raise_on_failure=False)
    assert calls == [True, None]
    assert node._webui_url == ""  # what Ray's dashboard process publishes when started without its modules
    assert Node.start_api_server is ours


def test_no_dashboard_leaves_a_ray_with_another_signature_alone(monkeypatch):
    from ray._private.node import Node

    def start_api_server(self, include_dashboard, raise_on_failure, port=None):
        return "started"

    monkeypatch.setattr(Node, "start_api_server", start_api_server)
    with no_dashboard() as used:
        assert not used and Node.start_api_server is start_api_server


@pytest.mark.ray
def test_a_cluster_started_without_its_dashboard_runs_tasks():
    import ray
    import ray._private.worker as ray_worker
    from ray._private import ray_constants

    from fedelastic.runtime import lifecycle

    with no_dashboard():
        ray.init(num_cpus=1, include_dashboard=False)
    try:
        started = set(ray_worker._global_node.all_processes)
        assert ray_constants.PROCESS_TYPE_DASHBOARD not in started
        assert ray_worker._global_node.webui_url == ""  # as with the process (ray.init's dashboard_url)
        assert ray_constants.PROCESS_TYPE_RAYLET in started  # the rest of the cluster is there

        @ray.remote
        def double(x):
            return 2 * x

        assert ray.get(double.remote(21)) == 42
    finally:
        lifecycle.quick_shutdown()


@pytest.mark.ray
@pytest.mark.unpatched
def test_a_run_that_fails_after_ray_started_early_leaves_no_ray_behind(make_scenario, monkeypatch, tmp_path):
    """api.run starts Ray before it imports the runtime; a run refused after that (its data has no
    class 42, found by the checks beside ray.init) stops it."""
    import ray

    from fedelastic import api
    from fedelastic.errors import ConfigError
    from tests.support import processes_with

    sc = make_scenario(simulation={"backend": "ray", "num_cpus_per_client": 1}, data={"classes": [0, 42]})
    monkeypatch.setenv("FEDELASTIC_TEST_RUN", str(tmp_path))
    import fedelastic.fl.raypool as raypool

    up_at_shutdown: list[bool] = []
    real = raypool.quick_shutdown
    monkeypatch.setattr(raypool, "quick_shutdown", lambda: (up_at_shutdown.append(ray.is_initialized()), real()))
    with pytest.raises(ConfigError, match="key 'data.classes'"):
        api.run(sc)
    assert up_at_shutdown[:1] == [True]  # Ray was up (started early) when the refused run ended, and was stopped
    assert not ray.is_initialized()
    assert not processes_with(f"FEDELASTIC_TEST_RUN={tmp_path}".encode())


@pytest.mark.perf
def test_fedelastic_run_skips_the_final_garbage_collection_at_exit(tmp_path):
    """The command's process freezes the heap at exit (no final GC passes); its results are complete."""
    import tomli_w

    from tests.support import small_scenario_dict

    path = tmp_path / "tiny.toml"
    path.write_text(tomli_w.dumps(small_scenario_dict(tmp_path, server={"rounds": 1})))
    code = (
        "import atexit, gc, sys\n"
        "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count() > 0))  # runs after the CLI's hooks\n"
        "from fedelastic.cli import main\n"
        f"sys.exit(main(['run', {str(path)!r}]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("frozen at exit: True")
    run_dir = next((tmp_path / "runs" / "tiny").iterdir())
    assert '"completed"' in (run_dir / "status.json").read_text()


def _store_all(loop, items):
    """Run a reply-storing loop over ``items`` and stop it; what it stored, in order."""
    from queue import Queue

    class State:
        stored: list = []

        def store_message_res(self, message):
            self.stored.append(message)

    state, queue, stop = State(), Queue(), threading.Event()
    state.stored = []
    for item in items:
        queue.put(item)
    thread = threading.Thread(target=loop, args=(state, queue, stop))
    thread.start()
    deadline = time.monotonic() + 30
    while len(state.stored) < len(items) and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    thread.join(5)
    return state.stored


def test_the_reply_loop_stores_what_flowers_stores_and_wakes_the_pull_loop():
    from flwr.server.superlink.fleet.vce import vce_api

    from fedelastic.runtime import dispatch

    items = [f"reply-{i}" for i in range(5)]
    assert _store_all(dispatch._storing_replies, items) == _store_all(vce_api.put_message_into_state, items) == items
    dispatch.replies_may_wait()
    waiter = threading.Thread(target=dispatch.wait_for_replies, args=(60.0,))
    t = time.monotonic()
    waiter.start()
    _store_all(dispatch._storing_replies, ["one more"])
    waiter.join(30)
    assert not waiter.is_alive() and time.monotonic() - t < 30  # woken by the store, not its 60 s period
    with fast_dispatch():
        assert vce_api.put_message_into_state is dispatch._storing_replies
    assert vce_api.put_message_into_state is not dispatch._storing_replies


def test_another_flowers_reply_loop_is_left_in_place(monkeypatch):
    """Only the exact loop _storing_replies copies is replaced (a loop with another signature would break)."""
    from flwr.server.superlink.fleet.vce import vce_api

    from fedelastic.runtime import dispatch

    def newer_loop(state, queue, f_stop, metrics):  # a later Flower's loop, say
        pass

    monkeypatch.setattr(vce_api, "put_message_into_state", newer_loop)
    with fast_dispatch():
        assert vce_api.put_message_into_state is newer_loop
    assert not dispatch._replaceable_reply_loop(newer_loop)
