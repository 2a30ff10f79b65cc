import numpy as np

from fedelastic.fl.aggregate import ClientUpdate, aggregate_partial


def test_hand_computed_partial_average():
    global_state = {
        "a": np.array([1.0, 1.0], np.float32),
        "b": np.array([5.0], np.float32),
        "c": np.zeros((2, 2), np.float32),
    }
    updates = [
        ClientUpdate(10, {"a": np.array([3.0, 5.0])}),
        ClientUpdate(
            30, {"a": np.array([7.0, 9.0]), "c": np.array([[4.0, 4.0], [8.0, 8.0]])}, {"c": np.array([0.0, 1.0])}
        ),
        ClientUpdate(20, {"c": np.array([[1.0, 1.0], [2.0, 2.0]])}),
    ]
    new = aggregate_partial(global_state, updates)
    # a: trained by clients 1 and 2 -> (10*3 + 30*7)/40 = 6, (10*5 + 30*9)/40 = 8
    np.testing.assert_allclose(new["a"], [6.0, 8.0])
    # b: trained by nobody -> keeps its value
    np.testing.assert_array_equal(new["b"], [5.0])
    # c row 0: only client 3 trained it -> 1; row 1: clients 2 and 3 -> (30*8 + 20*2)/50 = 5.6
    np.testing.assert_allclose(new["c"], [[1.0, 1.0], [5.6, 5.6]], rtol=1e-6)
    assert new["a"].dtype == np.float32


def test_no_updates_keeps_everything():
    g = {"w": np.arange(4.0)}
    np.testing.assert_array_equal(aggregate_partial(g, [])["w"], g["w"])
