"""Every change fedelastic makes to private Flower or Ray code, its version guard and its off switch.

Each entry of :data:`PATCHES` names the private attribute it replaces, the upstream behaviour it
works around (with the upstream issue where one exists) and where the code lives. A patch is
applied only when :func:`active` says so for its package:

* the installed version is exactly the one tested (:data:`TESTED`, the versions ``pyproject.toml``
  pins). On any other version Flower's and Ray's own code runs unchanged, and a warning says so
  once per package and process;
* patches are on: ``simulation.patches = false`` in a scenario, or ``FEDELASTIC_PATCHES=0`` in the
  environment (for CI), turns every one of them off. The run is then Flower's and Ray's own:
  slower to start and stop, a dead or hung Ray client is not retried or timed out
  (``simulation.client_retries`` and ``simulation.timeout_s`` do not apply on Ray), and Ray's
  agents may outlive a killed run.

The results never depend on the patches: they change how fast messages move and what happens
to dead workers, not what any client computes.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from importlib import metadata

#: the exact versions the patches were written and tested for (pinned in pyproject.toml)
TESTED = {"flwr": "1.42.0", "ray": "2.55.1"}

ENV = "FEDELASTIC_PATCHES"  # "0", "false", "off" or "no": every patch off, whatever the scenario says


@dataclass(frozen=True)
class Patch:
    package: str  # "flwr" or "ray"
    target: str  # the private attribute replaced
    where: str  # fedelastic's code
    works_around: str  # the upstream behaviour (and issue)


PATCHES: tuple[Patch, ...] = (
    Patch("flwr", "RayBackend.process_message", "runtime/backend.py:_process_message",
          "one dead actor process poisons its pool: every later job sent to it fails with ActorDiedError "
          "(flwrlabs/flower#2758, #4277 'All the actors in your pool crashed'); a hung client is waited for "
          "without limit"),
    Patch("flwr", "RayBackend.terminate", "runtime/backend.py:_terminate",
          "exit_actor() runs each worker's interpreter teardown and ray.shutdown waits on the autoscaler "
          "monitor: seconds at the end of every run (no upstream issue found)"),
    Patch("flwr", "RayBackend.build", "runtime/backend.py:_build",
          "the pool creates its actors only when the simulation starts, and unpickling Flower's actor class "
          "imports flwr.simulation (CLI, SQL, web stack) in every worker (no upstream issue found)"),
    Patch("flwr", "vce_api.add_messages_to_queue", "runtime/dispatch.py:fast_dispatch",
          "O(nodes^2) polling of the in-memory LinkState every 0.1 s (no upstream issue found)"),
    Patch("flwr", "vce_api.put_message_into_state", "runtime/dispatch.py:_storing_replies",
          "the ServerApp's pull loop polls for replies instead of being woken (no upstream issue found)"),
    Patch("flwr", "vce_api.Queue", "runtime/dispatch.py:StoppableQueue",
          "worker and reply threads wait out Queue.get(timeout=1.0) after the run ended"),
    Patch("ray", "services.get_node", "runtime/raystart.py:prompt_node_wait",
          "ray.init polls the GCS node table once a second for its raylet (no upstream issue found)"),
    Patch("ray", "parameter.RayParams", "runtime/raystart.py:no_autoscaler",
          "ray.init has no argument for `ray start --no-monitor`: a one-machine cluster runs an autoscaler"),
    Patch("ray", "Node.start_api_server", "runtime/raystart.py:no_dashboard",
          "include_dashboard=False still starts the dashboard's head process for usage stats and waits for it "
          "(ray-project/ray#31465, #26042)"),
    Patch("ray", "auto_init_hook.enable_auto_connect", "runtime/backend.py:resilient_actors",
          "a thread touching Ray after ray.shutdown() starts a new local cluster whose agents outlive the run"),
    Patch("flwr", "Array/ArrayRecord/MetricRecord/ConfigRecord/RecordDict __dict__ (_data, _is_dirty)",
          "fl/arrays.py:_fast_records_match",
          "the record constructors type-check and sort every item (~2 us each: 40 us for a reply's metrics, "
          "a tenth of a small client's step); the records are filled directly, only where a check at import "
          "finds them built exactly as Flower builds them (decided at import: FEDELASTIC_PATCHES, not the "
          "scenario key, turns it off)"),
)  # fmt: skip

_state = {"on": True}
_warned: set[str] = set()


def configure(enabled: bool) -> None:
    """Turn the patches on or off for the runs this process starts next (``simulation.patches``)."""
    _state["on"] = bool(enabled)


def switched_on() -> bool:
    """Whether patches are on (the scenario key and :data:`ENV`), whatever the versions."""
    return _state["on"] and os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "off", "no")


def installed(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def active(package: str) -> bool:
    """Whether the patches of ``package`` ("flwr" or "ray") apply: switched on, and its version tested."""
    if not switched_on():
        return False
    version = installed(package)
    if version == TESTED[package]:
        return True
    if package not in _warned:
        _warned.add(package)
        warnings.warn(
            f"fedelastic: {package} {version} is not the tested {TESTED[package]}: its runtime patches are off "
            f"and {package}'s own code runs (slower start and stop; on Ray, client retries and timeouts do not apply)",
            UntestedVersionWarning,
            stacklevel=2,
        )
    return False


class UntestedVersionWarning(UserWarning):
    """A Flower or Ray version other than the tested one: fedelastic's patches of it are off."""
