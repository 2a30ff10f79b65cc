"""The generated SynthDigits set and the parameterised domain shifts, against hand computations."""

import numpy as np
import pytest

from fedelastic.data import load_dataset, synth
from fedelastic.data.shifts import Shift, apply_shift, hue_matrix


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDELASTIC_CACHE", str(tmp_path / "cache"))


def test_synth_digits_shape_classes_and_prefix_property():
    x, y = synth.generate(2500, seed=0)
    assert x.shape == (2500, 3, 32, 32) and x.dtype == np.uint8 and y.dtype == np.int64
    assert set(np.unique(y)) == set(range(10)) and np.bincount(y).min() > 150  # all ten digits, roughly balanced
    assert x.std() > 30  # not blank: colours and clutter vary
    head, head_y = synth.generate(2000, seed=0)  # a prefix does not depend on how many were asked for
    np.testing.assert_array_equal(head, x[:2000])
    np.testing.assert_array_equal(head_y, y[:2000])
    other, _ = synth.generate(100, seed=1)
    assert not np.array_equal(other, x[:100])


def test_synth_digits_is_cached_and_loads_as_floats(tmp_path):
    ds = load_dataset("synth_digits", size=300)
    files = list((tmp_path / "cache" / "datasets").glob("synth_digits-*-n300.npz"))
    assert len(files) == 1
    assert ds.x.shape == (300, 3, 32, 32) and ds.x.dtype == np.float32 and 0 <= ds.x.min() and ds.x.max() <= 1
    again = load_dataset("synth_digits", size=300)  # from the file
    np.testing.assert_array_equal(ds.x, again.x)


def test_every_digit_glyph_is_drawn_in_every_face():
    masks = synth.glyph_masks()
    assert masks.shape[0] >= 6 and masks.shape[1] == 10
    assert (masks.reshape(*masks.shape[:2], -1).max(-1) > 0.9).all()
    # distinct digits look different in the same face
    assert np.abs(masks[0, 1] - masks[0, 8]).sum() > 50


def _img(n=2, c=3, h=8, w=8, seed=0):
    return np.random.default_rng(seed).random((n, c, h, w)).astype(np.float32)


def test_identity_shift_returns_the_images():
    x = _img()
    assert apply_shift(x, Shift()) is x


def test_rotation_by_90_degrees_is_rot90():
    x = _img()
    out = apply_shift(x, Shift(rotation=90))
    # counter-clockwise as displayed (row 0 at the top): the top row becomes the left column, reversed
    np.testing.assert_allclose(out, np.rot90(x, 1, axes=(2, 3)), atol=1e-5)
    np.testing.assert_allclose(apply_shift(x, Shift(rotation=360)), x, atol=1e-5)


def test_hue_rotation_of_120_degrees_cycles_red_green_blue():
    np.testing.assert_allclose(hue_matrix(120) @ [1, 0, 0], [0, 1, 0], atol=1e-12)
    x = np.zeros((1, 3, 2, 2), np.float32)
    x[0, 0] = 1  # pure red
    np.testing.assert_allclose(apply_shift(x, Shift(hue=120))[0, 1], 1, atol=1e-6)
    grey = np.full((1, 3, 2, 2), 0.4, np.float32)
    np.testing.assert_allclose(apply_shift(grey, Shift(hue=77)), grey, atol=1e-6)  # grey is on the axis


def test_blur_of_a_point_is_the_separable_gaussian():
    x = np.zeros((1, 1, 15, 15), np.float32)
    x[0, 0, 7, 7] = 1
    sigma = 1.0
    out = apply_shift(x, Shift(blur=sigma))[0, 0]
    k = np.exp(-0.5 * (np.arange(-3, 4) / sigma) ** 2)
    k /= k.sum()
    np.testing.assert_allclose(out[4:11, 4:11], np.outer(k, k), atol=1e-6)
    flat = np.full((1, 1, 6, 6), 0.3, np.float32)
    np.testing.assert_allclose(apply_shift(flat, Shift(blur=2.0)), flat, atol=1e-6)


def test_noise_has_the_asked_std_and_is_seeded():
    x = np.full((4, 3, 32, 32), 0.5, np.float32)
    out = apply_shift(x, Shift(noise=0.05), seed=3)
    assert (out - 0.5).std() == pytest.approx(0.05, rel=0.05)
    np.testing.assert_array_equal(out, apply_shift(x, Shift(noise=0.05), seed=3))
    assert not np.array_equal(out, apply_shift(x, Shift(noise=0.05), seed=4))


def test_background_blends_a_texture_by_its_share():
    zeros, ones = np.zeros((2, 3, 8, 8), np.float32), np.ones((2, 3, 8, 8), np.float32)
    a = apply_shift(zeros, Shift(background=0.5), seed=1)
    b = apply_shift(ones, Shift(background=0.5), seed=1)
    np.testing.assert_allclose(b - a, 0.5, atol=1e-6)  # (1 - share) * x + share * texture
    assert a.std() > 0.01
    np.testing.assert_allclose(apply_shift(zeros, Shift(background=1.0), seed=1), 2 * a, atol=1e-6)


def test_hue_needs_rgb():
    with pytest.raises(ValueError, match="RGB"):
        apply_shift(np.zeros((1, 1, 4, 4), np.float32), Shift(hue=10))


def test_the_default_synth_size_gives_a_10000_client_fleet_a_few_samples_each():
    labels = np.repeat(np.arange(10), synth.DEFAULT_SAMPLES // 10)  # 60,000 images, as generated
    from fedelastic.data import partition_iid, partition_shards, train_test_split

    train, _ = train_test_split(labels, 0.2, seed=0)
    assert len(train) == 48_000
    for parts in (partition_iid(labels[train], 10_000, seed=0), partition_shards(labels[train], 10_000, 2, seed=0)):
        assert len(parts) == 10_000 and min(map(len, parts)) >= 4
        assert sum(map(len, parts)) == 48_000
