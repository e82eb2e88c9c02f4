"""index.json as typed, validated models.

The index is the container's root authority, so every fact in it is typed here: a wrong type,
a missing key or an impossible value is a named refusal (`IntegrityError` naming the key), never
an ``AttributeError`` three modules later. Unknown top-level keys are allowed and preserved by
rewrites (the raw dict is kept beside the model); inside a representation every key is known, so
a renamed hash key is a missing hash, not an ignored one.

Three keys are newer than format version 3's first writer: ``index_sha256`` (the index's own
hash, over its canonical JSON without that key) and, per representation, ``header_sha256`` (the
segment's length prefix and JSON header) and ``tensor_sha256`` (each tensor's stored bytes). An
index written by this build has all three; one written before has none, and its absence is a
recorded fact: such a segment is checked whole against ``segment_sha256`` on first use instead
(see docs/container.md#integrity). Some without the others is refused.
"""

from __future__ import annotations

import hashlib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import IntegrityError

Sha256 = str  # 64 lowercase hex digits, checked by _hex
GRAPH_FILE = "system_graph.json"
INDEX_HASH = "index_sha256"


def index_digest(raw: dict) -> str:
    """The index's own hash: SHA-256 of its canonical JSON without the ``index_sha256`` key."""
    from .jsonio import canonical

    return hashlib.sha256(canonical({k: v for k, v in raw.items() if k != INDEX_HASH})).hexdigest()


def seal(raw: dict) -> dict:
    """``raw`` with its ``index_sha256`` recorded (every writer of index.json calls this last)."""
    out = {k: v for k, v in raw.items() if k != INDEX_HASH}
    out[INDEX_HASH] = index_digest(out)
    return out


def _hex(v: Any, key: str) -> str:
    if not isinstance(v, str) or len(v) != 64 or any(ch not in "0123456789abcdef" for ch in v):
        raise ValueError(f"{key} must be 64 lowercase hex digits (a SHA-256)")
    return v


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class GraphRef(_Strict):
    path: Literal["system_graph.json"]
    sha256: str
    schema_: int = Field(alias="schema")

    @field_validator("sha256")
    @classmethod
    def _sha(cls, v: str) -> str:
        return _hex(v, "sha256")


class ModelInfo(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, frozen=True)
    name: str
    family: str | None


class Representation(_Strict):
    object: str = Field(min_length=1)
    encoding: str = Field(min_length=1)
    segment: str = Field(min_length=1)
    tensors: int = Field(ge=0)
    payload_bytes: int = Field(ge=0)
    payload_sha256: str
    segment_sha256: str
    segment_bytes: int = Field(ge=8)
    header_sha256: str | None = None  # absent in containers written before it was recorded
    tensor_sha256: dict[str, str] | None = None  # ditto
    # stacked expert banks stored in another order than the logical one: tensor -> the logical
    # expert held by each stored slot (slot s holds expert permutation[s]). Additive: a reader
    # without this field refuses it by name (extra keys are forbidden), never runs experts in
    # the wrong order.
    permutation: dict[str, list[int]] | None = None

    @field_validator("permutation")
    @classmethod
    def _perm(cls, v: dict[str, list[int]] | None) -> dict[str, list[int]] | None:
        if v is not None:
            for name, p in v.items():
                if sorted(p) != list(range(len(p))):
                    raise ValueError(f"permutation[{name!r}] is not a permutation of 0 .. {len(p) - 1}")
        return v

    @field_validator("payload_sha256", "segment_sha256", "header_sha256")
    @classmethod
    def _sha(cls, v: str | None, info) -> str | None:
        return v if v is None else _hex(v, info.field_name)

    @field_validator("tensor_sha256")
    @classmethod
    def _tensor_shas(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is not None:
            for name, h in v.items():
                _hex(h, f"tensor_sha256[{name!r}]")
        return v


class SegmentRef(_Strict):
    path: str
    bytes: int = Field(ge=0)
    sha256: str

    @field_validator("sha256")
    @classmethod
    def _sha(cls, v: str) -> str:
        return _hex(v, "sha256")


class CapabilityRef(_Strict):
    sha256: str
    bytes: int = Field(ge=0)

    @field_validator("sha256")
    @classmethod
    def _sha(cls, v: str) -> str:
        return _hex(v, "sha256")


class IndexFile(BaseModel):
    """The typed index. Unknown top-level keys are allowed (and preserved by rewrites)."""

    model_config = ConfigDict(extra="allow", strict=True, frozen=True)

    format: Literal["VINDEX3"]
    version: Literal[3]
    generation: int = Field(ge=1)
    model: ModelInfo
    authority: Literal["canonical", "derived"]
    profiles: list[Literal["exact"]] = Field(min_length=1)
    graph: GraphRef
    representations: dict[str, Representation] = Field(min_length=1)
    segments: list[SegmentRef]
    capabilities: dict[str, CapabilityRef]
    provenance: dict[str, Any]
    index_sha256: str | None = None  # absent in indexes written before it was recorded

    @field_validator("index_sha256")
    @classmethod
    def _self_sha(cls, v: str | None) -> str | None:
        return v if v is None else _hex(v, "index_sha256")

    @property
    def legacy(self) -> bool:
        """Written before the index, header and tensor hashes were recorded (it has none)."""
        return self.index_sha256 is None and all(
            r.header_sha256 is None and r.tensor_sha256 is None for r in self.representations.values())

    @model_validator(mode="after")
    def _consistent(self) -> IndexFile:
        for key, rep in self.representations.items():
            if key != f"{rep.object}@{rep.encoding}":
                raise ValueError(f"representation key {key!r} must be object@encoding ({rep.object}@{rep.encoding})")
        listed = {s.path: s for s in self.segments}
        if len(listed) != len(self.segments):
            raise ValueError("segments lists a path twice")
        for key, rep in self.representations.items():
            s = listed.get(rep.segment)
            if s is None:
                raise ValueError(f"representation {key!r} names segment {rep.segment!r}, which segments does not list")
            if s.sha256 != rep.segment_sha256 or s.bytes != rep.segment_bytes:
                raise ValueError(f"segments and representation {key!r} disagree about {rep.segment!r} (size or sha256)")
        used = {rep.segment for rep in self.representations.values()}
        extra = sorted(set(listed) - used)
        if extra:
            raise ValueError(f"segments lists {extra[0]!r}, which no representation uses")
        kinds = {(self.index_sha256 is not None, r.header_sha256 is not None, r.tensor_sha256 is not None)
                 for r in self.representations.values()}
        if kinds not in ({(True, True, True)}, {(False, False, False)}):
            raise ValueError("index_sha256, header_sha256 and tensor_sha256 are recorded together (this build) or "
                             "not at all (an older encode); this index has some without the others")
        return self


def problems(e: ValidationError, prefix: str = "") -> list[str]:
    """Each validation problem as one line naming the key."""
    out = []
    for err in e.errors():
        key = prefix + ".".join(str(x) for x in err["loc"])
        key = key or "(the index)"
        if err["type"] == "missing":
            out.append(f"{key} is missing")
        elif err["type"] == "extra_forbidden":
            out.append(f"{key} is not a known key")
        else:
            msg = err["msg"]
            msg = msg.removeprefix("Value error, ")
            found = err.get("input")
            shown = repr(found) if not isinstance(found, (dict, list)) else type(found).__name__
            if len(shown) > 80:
                shown = shown[:77] + "..."
            out.append(f"{key}: {msg[:1].lower() + msg[1:]} (found {shown})")
    return out


def parse_index(raw: Any, where: str = "index.json") -> IndexFile:
    """The typed index, or an IntegrityError naming every problem."""
    if not isinstance(raw, dict):
        raise IntegrityError(f"{where} is not a JSON object")
    try:
        return IndexFile.model_validate(raw)
    except ValidationError as e:
        ps = problems(e)
        more = f" (and {len(ps) - 8} more)" if len(ps) > 8 else ""
        raise IntegrityError(f"{where}: " + "; ".join(ps[:8]) + more,
                             hint="the index was altered or written by another tool; re-encode the container") from None
