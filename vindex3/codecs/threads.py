"""Threads of the rows kernels (decode-sized products), and the lock around numba's pool.

* **How many.** Every rows-kernel launch runs with `count()` numba threads:
  ``VINDEX3_DECODE_THREADS`` (default 1), the same number a decode-sized pass splits its large
  BLAS products over (`gemm`, vindex3.exec.engine), so one setting governs a decode step
  whatever runs it. One thread is the default because on a busy machine a static two-way split
  waits for its descheduled half (measured many times slower, docs/representations-notes.md); set 2 on a
  quiet two-core machine. The result does not depend on the count: each output element is
  computed by one thread from start to end (tests/test_codecs.py asserts it), so a Full run, a
  Draft and shard actors give the same bytes whatever their thread settings.
* **One entry at a time.** numba's default threading layer (workqueue) aborts the process when
  two Python threads launch parallel kernels at once, and numba's thread count is a per-thread
  setting. Every launch therefore goes through `launch()`: a process-wide lock, and the count
  applied to the launching thread when it differs from what that thread last set. Two streams
  decoding in two threads (the server's model workers, an embedding application) take turns
  kernel by kernel; on two cores they could not run faster side by side anyway.

* **Which launches go parallel.** A parallel launch costs more than a serial call (numba's
  pool hands the work out and waits for it: ~2 us with spinning workers, ~10 us more with
  sleeping ones, bench/intdot_passes.py), so `parallel()` sends a weight to the pool only when
  the count is above one and the weight has at least ``PARALLEL_MIN_BYTES`` (its serial pass
  takes tens of microseconds); smaller ones (SmolLM2's k/v projections, int8 and q4 matrices
  of the hidden width) run the serial kernel. The bytes are the same either way. With the
  dots kernels' software prefetch (intrinsics.PREFETCH) measured again on cold, file-mapped
  weights at load 9-12 (bench/prefetch_distance.py --threads 2, results/prefetch_threads.json):
  two threads lost on every f32 and q4 shape of SmolLM2 and the 1.1B shape but 576x1536 f32,
  and won only on int8's largest (the 1.1B head 32000x2048 4.5 -> 3.6 ms); no evidence to move
  the threshold either way, so it stays (and the count stays 1 by default).
* **Teams.** At more than one thread (unless ``VINDEX3_TEAMS=0``, `team`), a fused layer runs as
  one parallel region and a pool-sized single weight (a head) as a team too: the region's threads
  take row tasks from counters (a contiguous share each, then what the others left) instead of
  each holding a fixed share, so a worker that
  wakes late leaves its share to the thread that is running (vindex3.codecs.intrinsics
  `team_kernel`; docs/container.md measures it: 1.18-1.24x the tokens/s of a region per product
  at two threads on AMD Zen 4). Same bytes: each output element is still one thread's row dot.
* **Workers sleep when idle.** numba's OpenMP workers spin after a parallel region by default;
  on a machine whose cores are shared with other processes a spinning worker takes the core
  the decode thread needs and a parallel region waits for a descheduled one. Measured on this
  2-core machine at load ~9 with SmolLM2 f32 decode at 2 threads: 0.9-1.3 tok/s with spinning
  workers, 17.6 tok/s with ``OMP_WAIT_POLICY=PASSIVE`` (1 thread: 14-35 tok/s in the same
  minutes). So this module sets ``OMP_WAIT_POLICY=PASSIVE`` unless the environment already
  says otherwise (``ACTIVE`` restores spinning for a machine kept to oneself); it must be set
  before numba first loads its threading layer, which importing this module precedes.
  Measured again on an AMD Zen 5 two-core machine (bench/thread_wait_policy.py,
  results/thread_wait_policy.json; SmolLM2 decode, tokens/s, 2 interleaved rounds). Quiet (load
  1.6-2.2): f32 67-68 at one thread, 60-63 at two sleeping, 91-92 at two spinning (``ACTIVE``);
  int8 q8 217-229 at one, 184-193 sleeping, 227-243 spinning. With two busy loops beside it
  (load 1.7-3.9, rising as they ran): f32 41-51 at one, 50-54 sleeping, 26-30 spinning; int8
  q8 140-168 at one, 153-209 sleeping, 98-116 spinning; a bounded spin (``GOMP_SPINCOUNT=20000``) fell between and
  once to 31. Sleeping workers cost two threads their gain on a quiet machine and spinning ones
  cost more than that on a busy one.
* **Workers spin a bounded while, then sleep** (the default since a later round). With teams a
  decode step is ~31 parallel regions (30 layers, the head) a few microseconds apart, so a
  worker that sleeps after each one is woken ~31 times a token; one that spins
  ``GOMP_SPINCOUNT`` = `SPIN_COUNT` (20000; libgomp's rough rate is 100000 spins a millisecond,
  so ~0.2 ms) catches the next region and still sleeps while nothing runs (between generations,
  a REPL waiting for input). Measured on an AMD Zen 4 two-core machine (bench/thread_wait_policy.py,
  results/thread_wait_policy_zen4_spins.json and _zen4_bounded.json, 3 interleaved rounds each;
  medians, tokens/s). Quiet (load 0.4-1.9): int8 q8 sleeping 140.2 / 161.5, spinning 165.3 /
  168.4, bounded 169.7 / 167.9; f32 sleeping 56.9, spinning 66.4, bounded 68.7. With two busy
  loops beside it (load 1.5-3.9): int8 q8 sleeping 71.3 / 56.3, spinning 45.0 / 68.6, bounded
  83.6 / 87.5 (one thread 113.1 / 107.9); f32 sleeping 30.5, spinning 19.2, bounded 26.7 (one
  thread 31.3). So the bounded spin is as fast as spinning on a quiet machine and as good as or
  better than sleeping on a busy one except f32 there (-12%); on a busy machine one thread (the
  default count) is faster than two in every form. This module sets ``OMP_WAIT_POLICY=PASSIVE``
  and ``GOMP_SPINCOUNT=20000`` when the environment sets no ``OMP_WAIT_POLICY`` (an explicit
  ``GOMP_SPINCOUNT`` is kept); ``OMP_WAIT_POLICY=PASSIVE`` sleeps at once and ``ACTIVE`` spins
  without bound (docs/container.md). Both must be set before numba first loads its threading
  layer, which importing this module precedes. One thread starts no region, so this changes
  nothing at the default count.

* **Large products split themselves; BLAS keeps one thread.** Every pass of the executor
  (vindex3.exec.engine `_pass_limit`) holds BLAS at one thread, and a product large enough
  (`gemm`: at least ``GEMM_SPLIT_MIN`` multiply-adds a part) is computed as ``GEMM_BLOCKS``
  blocks of output columns whose cuts depend on the product's shape only (`gemm_cuts`). The
  blocks are shared among the pass's threads (the decode count up to ``SMALL_PASS`` positions,
  every core this process may use beyond, `pass_threads`): the calling thread computes the
  first and a small pool of Python threads the others (numpy lets go of the GIL inside BLAS);
  at one thread the caller computes them all in turn. Where numpy's own OpenBLAS can be called
  from compiled code, the blocks are instead one parallel region of numba's pool, each numpy's
  own call for its block (vindex3.codecs.blasblocks: a Python thread's block fought numba's
  still-spinning worker for a core). Why not BLAS's own threads: after every
  product OpenBLAS's worker spins for 2^28 cycles (~80 ms) before it sleeps, so the compiled
  attention, SiLU and norms between a prompt's products shared a core with it (a 512-token f32
  prefill's attention took 290 ms at two threads against 234 at one, its norms 108 against 17;
  docs/container.md, "Products split by the executor"). A pool thread sleeps on a queue the
  moment its part is done. **Same bytes at every thread count by construction**: each block is
  the same single-threaded BLAS call whoever runs it. They are not always one whole BLAS
  call's bytes: OpenBLAS's Haswell/Zen kernels (AMD Zen 3, 0.3.31) sum an element in an order
  that depends on the product's whole shape (a block of 288 of 576 columns differs from the
  whole product in the last bits, even in columns far from the cut), where its SkylakeX kernels
  do not; an earlier round promised split = whole and failed there
  (tests/test_split_products.py now checks the blocks across thread counts, and against the
  whole product within a bound).

This module does not import numba at import: `launch()` is entered by code that is about to call
a kernel, which has imported numba already, and a product split over more than one thread imports
vindex3.codecs.blasblocks.
"""

from __future__ import annotations

import itertools
import os
import threading

from ..switches import EnvSwitch, set_switch

SPIN_COUNT = 20000  # GOMP_SPINCOUNT when the environment names no wait policy (module docstring)
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ.setdefault("GOMP_SPINCOUNT", str(SPIN_COUNT))

PARALLEL_MIN_BYTES = 1 << 20  # weight bytes from which a launch goes to numba's pool
TEAM_PHASES = 7  # the phases of a team layer (vindex3.exec.ops.fused_source)


def team_ctl_len(nt: int, phases: int = TEAM_PHASES) -> int:
    """int64 counters (zeros) a team call of ``nt`` threads over ``phases`` phases takes: 16
    slots of 8 int64s (one cache line each, vindex3.codecs.atomics.SLOT) for the phases' arrival
    and finished counts and flags, then one slot per phase and thread share
    (vindex3.codecs.intrinsics `team_kernel`)."""
    return (16 + phases * max(1, nt)) * 8


class _TeamSwitch:
    on = EnvSwitch("VINDEX3_TEAMS")


TEAM = _TeamSwitch()

_LOCK = threading.Lock()
_local = threading.local()
_count: int | None = None


def _from_env() -> int:
    raw = os.environ.get("VINDEX3_DECODE_THREADS", "1")
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        from ..errors import ConfigError

        raise ConfigError(f"VINDEX3_DECODE_THREADS={raw!r} is not a positive whole number of threads")
    return n


def count() -> int:
    """Threads a decode-sized pass uses (rows kernels and BLAS alike)."""
    global _count
    if _count is None:
        _count = _from_env()
    return _count


def numba_count() -> int:
    """The threads a parallel region launched under `launch()` gets: `count()`, at most numba's
    pool size."""
    import numba

    return min(count(), numba.config.NUMBA_NUM_THREADS)


def parallel(nbytes: int) -> bool:
    """Should a launch over ``nbytes`` of weights use numba's pool (see the module docstring)?"""
    return count() > 1 and nbytes >= PARALLEL_MIN_BYTES


def team(nbytes: int | None = None) -> bool:
    """Do parallel launches run as teams (one region whose threads take row tasks from shared
    counters, vindex3.codecs.intrinsics `team_kernel`) rather than a fixed split? At more than one
    thread, unless ``VINDEX3_TEAMS=0``; with ``nbytes``, only for a launch `parallel` sends to the
    pool."""
    return count() > 1 and TEAM.on and (nbytes is None or nbytes >= PARALLEL_MIN_BYTES)


def set_team(flag: bool | None) -> None:
    """Turn teams on or off for this process (None: read ``VINDEX3_TEAMS`` again)."""
    set_switch(TEAM, "on", flag)


def set_count(n: int | None) -> None:
    """Set the count for this process (None: read ``VINDEX3_DECODE_THREADS`` again)."""
    global _count
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        from ..errors import ConfigError

        raise ConfigError(f"decode threads must be a positive whole number, got {n!r}")
    _count = n


class _Launch:
    """The context `launch()` returns: a plain class, not a generator context manager, because
    a decode step enters it about 200 times (a generator-based one cost ~3 us per entry)."""

    __slots__ = ()

    def __enter__(self):
        _LOCK.acquire()
        try:
            want = count()
            if getattr(_local, "n", None) != want:
                import numba

                numba.set_num_threads(numba_count())
                _local.n = want
        except BaseException:
            _LOCK.release()
            raise
        return self

    # The release is the lock's own C method, not a Python function: a Ctrl-C that arrives while
    # a kernel runs is raised at the next Python function entry, which a Python __exit__ would be
    # (before its first line), leaving the lock held and every later launch waiting on it for
    # ever (the REPL hung on the first statement after an interrupted GENERATE;
    # tests/test_launch_interrupt.py).
    __exit__ = _LOCK.__exit__


_LAUNCH = _Launch()


def launch() -> _Launch:
    """Hold the pool for one kernel launch, with `count()` threads (capped at numba's pool)."""
    return _LAUNCH


# Each block of a split product has at least this many multiply-adds (T x rows x cols): smaller
# products stay one BLAS call (a block would cost its own packing for little work). OpenBLAS also
# sends smaller products to kernels that sum in another order (its small-matrix kernels up to
# 100^3, its SkylakeX "direct" sgemm up to 28 x 512^2).
GEMM_SPLIT_MIN = 1 << 23
# Blocks a large product is cut into, whatever the thread count (so its bytes never depend on
# it): two, the cores of the machines this project is measured on. One thread computing both
# costs 0-6 % against one whole call on SmolLM2's prompt-sized products (AMD Zen 3, OpenBLAS
# 0.3.31, best of 7: T = 512 576x576 5.32 -> 5.33 ms, 576x1536 10.2 -> 10.9, 1536x576 13.8 ->
# 14.3; T = 80 576x576 0.80 -> 0.81, 1536x576 1.74 -> 1.69).
GEMM_BLOCKS = 2
_split = threading.local()
_pool: list = []


def gemm_cuts(T: int, K: int, N: int) -> list[int]:
    """The column cuts of a [T, K] x [K, N] product: ``[0, N]`` (one call) below
    ``GEMM_SPLIT_MIN`` multiply-adds a block, else ``GEMM_BLOCKS`` blocks of at least 64 columns
    cut at multiples of 16. A function of the shape alone."""
    parts = min(GEMM_BLOCKS, N // 64, (T * K * N) // GEMM_SPLIT_MIN)
    if parts <= 1:
        return [0, N]
    return [(N * i // parts) // 16 * 16 for i in range(parts)] + [N]


def usable_cores() -> int:
    """CPUs this process may run on (its affinity where the OS tells it)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class SplitProducts:
    """The context a pass runs in: `gemm` shares a large product's blocks among ``n`` threads
    (default `count()`) in this thread while it is entered (BLAS must be held at one thread
    meanwhile). The count changes who computes a block, never the bytes."""

    __slots__ = ("_n", "_prev")

    def __init__(self, n: int | None = None):
        self._n = n

    def __enter__(self):
        self._prev = getattr(_split, "n", 1)
        _split.n = count() if self._n is None else max(1, int(self._n))
        return self

    def __exit__(self, *exc) -> bool:
        _split.n = self._prev
        return False


def _workers():
    if not _pool:
        from concurrent.futures import ThreadPoolExecutor

        _pool.append(ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1), thread_name_prefix="vindex3-gemm"))
    return _pool[0]


if hasattr(os, "register_at_fork"):  # a forked child has none of its parent's threads
    os.register_at_fork(after_in_child=_pool.clear)


def gemm(x, bT, out=None):
    """``x @ bT`` for float32 ``x`` [T, K] and ``bT`` [K, N], into ``out`` when given, as the
    blocks of `gemm_cuts` (in or out of a pass: the bytes depend on the shape only). Inside a
    `SplitProducts` context of more than one thread the blocks run at once: as one parallel
    region of numba's pool where numpy's own BLAS can be called from it (vindex3.codecs.blasblocks),
    else on a pool of Python threads, the caller computing the first (module docstring)."""
    import numpy as np

    if x.ndim == 2 and bT.ndim == 2:
        cuts = gemm_cuts(x.shape[0], x.shape[1], bT.shape[1])
        if len(cuts) > 2:
            y = out if out is not None else np.empty((x.shape[0], bT.shape[1]), np.result_type(x, bT))
            blocks = list(itertools.pairwise(cuts))
            n = min(getattr(_split, "n", 1), len(blocks))
            if n > 1:
                from . import blasblocks

                with launch():
                    if blasblocks.run(x, bT, y, cuts, n):  # one region of numba's pool (blasblocks)
                        return y
            futs = [_workers().submit(np.matmul, x, bT[:, a:b], out=y[:, a:b]) for a, b in blocks[1:n]]
            try:
                for a, b in blocks[:1] + blocks[n:]:
                    np.matmul(x, bT[:, a:b], out=y[:, a:b])
            finally:
                for f in futs:
                    f.result()
            return y
    return np.matmul(x, bT, out=out)


_kernels: list = []


def kernels():
    """vindex3.codecs.kernels, imported on first use (numba costs resident memory a model that
    never runs a rows kernel should not pay) and then returned without the import machinery,
    which a decode step would otherwise enter a few hundred times."""
    if not _kernels:
        from . import kernels as k

        _kernels.append(k)
    return _kernels[0]


_intdot: list = []


def intdot():
    """vindex3.codecs.intrinsics, imported on first use (as `kernels`)."""
    if not _intdot:
        from . import intrinsics as k

        _intdot.append(k)
    return _intdot[0]


def one_array_type(arrays) -> bool:
    """Do ``arrays`` share the one numba array type (dtype, dimensions, C layout, read-only or
    not) that a tuple a kernel indexes at run time must have?"""
    a0 = arrays[0]
    return all(
        a.dtype == a0.dtype and a.ndim == a0.ndim and a.flags.c_contiguous and a.flags.writeable == a0.flags.writeable
        for a in arrays
    )
