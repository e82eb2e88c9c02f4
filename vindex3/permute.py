"""A container whose expert banks are stored hot experts first, from router statistics.

`permute_experts` runs a prompt bank through the source container, counts how often each
layer's router picks each expert, and writes a new container whose stacked banks of that layer
hold the experts in descending order of use (ties: the lower logical index first). Only the
order of the bytes changes: each permuted tensor's representation entry records
``permutation`` (stored slot s holds logical expert ``permutation[s]``), the executor hands out
logical experts (vindex3.codecs.permuted), and every output equals the source's bit for bit.
The graph, every other tensor and the capability files are copied as they are; the routing
counts, the bank's name and SHA-256 are recorded in ``provenance.expert_permutation``."""

from __future__ import annotations

import datetime as _dt
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import __version__
from .codecs.rowwise import join_sections, rows_cols, split_sections
from .container import GRAPH, Container
from .errors import ConfigError, UnsupportedEncoding
from .paths import read_regular
from .rewrite import ContainerWriter, rewritten
from .segments import Encoded, write_segment

METHOD = "vindex3 represent --permute-experts"
_SINGLE = {"f32", "bf16", "f16"}  # one section of rows


def _sections(dtype: str, shape: tuple[int, ...]) -> list[int] | None:
    """Byte sizes of the sections of a tensor in ``dtype`` (None: one unpadded section)."""
    from .codecs import ggml

    if dtype in _SINGLE or dtype in ggml.KINDS:
        return None
    r, c = rows_cols(shape, dtype)
    if dtype in ("int8", "int8h", "q4"):
        from . import codecs

        return codecs.get(dtype)._sizes(r, c)
    if dtype in ("fp8_e4m3_b128", "nvfp4"):
        from . import codecs

        return codecs.get(dtype)._sizes(shape)
    raise UnsupportedEncoding(f"an expert bank in encoding {dtype!r} cannot be reordered by this build "
                              "(its byte layout is not known here)")


def reorder_bank(dtype: str, raw: np.ndarray, shape: tuple[int, ...], slots: np.ndarray) -> np.ndarray:
    """The bytes of bank [E, out, in] with stored slot s taken from source slot ``slots[s]``: every
    section of the encoding is E equal runs in expert order (rows, or per-matrix scales)."""
    E = shape[0]
    sizes = _sections(dtype, shape)
    if sizes is None:
        return np.ascontiguousarray(raw.reshape(E, -1)[slots]).reshape(-1)
    parts = split_sections(raw, sizes, f"{dtype} bank of shape {list(shape)}")
    return join_sections([np.ascontiguousarray(p.reshape(E, -1)[slots]) for p in parts])


@dataclass
class PermuteResult:
    path: Path
    source: Path
    layers: dict[int, list[int]] = field(default_factory=dict)  # layer -> logical expert of each stored slot
    tensors: list[str] = field(default_factory=list)  # object/tensor of every reordered bank
    prompts: int = 0
    cleaned: list[str] = field(default_factory=list)


def _routed_banks(c: Container) -> dict[int, tuple[int, list]]:
    """layer -> (E, the operand refs of its stacked banks [E, out, in])."""
    out = {}
    for lo in c.op_plan().layers:
        for op in lo.ops:
            if op.kind != "moe_ffn":
                continue
            E = int(op.params.num_experts)
            refs = [ref for ref in op.operands.values() if len(ref.shape) == 3 and ref.shape[0] == E]
            out[lo.index] = (E, refs)
    return out


def permute_experts(src: str | Path, out: str | Path, prompts: str | Path, *, max_prompts: int | None = None) -> PermuteResult:
    from .draft.bank import _read_bank, load_prompts
    from .operators.moe_ffn import expert_routing

    source = Container(src)
    banks = _routed_banks(source)
    if not banks:
        raise ConfigError(f"{source.path.name} has no routed-expert layers; there is no expert bank to reorder")
    bank = load_prompts(prompts, max_prompts=max_prompts)
    if not bank:
        raise ConfigError(f"{Path(prompts).name} holds no prompts")
    counts = {layer: np.zeros(E, np.int64) for layer, (E, _) in banks.items()}
    for p in bank:
        if p.token_ids is not None:
            ids = p.token_ids
        else:
            if not source.has_tokenizer:
                raise ConfigError(f"{source.path.name} carries no tokenizer and prompt {p.id!r} is text",
                                  hint="give the bank's prompts as token_ids")
            ids = source.tokenizer.encode(p.text)
        for lr in expert_routing(source, ids).layers:
            for pos in lr.positions:
                np.add.at(counts[lr.layer], pos.experts, 1)
    # logical expert of each stored slot: most used first, ties by logical index
    orders = {layer: [int(e) for e in np.lexsort((np.arange(len(n)), -n))] for layer, n in counts.items()}
    targets: dict[tuple[str, str], list[int]] = {}
    for layer, (_, refs) in banks.items():
        for ref in refs:
            targets[(ref.object, ref.tensor)] = orders[layer]

    result = PermuteResult(path=Path(out), source=source.path, layers=orders, prompts=len(bank))
    with ContainerWriter(out, "represent output", forbid_inside=[source.path]) as w:
        reps, segs = {}, []
        for obj in sorted(source.segments):
            seg = source.segments[obj]
            old = source._reps[obj]
            old_perm = dict(old.permutation or {})
            specs = {n: (e.dtype, e.shape, e.nbytes) for n, e in seg.entries.items()}
            new_perm = dict(old_perm)

            def load(name: str, obj=obj, seg=seg, old_perm=old_perm, new_perm=new_perm):
                source.check_tensor(obj, name)
                raw = np.asarray(seg.raw(name))
                want = targets.get((obj, name))
                if want is None:
                    return Encoded(raw)
                e = seg.entries[name]
                held = old_perm.get(name, list(range(e.shape[0])))  # logical expert of each source slot
                where = {lg: s for s, lg in enumerate(held)}
                slots = np.asarray([where[lg] for lg in want], dtype=np.int64)
                new_perm[name] = list(want)
                return Encoded(reorder_bank(e.dtype, raw, e.shape, slots))

            key = next(k for k, r in source.manifest.representations.items() if r.object == obj)
            info = write_segment(w.tmp / old.segment, key, specs, load)
            entry = old.model_dump(exclude_none=True)
            entry.update({"payload_bytes": info.payload_bytes, "payload_sha256": info.payload_sha256,
                          "segment_sha256": info.segment_sha256, "segment_bytes": info.segment_bytes,
                          "header_sha256": info.header_sha256, "tensor_sha256": info.tensor_sha256})
            identity = {n: p for n, p in new_perm.items() if p != list(range(len(p)))}
            if identity:
                entry["permutation"] = identity
            else:
                entry.pop("permutation", None)
            reps[key] = entry
            segs.append({"path": old.segment, "bytes": info.segment_bytes, "sha256": info.segment_sha256})
        (w.tmp / GRAPH).write_bytes(read_regular(source.path / GRAPH, f"{source.path.name}/{GRAPH}", max_bytes=64 << 20))
        for name in sorted(source.manifest.capabilities):
            (w.tmp / name).write_bytes(source.capability_bytes(name))
        record = {
            "method": METHOD, "writer": f"vindex3 {__version__}",
            "written_at": _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat(),
            "source": {"name": source.path.name, "digest": source.digest, "index_sha256": source.index.get("index_sha256")},
            "prompts": {"name": Path(prompts).name, "sha256": hashlib.sha256(_read_bank(prompts)).hexdigest(),
                        "count": len(bank)},
            "rule": "each routed layer's banks hold its experts in descending order of router picks over the prompts "
                    "(ties: lower logical index first); bytes reordered only, outputs identical",
            "layers": {str(k): {"order": orders[k], "picks": [int(x) for x in counts[k]]} for k in sorted(orders)},
        }
        index = rewritten(source.index, replace={"representations": reps, "segments": segs}, drop=["derived"],
                          provenance={"expert_permutation": record}, sealed=True)
        result.path = w.finish(index)
        result.cleaned = w.cleaned
    result.tensors = sorted(f"{o}/{n}" for o, n in targets)
    return result
