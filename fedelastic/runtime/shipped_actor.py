"""Flower's client actor (``flwr.simulation.ray_transport.ray_actor``: ``ClientAppActor`` and its
base's ``run`` and ``terminate``), method for method, shipped to Ray's workers by value.

A worker unpickling Flower's own class imports its module, hence the package ``flwr.simulation``,
whose ``__init__`` imports Flower's CLI, SQL state and web stack (sqlalchemy, alembic, fastapi...):
~0.45 s and ~85,000 objects per worker that a client never uses. This module is registered with
Ray's cloudpickle to be pickled by value (:func:`fedelastic.runtime.backend.light_actor`), so
unpickling this copy imports ``flwr.clientapp`` only. ``backend.actor_class`` uses it only while
its methods compile to the same code as Flower's.
"""

from logging import WARNING

import ray
from flwr.clientapp.client_app import ClientAppException, LoadClientAppError
from flwr.supercore import log


class VirtualClientEngineActor:
    def terminate(self):
        log(WARNING, "Manually terminating %s", self.__class__.__name__)
        ray.actor.exit_actor()

    def run(self, client_app_fn, message, cid, context):
        try:
            app = client_app_fn()
            out_message = app(message=message, context=context)
        except LoadClientAppError as load_ex:
            raise load_ex
        except Exception as ex:
            raise ClientAppException(str(ex)) from ex
        return cid, out_message, context


class ClientAppActor(VirtualClientEngineActor):
    def __init__(self, on_actor_init_fn=None):
        super().__init__()
        if on_actor_init_fn:
            on_actor_init_fn()
