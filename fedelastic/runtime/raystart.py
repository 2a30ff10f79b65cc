"""Ray's start-up, patched (each listed in :mod:`fedelastic.runtime.patches`, applied where
``patches.active("ray")``): ``ray.init`` of a local cluster without the autoscaler monitor or the
dashboard's head process, and going on as soon as its raylet registered."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from . import patches


@contextmanager
def _ray_start_patches() -> Iterator[None]:
    """:func:`no_autoscaler`, :func:`no_dashboard` and :func:`prompt_node_wait` where Ray's patches
    are active (they act only when ``ray.init`` starts a local cluster)."""
    if not patches.active("ray"):
        yield
        return
    with no_autoscaler(), no_dashboard(), prompt_node_wait():
        yield


@contextmanager
def prompt_node_wait(period_s: float = 0.02) -> Iterator[bool]:
    """Inside this block ``ray.init`` goes on as soon as its raylet has registered, not at Ray's next 1 s poll.

    ``ray.init`` waits for the raylet it started through ``services.get_node``, whose C++ loop
    (``GlobalStateAccessor::GetNode``) sleeps a fixed second between looks at the GCS's node
    table: the raylet registers at a random point of that second, so ``ray.init`` waits half a
    second on average for nothing. The block swaps in a ``get_node`` that looks every
    ``period_s`` (at most Ray's own 30 s) and then asks Ray's, which finds the node at once.
    Yields whether it could (a Ray without these functions is left as it is).
    """
    try:
        import ray._private.services as services
        from ray._private.state import GlobalState

        original, options = services.get_node, services._get_gcs_client_options
    except Exception:  # noqa: BLE001 (another Ray)
        yield False
        return

    def get_node(gcs_address, node_id):
        try:
            state = GlobalState()
            state._initialize_global_state(options(gcs_address))
            deadline = time.monotonic() + 30.0
            try:
                while time.monotonic() < deadline:
                    table = state.node_table()
                    if any(n.get("NodeID") == node_id and n.get("Alive") for n in table):
                        break
                    if not all("NodeID" in n and "Alive" in n for n in table):  # another Ray's table: its own wait
                        break
                    time.sleep(period_s)
            finally:
                state.disconnect()
        except Exception:  # noqa: BLE001,S110 (Ray's own wait below decides)
            pass
        return original(gcs_address, node_id)

    services.get_node = get_node
    try:
        yield True
    finally:
        services.get_node = original


@contextmanager
def no_autoscaler() -> Iterator[bool]:
    """Inside this block ``ray.init`` starts a local cluster without its autoscaler monitor.

    Ray builds its ``RayParams`` inside ``ray.init``; the block swaps in a subclass whose
    ``no_monitor`` defaults to True. Yields whether it could (a Ray without that parameter is
    left as it is).
    """
    import inspect

    try:
        import ray._private.parameter as parameter

        original = parameter.RayParams
        usable = "no_monitor" in inspect.signature(original.__init__).parameters
    except Exception:  # noqa: BLE001 (another Ray)
        usable = False
    if not usable:
        yield False
        return

    class RayParams(original):  # type: ignore[misc,valid-type]
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("no_monitor", True)
            super().__init__(*args, **kwargs)

    parameter.RayParams = RayParams
    try:
        yield True
    finally:
        parameter.RayParams = original


@contextmanager
def no_dashboard() -> Iterator[bool]:
    """Inside this block ``ray.init(include_dashboard=False)`` starts a local cluster without the
    dashboard's head process.

    With ``include_dashboard=False`` Ray still starts that process, to run its usage-stats module
    only, and waits for it to publish its address (looking every 0.1 s) before it starts the
    raylet: ~0.5 s of every local start here. The block makes ``Node.start_api_server``
    return at once when the dashboard is not wanted; a wanted one (``True`` or Ray's default
    ``None``) starts as before. Yields whether it could (a Ray whose ``start_api_server`` takes
    other arguments is left as it is).
    """
    import inspect

    try:
        from ray._private.node import Node

        original = Node.start_api_server
        usable = list(inspect.signature(original).parameters) == ["self", "include_dashboard", "raise_on_failure"]
    except Exception:  # noqa: BLE001 (another Ray)
        usable = False
    if not usable:
        yield False
        return

    def start_api_server(self, *, include_dashboard, raise_on_failure):
        if include_dashboard is False:
            self._webui_url = ""  # the address that process publishes without its web modules (raylet and workers get it)
            return None
        return original(self, include_dashboard=include_dashboard, raise_on_failure=raise_on_failure)

    Node.start_api_server = start_api_server
    try:
        yield True
    finally:
        Node.start_api_server = original


