"""Plain text, the leaf every layout stands on: number, byte, time and value formats, aligned
``label  value`` fields, and the table engine. It imports nothing from lql (or vindex3), so any
layer may use it, and a layout never formats a number its own way.

A table is declared by its columns: a header string is a left-aligned text column, ``num(h)`` a
right-aligned number column; alignment follows the column's kind, never a counted index. When a
width is set (``fitting``), long text cells are cut with an ellipsis so that no line wraps, and
in expanded mode rows come one field per line."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

# (width, expanded) for the tables being laid out: width None means no fitting; expanded is "on"
# (one field per line), "off", or "auto" (one field per line when too wide).
_FIT: ContextVar[tuple[int | None, str]] = ContextVar("lql_fit", default=(None, "off"))


@contextmanager
def fitting(width: int | None, expanded: str = "off") -> Iterator[None]:
    """Tables laid out inside fit ``width`` columns (None: no fitting) and follow ``expanded``."""
    token = _FIT.set((width, expanded if expanded in ("on", "off", "auto") else "off"))
    try:
        yield
    finally:
        _FIT.reset(token)


@dataclass(frozen=True)
class Col:
    """A table column: its header and whether it holds numbers (right-aligned, never shrunk)."""

    header: str
    numeric: bool = False


def num(header: str) -> Col:
    """A number column: right-aligned."""
    return Col(header, numeric=True)


def fmt_int(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def fmt_bytes(n: int | None) -> str:
    """Exact bytes, with a binary-prefixed size beside it once it is large."""
    if n is None:
        return "-"
    if n < 1024:
        return f"{n:,} bytes"
    return f"{n:,} bytes ({binary_size(n)})"


def binary_size(n: int) -> str:
    """A byte count in binary units (KiB ... EiB), for any non-negative integer however large:
    integer arithmetic picks the unit, so no count overflows a float."""
    units = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")
    k = min(len(units), max(1, (int(n).bit_length() - 1) // 10))
    whole = int(n) >> (10 * k)
    if whole >= 1 << 50:  # beyond any float's exact range: the digits, in EiB
        return f"{whole:,} {units[k - 1]}"
    return f"{int(n) / float(1 << (10 * k)):.1f} {units[k - 1]}"


def fmt_seconds(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1000:.1f} ms" if s < 1.0 else f"{s:.2f} s"


def fmt_prob(p: float) -> str:
    return f"{p:.4f}"


def fmt_value(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(fmt_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {fmt_value(x)}" for k, x in v.items()) + "}"
    return str(v)


def fmt_bpw(bits: float | None) -> str:
    return "-" if bits is None else f"{bits:.2f}"


def fmt_mixed(encodings: dict[str, int]) -> str:
    """`` (int8 210, f32 61)`` when an object's tensors are stored in several encodings."""
    if len(encodings) < 2:
        return ""
    return " (" + ", ".join(f"{e} {n}" for e, n in encodings.items()) + ")"


def fmt_shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def fmt_text(s: str | None) -> str:
    """A token's or a generation's text, quoted so that whitespace is visible."""
    return "-" if s is None else repr(s)


def fmt_mix(mix: Iterable[Any]) -> str:
    """Entries with ``count`` and ``label`` (an operator mix) as '2 softmax / 1 mamba2'."""
    return " / ".join(f"{m.count} {m.label}" for m in mix) or "-"


def fmt_layers(layers: Sequence[int]) -> str:
    """[0, 1, 2, 3, 7] → '0-3, 7' (real layer indices, runs collapsed)."""
    if not layers:
        return "none"
    runs: list[tuple[int, int]] = []
    for i in layers:
        if runs and i == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], i)
        else:
            runs.append((i, i))
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs)


def layers_phrase(layers: Sequence[int]) -> str:
    """'layer 0' or 'layers 0-3'."""
    return ("layer " if len(layers) == 1 else "layers ") + fmt_layers(layers)


def fmt_params(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={fmt_value(v)}" for k, v in params.items() if v is not None)


#: A ``label  value`` line wider than the fitting width folds its value onto at most this many
#: lines (continuations indented under the value); what is left after them is cut, and the cut
#: says how many characters it left out.
FOLD_LINES = 8


def fields(pairs: Iterable[tuple[str, Any]]) -> list[str]:
    """Aligned ``label  value`` lines; pairs whose value is None are left out. When a width is
    set (``fitting``), a value too wide for it is folded under itself (at a space where one
    falls in the second half of the line), at most `FOLD_LINES` lines, then cut with an
    ellipsis, so that no line wraps on the screen."""
    pairs = [(k, v) for k, v in pairs if v is not None]
    if not pairs:
        return []
    width = max(len(k) for k, _ in pairs)
    fit, _ = _FIT.get()
    out: list[str] = []
    for k, v in pairs:
        line = f"{k.ljust(width)}  {v}".rstrip()
        if fit is None or len(line) <= fit or "\n" in str(v):
            out.append(line)
        else:
            out += fold(f"{k.ljust(width)}  ", str(v), fit)
    return out


def fold(head: str, value: str, width: int, *, max_lines: int = FOLD_LINES) -> list[str]:
    """``head`` then ``value`` within ``width`` columns: the value folded onto lines indented
    by ``len(head)``, breaking after a space in the second half of a line (else mid-word), at
    most ``max_lines`` lines; a value longer than that is cut and ends with
    ``… (+n characters)``. A head too wide to leave 16 columns cuts the line instead."""
    room = width - len(head)
    if room < 16:
        return [_clip(head + value, width)]
    pieces: list[str] = []
    rest = value
    while rest:
        if len(pieces) == max_lines - 1 and len(rest) > room:  # the last line: cut, saying how much
            shown = room - len(f"… (+{len(rest):,} characters)")
            left = len(rest) - shown
            pieces.append(rest[:shown] + f"… (+{left:,} characters)")
            break
        if len(rest) <= room:
            pieces.append(rest)
            break
        cut = rest.rfind(" ", room // 2, room)
        cut = room if cut < 0 else cut + 1
        pieces.append(rest[:cut])
        rest = rest[cut:]
    pad = " " * len(head)
    return [(head if i == 0 else pad) + p.rstrip() for i, p in enumerate(pieces)]


def _natural_widths(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[int]:
    widths = [len(h) for h in headers]
    for row in rows:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c))
    return widths


def _wants_vertical(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> bool:
    width, expanded = _FIT.get()
    if expanded == "on":
        return True
    if expanded == "auto" and width is not None:
        widths = _natural_widths(headers, rows)
        return sum(widths) + 2 * (len(widths) - 1) > width
    return False


def _fit_widths(widths: list[int], headers: Sequence[str], right: set[int], width: int) -> list[int]:
    """Shrink the widest text columns (never the right-aligned numbers) until the table fits,
    down to a floor per column; a table that cannot fit keeps its floor widths."""
    widths = list(widths)
    floor = [max(4, min(len(h), 12)) for h in headers]
    while sum(widths) + 2 * (len(widths) - 1) > width:
        cands = [i for i in range(len(widths)) if i not in right and widths[i] > floor[i]]
        if not cands:
            break
        i = max(cands, key=lambda j: widths[j])
        widths[i] -= 1
    return widths


def _clip(cell: str, w: int) -> str:
    return cell if len(cell) <= w else cell[: max(0, w - 1)] + "…"


def vertical(headers: Sequence[str], rows: Iterable[Sequence[str]], *, start: int = 1) -> list[str]:
    """Rows one field per line (``\\x``, ``SET expanded = on``), each under a record banner."""
    hw = max(len(h) for h in headers)
    out: list[str] = []
    for n, row in enumerate(rows, start=start):
        out.append(f"-[ RECORD {n} ]" + "-" * max(3, hw - 10))
        out += [f"{h.ljust(hw)} | {c}".rstrip() for h, c in zip(headers, row)]
    return out


def table(columns: Sequence[str | Col], rows: Iterable[Sequence[Any]]) -> list[str]:
    """An aligned table: header, a rule, rows. A column is a header (text, left-aligned) or a
    `Col` (``num(header)``: numbers, right-aligned). When a width is set, long text cells are cut
    with an ellipsis so that no line wraps; in expanded mode the rows come one field per line."""
    cols = [c if isinstance(c, Col) else Col(c) for c in columns]
    headers = [c.header for c in cols]
    rows = [[c if isinstance(c, str) else fmt_value(c) for c in row] for row in rows]
    if _wants_vertical(headers, rows):
        return vertical(headers, rows)
    right = {i for i, c in enumerate(cols) if c.numeric}
    widths = _natural_widths(headers, rows)
    width, _ = _FIT.get()
    if width is not None and sum(widths) + 2 * (len(widths) - 1) > width:
        widths = _fit_widths(widths, headers, right, width)

    def line(cells: Sequence[str]) -> str:
        cells = [_clip(c, widths[i]) for i, c in enumerate(cells)]
        out = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(cells)]
        return "  ".join(out).rstrip()

    return [line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows]


# ---- rows ------------------------------------------------------------------------------


def flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts as one level of dotted keys."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flat(v, key + "."))
        else:
            out[key] = v
    return out


def dump(m: Any) -> dict[str, Any]:
    """A model (or a mapping) as a JSON-ready dict."""
    return m.model_dump(mode="json") if hasattr(m, "model_dump") else dict(m)
