"""The Flower ClientApp (:func:`make_client_app`): a node trains its one client
(:func:`fedelastic.fl.client.client_train`) or its cohort (:func:`fedelastic.fl.cohort.cohort_train`);
and a Ray worker's warm-up before its first call (:func:`warm_worker`)."""

from __future__ import annotations

import os
from pathlib import Path

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from .. import plugins
from ..environment import warm_up as warm_environment
from ..modelinfo import ModelInfo
from ..scenario import Scenario
from .client import _partition_id, client_train
from .cohort import cohort_train, warm_up


def warm_worker(scenario: Scenario, registered: dict, info: ModelInfo | None = None) -> None:
    """Build in a Ray worker, before its first client call, what every call needs: what the
    driver's code registered (:func:`fedelastic.plugins.registered`), the data and the client model.

    ``info`` is the driver's model description, used instead of describing the model again here
    (the same object the worker would build: the description is deterministic).
    """
    plugins.adopt(registered)
    warm_environment(scenario, info)


def check_same_code() -> None:
    """A Ray worker must run the fedelastic the driver runs (the runner exports its folder as FEDELASTIC_ROOT)."""
    import fedelastic

    expected = os.environ.get("FEDELASTIC_ROOT")
    here = str(Path(fedelastic.__file__).resolve().parent.parent)
    if expected and here != expected:
        raise RuntimeError(
            f"this worker imported fedelastic from {here}, the driver runs it from {expected}; "
            "run from a folder that holds no other copy of fedelastic"
        )


def make_client_app(scenario: Scenario) -> ClientApp:
    """A ClientApp bound to ``scenario`` (the scenario is small; data is rebuilt per process).

    It carries the strategies, models and datasets the driver's code registered (a notebook's, say),
    so that Ray workers, which run none of that code, know them too.
    """
    registered = plugins.registered()
    app = ClientApp()

    def adopt_plugins() -> None:  # a module function: Ray ships it by reference, the dicts by value
        plugins.adopt(registered)

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        check_same_code()
        adopt_plugins()
        if "cohort" in msg.content:  # a cohort node's start-up query: build its data and model now
            warm_up(scenario)
        return Message(
            content=RecordDict({"metrics": MetricRecord({"partition-id": _partition_id(context)})}), reply_to=msg
        )

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        adopt_plugins()
        if "cohort" in msg.content:  # this node trains a cohort of virtual clients (fl/cohort.py)
            return cohort_train(scenario, msg)
        return client_train(scenario, msg, context)

    return app
