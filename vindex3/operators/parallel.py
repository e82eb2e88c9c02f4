"""A parallel mixer (graph operator ``parallel``, slot mixer; its composition in
``surface.operators.parallel``): one layer whose mixer slot holds several operators that read
the same normed input and whose writes are summed, each scaled by declared multipliers —
Falcon-H1's attention beside a Mamba2 mixer.

    write = Σ_m out_multiplier_m · member_m(in_multiplier_m · x)

The composition is graph vocabulary (schema 6, additive):

    surface.operators.parallel = {"combine": "sum",
                                  "members": [{"name": "attention", "operator": "softmax",
                                               "in_multiplier": 1.0, "out_multiplier": 1.0},
                                              {"name": "ssm", "operator": "mamba2_mup", ...}]}

and the layer's ``operator`` is ``parallel``. Each member is a registered mixer operator that reads
its own facts where it always does (softmax: surface.attention and the layer's span and
position; mamba2_mup: surface.operators.mamba2_mup); its operand roles are prefixed by the member
name (``attention.q_proj``, ``ssm.in_proj``). A reader that predates this operator refuses the
layer by name ("unknown operator 'parallel'") before running any of it.

The layer's continuation geometry is the union of its members' parts (KV rows beside recurrent
buffers: KvAndRecurrent); its state is one `ParallelState` holding each member's state, which
snapshots and restores them together and refuses truncation, before cutting anything, when any
member keeps a recurrence.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import numpy as np
from pydantic import Field, model_validator

from ..continuation import SNAPSHOT, Geometry
from ..errors import GraphSchemaError, StateError, UnsupportedOperator
from ..exec.state import OpState
from .base import MIXER, Kernel, Operator, Params, ReadProfile, Role, get, parse_params, register
from .mamba1 import operator_group

SEP = "."  # member name, then the member's own role: "attention.q_proj"


class Member(Params):
    name: str = Field(min_length=1)
    operator: str
    in_multiplier: float = Field(allow_inf_nan=False)
    out_multiplier: float = Field(allow_inf_nan=False)
    params: Any  # the member operator's own typed parameters

    @model_validator(mode="after")
    def _ok(self) -> Member:
        if not re.fullmatch(r"[a-z][a-z0-9_]*", self.name):
            raise ValueError(f"member name {self.name!r} must be a lowercase identifier")
        if self.in_multiplier == 0 or self.out_multiplier == 0:
            raise ValueError(f"member {self.name!r}: a multiplier of 0 erases the member")
        return self


class ParallelParams(Params):
    hidden_size: int = Field(gt=0)
    combine: Literal["sum"]
    members: tuple[Member, ...] = Field(strict=False)  # a JSON list of members

    @model_validator(mode="after")
    def _members(self) -> ParallelParams:
        names = [m.name for m in self.members]
        if len(self.members) < 2:
            raise ValueError(f"a parallel mixer holds at least two members, found {len(self.members)}")
        if len(set(names)) != len(names):
            raise ValueError(f"member names must be unique, found {names}")
        return self

    def items(self) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = [("combine", self.combine)]
        for m in self.members:
            out += [(f"{m.name}.operator", m.operator), (f"{m.name}.in_multiplier", m.in_multiplier),
                    (f"{m.name}.out_multiplier", m.out_multiplier)]
            out += [(f"{m.name}.{k}", v) for k, v in m.params.items()]
        return out


class ParallelState(OpState):
    """Each member's state (None for a member that keeps none), keyed by member name."""

    def __init__(self, members: dict[str, OpState | None], recurrent: list[str]):
        self.members = members
        self.recurrent = recurrent  # members whose parts roll back only by snapshot

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.members.values() if s is not None)

    def snapshot(self) -> dict:
        return {k: (s.snapshot() if s is not None else None) for k, s in self.members.items()}

    def restore(self, snap: dict) -> None:
        for k, s in self.members.items():
            if s is not None:
                s.restore(snap[k])

    def truncate(self, position: int) -> None:
        if self.recurrent:
            raise StateError(f"a parallel mixer whose members {', '.join(self.recurrent)} keep a recurrence cannot be "
                             f"truncated to position {position}; it rolls back only through snapshot() and restore()")
        for s in self.members.values():
            if s is not None:
                s.truncate(position)


class _Bound(Kernel):
    def __init__(self, p: ParallelParams, kernels: list[Kernel]):
        self.parts = [(k, np.float32(m.in_multiplier), np.float32(m.out_multiplier), m.name) for m, k in zip(p.members, kernels)]

    def _run(self, x: np.ndarray, state: ParallelState, p0: int, one: bool) -> np.ndarray:
        out = None
        for k, a, b, name in self.parts:
            xin = x if a == 1 else x * a
            y = (k.step if one else k.prefill)(xin, state.members[name], p0)
            if b != 1:
                y = y * b
            out = y if out is None else out + y
        return out

    def prefill(self, x: np.ndarray, state: ParallelState, p0: int) -> np.ndarray:
        return self._run(x, state, p0, False)

    def step(self, x: np.ndarray, state: ParallelState, p0: int) -> np.ndarray:
        return self._run(x, state, p0, True)


def _split(operands: dict, name: str) -> dict:
    pre = name + SEP
    return {k[len(pre):]: v for k, v in operands.items() if k.startswith(pre)}


class Parallel(Operator):
    name = "parallel"
    slot = MIXER
    selects = "parallel"
    operator_group = "parallel"
    Params = ParallelParams

    def params(self, surface, layer) -> ParallelParams:
        where = f"layer {layer.index} (parallel)"
        g = operator_group(surface, layer, "parallel")
        raw = g.get("members")
        if not isinstance(raw, list):
            raise GraphSchemaError(f"system_graph.json: {where}: surface.operators.parallel.members must be a list, found {raw!r}")
        members = []
        for j, m in enumerate(raw):
            if not isinstance(m, dict) or set(m) != {"name", "operator", "in_multiplier", "out_multiplier"}:
                raise GraphSchemaError(f"system_graph.json: {where}: member {j} must be {{name, operator, in_multiplier, "
                                       f"out_multiplier}}, found {m!r}")
            op = get(m["operator"]) if isinstance(m["operator"], str) else None
            if op is None or op.slot != MIXER or isinstance(op, Parallel):
                raise GraphSchemaError(f"system_graph.json: {where}: member {m.get('name')!r} names operator "
                                       f"{m['operator']!r}, which is not a registered mixer that can run in parallel")
            members.append({**m, "params": op.params(surface, layer)})
        extra = sorted(set(g) - {"members", "combine"})
        if extra:
            raise GraphSchemaError(f"system_graph.json: {where}: surface.operators.parallel has unknown keys {', '.join(extra)}")
        return parse_params(ParallelParams, {"hidden_size": surface.get("hidden_size"), "combine": g.get("combine"),
                                             "members": members}, where)

    @staticmethod
    def _ops(p: ParallelParams) -> list[tuple[Member, Operator]]:
        return [(m, get(m.operator)) for m in p.members]

    def reads_groups(self, p: ParallelParams) -> tuple[tuple[str, ...], tuple[str, ...]]:
        top, under = [], ["parallel"]
        for m, op in self._ops(p):
            t, u = op.reads_groups(m.params)
            top += [x for x in t if x not in top]
            under += [x for x in u if x not in under]
        return tuple(top), tuple(under)

    def roles(self, p: ParallelParams) -> list[Role]:
        return [Role(f"{m.name}{SEP}{r.name}", r.shape, r.required, r.kind) for m, op in self._ops(p) for r in op.roles(m.params)]

    def geometry(self, p: ParallelParams) -> Geometry:
        return Geometry(tuple(part for m, op in self._ops(p) for part in op.geometry(m.params).parts))

    def new_state(self, p: ParallelParams) -> ParallelState:
        states = {m.name: op.new_state(m.params) for m, op in self._ops(p)}
        recurrent = [m.name for m, op in self._ops(p) if op.geometry(m.params).rollback == SNAPSHOT]
        return ParallelState(states, recurrent)

    def summary(self, p: ParallelParams) -> dict:
        out: dict[str, Any] = {}
        for m, op in self._ops(p):
            out[m.name] = m.operator
            out.update({f"{m.name}.{k}": v for k, v in op.summary(m.params).items()})
        return out

    def preflight(self, p: ParallelParams, where: str) -> None:
        for m, op in self._ops(p):
            op.preflight(m.params, f"{where} member {m.name} ({m.operator})")

    def work_bytes(self, p: ParallelParams, positions: int, keys: int) -> int | None:
        parts = [op.work_bytes(m.params, positions, keys) for m, op in self._ops(p)]
        return None if any(b is None for b in parts) else sum(parts) + 4 * 2 * positions * p.hidden_size

    def read_profile(self, p: ParallelParams, operands) -> ReadProfile:
        total = ReadProfile(0, 0, 0)
        for m, op in self._ops(p):
            r = op.read_profile(m.params, _split(operands, m.name))
            total = total + ReadProfile(r.always_bytes, r.bank_bytes, r.per_position_bytes, {m.name: r.detail} if r.detail else {})
        return total

    def bind(self, p: ParallelParams, operands: dict) -> Kernel:
        kernels = []
        for m, op in self._ops(p):
            k = op.bind(m.params, _split(operands, m.name))
            if k.reports:
                raise UnsupportedOperator(f"parallel member {m.name!r} ({m.operator}) reports per-call reads, which a "
                                          "parallel mixer does not combine yet")
            kernels.append(k)
        return _Bound(p, kernels)


register(Parallel)
