"""Exact, faster conversion between numpy arrays and Flower ``Array`` records.

Flower stores every ``Array`` as the bytes of ``np.save`` and reads it back with ``np.load``,
which parses the ``.npy`` header (a Python literal) for every tensor of every message: about
60-70 us per tensor, i.e. 1-1.5 ms per model per direction for a 20-tensor model, as much as a
small client's whole local training step. The header of a given dtype and shape never changes,
so here it is built or parsed once and cached; the bytes written and the arrays read are
exactly those of ``np.save``/``np.load`` (anything unusual falls back to Flower's own code).

Building the records costs as much again: Flower's ``Array(...)`` sorts out its three calling
conventions (~10 us), and ``ArrayRecord(dict)`` copies every ``Array`` once more and type-checks
each item (~20 us per tensor; 170 us for an 8-tensor update). :func:`record_from_numpy`
fills the record's dict directly with Arrays made with exactly the attributes Flower's
constructor sets; :func:`metric_record` and :func:`record_dict` do the same for a reply's metrics
and its record dict. Whether they are the same is checked once, at import, against Flower's own
constructors (:func:`_fast_records_match`); if a Flower version differs, Flower's constructors are
used.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from ..runtime import patches

_NPY = "numpy.ndarray"  # flwr's SType.NUMPY
_MAGIC = b"\x93NUMPY"
_MAX_CACHE = 4096
_READ: dict[bytes, tuple[tuple[int, ...], bool, np.dtype]] = {}  # header bytes -> (shape, fortran, dtype)
# (dtype.str, shape, fortran) -> (header bytes, str(dtype)); only for dtypes without fields, whose
# ``.str`` ('<f4') fixes both the header and the name ('float32'): a structured dtype's ``.str`` ('|V8') does not
_WRITE: dict[tuple[str, tuple[int, ...], bool], tuple[bytes, str]] = {}


def _remember(cache: dict, key, value) -> None:
    if len(cache) >= _MAX_CACHE:
        cache.clear()
    cache[key] = value


def to_numpy(array: Array, copy: bool = True) -> np.ndarray:
    """``array.numpy()``, with the ``.npy`` header parsed once per distinct header.

    ``copy=False``: a read-only view of the message's bytes (no copy), for a reader that only reads.
    """
    data = array.data
    if array.stype != _NPY or data[:6] != _MAGIC or data[6] not in (1, 2):
        return array.numpy()
    size = 2 if data[6] == 1 else 4
    start = 8 + size + int.from_bytes(data[8 : 8 + size], "little")
    header = data[:start]
    info = _READ.get(header)
    if info is None:
        fh = io.BytesIO(header)
        version = np.lib.format.read_magic(fh)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        info = read(fh)
        if info[2].hasobject:
            return array.numpy()
        _remember(_READ, header, info)
    shape, fortran, dtype = info
    count = math.prod(shape)  # Python ints: no overflow, and ~10x faster than np.prod on a tuple
    if len(data) != start + count * dtype.itemsize:
        return array.numpy()  # let numpy raise its own error
    flat = np.frombuffer(data, dtype=dtype, count=count, offset=start)
    out = flat.reshape(shape[::-1]).transpose() if fortran else flat.reshape(shape)
    return out.copy(order="K") if copy else out  # a copy: writable and owning its memory, as np.load's result


def from_numpy(ndarray: np.ndarray) -> Array:
    """``Array(ndarray)``: the same bytes as ``np.save``, with the header and the dtype's name worked
    out once per dtype and shape (``str(dtype)`` is a Python-level numpy call, ~2 us a tensor)."""
    dtype = ndarray.dtype
    if dtype.hasobject or dtype.fields is not None:
        return Array(ndarray)
    fortran = bool(ndarray.flags.f_contiguous and not ndarray.flags.c_contiguous)
    shape = ndarray.shape  # a tuple of ints, what Array(ndarray) stores
    key = (dtype.str, shape, fortran)
    known = _WRITE.get(key)
    if known is None:
        buffer = io.BytesIO()
        np.save(buffer, ndarray, allow_pickle=False)
        data = buffer.getvalue()
        known = (data[: len(data) - ndarray.nbytes], str(dtype))
        _remember(_WRITE, key, known)
    else:
        data = known[0] + ndarray.tobytes(order="F" if fortran else "C")
    return _array(known[1], shape, _NPY, data)


def _array(dtype: str, shape: tuple[int, ...], stype: str, data: bytes) -> Array:
    """``Array(dtype=..., shape=..., stype=..., data=...)`` without its argument sorting (see :func:`_fast_records_match`)."""
    if not _FAST:
        return Array(dtype=dtype, shape=shape, stype=stype, data=data)
    array = object.__new__(Array)
    array.__dict__.update(_is_dirty=True, dtype=dtype, shape=shape, stype=stype, data=data)
    return array


def _record(arrays: dict[str, Array]) -> ArrayRecord:
    """``ArrayRecord(arrays)`` without copying each Array again (see :func:`_fast_records_match`)."""
    if not _FAST:
        return ArrayRecord(arrays)
    record = ArrayRecord()
    record.__dict__["_data"].update(arrays)
    record.__dict__["_is_dirty"] = True
    return record


# Flower's record constructors type-check every item (~2 us each): 40 us for a client's 19 metrics, as
# much as a tenth of a small client's training step. The reply's values are built here, so the records
# are filled directly where the values are of the types Flower's checks accept.
_RECORDS = (ArrayRecord, MetricRecord, ConfigRecord)
_SCALARS = (int, float, np.float64)  # what Flower's check accepts (np.float64 is a float), exactly these types
_CONFIG_SCALARS = (str, bytes, bool, int, float)  # scalars Flower's ConfigRecord accepts


def metric_record(values: dict[str, int | float]) -> MetricRecord:
    """``MetricRecord(values)`` for plain ints and floats, without the per-item checks."""
    if not _FAST or not all(type(v) in _SCALARS for v in values.values()):
        return MetricRecord(values)
    record = MetricRecord()
    record.__dict__["_data"].update(values)
    return record


def config_record(values: dict[str, str | bytes | bool | int | float]) -> ConfigRecord:
    """``ConfigRecord(values)`` for plain scalars (a reply's one-string info), without the per-item checks."""
    if not _FAST or not all(type(v) in _CONFIG_SCALARS for v in values.values()):
        return ConfigRecord(values)
    record = ConfigRecord()
    record.__dict__["_data"].update(values)
    return record


def record_dict(records: dict[str, ArrayRecord | MetricRecord | ConfigRecord]) -> RecordDict:
    """``RecordDict(records)`` for Flower's own record types, without the per-item checks."""
    if not _FAST or not all(type(v) in _RECORDS for v in records.values()):
        return RecordDict(records)
    out = RecordDict()
    out.__dict__["_data"].update(records)
    return out


def _fast_records_match() -> bool:
    """Whether :func:`_array`, :func:`_record`, :func:`metric_record`, :func:`config_record` and
    :func:`record_dict` build exactly what Flower's constructors build."""
    global _FAST
    try:
        sample = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(0, np.int64)}
        values = {"a": 1, "b": 2.5, "c": -0.0, "d": np.float64(3.0)}
        _FAST = True
        ours = _record({k: from_numpy(v) for k, v in sample.items()})
        ours_m, ours_r = metric_record(values), record_dict({"m": MetricRecord(values), "c": ConfigRecord({"x": "y"})})
        config = {"s": "why", "e": "", "b": b"x", "t": True, "i": 2, "f": 0.5}
        ours_c = config_record(config)
        _FAST = False
        theirs_c = ConfigRecord(config)
        theirs = ArrayRecord({k: from_numpy(v) for k, v in sample.items()})
        theirs_m = MetricRecord(values)
        theirs_r = RecordDict({"m": MetricRecord(values), "c": ConfigRecord({"x": "y"})})
        same = set(vars(ours)) == set(vars(theirs)) and list(ours.keys()) == list(theirs.keys())
        for k in sample:
            a, b = ours[k], theirs[k]
            same = same and type(a) is type(b) and vars(a) == vars(b) and np.array_equal(a.numpy(), b.numpy())
        same = same and ours.object_id == theirs.object_id and ours.is_dirty == theirs.is_dirty
        same = same and vars(ours_m).keys() == vars(theirs_m).keys() and list(ours_m.items()) == list(theirs_m.items())
        same = same and vars(ours_r).keys() == vars(theirs_r).keys() and list(ours_r.keys()) == list(theirs_r.keys())
        same = same and all(type(ours_r[k]) is type(theirs_r[k]) for k in ours_r)
        same = same and vars(ours_c).keys() == vars(theirs_c).keys() and list(ours_c.items()) == list(theirs_c.items())
        same = same and ours_c.object_id == theirs_c.object_id
        return bool(same and ours_m.object_id == theirs_m.object_id and ours_r.object_id == theirs_r.object_id)
    except Exception:  # noqa: BLE001 (another Flower: use its constructors)
        return False
    finally:
        _FAST = False


_FAST = False
# a registered patch (runtime/patches.py): on only for the tested Flower and without FEDELASTIC_PATCHES=0
_FAST = patches.active("flwr") and _fast_records_match()


def record_from_numpy(arrays: Mapping[str, np.ndarray]) -> ArrayRecord:
    return _record({k: from_numpy(np.asarray(v)) for k, v in arrays.items()})


def record_to_numpy(record: ArrayRecord, copy: bool = True) -> dict[str, np.ndarray]:
    """The record's arrays (``copy=False``: read-only views of its bytes, see :func:`to_numpy`)."""
    return {k: to_numpy(v, copy) for k, v in record.items()}


def record_to_torch(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """``record.to_torch_state_dict()``, with the faster reader."""
    return {k: torch.from_numpy(to_numpy(v)) for k, v in record.items()}
