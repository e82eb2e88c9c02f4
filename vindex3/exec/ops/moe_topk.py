"""Top-k selection that breaks ties exactly as torch.topk does on CPU (torch 2.13, float32).

Why this exists: a router picks k experts out of E by score, and when two scores are equal the
choice is decided by the order the sorting algorithm happens to visit them in, not by any rule
about indices. A different tie-break sends a token to a different expert, which changes the
output by the whole difference between two experts. So the selection here reproduces the
reference's algorithm step by step.

torch's CPU kernel (ATen ``topk_impl_loop``) fills a queue of (value, index) pairs in index
order and then, with the comparator ``a.value > b.value`` (NaN counted as the largest):

* if ``k * 64 <= n``: ``std::partial_sort(q, q + k, q + n)`` (heap select, then heap sort);
* else: ``std::nth_element(q, q + k - 1, q + n)`` (introselect), and, only when ``sorted``,
  ``std::sort(q, q + k - 1)`` (the k-th element is already in place).

and returns the first k pairs in queue order. The libstdc++ algorithms are deterministic but not
stable: equal values come out in whatever order the partitioning left them, and with
``sorted=False`` even the order of unequal values is the partition's. Both are reproduced here
from libstdc++'s definitions (introselect with median-of-three pivots and unguarded partitions,
heap select, introsort with a 16-element insertion-sort threshold), compiled with numba. The
test suite checks them against torch.topk itself on tie-heavy inputs for both branches and
both ``sorted`` settings; only ``largest=True`` exists (no router selects the smallest).
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["topk", "topk_rows"]

_THRESHOLD = 16  # libstdc++ _S_threshold: ranges at most this long are insertion-sorted


@numba.njit(inline="always")
def _gt(a, b):  # pragma: no cover - compiled
    """The reference comparator for largest=True: a before b."""
    return a > b or (np.isnan(a) and not np.isnan(b))


@numba.njit(inline="always")
def _swap(v, ix, i, j):  # pragma: no cover - compiled
    tv = v[i]
    v[i] = v[j]
    v[j] = tv
    ti = ix[i]
    ix[i] = ix[j]
    ix[j] = ti


@numba.njit
def _lg(n):  # pragma: no cover - compiled
    """floor(log2(n)) for n >= 1 (std::__lg)."""
    r = 0
    while n > 1:
        n >>= 1
        r += 1
    return r


# ----------------------------------------------------------------- heap (std::__adjust_heap etc.)


@numba.njit
def _push_heap(v, ix, first, hole, top, val, vix):  # pragma: no cover - compiled
    parent = (hole - 1) // 2
    while hole > top and _gt(v[first + parent], val):
        v[first + hole] = v[first + parent]
        ix[first + hole] = ix[first + parent]
        hole = parent
        parent = (hole - 1) // 2
    v[first + hole] = val
    ix[first + hole] = vix


@numba.njit
def _adjust_heap(v, ix, first, hole, length, val, vix):  # pragma: no cover - compiled
    top = hole
    child = hole
    while child < (length - 1) // 2:
        child = 2 * (child + 1)
        if _gt(v[first + child], v[first + child - 1]):
            child -= 1
        v[first + hole] = v[first + child]
        ix[first + hole] = ix[first + child]
        hole = child
    if (length & 1) == 0 and child == (length - 2) // 2:
        child = 2 * (child + 1)
        v[first + hole] = v[first + child - 1]
        ix[first + hole] = ix[first + child - 1]
        hole = child - 1
    _push_heap(v, ix, first, hole, top, val, vix)


@numba.njit
def _make_heap(v, ix, first, last):  # pragma: no cover - compiled
    length = last - first
    if length < 2:
        return
    parent = (length - 2) // 2
    while True:
        _adjust_heap(v, ix, first, parent, length, v[first + parent], ix[first + parent])
        if parent == 0:
            return
        parent -= 1


@numba.njit
def _pop_heap(v, ix, first, last, result):  # pragma: no cover - compiled
    val = v[result]
    vix = ix[result]
    v[result] = v[first]
    ix[result] = ix[first]
    _adjust_heap(v, ix, first, 0, last - first, val, vix)


@numba.njit
def _heap_select(v, ix, first, middle, last):  # pragma: no cover - compiled
    _make_heap(v, ix, first, middle)
    for i in range(middle, last):
        if _gt(v[i], v[first]):
            _pop_heap(v, ix, first, middle, i)


@numba.njit
def _sort_heap(v, ix, first, last):  # pragma: no cover - compiled
    while last - first > 1:
        last -= 1
        _pop_heap(v, ix, first, last, last)


@numba.njit
def _partial_sort(v, ix, first, middle, last):  # pragma: no cover - compiled
    _heap_select(v, ix, first, middle, last)
    _sort_heap(v, ix, first, middle)


# ----------------------------------------------------------------- partition and insertion sort


@numba.njit
def _move_median_to_first(v, ix, result, a, b, c):  # pragma: no cover - compiled
    if _gt(v[a], v[b]):
        if _gt(v[b], v[c]):
            _swap(v, ix, result, b)
        elif _gt(v[a], v[c]):
            _swap(v, ix, result, c)
        else:
            _swap(v, ix, result, a)
    elif _gt(v[a], v[c]):
        _swap(v, ix, result, a)
    elif _gt(v[b], v[c]):
        _swap(v, ix, result, c)
    else:
        _swap(v, ix, result, b)


@numba.njit
def _unguarded_partition(v, ix, first, last, pivot):  # pragma: no cover - compiled
    while True:
        while _gt(v[first], v[pivot]):
            first += 1
        last -= 1
        while _gt(v[pivot], v[last]):
            last -= 1
        if not first < last:
            return first
        _swap(v, ix, first, last)
        first += 1


@numba.njit
def _unguarded_partition_pivot(v, ix, first, last):  # pragma: no cover - compiled
    mid = first + (last - first) // 2
    _move_median_to_first(v, ix, first, first + 1, mid, last - 1)
    return _unguarded_partition(v, ix, first + 1, last, first)


@numba.njit
def _unguarded_linear_insert(v, ix, last):  # pragma: no cover - compiled
    val = v[last]
    vix = ix[last]
    nxt = last - 1
    while _gt(val, v[nxt]):
        v[last] = v[nxt]
        ix[last] = ix[nxt]
        last = nxt
        nxt -= 1
    v[last] = val
    ix[last] = vix


@numba.njit
def _insertion_sort(v, ix, first, last):  # pragma: no cover - compiled
    if first == last:
        return
    for i in range(first + 1, last):
        if _gt(v[i], v[first]):
            val = v[i]
            vix = ix[i]
            for j in range(i, first, -1):  # move_backward(first, i, i + 1)
                v[j] = v[j - 1]
                ix[j] = ix[j - 1]
            v[first] = val
            ix[first] = vix
        else:
            _unguarded_linear_insert(v, ix, i)


# ----------------------------------------------------------------- nth_element and sort


@numba.njit
def _nth_element(v, ix, first, nth, last):  # pragma: no cover - compiled
    if first == last or nth == last:
        return
    depth = _lg(last - first) * 2
    while last - first > 3:
        if depth == 0:
            _heap_select(v, ix, first, nth + 1, last)
            _swap(v, ix, first, nth)  # the nth largest to its final place
            return
        depth -= 1
        cut = _unguarded_partition_pivot(v, ix, first, last)
        if cut <= nth:
            first = cut
        else:
            last = cut
    _insertion_sort(v, ix, first, last)


@numba.njit
def _sort(v, ix, first, last):  # pragma: no cover - compiled
    """std::sort: introsort down to 16-element ranges, then one insertion-sort pass. The
    recursion on the right part is an explicit stack; the ranges are disjoint, so the order
    they are visited in does not change the result."""
    if first == last:
        return
    stack = np.empty((2 * _lg(last - first) + 2, 3), np.int64)
    sp = 0
    stack[0, 0] = first
    stack[0, 1] = last
    stack[0, 2] = _lg(last - first) * 2
    sp = 1
    while sp > 0:
        sp -= 1
        lo = stack[sp, 0]
        hi = stack[sp, 1]
        depth = stack[sp, 2]
        while hi - lo > _THRESHOLD:
            if depth == 0:
                _partial_sort(v, ix, lo, hi, hi)
                break
            depth -= 1
            cut = _unguarded_partition_pivot(v, ix, lo, hi)
            if sp == stack.shape[0]:
                grown = np.empty((2 * stack.shape[0], 3), np.int64)
                grown[:sp] = stack[:sp]
                stack = grown
            stack[sp, 0] = cut
            stack[sp, 1] = hi
            stack[sp, 2] = depth
            sp += 1
            hi = cut
    if last - first > _THRESHOLD:
        _insertion_sort(v, ix, first, first + _THRESHOLD)
        for i in range(first + _THRESHOLD, last):
            _unguarded_linear_insert(v, ix, i)
    else:
        _insertion_sort(v, ix, first, last)


@numba.njit(cache=True)
def _topk_rows(values, k, sorted_, out_v, out_i):  # pragma: no cover - compiled
    T, n = values.shape
    v = np.empty(n, values.dtype)
    ix = np.empty(n, np.int64)
    partial = k * 64 <= n
    for t in range(T):
        for j in range(n):
            v[j] = values[t, j]
            ix[j] = j
        if partial:
            _partial_sort(v, ix, 0, k, n)
        else:
            _nth_element(v, ix, 0, k - 1, n)
            if sorted_:
                _sort(v, ix, 0, k - 1)
        for j in range(k):
            out_v[t, j] = v[j]
            out_i[t, j] = ix[j]


def topk_rows(values: np.ndarray, k: int, *, sorted: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Row-wise top-k of ``values`` [T, n] (largest first): (values [T, k], indices int64
    [T, k]) in exactly the order ``torch.topk(values, k, dim=-1, sorted=sorted)`` returns."""
    if values.ndim != 2:
        raise ValueError(f"topk_rows: values must be 2-D [rows, n], got shape {list(values.shape)}")
    T, n = values.shape
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= n:
        raise ValueError(f"topk_rows: k must be an int in [1, {n}], got {k!r}")
    a = np.ascontiguousarray(values)
    out_v = np.empty((T, int(k)), a.dtype)
    out_i = np.empty((T, int(k)), np.int64)
    if T:
        _topk_rows(a, int(k), bool(sorted), out_v, out_i)
    return out_v, out_i


def topk(values: np.ndarray, k: int, *, sorted: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """``torch.topk(values, k, dim=-1, sorted=sorted)`` over the last axis of any shape."""
    lead = values.shape[:-1]
    v, i = topk_rows(values.reshape(-1, values.shape[-1]), k, sorted=sorted)
    return v.reshape(*lead, v.shape[-1]), i.reshape(*lead, i.shape[-1])
