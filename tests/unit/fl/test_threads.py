"""The kept threads that run client calls and cohort trainings (fl/threads.py)."""

from __future__ import annotations

import threading

import pytest

from fedelastic.fl.runner import run_scenario
from fedelastic.fl.threads import KeptThread


def test_a_kept_thread_runs_its_calls_in_order_on_one_thread():
    kept, seen = KeptThread("t"), []
    events = [kept.run(lambda i=i: seen.append((i, threading.get_ident()))) for i in range(5)]
    assert all(e.wait(10) for e in events)
    assert [i for i, _ in seen] == list(range(5))
    assert len({ident for _, ident in seen}) == 1 and seen[0][1] != threading.get_ident()


def test_a_call_that_raises_ends_and_retires_its_thread_and_is_reported(monkeypatch):
    reported = []
    monkeypatch.setattr(threading, "excepthook", lambda args: reported.append(args.exc_type))
    kept = KeptThread("t")
    assert kept.run(lambda: 1 / 0).wait(10)
    assert kept.retired and reported == [ZeroDivisionError]


def test_a_retired_thread_ends_after_its_call():
    kept, release, idents = KeptThread("t"), threading.Event(), []
    done = kept.run(lambda: (idents.append(threading.get_ident()), release.wait(10)))
    kept.retired = True  # what a caller does when the call overran
    release.set()
    assert done.wait(10)
    thread = next((t for t in threading.enumerate() if t.ident == idents[0]), None)
    if thread is not None:
        thread.join(10)
        assert not thread.is_alive()


def test_a_closed_thread_ends_after_its_calls():
    kept, seen = KeptThread("t"), []
    done = kept.run(lambda: seen.append(threading.current_thread()))
    kept.close()
    assert done.wait(10)
    seen[0].join(10)
    assert not seen[0].is_alive() and kept.retired


THREAD_MODEL = """
import threading
from torch import nn

SEEN = set()


class Net(nn.Module):
    def __init__(self, num_classes, in_channels, input_size):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(in_channels * input_size**2, num_classes))

    def forward(self, x):
        if self.training:
            SEEN.add(threading.get_ident())
        return self.body(x)


def net(num_classes, in_channels, input_size, width=0):
    return Net(num_classes, in_channels, input_size)
"""


@pytest.mark.parametrize("node_mode", ["cohort", "per_client"])
def test_in_process_clients_train_on_one_kept_thread_across_rounds(make_scenario, tmp_path, monkeypatch, node_mode):
    (tmp_path / "thread_models.py").write_text(THREAD_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    import thread_models

    thread_models.SEEN.clear()
    sc = make_scenario(model={"name": "thread_models:net"}, server={"rounds": 3}, simulation={"node_mode": node_mode})
    before = set(threading.enumerate())
    run_scenario(sc, run_id=node_mode)
    assert len(thread_models.SEEN) == 1 and threading.get_ident() not in thread_models.SEEN
    left = [t for t in set(threading.enumerate()) - before if t.name == "client-call"]
    for t in left:
        t.join(10)
    assert not any(t.is_alive() for t in left)  # the run's client-call thread ends with it
