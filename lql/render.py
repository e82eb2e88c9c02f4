"""The one renderer. Results → text (aligned fields and tables, fitted to a width or laid out
one field per line), JSON (one object per statement, stable keys), rows for CSV, TSV,
Markdown and JSON lines, HTML for notebooks, a ladder chart; and errors → text (the one
error formatter every front end uses) and JSON (one shape for syntax errors and refusals).
Layout only: nothing here computes a fact, opens a container or touches a model.

Machine-dependent values (timings) are rendered with a unit (``12.3 ms``, ``0.004 s``,
``250.1 tok/s``) and only when the ``timing`` setting is on, so that text output is otherwise
reproducible."""

from __future__ import annotations

import csv
import html
import io
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover - types only: results call the renderer, not the reverse
    from . import results as R
from .errors import clip_statement, error_fragments, error_text, internal_error_text  # noqa: F401  (the one formatter)

#: Output formats, as ``SET format``, ``\T`` and ``lql --format`` name them.
FORMATS = ("text", "json", "csv", "tsv", "markdown", "jsonl")

from .text import fitting

# ---- entry points ---------------------------------------------------------------------


def to_text(result: R.Result, *, timing: bool = True, width: int | None = None, expanded: str = "off") -> str:
    """The result as aligned text (no trailing newline). ``width``: fit tables to it (cells
    cut with an ellipsis, never wrapped); ``expanded``: on, off or auto (one field per line
    when a table does not fit)."""
    with fitting(width, expanded):
        lines = result.layout(timing)  # each result class has its family's layout
        lines += [f"note: {n}" for n in getattr(result, "notes", None) or []]
        return "\n".join(lines)


def to_json(result: R.Result) -> dict:
    """One object per statement: ``{"statement", "kind", "ok", "result"}``; keys are stable
    (declaration order), values JSON-safe."""
    body = result.model_dump(mode="json", exclude={"statement", "kind"})
    return {
        "statement": result.statement.model_dump() if result.statement else None,
        "kind": result.kind,
        "ok": True,
        "result": body,
    }


def error_json(err: BaseException, statement: R.StatementRef | None) -> dict:
    """The JSON object for a statement that failed. One shape for every failure:
    ``{"statement", "kind", "ok": false, "error": {type, message, hint, line, column,
    expected}}``; ``expected`` lists what a syntax error expected (empty otherwise)."""
    from .errors import LqlError

    if isinstance(err, LqlError):
        error = {"type": err.kind, "message": err.message, "hint": err.hint, "line": err.line,
                 "column": err.column, "expected": list(getattr(err, "expected", []) or [])}
    else:
        from .errors import describe_exception

        error = {"type": "InternalError", "message": f"internal error: {describe_exception(err)}", "hint": None,
                 "line": statement.line if statement else None, "column": statement.column if statement else None,
                 "expected": []}
    return {
        "statement": statement.model_dump() if statement else None,
        "kind": statement.kind if statement else None,
        "ok": False,
        "error": error,
    }


# ---- rows: CSV, TSV, Markdown, JSON lines, pandas, HTML -------------------------------

def records(result: R.Result) -> list[dict[str, Any]]:
    """The result's rows as flat dicts: one per layer for SHOW LAYERS, one per candidate for
    INFER ... TOP, one per generated token for GENERATE alone, one per position for TRACE and
    SCORE DRAFT, one per depth for DRAFT LADDER, one per operand for SHOW OPERANDS and
    EXPLAIN, one per finding for PLAN; a single row of fields otherwise."""
    return result.records()


def _columns(rows: list[dict[str, Any]]) -> list[str]:
    cols: dict[str, None] = {}
    for row in rows:
        for k in row:
            cols.setdefault(k, None)
    return list(cols)


def _cell(v: Any) -> str:
    """A value as one CSV/TSV/Markdown cell: lists and objects as JSON, None as empty."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, (list, dict)):
        return dumps_json(v)
    return str(v)


def to_delimited(result: R.Result, delimiter: str = ",", *, header: bool = True) -> str:
    """CSV (or TSV with a tab) of `records`: a header line (unless ``header`` is false), then
    one line per row."""
    rows = records(result)
    if not rows:
        return ""
    cols = _columns(rows)
    buf = io.StringIO()
    if delimiter == "\t":  # TSV: no quoting; tabs and newlines inside a value are escaped
        esc = str.maketrans({"\t": "\\t", "\n": "\\n", "\r": "\\r", "\\": "\\\\"})
        if header:
            buf.write("\t".join(cols) + "\n")
        for row in rows:
            buf.write("\t".join(_cell(row.get(c)).translate(esc) for c in cols) + "\n")
    else:
        w = csv.writer(buf, delimiter=delimiter, lineterminator="\n")
        if header:
            w.writerow(cols)
        for row in rows:
            w.writerow([_cell(row.get(c)) for c in cols])
    return buf.getvalue().rstrip("\n")


def to_markdown(result: R.Result) -> str:
    """A GitHub-flavoured Markdown table of `records` (pipes escaped, newlines as <br>)."""
    rows = records(result)
    if not rows:
        return ""
    cols = _columns(rows)

    def cell(v: Any) -> str:
        return _cell(v).replace("\\", "\\\\").replace("|", "\\|").replace("\n", "<br>")

    out = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    out += ["| " + " | ".join(cell(row.get(c)) for c in cols) + " |" for row in rows]
    return "\n".join(out)


def to_jsonl(result: R.Result) -> str:
    """One compact JSON object per row of `records`."""
    return "\n".join(dumps_json(row) for row in records(result))


def format_result(result: R.Result, fmt: str, *, timing: bool = True, width: int | None = None,
                  expanded: str = "off", indent: int | None = None, header: bool = True) -> str:
    """The result in one of `FORMATS` (no trailing newline); ``header`` false leaves CSV's and
    TSV's header line out (tuples-only)."""
    if fmt == "json":
        return dumps_json(to_json(result), indent=indent)
    if fmt == "jsonl":
        return to_jsonl(result)
    if fmt == "csv":
        return to_delimited(result, ",", header=header)
    if fmt == "tsv":
        return to_delimited(result, "\t", header=header)
    if fmt == "markdown":
        return to_markdown(result)
    return to_text(result, timing=timing, width=width, expanded=expanded)


def to_pandas(result: R.Result):
    """`records` as a pandas DataFrame (pandas is an optional extra)."""
    from .errors import NotAvailable

    try:
        import pandas as pd
    except ImportError:
        raise NotAvailable("to_pandas() needs pandas, which is not installed",
                           hint="from a clone of the source: pip install -e '.[notebook]' (or pip install pandas)") from None
    return pd.DataFrame.from_records(records(result), columns=_columns(records(result)) or None)


#: Record columns whose strings are token or generated text: shown quoted in HTML, as the text
#: output shows them (a leading space and a newline stay visible).
TEXT_COLUMNS = ("token", "text", "tokens", "prompt")


def _html_cell(column: str, v: Any) -> str:
    """A value as an HTML cell shows it: token text quoted as the text output quotes it (so
    ``' Paris'`` keeps its space and ``'\\n'`` is seen), any other string with edge spaces or
    control characters quoted too, floats with 4 significant digits (the text output's), the
    rest as in CSV."""
    if isinstance(v, str):
        last = column.rsplit(".", 1)[-1]
        if last in TEXT_COLUMNS or last.endswith(tuple("_" + c for c in TEXT_COLUMNS)) \
                or v != v.strip() or not v.isprintable():
            return repr(v)
        return v
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list) and v and all(isinstance(x, str) for x in v) and \
            column.rsplit(".", 1)[-1] in TEXT_COLUMNS:
        return "[" + ", ".join(repr(x) for x in v) + "]"
    return _cell(v)


def to_html(result: R.Result, figure_png: bytes | None = None) -> str:
    """An HTML view for notebooks: the statement as a caption above the table (never cut), the
    rows as a table (a single row as field/value pairs) that scrolls sideways when wide, the
    result's figure when it has one (``figure_png``, embedded), and the text layout in a
    collapsible block."""
    rows = records(result)
    esc = html.escape
    caption = esc(result.statement.text) if result.statement else esc(result.kind)
    parts = ['<div class="lql-result">',
             f'<div class="lql-caption" style="overflow-wrap:anywhere"><code>{caption}</code></div>',
             '<div class="lql-table" style="overflow-x:auto;max-width:100%"><table>']
    if len(rows) == 1:
        parts.append("<tr><th>field</th><th>value</th></tr>")
        parts += [f"<tr><td>{esc(k)}</td><td>{esc(_html_cell(k, v))}</td></tr>" for k, v in rows[0].items()]
    elif rows:
        cols = _columns(rows)
        parts.append("<tr>" + "".join(f"<th>{esc(c)}</th>" for c in cols) + "</tr>")
        parts += ["<tr>" + "".join(f"<td>{esc(_html_cell(c, r.get(c)))}</td>" for c in cols) + "</tr>" for r in rows]
    parts.append("</table></div>")
    if figure_png is not None:
        import base64

        data = base64.b64encode(figure_png).decode("ascii")
        parts.append(f'<img class="lql-figure" alt="{esc(result.kind)} figure" src="data:image/png;base64,{data}">')
    parts.append(f"<details><summary>text</summary><pre>{esc(to_text(result))}</pre></details></div>")
    return "\n".join(parts)


# ---- the ladder chart ------------------------------------------------------------------

def dumps_json(obj: Any, *, indent: int | None = None) -> str:
    """Strict JSON text for one statement's object (non-finite floats in the project's tagged
    spelling, see vindex3.jsonio)."""
    from vindex3 import jsonio

    return escape_surrogates(jsonio.dumps(obj, indent=indent))


_SURROGATE = re.compile("[\ud800-\udfff]")


def escape_surrogates(text: str) -> str:
    """``text`` with every lone surrogate (text that no encoding can write: a file name read with
    surrogateescape, a character no string literal may hold) written as ``\\udXXX``, so that
    printing it cannot fail. In JSON text the escape is JSON's own (surrogates only occur inside
    strings there), and a reader gets the same code point back."""
    if _SURROGATE.search(text) is None:
        return text
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group(0)):04x}", text)
