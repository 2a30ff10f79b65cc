import numpy as np

from fedelastic.sim.aggregate import ClientUpdate, aggregate_buffered, aggregate_partial, fednova_rescale


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


def test_fednova_normalises_by_local_steps():
    g = {"w": np.array([1.0]), "bn.running_mean": np.array([0.0])}
    # client 1: 10 examples, 4 steps, moved w by -2; client 2: 30 examples, 1 step, moved w by -1
    updates = [
        ClientUpdate(10, {"w": np.array([-1.0])}),
        ClientUpdate(30, {"w": np.array([0.0]), "bn.running_mean": np.array([3.0])}),
    ]
    scaled = fednova_rescale(g, updates, [4, 1], {"w"})
    # tau_eff = 0.25*4 + 0.75*1 = 1.75; x + 1.75 * (0.25*(-2/4) + 0.75*(-1/1)) = 1 - 1.53125
    np.testing.assert_allclose(aggregate_partial(g, scaled)["w"], [1 - 1.53125])
    np.testing.assert_array_equal(scaled[1].arrays["bn.running_mean"], [3.0])  # statistics are not rescaled
    # plain FedAvg would give 0.25*(-1) + 0.75*0 = -0.25
    np.testing.assert_allclose(aggregate_partial(g, updates)["w"], [-0.25])


def test_buffered_step_discounts_stale_changes():
    g = {"w": np.array([10.0, 10.0], np.float32)}
    # fresh client (base = g): +2 on both elements; stale client trained from base 4 -> 8 (+4) on row 1 only
    updates = [
        ClientUpdate(1, {"w": np.array([12.0, 12.0])}),
        ClientUpdate(3, {"w": np.array([8.0, 8.0])}, {"w": np.array([0.0, 1.0])}),
    ]
    bases = [g, {"w": np.array([4.0, 4.0])}]
    new = aggregate_buffered(g, updates, bases, [1.0, 0.5])
    # element 0: only the fresh client: 10 + 2; element 1: 10 + (1*2 + 0.5*3*4) / (1 + 3) = 12
    np.testing.assert_allclose(new["w"], [12.0, 12.0])
    new = aggregate_buffered(g, updates, bases, [1.0, 1.0])
    np.testing.assert_allclose(new["w"], [12.0, 10 + (2 + 12) / 4])
    fresh = [ClientUpdate(1, {"w": np.array([12.0, 14.0])}), ClientUpdate(3, {"w": np.array([8.0, 8.0])})]
    np.testing.assert_allclose(aggregate_buffered(g, fresh, [g, g], [1, 1])["w"], aggregate_partial(g, fresh)["w"])


def test_conv_tensors_with_output_and_input_channel_masks():
    # a conv weight (out 2, in 3, 1 x 1): client A trained output channel 1 only, client B input
    # channels 0 and 2 only (Sparse Update), client C all of it
    g = {"w": np.zeros((2, 3, 1, 1), np.float32)}
    a = np.full((2, 3, 1, 1), 10.0)
    b = np.full((2, 3, 1, 1), 20.0)
    c = np.full((2, 3, 1, 1), 40.0)
    updates = [
        ClientUpdate(1, {"w": a}, {"w": np.array([0.0, 1.0])}),
        ClientUpdate(2, {"w": b}, {"w": np.array([1.0, 0.0, 1.0]).reshape(1, 3, 1, 1)}),
        ClientUpdate(1, {"w": c}),
    ]
    new = aggregate_partial(g, updates)["w"][:, :, 0, 0]
    expected = np.array(
        [
            [(2 * 20 + 40) / 3, 40.0, (2 * 20 + 40) / 3],  # out 0: B on inputs 0 and 2, C everywhere
            [(10 + 2 * 20 + 40) / 4, (10 + 40) / 2, (10 + 2 * 20 + 40) / 4],  # out 1: A too
        ]
    )
    np.testing.assert_allclose(new, expected, rtol=1e-6)
