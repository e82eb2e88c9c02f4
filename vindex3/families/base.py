"""What every family lowering shares: the grades a config key can receive, the reader that grades
each key as it is read, the lowering a family produces (a graph plus tensor placements), and the
registry of families by ``model_type``.

Families (vindex3.families.*) and admission (vindex3.admit) both build on this module; it imports
neither of them, so there is no cycle between them."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel

from ..sources import CheckpointSource

# Grades a key can receive.
CONSUMED = "consumed"  # lowered into the graph
METADATA = "metadata"  # kept as a fact about the model, no effect on execution
IGNORED = "ignored"  # known safe to ignore for inference (training-only and the like)
DEFAULTED = "reference_default"  # absent, and the reference implementation fixes its value
UNKNOWN = "unknown"  # blocks
UNSUPPORTED = "unsupported"  # a known key with a value we cannot execute; blocks
STRUCTURE = "structure"  # a defect in the tensors or the layout; blocks
UNREAD = "unread"  # not reached: the lowering stopped at a refusal (which blocks)


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    return v


class Finding(BaseModel):
    category: str
    key: str
    value: Any = None
    message: str
    blocks: bool

    def text(self) -> str:
        mark = "BLOCKS" if self.blocks else "ok"
        return f"[{mark}] {self.category}: {self.key} = {self.value!r} — {self.message}"


class ConfigReader:
    """Reads config keys and records a finding for each, so that nothing is silently ignored."""

    # Keys every Hugging Face config may carry that do not change inference.
    GENERIC_METADATA: ClassVar[set[str]] = {
        "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "bos_token_id",
        "eos_token_id", "pad_token_id", "_name_or_path", "name_or_path", "max_position_embeddings",
        "use_cache", "initializer_range", "sep_token_id", "decoder_start_token_id",
    }
    GENERIC_IGNORED: ClassVar[dict[str, str]] = {
        "attention_dropout": "dropout is a training-time setting",
        "hidden_dropout": "dropout is a training-time setting",
        "embd_pdrop": "dropout is a training-time setting",
        "resid_pdrop": "dropout is a training-time setting",
        "pretraining_tp": "tensor-parallel slicing used in pretraining; inference math is the same",
        "output_attentions": "an output option of the reference, not model math",
        "output_hidden_states": "an output option of the reference, not model math",
        "return_dict": "an output option of the reference, not model math",
        "id2label": "classification-head labels, unused by a causal LM",
        "label2id": "classification-head labels, unused by a causal LM",
        "problem_type": "classification-head setting, unused by a causal LM",
        "tokenizer_class": "the tokenizer is snapshotted from its own files",
        "chunk_size_feed_forward": "a memory option of the reference; same math",
        "torchscript": "an export option of the reference",
        "rescale_prenorm_residual": "an initialisation option, no effect on trained weights",
        "router_aux_loss_coef": "a training loss coefficient",
        "output_router_logits": "an output option of the reference",
    }

    def __init__(self, config: dict):
        self.config = config
        self.findings: list[Finding] = []
        self.graded: set[str] = set()

    def _grade(self, key: str, category: str, message: str, blocks: bool = False) -> None:
        self.graded.add(key)
        self.findings.append(Finding(category=category, key=key, value=_jsonable(self.config.get(key)), message=message, blocks=blocks))

    def has(self, key: str) -> bool:
        return key in self.config

    def take(self, key: str, message: str, *, default: Any = ..., default_reason: str = "") -> Any:
        """Consume a key into the graph. ``default`` is used only where the reference
        implementation fixes the value when the key is absent, and is recorded as such."""
        if key in self.config:
            self._grade(key, CONSUMED, message)
            return self.config[key]
        if default is ...:
            self.refuse(key, f"required key is absent: {message}", category=STRUCTURE)
            return None
        self.graded.add(key)
        self.findings.append(
            Finding(category=DEFAULTED, key=key, value=_jsonable(default), message=f"absent; {default_reason or 'the reference fixes this value'}", blocks=False)
        )
        return default

    def meta(self, key: str, message: str) -> Any:
        if key in self.config:
            self._grade(key, METADATA, message)
        return self.config.get(key)

    def ignore(self, key: str, message: str) -> None:
        if key in self.config:
            self._grade(key, IGNORED, message)

    def refuse(self, key: str, message: str, *, category: str = UNSUPPORTED) -> None:
        # A key refused after it was taken keeps one finding: the refusal replaces the grade.
        if key in self.graded:
            self.findings = [f for f in self.findings if f.key != key or f.blocks]
        self.graded.add(key)
        self.findings.append(Finding(category=category, key=key, value=_jsonable(self.config.get(key)), message=message, blocks=True))

    # -- typed takes: a value of the wrong type or out of range is refused by name -----------
    # Each returns the value, or None when the key is refused (or absent with a None default,
    # or null where ``nullable``); a refusal blocks admission, so a None never reaches a graph.

    def take_int(self, key: str, message: str, *, minimum: int = 1, nullable: bool = False, default: Any = ...,
                 default_reason: str = "") -> int | None:
        present = key in self.config
        v = self.take(key, message, default=default, default_reason=default_reason)
        if not present or (v is None and nullable):
            return v
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            self.refuse(key, f"expected an integer >= {minimum}{' or null' if nullable else ''}, found {v!r}")
            return None
        return v

    def take_number(self, key: str, message: str, *, minimum: float | None = None, nonzero: bool = False,
                    default: Any = ..., default_reason: str = "") -> float | None:
        present = key in self.config
        v = self.take(key, message, default=default, default_reason=default_reason)
        if not present:
            return None if v is None else float(v)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        ok = ok and (minimum is None or v >= minimum) and not (nonzero and v == 0)
        if not ok:
            want = "a finite number" + (f" >= {minimum:g}" if minimum is not None else "") + (", not 0" if nonzero else "")
            self.refuse(key, f"expected {want}, found {v!r}")
            return None
        return float(v)

    def take_bool(self, key: str, message: str, *, default: Any = ..., default_reason: str = "") -> bool | None:
        present = key in self.config
        v = self.take(key, message, default=default, default_reason=default_reason)
        if present and not isinstance(v, bool):
            self.refuse(key, f"expected true or false, found {v!r}")
            return None
        return v

    def take_str(self, key: str, message: str, *, default: Any = ..., default_reason: str = "") -> str | None:
        present = key in self.config
        v = self.take(key, message, default=default, default_reason=default_reason)
        if present and not isinstance(v, str):
            self.refuse(key, f"expected a string, found {v!r}")
            return None
        return v

    def context_length(self) -> tuple[bool, int | None]:
        """``max_position_embeddings``: the positions the model was trained for, recorded in the
        graph as surface.context_length and enforced by the executor. Absent: the checkpoint
        states none (recorded as null; nothing is enforced). Returns (ok, value)."""
        key = "max_position_embeddings"
        if key in self.config and self.config[key] is None:
            self.take(key, "null: the checkpoint states no context length; none is enforced")
            return True, None
        v = self.take_int(key, "the context length: positions the executor allows",
                          default=None, default_reason="absent: the checkpoint states no context length; none is enforced")
        return (v is not None or key not in self.config), v

    def finish(self, stopped: bool = False) -> None:
        """Grade every key nothing read. ``stopped``: the lowering ended at a refusal, so a key it
        did not reach is reported as unread (not as unknown: it may be a key the lowering reads
        once the refusal is fixed)."""
        for key in self.config:
            if key in self.graded:
                continue
            if key in self.GENERIC_METADATA:
                self._grade(key, METADATA, "recorded as a fact about the model")
            elif key in self.GENERIC_IGNORED:
                self._grade(key, IGNORED, self.GENERIC_IGNORED[key])
            elif stopped:
                self._grade(key, UNREAD, "not read: admission stopped at an earlier refusal")
            else:
                self._grade(key, UNKNOWN, "not understood by this build; refusing rather than guessing", blocks=True)


@dataclass
class TensorPlacement:
    """One container tensor: the source tensor it is (``source_name``), or the ordered
    ``sources`` it is assembled from by ``transform``, a sequence of named steps in `TRANSFORMS`
    applied at encode (stack many tensors into one, transpose, de-interleave). The encode
    records every assembled tensor's sources and steps in the container's provenance."""

    source_name: str
    object: str
    name: str  # relative to the object
    role: str
    layer: int | None
    sources: tuple[str, ...] = ()  # empty: the one tensor ``source_name``
    transform: tuple[str, ...] = ()
    # a quantized matrix: the sources are groups of parts (blocks and scales, ...) that
    # vindex3.codecs.packing packs into this encoding, group by group, before ``transform``
    codec: str = ""

    @property
    def inputs(self) -> tuple[str, ...]:
        return self.sources or (self.source_name,)

    def shape(self, source_shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
        """The container tensor's shape, from the sources' shapes (headers only)."""
        if self.codec:
            from ..codecs.packing import groups, part_shape

            shapes = [part_shape(self.codec, [tuple(source_shapes[n]) for n in g]) for g in groups(self.codec, self.inputs)]
        else:
            shapes = [tuple(source_shapes[n]) for n in self.inputs]
        return apply_steps(self.transform, shapes, shape_only=True)

    def packed_parts(self, load_stored: Callable[[str], Any]) -> list[tuple[Any, tuple[int, ...]]]:
        """Of a quantized matrix: each group of sources packed into ``codec``'s bytes, with its shape."""
        from ..codecs.packing import PACKERS, groups

        out = []
        for g in groups(self.codec, self.inputs):
            arrays = [load_stored(n) for n in g]
            out.append((PACKERS[self.codec].pack(arrays), tuple(PACKERS[self.codec].shape([a.shape for a in arrays]))))
        return out

    def assemble(self, load: Callable[[str], Any], load_stored: Callable[[str], Any] | None = None) -> Any:
        """The container tensor: the sources loaded (float32) and transformed; a quantized
        matrix's parts are packed (``load_stored`` reads them as stored) and decoded exactly."""
        if self.codec:
            from .. import codecs

            c = codecs.get(self.codec)
            xs = [np.array(c.weight(raw, shape).dense()) for raw, shape in self.packed_parts(load_stored or load)]
            return apply_steps(self.transform, xs)
        return apply_steps(self.transform, [load(n) for n in self.inputs])


# ---- transforms: named steps that turn source tensors into one container tensor -----------------
# Each step maps a list of arrays (or of shapes) to a list; "stack" is the only step that takes
# many and gives one. Every step only moves elements, so a transform never changes the parameter
# count nor a value.

def _one(xs: list, step: str) -> Any:
    if len(xs) != 1:
        raise ValueError(f"transform step {step!r} takes one tensor, got {len(xs)} (stack them first)")
    return xs[0]


def _stack(xs: list, shape_only: bool) -> list:
    first = tuple(xs[0]) if shape_only else xs[0].shape
    for x in xs[1:]:
        if (tuple(x) if shape_only else x.shape) != first:
            raise ValueError(f"stack: source shapes differ ({list(first)} and {list(x if shape_only else x.shape)})")
    if shape_only:
        return [(len(xs), *first)]
    return [np.stack(xs)]


def _merge_pairs(xs: list, shape_only: bool) -> list:
    """[2E, o, ...] -> [E, 2o, ...]: consecutive tensors (a pair per expert: gate, then up)
    joined along their first axis."""
    x = _one(xs, "merge_pairs")
    shp = tuple(x) if shape_only else x.shape
    if len(shp) < 2 or shp[0] % 2:
        raise ValueError(f"merge_pairs needs [2E, out, ...], got {list(shp)}")
    out = (shp[0] // 2, 2 * shp[1], *shp[2:])
    return [out] if shape_only else [x.reshape(out)]


def _swap_last2(xs: list, shape_only: bool) -> list:
    """[..., a, b] -> [..., b, a] (an in-out matrix made out-in)."""
    x = _one(xs, "swap_last2")
    if shape_only:
        return [(*x[:-2], x[-1], x[-2])]
    return [np.ascontiguousarray(np.swapaxes(x, -1, -2))]


def _uninterleave_axis1(xs: list, shape_only: bool) -> list:
    """[E, 2n, ...] with rows (a0, b0, a1, b1, ...) -> [E, 2n, ...] with rows (a0..an-1, b0..bn-1):
    interleaved gate/up made halves, gate first."""
    x = _one(xs, "uninterleave_axis1")
    shp = tuple(x) if shape_only else x.shape
    if len(shp) < 2 or shp[1] % 2:
        raise ValueError(f"uninterleave_axis1 needs an even axis 1, got {list(shp)}")
    if shape_only:
        return [shp]
    return [np.ascontiguousarray(np.concatenate([x[:, 0::2], x[:, 1::2]], axis=1))]


TRANSFORMS: dict[str, Callable[[list, bool], list]] = {
    "stack": _stack,
    "merge_pairs": _merge_pairs,
    "swap_last2": _swap_last2,
    "uninterleave_axis1": _uninterleave_axis1,
}


def _row_blocks(xs: list, shape_only: bool, size: int, stride: int, offset: int) -> list:
    """Rows ``offset + k·stride + [0, size)`` for every k, along axis 0: one piece of a fused
    projection (``row_blocks:n:n:a`` is rows [a, a + n); GPT-NeoX's per-head interleaved q|k|v
    is ``row_blocks:d:3d:0`` for q)."""
    x = _one(xs, "row_blocks")
    shp = tuple(x) if shape_only else x.shape
    if not shp or shp[0] % stride or size + offset > stride:
        raise ValueError(f"row_blocks:{size}:{stride}:{offset} does not fit axis 0 of {list(shp)}")
    n = shp[0] // stride
    out = (n * size, *shp[1:])
    if shape_only:
        return [out]
    return [np.ascontiguousarray(x.reshape(n, stride, *shp[1:])[:, offset:offset + size].reshape(out))]


def row_blocks(size: int, stride: int, offset: int) -> str:
    """The transform step that keeps rows offset + k·stride + [0, size) (see `_row_blocks`)."""
    return f"row_blocks:{size}:{stride}:{offset}"


def apply_steps(steps: tuple[str, ...], xs: list, shape_only: bool = False) -> Any:
    """Apply named transform steps to tensors (or, with ``shape_only``, to their shapes). A step
    is a name of `TRANSFORMS`, or ``row_blocks:size:stride:offset``."""
    for step in steps:
        name, _, args = step.partition(":")
        if name == "row_blocks":
            try:
                size, stride, offset = (int(a) for a in args.split(":"))
            except ValueError:
                raise ValueError(f"transform step {step!r} needs three integers") from None
            xs = _row_blocks(xs, shape_only, size, stride, offset)
            continue
        fn = TRANSFORMS.get(step)
        if fn is None:
            raise ValueError(f"unknown transform step {step!r} (known: {', '.join(TRANSFORMS)}, row_blocks:size:stride:offset)")
        xs = fn(xs, shape_only)
    return _one(xs, "the result")


@dataclass
class Lowering:
    """What a family builder produces."""

    graph: dict
    placements: list[TensorPlacement]
    dropped: list[tuple[str, str]]  # (source tensor, why it is not encoded)
    # components of the checkpoint set aside whole (a vision tower, a multi-token-prediction
    # head): {component, role, prefix, tensors, parameters, why}; their tensors are in ``dropped``
    not_carried_components: list[dict] | None = None


FamilyBuilder = Callable[[ConfigReader, CheckpointSource], Lowering | None]
_FAMILIES: dict[str, tuple[str, FamilyBuilder]] = {}


def register_family(model_type: str, family: str, builder: FamilyBuilder) -> None:
    _FAMILIES[model_type] = (family, builder)




@dataclass(frozen=True)
class HfExport:
    """How a family writes a container back as a Hugging Face checkpoint: the inverse of its
    lowering, declared next to it. ``config(graph)`` gives config.json (token ids excepted: the
    exporter reads them from the container's generation config); ``prefixes`` is the very
    (Hugging Face prefix, object) table admission places tensors by, so a container tensor
    ``object/rel`` is written as ``prefix + rel``; ``architecture`` is the class transformers
    loads. `vindex3.export` lowers what it is about to write with the family's own builder and
    refuses by name unless that gives back the container's graph and tensors."""

    config: Callable[[dict], dict]
    prefixes: tuple[tuple[str, str], ...]
    architecture: str


_EXPORTS: dict[str, HfExport] = {}


def register_export(model_type: str, spec: HfExport) -> None:
    _EXPORTS[model_type] = spec


def registered_exports() -> dict[str, HfExport]:
    """model_type -> how a container of that family is written back as a checkpoint."""
    return dict(_EXPORTS)


def unregister_family(model_type: str) -> None:
    """Remove a registration (tests register toy families and clean up after themselves)."""
    _FAMILIES.pop(model_type, None)


def registered_families() -> dict[str, tuple[str, FamilyBuilder]]:
    """model_type -> (family, builder), as registered so far."""
    return dict(_FAMILIES)
