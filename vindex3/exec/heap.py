"""How the C allocator keeps the memory of a pass's large temporaries.

A prompt's pass allocates arrays of megabytes many times a layer (a 512-token SmolLM2 prefill:
every product's output, 512 x 1536 float32 = 3 MB for gate and up, the SiLU's output, the
attention's), each freed a few calls later. glibc's malloc serves a request above its mmap
threshold with a fresh mapping, and gives the top of its heap back to the system once more than
its trim threshold lies free there; both start low and move only as the process frees large
blocks (128 kB, raised to the largest mapped block freed, at most 32 MB; trim at twice that). A
block that comes back from the system comes back as untouched pages, and the first write to each
4 kB page is a page fault: the SiLU over gate and up, a numpy-speed loop of ~0.7 ms on warm
memory, took 2.8 ms a layer in a prefill, its output's pages faulted in every time.

`tune` (called when an executor is built) fixes both thresholds for the process: blocks up to
``MMAP_THRESHOLD`` come from the heap, and the heap keeps up to ``TRIM_THRESHOLD`` free at its top
before it trims. Measured on an AMD Zen 3 (2 cores, glibc 2.36, 1 thread, prefill-512 of SmolLM2
f32, four runs in turn): 1.93-1.98 s -> 1.77-1.80 s, the SiLU 87 -> 32 ms, the products 1.37-1.41
-> 1.31-1.32 s, attention 400-412 -> 382-396 ms, peak resident memory unchanged (777 MB). The
cost is memory a process keeps after it frees it: at most ``TRIM_THRESHOLD`` of free heap top,
plus what the heap's fragments hold (a block above 32 MB is still mapped and given back on free).

The allocator is the process's, not this project's: a program that embeds vindex3 and wants its
own malloc settings sets ``VINDEX3_MALLOC_TUNE=0`` (vindex3.switches), and nothing is changed.
On a C library other than glibc nothing is changed either (`tune` returns False). It changes
which memory an array lives in, never a value computed in it."""

from __future__ import annotations

import platform

from ..switches import read_switch

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 1 << 30
_state: list[bool] = []


def tune() -> bool:
    """Set the process's malloc thresholds once (module docstring); True if they were set.
    ``VINDEX3_MALLOC_TUNE=0`` leaves them alone; so does a C library other than glibc."""
    if _state:
        return _state[0]
    on = read_switch("VINDEX3_MALLOC_TUNE")  # a bad value is refused before anything is set
    done = False
    if on and platform.libc_ver()[0] == "glibc":
        import ctypes

        try:
            libc = ctypes.CDLL(None)
            done = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
                libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
        except (OSError, AttributeError):  # no mallopt to call: the allocator stays as it is
            done = False
    _state.append(done)
    return done


def tuned() -> bool | None:
    """Whether `tune` set the thresholds in this process (None: not asked yet)."""
    return _state[0] if _state else None
