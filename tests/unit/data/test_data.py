import numpy as np
import pytest

from fedelastic.data import load_digits_dataset, partition_dirichlet, partition_iid, partition_shards, train_test_split


@pytest.fixture(scope="module")
def labels():
    return load_digits_dataset().y


def _check_disjoint_cover(parts, n):
    allidx = np.concatenate(parts)
    assert len(allidx) == n and len(np.unique(allidx)) == n


def test_digits_shape():
    ds = load_digits_dataset()
    assert ds.x.shape == (1797, 1, 8, 8) and ds.x.dtype == np.float32
    assert 0 <= ds.x.min() and ds.x.max() <= 1 and ds.num_classes == 10


def test_split_is_stratified_and_disjoint(labels):
    train, test = train_test_split(labels, 0.2, seed=0)
    assert len(np.intersect1d(train, test)) == 0 and len(train) + len(test) == len(labels)
    frac = np.bincount(labels[test], minlength=10) / np.bincount(labels, minlength=10)
    assert np.allclose(frac, 0.2, atol=0.02)


@pytest.mark.parametrize("n", [4, 20, 200])
def test_dirichlet_covers_each_sample_once_and_respects_min_size(labels, n):
    parts = partition_dirichlet(labels, n, alpha=0.5, seed=1, min_size=2)
    assert len(parts) == n
    _check_disjoint_cover(parts, len(labels))
    assert min(len(p) for p in parts) >= 2


def test_dirichlet_is_deterministic_and_seed_sensitive(labels):
    a = partition_dirichlet(labels, 10, 0.5, seed=1)
    b = partition_dirichlet(labels, 10, 0.5, seed=1)
    c = partition_dirichlet(labels, 10, 0.5, seed=2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_small_alpha_skews_labels_more_than_large_alpha(labels):
    def mean_entropy(parts):
        ent = []
        for p in parts:
            q = np.bincount(labels[p], minlength=10) / len(p)
            ent.append(-(q[q > 0] * np.log(q[q > 0])).sum())
        return np.mean(ent)

    skewed = partition_dirichlet(labels, 20, 0.1, seed=0)
    flat = partition_dirichlet(labels, 20, 100.0, seed=0)
    assert mean_entropy(skewed) < mean_entropy(flat) - 0.5


def test_iid_and_shards_cover(labels):
    _check_disjoint_cover(partition_iid(labels, 7, seed=0), len(labels))
    shards = partition_shards(labels, 10, 2, seed=0)
    _check_disjoint_cover(shards, len(labels))
    assert max(len(np.unique(labels[p])) for p in shards) <= 4


def test_dirichlet_impossible_request_is_a_clear_error(labels):
    with pytest.raises(ValueError, match="cannot give"):
        partition_dirichlet(labels[:10], 20, 0.5, seed=0)


def test_digits_match_scikit_learn():
    from sklearn.datasets import load_digits

    bunch = load_digits()
    ds = load_digits_dataset()
    np.testing.assert_array_equal(ds.y, bunch.target)
    np.testing.assert_array_equal(ds.x[:, 0], (bunch.images / 16.0).astype(np.float32))
