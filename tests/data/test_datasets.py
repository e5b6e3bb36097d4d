"""Bundled and synthetic data sets: ``replicafit.data.datasets`` (load_digits, make_classification, make_regression)."""

from __future__ import annotations

import io
import os
import re
import zipfile

import numpy as np
import pytest

from replicafit import data
from replicafit.data import datasets

DIGIT_COUNTS = [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]


# --- load_digits ---------------------------------------------------------------------------------------


def test_load_digits_shapes_dtypes_and_classes():
    x, y = datasets.load_digits()
    assert x.shape == (1797, 64) and x.dtype == np.float32
    assert y.shape == (1797,) and y.dtype == np.int64
    assert np.unique(y).tolist() == list(range(10))
    assert np.bincount(y).tolist() == DIGIT_COUNTS
    assert x.min() == 0.0 and x.max() == 16.0
    np.testing.assert_array_equal(x, np.round(x))  # integer pixel values
    assert data.datasets is datasets


def test_load_digits_images_and_normalize():
    x, y = datasets.load_digits()
    images, y_images = datasets.load_digits(images=True)
    assert images.shape == (1797, 8, 8) and images.dtype == np.float32
    np.testing.assert_array_equal(images.reshape(1797, 64), x)
    np.testing.assert_array_equal(y_images, y)
    normalized, _ = datasets.load_digits(normalize=True)
    assert normalized.shape == (1797, 64) and normalized.dtype == np.float32
    assert normalized.max() == 1.0 and normalized.min() == 0.0
    np.testing.assert_allclose(normalized, x / 16.0, rtol=0, atol=1e-7)
    both, _ = datasets.load_digits(images=True, normalize=True)
    assert both.shape == (1797, 8, 8) and both.max() == 1.0
    # fresh arrays every call: mutating one does not change the next
    x[0, 0] = 99.0
    again, _ = datasets.load_digits()
    assert again[0, 0] != 99.0


def test_load_digits_is_learnable():
    x, y = datasets.load_digits(normalize=True)
    # nearest class mean already separates the digits well
    means = np.stack([x[y == c].mean(axis=0) for c in range(10)])
    predicted = np.argmin(((x[:, None, :] - means[None]) ** 2).sum(-1), axis=1)
    assert (predicted == y).mean() > 0.85


def test_shipped_file_size_and_readme():
    path = datasets._DIGITS_FILE
    assert os.path.basename(path) == "digits.npz"
    assert os.path.getsize(path) <= 100 * 1024
    readme = os.path.join(os.path.dirname(path), "README.md")
    with open(readme, encoding="utf-8") as f:
        text = f.read()
    assert "CC BY 4.0" in text
    assert "UCI" in text
    assert "archive.ics.uci.edu" in text
    assert "digits.npz" in text


def _write_resaved(path, change):
    with np.load(datasets._DIGITS_FILE) as archive:
        arrays = {k: archive[k].copy() for k in archive.files}
    change(arrays)
    np.savez_compressed(path, **arrays)


def _flip_middle_byte(raw):
    middle = len(raw) // 2
    return raw[:middle] + bytes([raw[middle] ^ 0xFF]) + raw[middle + 1 :]


def _zip_of(**members):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        for name, payload in members.items():
            z.writestr(name, payload)
    return buffer.getvalue()


DAMAGES = {
    "flipped-byte": lambda raw: _flip_middle_byte(raw),
    "flipped-byte-near-start": lambda raw: raw[:200] + bytes([raw[200] ^ 0x55]) + raw[201:],
    "truncated-half": lambda raw: raw[: len(raw) // 2],
    "truncated-tail": lambda raw: raw[:-10],
    "empty": lambda raw: b"",
    "not-a-zip": lambda raw: b"this is not a zip archive at all" * 10,
    "zip-of-garbage": lambda raw: _zip_of(**{"images.npy": b"\x00" * 64, "target.npy": b"junk"}),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damaged_file_raises_runtime_error(tmp_path, monkeypatch, damage):
    with open(datasets._DIGITS_FILE, "rb") as f:
        raw = f.read()
    damaged = DAMAGES[damage](raw)
    assert damaged != raw
    path = tmp_path / "digits.npz"
    path.write_bytes(damaged)
    monkeypatch.setattr(datasets, "_DIGITS_FILE", str(path))
    with pytest.raises(RuntimeError, match=re.escape(str(path))):
        datasets.load_digits()


@pytest.mark.parametrize(
    "change",
    [
        lambda a: a["images"].__setitem__((5, 3, 3), (a["images"][5, 3, 3] + 1) % 17),
        lambda a: a["target"].__setitem__(0, (a["target"][0] + 1) % 10),
        lambda a: a.pop("target"),
        lambda a: a.update(images=a["images"][:-1]),
    ],
    ids=["pixel", "label", "missing-array", "missing-row"],
)
def test_changed_values_raise_runtime_error(tmp_path, monkeypatch, change):
    path = tmp_path / "digits_copy.npz"
    _write_resaved(path, change)
    monkeypatch.setattr(datasets, "_DIGITS_FILE", str(path))
    with pytest.raises(RuntimeError, match=re.escape(str(path))):
        datasets.load_digits()


def test_intact_copy_loads(tmp_path, monkeypatch):
    path = tmp_path / "copy.npz"
    _write_resaved(path, lambda arrays: None)
    monkeypatch.setattr(datasets, "_DIGITS_FILE", str(path))
    x, y = datasets.load_digits()
    assert x.shape == (1797, 64) and np.bincount(y).tolist() == DIGIT_COUNTS


def test_missing_file_raises_runtime_error(tmp_path, monkeypatch):
    path = tmp_path / "nowhere.npz"
    monkeypatch.setattr(datasets, "_DIGITS_FILE", str(path))
    with pytest.raises(RuntimeError, match=re.escape(str(path))):
        datasets.load_digits()


# --- make_classification --------------------------------------------------------------------------------


def test_make_classification_shapes_and_dtypes():
    x, y = datasets.make_classification()
    assert x.shape == (100, 20) and x.dtype == np.float32
    assert y.shape == (100,) and y.dtype == np.int64
    x, y = datasets.make_classification(37, 5, n_classes=4, n_informative=3, seed=2)
    assert x.shape == (37, 5) and y.shape == (37,)
    assert set(y.tolist()) == {0, 1, 2, 3}
    x, y = datasets.make_classification(1, 1, seed=0)
    assert x.shape == (1, 1) and y.shape == (1,)


def test_make_classification_seeds():
    a = datasets.make_classification(200, 6, n_classes=3, seed=5)
    b = datasets.make_classification(200, 6, n_classes=3, seed=5)
    c = datasets.make_classification(200, 6, n_classes=3, seed=6)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert not np.array_equal(a[0], c[0])
    assert not np.array_equal(a[1], c[1])


@pytest.mark.parametrize("n, classes", [(100, 2), (100, 3), (101, 4), (10, 10), (7, 3)])
def test_make_classification_balanced_and_shuffled(n, classes):
    _, y = datasets.make_classification(n, 4, n_classes=classes, seed=1)
    counts = np.bincount(y, minlength=classes)
    assert len(counts) == classes and counts.sum() == n
    assert counts.max() - counts.min() <= 1
    if n >= 20:
        assert not np.array_equal(y, np.arange(n) % classes)  # rows are shuffled


def test_make_classification_uninformative_features_are_noise():
    x, y = datasets.make_classification(4000, 6, n_informative=2, class_sep=3.0, noise=1.0, seed=0)
    for c in range(2):
        means = x[y == c].mean(axis=0)
        assert np.all(np.abs(means[2:]) < 0.15)  # no class signal outside the informative features
        np.testing.assert_allclose(np.abs(means[:2]), 3.0, atol=0.15)
    assert abs(x[:, 2:].std() - 1.0) < 0.05


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n_informative": 0},
        {"n_informative": 11},
        {"n_informative": -1},
        {"n_classes": 1},
        {"n_samples": 0},
        {"n_features": 0},
    ],
)
def test_make_classification_validation(kwargs):
    arguments = {"n_samples": 20, "n_features": 10, **kwargs}
    with pytest.raises(ValueError):
        datasets.make_classification(**arguments)


def _fit_softmax(x, y, classes, steps=300, lr=0.5):
    w = np.zeros((x.shape[1] + 1, classes))
    onehot = np.eye(classes)[y]
    design = _with_bias(x)
    for _ in range(steps):
        logits = design @ w
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(axis=1, keepdims=True)
        w -= lr * design.T @ (p - onehot) / len(x)
    return w


def _with_bias(x):
    return np.hstack([x, np.ones((len(x), 1))]).astype(np.float64)


@pytest.mark.parametrize("classes", [2, 4])
def test_make_classification_is_learnable(classes):
    x, y = datasets.make_classification(600, 10, n_classes=classes, class_sep=2.0, seed=3)
    train, test = slice(0, 400), slice(400, 600)
    xs = (x - x[train].mean(0)) / x[train].std(0)
    w = _fit_softmax(xs[train], y[train], classes)
    assert ((_with_bias(xs[train]) @ w).argmax(1) == y[train]).mean() > 0.95
    # and it generalises to held-out rows of the same problem
    assert ((_with_bias(xs[test]) @ w).argmax(1) == y[test]).mean() > 0.95


# --- make_regression ---------------------------------------------------------------------------------------


def test_make_regression_shapes_and_dtypes():
    x, y = datasets.make_regression()
    assert x.shape == (100, 10) and x.dtype == np.float32
    assert y.shape == (100,) and y.dtype == np.float32
    x, y, coef = datasets.make_regression(13, 4, return_coef=True)
    assert x.shape == (13, 4) and y.shape == (13,) and coef.shape == (4,)
    assert coef.dtype == np.float32


def test_make_regression_seeds():
    a = datasets.make_regression(50, 3, noise=0.5, seed=1)
    b = datasets.make_regression(50, 3, noise=0.5, seed=1)
    c = datasets.make_regression(50, 3, noise=0.5, seed=2)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert not np.array_equal(a[0], c[0])
    assert not np.array_equal(a[1], c[1])


@pytest.mark.parametrize("bias", [0.0, 3.5, -20.0])
def test_make_regression_noiseless_is_exactly_linear(bias):
    x, y, coef = datasets.make_regression(200, 8, noise=0.0, bias=bias, seed=4, return_coef=True)
    expected = x.astype(np.float64) @ coef.astype(np.float64) + bias
    np.testing.assert_allclose(y, expected, rtol=0, atol=1e-4)
    assert np.all(np.abs(coef) <= 10.0) and np.all(coef != 0.0)


def test_make_regression_informative_coefficients():
    x, y, coef = datasets.make_regression(100, 6, n_informative=2, seed=0, return_coef=True)
    assert np.all(coef[2:] == 0.0) and np.all(coef[:2] != 0.0)
    np.testing.assert_allclose(y, x.astype(np.float64) @ coef, rtol=0, atol=1e-4)
    _, y0, coef0 = datasets.make_regression(30, 3, n_informative=0, bias=1.5, seed=0, return_coef=True)
    assert np.all(coef0 == 0.0)
    np.testing.assert_allclose(y0, 1.5, atol=1e-6)


def test_make_regression_noise_scale():
    x, y, coef = datasets.make_regression(5000, 4, noise=2.0, seed=7, return_coef=True)
    residual = y - x.astype(np.float64) @ coef
    assert abs(residual.std() - 2.0) < 0.1
    assert abs(residual.mean()) < 0.1


@pytest.mark.parametrize(
    "kwargs",
    [{"n_informative": -1}, {"n_informative": 11}, {"n_samples": 0}, {"n_features": 0}],
)
def test_make_regression_validation(kwargs):
    arguments = {"n_samples": 20, "n_features": 10, **kwargs}
    with pytest.raises(ValueError):
        datasets.make_regression(**arguments)


def test_make_regression_is_learnable_by_least_squares():
    x, y, coef = datasets.make_regression(400, 8, noise=0.1, bias=2.0, seed=9, return_coef=True)
    design = np.hstack([x, np.ones((len(x), 1))]).astype(np.float64)
    solution, *_ = np.linalg.lstsq(design[:300], y[:300].astype(np.float64), rcond=None)
    np.testing.assert_allclose(solution[:-1], coef, atol=0.05)
    assert abs(solution[-1] - 2.0) < 0.05
    test_error = np.sqrt(np.mean((design[300:] @ solution - y[300:]) ** 2))
    assert test_error < 0.15
    assert 1 - np.var(design[300:] @ solution - y[300:]) / np.var(y[300:]) > 0.999
