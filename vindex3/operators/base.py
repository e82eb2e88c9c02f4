"""What every operator module provides, and the registry that finds one by name.

An operator is one module that owns everything about one kind of layer computation:

* its **slot** in the layer skeleton ("mixer" or "ffn") and the graph value that selects it
  (a layer's ``operator`` for mixers, its ``ffn`` for FFNs);
* its **typed parameters** (`Params`), read from its own part of the graph surface and the layer
  policy, validated when the graph loads: a missing or ill-typed fact is a named refusal, never a
  default;
* its **operand roles** (`Role`): name, expected shape from the parameters, required or optional,
  and whether the kernel multiplies by it (a `vindex3.codecs.Weight`) or reads it whole;
* its **continuation geometry** (a list of `vindex3.continuation` parts) and its **state** object;
* its **kernel binding**: ``preflight`` (a named refusal before any operand is read), ``bind``
  once per executor, then ``prefill(x, state, p0)`` and ``step(x, state, p0)``; a kernel that
  reads only part of its operands per call (a routed FFN reads k of E experts) opts in to
  reporting what each call touched (`Kernel.reports`, `OpRecord`), and the executor's stream
  trace carries it;
* its **read profile** (`ReadProfile`): the operand bytes a position always reads, the bytes
  held in banks it reads only a part of, and the bytes one position reads: plain data for
  STATS and EXPLAIN, computed from operand sizes without reading a tensor.

Nothing outside the module names its kind. See docs/operators.md#adding-an-operator.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar

import numpy as np
import pydantic.dataclasses
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..continuation import Geometry
from ..errors import GraphSchemaError, UnsupportedOperator

MIXER = "mixer"
FFN = "ffn"
SLOTS = (MIXER, FFN)

MATRIX = "matrix"  # the kernel receives a Weight (mm / take / expert): any encoding with a codec
ARRAY = "array"  # the kernel receives the whole tensor as float32


@dataclass(frozen=True)
class Role:
    name: str
    shape: tuple[int, ...]
    required: bool = True
    kind: str = MATRIX


@dataclass(frozen=True)
class RoleSpec:
    """An operand role declared once, its shape in words: ``"key_dim hidden_size"`` is
    [p.key_dim, p.hidden_size] of the op's params ``p`` (an integer stands for itself).
    ``kind``: MATRIX or ARRAY; ``when``: the name of a boolean param that makes the role
    required (None: always); ``view``: the shape the kernel reads an ARRAY role as, where the
    checkpoint's layout differs ([C, 1, K] conv weights read as [C, K]); ``field``: the kernel's
    name for it, where it differs. `roles_of` gives the `Role` list, `operands_class` the
    kernel's operand record, `check_operands` the kernel's checks."""

    name: str
    shape: str
    kind: str = MATRIX
    when: str | None = None
    view: str | None = None
    field: str | None = None

    @property
    def attr(self) -> str:
        return self.field or self.name

    def dims(self, p: Any, view: bool = False) -> tuple[int, ...]:
        words = (self.view if view and self.view is not None else self.shape).split()
        return tuple(int(w) if w.isdigit() else int(getattr(p, w)) for w in words)

    def required(self, p: Any) -> bool:
        return self.when is None or bool(getattr(p, self.when))


def roles_of(specs: Sequence[RoleSpec], p: Any) -> list[Role]:
    return [Role(s.name, s.dims(p), s.required(p), s.kind) for s in specs]


def operands_class(name: str, specs: Sequence[RoleSpec], doc: str, bases: tuple[type, ...] = (),
                   extra: Sequence[tuple] = ()) -> type:
    """A plain dataclass with one field per role, in role order (optional roles default to
    None): what a kernel receives (weight objects for MATRIX roles, float32 arrays for ARRAY
    roles). ``of(operands)`` builds it from the executor's role -> operand mapping. ``bases``
    and ``extra`` (dataclass field tuples) add the kernel's own methods and caches."""
    fields = [(s.attr, Any) for s in specs if s.when is None]
    fields += [(s.attr, Any, dataclasses.field(default=None)) for s in specs if s.when is not None]
    cls = dataclasses.make_dataclass(name, [*fields, *extra], bases=bases)
    cls.__doc__ = doc
    cls.of = classmethod(lambda c, operands: c(**{s.attr: operands.get(s.name) for s in specs}))
    return cls


def check_operands(op: str, specs: Sequence[RoleSpec], w: Any, p: Any) -> dict[str, Any]:
    """Every role of ``w`` against its shape under ``p``: a `ClosureError` naming every defect,
    or role -> operand, ARRAY roles as their kernel view."""
    from ..errors import ClosureError
    from ..exec.ops.checks import expect_array, expect_weight, squeeze

    defects: list[str] = []
    out: dict[str, Any] = {}
    for s in specs:
        v = getattr(w, s.attr)
        if not s.required(p):
            if v is not None:
                defects.append(f"{s.name}: present, but the params leave it out ({s.when} is false)")
        elif s.kind == MATRIX:
            expect_weight(s.name, v, s.dims(p), defects)
        else:
            shape = s.dims(p, view=True)
            v = squeeze(v, shape)
            expect_array(s.name, v, shape, defects)
        out[s.attr] = v
    if defects:
        raise ClosureError(f"{op} operands do not match the layer geometry", defects)
    return out


class Params(BaseModel):
    """Typed, immutable parameters of one op. Unknown keys are refused (extra="forbid"). Reads
    like a read-only mapping for display (``items()``); fields listed in ``HIDDEN`` (facts every
    op carries, such as the hidden size) are not shown."""

    # strict: a number spelled as a string or a bool where an integer belongs is refused
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)
    HIDDEN: ClassVar[frozenset[str]] = frozenset({"hidden_size"})

    def items(self) -> list[tuple[str, Any]]:
        return [(k, v) for k, v in self.model_dump().items() if k not in self.HIDDEN]

    def __iter__(self) -> Iterator[tuple[str, Any]]:  # dict(params) shows what items() shows
        return iter(self.items())

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)


class DataParams:
    """Base of params declared as a pydantic dataclass (`params_dataclass`): the one params type
    of an operator whose kernels take it directly (derived quantities are its properties, and
    ``dataclasses.replace`` re-validates). Reads like `Params` for display."""

    HIDDEN: ClassVar[frozenset[str]] = frozenset({"hidden_size"})

    def items(self) -> list[tuple[str, Any]]:
        """Fields in declaration order, nested params as plain dicts (as `Params` shows them)."""
        return [(k, v) for k, v in dataclasses.asdict(self).items() if k not in self.HIDDEN]

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(self.items())

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)


PositiveInt = Annotated[int, Field(gt=0)]
NonNegative = Annotated[float, Field(ge=0, allow_inf_nan=False)]

# strict: a number spelled as a string or a bool where an integer belongs is refused
PARAMS_CONFIG = ConfigDict(strict=True, extra="forbid")


def params_dataclass(cls: type) -> type:
    """Declare ``cls`` (a `DataParams` with annotated fields) as frozen, strictly validated
    params: unknown keys, missing facts and ill-typed values are refused on construction."""
    return pydantic.dataclasses.dataclass(frozen=True, config=PARAMS_CONFIG)(cls)


def parse_params(cls: type[Params | DataParams], raw: Mapping[str, Any], where: str) -> Params | DataParams:
    """Validate ``raw`` into ``cls``; every problem is named (key and what was expected)."""
    try:
        if dataclasses.is_dataclass(cls):
            return cls(**dict(raw))
        return cls.model_validate(dict(raw))
    except UnsupportedOperator as e:
        raise GraphSchemaError(f"system_graph.json: {where}: {e}") from None
    except ValidationError as e:
        problems = []
        for err in e.errors():
            key = ".".join(str(x) for x in err["loc"]) or "(params)"
            if err["type"] in ("missing", "missing_argument"):
                problems.append(f"'{key}' is missing (absence is not a default)")
            elif err["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
                problems.append(f"'{key}' is not a parameter of this operator")
            else:
                problems.append(f"'{key}' {err['msg'].lower()} (found {err.get('input')!r})")
        raise GraphSchemaError(f"system_graph.json: {where}: " + "; ".join(problems)) from None


@dataclass(frozen=True)
class OpRecord:
    """What one call of a reporting kernel did: the operand bytes it actually read, and an
    operator-defined record for the trace (an object with ``to_data()`` returning plain data,
    or None)."""

    bytes_read: int
    detail: Any = None


@dataclass(frozen=True)
class ReadProfile:
    """Operand bytes of an op (or a sum of ops), at their stored encoding: ``always_bytes``
    are read for every position whatever it computes; ``bank_bytes`` are held in banks of which
    one position reads only a part (routed experts); ``per_position_bytes`` is what one position
    reads (always plus its share of the banks). ``detail`` is the operator's own plain data
    (e.g. experts, top-k, bytes per expert), keyed by op where profiles were summed."""

    always_bytes: int
    bank_bytes: int
    per_position_bytes: int
    detail: dict = field(default_factory=dict)

    @staticmethod
    def dense(nbytes: int) -> ReadProfile:
        """Every byte read by every position."""
        return ReadProfile(int(nbytes), 0, int(nbytes))

    def __add__(self, other: ReadProfile) -> ReadProfile:
        return ReadProfile(self.always_bytes + other.always_bytes, self.bank_bytes + other.bank_bytes,
                           self.per_position_bytes + other.per_position_bytes, {**self.detail, **other.detail})

    @property
    def total_bytes(self) -> int:
        return self.always_bytes + self.bank_bytes

    def to_data(self) -> dict:
        return {"always_bytes": self.always_bytes, "bank_bytes": self.bank_bytes,
                "per_position_bytes": self.per_position_bytes, "total_bytes": self.total_bytes,
                "detail": dict(self.detail)}


def distinct_bytes(operands: Mapping[str, Any]) -> int:
    """Stored bytes of distinct tensors among operand references (a tensor read under two
    roles counts once)."""
    return sum({r.label: r.nbytes for r in operands.values()}.values())


class Kernel:
    """A bound op: ``prefill`` runs any number of positions from ``p0``; ``step`` runs one.
    ``x`` is [T, hidden] float32 (T = 1 for step); the result is the op's write, [T, hidden].

    A kernel that sets ``reports = True`` returns ``(write, OpRecord)`` instead: the executor
    counts the record's bytes as what that call read (not all of the op's operands) and appends
    the record to the stream's trace (`vindex3.exec.trace.OpCall`)."""

    reports: ClassVar[bool] = False

    def prefill(self, x: np.ndarray, state: Any, p0: int) -> np.ndarray:
        raise NotImplementedError

    def step(self, x: np.ndarray, state: Any, p0: int) -> np.ndarray:
        return self.prefill(x, state, p0)


class FeatureFfnKernel(Kernel):
    """The kernel of a feature FFN (`FeatureFfn`): its write is ``down(activations(x))`` plus the
    down bias. A subclass sets ``down`` and ``down_b`` and gives ``_activations`` (x [T, hidden]
    -> [T, intermediate]); ``ablate`` (sorted feature indices, or None) zeroes those features'
    activations before the down projection, which is what ``bind_ablated`` promises."""

    down: Any
    down_b: Any = None
    ablate: np.ndarray | None = None

    def _activations(self, x: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def activations(self, x: np.ndarray) -> np.ndarray:
        """x [T, hidden] -> [T, intermediate]: what the down projection multiplies."""
        a = self._activations(x)
        if self.ablate is not None:
            a[..., self.ablate] = 0
        return a

    def prefill(self, x: np.ndarray, state: Any, p0: int) -> np.ndarray:
        y = self.down.mm(self.activations(x))
        if self.down_b is not None:
            y = y + self.down_b
        return y

    def ablated(self, features: np.ndarray) -> FeatureFfnKernel:
        """This kernel with ``features`` contributing nothing."""
        self.ablate = features
        return self


class RecurrentKernel(Kernel):
    """A recurrence bound to its params ``p`` and operand record ``w``: a pass of one position on
    a layer that has already run takes ``step(x[0], w, p, state)``, any other pass (several
    positions, or a layer's very first pass even of one position) ``prefill(x, w, p, state)`` —
    transformers' rule for its recurrent mixers. The state is a `RecurrentState`."""

    def __init__(self, p: Any, w: Any, prefill, step):
        self.p, self.w, self._prefill, self._step = p, w, prefill, step

    def prefill(self, x: np.ndarray, state: Any, p0: int) -> np.ndarray:
        if x.shape[0] == 1 and state.started:
            y = self._step(x[0], self.w, self.p, state)[None]
        else:
            y = self._prefill(x, self.w, self.p, state)
        state.started = True
        return y


class Operator:
    """Base of every operator. Subclasses set the class attributes and implement the methods."""

    name: ClassVar[str]  # registry name; the op's kind in plans and EXPLAIN
    slot: ClassVar[str]  # MIXER | FFN
    selects: ClassVar[str]  # the graph value that selects it (layer.operator, or layer.ffn)
    surface_group: ClassVar[str | None] = None  # the top-level surface group it reads, if any
    operator_group: ClassVar[str | None] = None  # its key under surface.operators, if any
    # An FFN operator that is not a `FeatureFfn` may say why it has no features; the feature
    # statements (WALK, DESCRIBE, ...) give this reason when they skip its layers.
    no_features: ClassVar[str | None] = None
    Params: ClassVar[type[Params]]

    def params(self, surface: Mapping[str, Any], layer: Any) -> Params:
        """Typed parameters of this op in ``layer`` (a `vindex3.graph.LayerPolicy`)."""
        raise NotImplementedError

    def reads_groups(self, p: Params) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The surface groups this op reads with parameters ``p``: (top-level groups, keys under
        surface.operators). The graph checks that a group exists exactly when some op reads it.
        The default is the class's ``surface_group`` and ``operator_group``; an op composed of
        others (a parallel mixer) reads its members' groups too."""
        return ((self.surface_group,) if self.surface_group else (), (self.operator_group,) if self.operator_group else ())

    def roles(self, p: Params) -> list[Role]:
        raise NotImplementedError

    def geometry(self, p: Params) -> Geometry:
        return Geometry()

    def new_state(self, p: Params) -> Any:
        """The op's state object (`vindex3.exec.state.OpState`), or None if it keeps none."""
        return None

    def summary(self, p: Params) -> dict[str, Any]:
        """The few parameters SHOW LAYERS and the plan's layer line show."""
        return {}

    def preflight(self, p: Params, where: str) -> None:
        """Refuse by name, before the executor reads a single operand of any layer, parameters
        that load (the graph may carry a fact as unjudged, null) but cannot be executed.
        ``where`` names the op for the message ("layer 3 (mla)")."""

    def work_bytes(self, p: Params, positions: int, keys: int) -> int | None:
        """Peak bytes of the temporary arrays one pass of ``positions`` new positions allocates
        (``keys``: positions held after the pass, the new ones included), state excluded; None
        when the operator states no estimate (vindex3.limits reports it as unknown)."""
        return None

    def bind(self, p: Params, operands: dict[str, Any]) -> Kernel:
        """``operands``: role -> Weight (MATRIX roles) or float32 array (ARRAY roles)."""
        raise NotImplementedError

    def read_profile(self, p: Params, operands: Mapping[str, Any]) -> ReadProfile:
        """What a position reads of ``operands`` (role -> `vindex3.opplan.OperandRef`, sizes
        only, no tensor is read). The default: every operand, every position."""
        return ReadProfile.dense(distinct_bytes(operands))

    def __repr__(self) -> str:
        return f"<operator {self.name} ({self.slot})>"


# ---- opt-in: FFN features ------------------------------------------------------------------------


class FeatureView:
    """An FFN layer read as a key-value memory of ``count`` features: feature f reads the FFN's
    input through its key (gate row f) and writes its value (down column f), weighted by its
    activation. All arrays are float32.

    * ``keys``   [count, hidden]: gate rows (no bias);
    * ``values`` [hidden, count]: down columns (no bias; the FFN adds a down bias, if any, whatever
      its features do);
    * ``activations(x)``: x [T, hidden] (the FFN's input) -> [T, count], the coefficient each
      value is written with (``write = values @ a + down bias``).
    """

    def __init__(self, keys: np.ndarray, values: np.ndarray, activations):
        self.keys = keys
        self.values = values
        self.count = int(keys.shape[0])
        self._activations = activations

    def scores(self, q: np.ndarray) -> np.ndarray:
        """Gate scores ``q @ keys.T``: q [n, hidden] -> [n, count]."""
        return q @ self.keys.T

    def activations(self, x: np.ndarray) -> np.ndarray:
        return self._activations(x)


class FeatureFfn:
    """Opt-in for an FFN operator whose write is a sum of features (see `FeatureView`): mix it
    into the operator class to let WALK, DESCRIBE, feature metadata and ``ABLATE FEATURES`` see
    its layers. An FFN operator without it is skipped by the feature queries and refused, by
    name, by an ablation."""

    def feature_count(self, p: Params) -> int:
        raise NotImplementedError

    def feature_view(self, p: Params, operands: dict[str, Any]) -> FeatureView:
        """``operands`` as for ``bind``."""
        raise NotImplementedError

    def bind_ablated(self, p: Params, operands: dict[str, Any], features: np.ndarray) -> Kernel:
        """A kernel that computes the FFN with ``features`` (sorted int64 indices, each within
        ``feature_count``) contributing nothing, as if their activations were zero."""
        raise NotImplementedError


def no_features_reason(kind: str, operator: Any) -> str:
    """Why an FFN op of ``kind`` (its operator not a `FeatureFfn`) has no features, in words."""
    why = getattr(operator, "no_features", None)
    if why:
        return f"FFN operator {kind!r} has no fixed features: {why}"
    return f"FFN operator {kind!r} does not expose features (vindex3.operators.FeatureFfn)"


# ---- registry ---------------------------------------------------------------------------------

_BY_NAME: dict[str, Operator] = {}
_BY_SELECT: dict[tuple[str, str], Operator] = {}


def register(op: Operator | type[Operator]) -> Operator:
    """Register an operator (class or instance). Re-registering the same class is a no-op; a
    second operator claiming a name or a graph value is refused."""
    inst = op() if isinstance(op, type) else op
    if inst.slot not in SLOTS:
        raise ValueError(f"operator {inst.name!r} has slot {inst.slot!r} (slots: {', '.join(SLOTS)})")
    for table, key in ((_BY_NAME, inst.name), (_BY_SELECT, (inst.slot, inst.selects))):
        have = table.get(key)
        if have is not None and type(have) is not type(inst):
            raise ValueError(f"operator {inst.name!r} claims {key!r}, already registered to {have.name!r}")
    _BY_NAME[inst.name] = inst
    _BY_SELECT[(inst.slot, inst.selects)] = inst
    return inst


def unregister(name: str) -> None:
    """Remove an operator (tests register toy operators and clean up after themselves)."""
    inst = _BY_NAME.pop(name, None)
    if inst is not None:
        _BY_SELECT.pop((inst.slot, inst.selects), None)


def registered() -> list[tuple[str, str]]:
    """(name, slot) of every registered operator, sorted by name."""
    _load_builtins()
    return sorted((o.name, o.slot) for o in _BY_NAME.values())


def get(name: str) -> Operator | None:
    _load_builtins()
    return _BY_NAME.get(name)


def selected(slot: str, value: str) -> Operator | None:
    """The operator a layer's ``operator`` (slot MIXER) or ``ffn`` (slot FFN) value selects."""
    _load_builtins()
    return _BY_SELECT.get((slot, value))


def all_operators() -> list[Operator]:
    _load_builtins()
    return list(_BY_NAME.values())


def _load_builtins() -> None:
    from . import builtins  # noqa: F401  (registers the built-in operators on import)
