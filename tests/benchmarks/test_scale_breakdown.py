"""benchmarks/scale_breakdown.py: a raw py-spy profile split into a round's parts, on a hand-written profile."""

from __future__ import annotations

import importlib.util

from tests.support import ROOT


def _load():
    spec = importlib.util.spec_from_file_location("scale_breakdown", ROOT / "benchmarks" / "scale_breakdown.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sb = _load()

LOOP = "main (scale.py:1);EngineStrategy.run (fedelastic/fl/server.py:240)"
TRAIN = "Thread.run (threading.py:9);KeptThread._loop (fedelastic/fl/threads.py:60)"
PROFILE = "\n".join(
    [
        f"{LOOP};EngineStrategy.end_round (server.py:3);CentralEvaluation.evaluate (server.py:4);conv (x.py:1) 30",
        f"{LOOP};EngineStrategy.settle (server.py:5);EngineStrategy._failures (server.py:6);to_numpy (a.py:1) 7",
        f"{LOOP};EngineStrategy.settle (server.py:5);RoundEngine.settle (engine.py:1) 3",
        f"{LOOP};CohortGrid.send_and_receive (cohort.py:1);Condition.wait (threading.py:2) 500",  # idle: left out
        f"{TRAIN};train_local (trainer.py:1);Tensor.backward (t.py:1) 40",
        f"{TRAIN};train_local (trainer.py:1);seed_everything (trainer.py:2) 5",
        f"{TRAIN};train_local (trainer.py:1) 10",
        f"{TRAIN};reply_content (client.py:1);record_from_numpy (arrays.py:1) 5",
        f"{TRAIN} 900",  # waiting for the next call: idle
        "main (scale.py:1);worker (scale.py:2);discover_partitions (server.py:7) 77",  # start-up: left out
        "main (scale.py:1);worker (scale.py:2);bare_client_ms (scale.py:3);train (t.py:1) 66",  # the bare loop: out
    ]
)


def test_split_claims_each_sample_once_and_leaves_out_idle_and_start_up(tmp_path):
    path = tmp_path / "prof.txt"
    path.write_text(PROFILE + "\n")
    parts, unmatched = sb.split(str(path))
    assert not unmatched
    assert sum(parts.values()) == 30 + 7 + 3 + 40 + 5 + 10 + 5  # 100: idle, start-up and the bare loop left out
    assert parts[("driver", "evaluation of the server's test set (once a round)")] == 30
    assert parts[("driver", "settle: replies decoded and checked")] == 7
    assert parts[("driver", "settle: trips, energy, client records")] == 3
    assert parts[("training thread", "client: torch forward, backward, SGD step")] == 40
    assert parts[("training thread", "client: seeding")] == 5  # before train_local claims it
    assert parts[("training thread", "client: trainer's own Python (selection, bookkeeping)")] == 10
    assert parts[("training thread", "client: reply (figures, arrays to records)")] == 5


def test_split_claims_the_bare_loop_of_a_peers_worker(tmp_path):
    bare = "worker_main (peers.py:1);worker_bare (peers.py:2)"
    path = tmp_path / "prof.txt"
    path.write_text(
        "\n".join(
            [
                f"{bare};local_sgd (peers.py:3);Module._wrapped_call_impl (m.py:1) 50",
                f"{bare};local_sgd (peers.py:3);_use_grad (o.py:1);SGD.step (sgd.py:1) 20",
                f"{bare};Module.load_state_dict (m.py:2) 9",
                f"{bare};worker_bare.<locals>.<dictcomp> (peers.py:4) 4",
                f"{bare};fedavg (peers.py:5) 6",
                f"{bare};local_sgd (peers.py:3) 3",  # torch.optim's set-up and the loop's own Python: other
            ]
        )
        + "\n"
    )
    parts, unmatched = sb.split(str(path))
    assert not unmatched and sum(parts.values()) == 92
    assert parts[("bare loop", "torch: forward, backward, SGD step")] == 70
    assert parts[("bare loop", "global weights loaded (load_state_dict)")] == 9
    assert parts[("bare loop", "trained weights copied out")] == 4
    assert parts[("bare loop", "FedAvg")] == 6
    assert parts[("bare loop", "bare loop, other")] == 3
