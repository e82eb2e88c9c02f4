"""What every weight encoding provides.

A *codec* turns the bytes a segment stores for one tensor into a *weight object* that kernels
use without knowing how it is stored. The logical tensor (its name, its shape, the role it plays)
never changes with the encoding; only the bytes and the arithmetic that reads them do.

Kernels speak to weights through these verbs:

* ``mm(x)``       x [T, in] float32 -> x @ W.T [T, out] float32   (W is [out, in], a linear map)
* ``mm_t(x)``     x [T, out] float32 -> x @ W [T, in] float32     (the transposed product)
* ``take(ids)``   rows of W as float32 [n, in]                     (an embedding gather)
* ``sub_rows(a, b)`` rows a..b-1 of W as a weight over the same bytes (one head's block, ...)
* ``dense()``     the whole tensor as float32                      (norms, biases, small operands)

and a stacked expert bank [E, out, in] hands out one expert at a time with ``expert(e)``.

An encoding this build cannot execute is still carried: segments keep its entries, tools pass
them through, and only the operation that must decode one refuses, naming it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import ClassVar

import numpy as np

from ..errors import UnsupportedEncoding, VindexError

# How a matrix product treats its float32 activations (an executor choice, recorded in traces):
#   exact  every product multiplies the float32 activation as it is (the default);
#   q8     an int8 or q4 weight's decode-sized product (the rows kernels) quantizes each
#          activation row per block of 32 (d = max|x| / 127, codes round(x / d)) and sums
#          integer products (vindex3.codecs.intrinsics); other encodings and prefill tiles are
#          unchanged.
ACTIVATIONS = ("exact", "q8")


def check_activations(mode) -> str:
    """``mode`` if it is one of ACTIVATIONS, else a refusal naming it."""
    if not isinstance(mode, str) or mode not in ACTIVATIONS:
        from ..errors import ConfigError

        raise ConfigError(f"activations {mode!r} is not a known activation treatment (known: {', '.join(ACTIVATIONS)})")
    return mode


class WeightShapeError(VindexError):
    """A weight verb was called with an operand it cannot take (shape, dtype, row id, expert)."""


class Weight:
    """A logical tensor in one physical encoding. Subclasses implement the verbs they can."""

    encoding: ClassVar[str] = "?"
    activations: ClassVar[str] = "exact"  # see ACTIVATIONS
    # The product kind a fused layer runs this class with ('f32' | 'bf16' | 'i8' | 'i8q8' | 'q4' |
    # 'q4q8', vindex3.exec.ops.fused_layer), declared by each class itself: read from the class's
    # own namespace, never inherited, since a subclass may multiply otherwise. Absent: not fused.
    fused_kind: ClassVar[str | None] = None

    def __init__(self, shape: tuple[int, ...], nbytes: int):
        self.shape = tuple(int(s) for s in shape)
        self.nbytes = int(nbytes)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def mm(self, x: np.ndarray) -> np.ndarray:
        """x [T, in] float32 -> x @ W.T, [T, out] float32."""
        raise UnsupportedEncoding(f"encoding {self.encoding!r} has no matrix product in this build")

    def mm_t(self, x: np.ndarray) -> np.ndarray:
        """x [T, out] float32 -> x @ W, [T, in] float32 (the transposed product, for a kernel that
        contracts over W's rows, e.g. MLA's absorbed keys)."""
        raise UnsupportedEncoding(f"encoding {self.encoding!r} has no transposed product in this build")

    def sub_rows(self, r0: int, r1: int) -> Weight:
        """Of a 2-D weight [out, in]: rows r0 .. r1-1 as a weight [r1-r0, in] over the same bytes."""
        raise UnsupportedEncoding(f"encoding {self.encoding!r} has no row view in this build")

    def take(self, ids: np.ndarray) -> np.ndarray:
        """Rows ``ids`` of W as float32 [len(ids), in]."""
        raise UnsupportedEncoding(f"encoding {self.encoding!r} has no row gather in this build")

    def dense(self) -> np.ndarray:
        """The whole tensor as float32 (a view when the encoding is float32)."""
        raise UnsupportedEncoding(f"encoding {self.encoding!r} cannot be decoded to float32 in this build")

    def nonfinite(self) -> int | None:
        """How many stored values are NaN or infinite (None: this encoding cannot say without
        decoding, which it does not do here)."""
        return None

    def with_activations(self, mode: str) -> Weight:
        """This weight with its products treating activations as ``mode`` (see ACTIVATIONS): a
        view over the same bytes, or the weight itself when ``mode`` changes nothing for its
        encoding."""
        check_activations(mode)
        return self

    def expert(self, e: int) -> Weight:
        """Of a stacked expert bank [E, out, in]: expert ``e`` as a 2-D weight [out, in]."""
        raise UnsupportedEncoding(f"encoding {self.encoding!r} has no expert view in this build")

    @classmethod
    def fused(cls, weights: tuple[Weight, ...]) -> Callable[[np.ndarray], tuple[np.ndarray, ...]] | None:
        """For ``weights``, all of this class: a function x -> ``tuple(w.mm(x) for w in
        weights)``, the same bytes, in fewer kernel launches; None when the encoding has no
        such kernel (see `products`)."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.encoding}, shape={list(self.shape)}, nbytes={self.nbytes})"


def products(weights) -> Callable[[np.ndarray], tuple[np.ndarray, ...]]:
    """x -> ``tuple(w.mm(x) for w in weights)`` for weights that multiply one activation (a
    layer's q/k/v projections, an FFN's gate and up): one launch of a fused kernel when every
    weight has the same class and that class has one (`Weight.fused`), else one product per
    weight. Bound once, when a kernel binds its operands, so a step pays no choice."""
    ws = tuple(weights)
    if len(ws) > 1 and len({type(w) for w in ws}) == 1:
        f = type(ws[0]).fused(ws)
        if f is not None:
            return f

    def each(x: np.ndarray) -> tuple[np.ndarray, ...]:
        return tuple(w.mm(x) for w in ws)

    return each


class Codec:
    """One encoding: its name (the dtype string in segment headers and the ``encoding`` of a
    representation), how many bytes a tensor of a shape takes, and how to view those bytes as
    a weight object without copying the tensor."""

    name: ClassVar[str]
    version: ClassVar[int] = 1
    bits_per_weight: ClassVar[float]
    # REPRESENT (vindex3.represent) writes whole containers in it; the others are kept as a source
    # holds them (a checkpoint's fp8 blocks, a GGUF's block types) or are read from older builds
    represent_target: ClassVar[bool] = False

    def nbytes(self, shape: tuple[int, ...]) -> int:
        return math.ceil(math.prod(shape) * self.bits_per_weight / 8)

    def accepts(self, shape: tuple[int, ...]) -> str | None:
        """None if a tensor of ``shape`` can be written in this encoding, else why not (so an
        encoder can keep that tensor in another encoding and record the reason)."""
        return None

    def weight(self, raw: np.ndarray, shape: tuple[int, ...]) -> Weight:
        """``raw``: the tensor's bytes as a read-only uint8 array (a view of the mapped segment)."""
        raise NotImplementedError

    def encode(self, arr: np.ndarray) -> np.ndarray:
        """float32 ``arr`` -> the bytes this encoding stores for it (uint8, C order)."""
        raise UnsupportedEncoding(f"encoding {self.name!r} cannot be written by this build")


_CODECS: dict[str, Codec] = {}


def register(codec: Codec) -> Codec:
    if codec.name in _CODECS and type(_CODECS[codec.name]) is not type(codec):
        raise ValueError(f"encoding {codec.name!r} is registered twice")
    _CODECS[codec.name] = codec
    return codec


def known() -> list[str]:
    """Encodings this build can execute."""
    return sorted(_CODECS)


def targets() -> tuple[str, ...]:
    """Encodings REPRESENT writes (`Codec.represent_target`), in registration order."""
    return tuple(name for name, c in _CODECS.items() if c.represent_target)


def is_known(name: str) -> bool:
    return name in _CODECS


def cannot_execute(encoding: str, representation: str, obj: str, tensor: str | None = None) -> UnsupportedEncoding:
    """The refusal for a tensor stored in an encoding this build has no codec for: raised by
    whatever must decode it (preparing a slice that reads it), never by opening, describing or
    copying the container."""
    which = f"; its tensor {tensor} is stored that way" if tensor else ""
    return UnsupportedEncoding(
        f"representation {representation} of object {obj} has encoding {encoding!r}, which this build cannot execute "
        f"(executable: {', '.join(known())}){which}",
        hint="a build with that codec can run it; this one can still open, describe, verify and copy the container",
    )


def get(name: str, *, what: str = "") -> Codec:
    """The codec for ``name``, or a refusal naming the encoding (and ``what`` needed it)."""
    codec = _CODECS.get(name)
    if codec is None:
        where = f"{what} has " if what else ""
        raise UnsupportedEncoding(
            f"{where}encoding {name!r}, which this build cannot execute (executable: {', '.join(known())})",
        )
    return codec
