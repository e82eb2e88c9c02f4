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
from collections.abc import Callable
from typing import Any

from . import results as R

#: Output formats, as ``SET format``, ``\T`` and ``lql --format`` name them.
FORMATS = ("text", "json", "csv", "tsv", "markdown", "jsonl")

from .layouts import (
    intervention,
    layer_groups,
    metadata_fields,
    prompt_text,
    share,
    skipped_fields,
    time,
    token,
    token_list,
)
from .text import (  # noqa: F401
    Col,
    _wants_vertical,
    binary_size,
    fields,
    fitting,
    fmt_bpw,
    fmt_bytes,
    fmt_int,
    fmt_layers,
    fmt_mix,
    fmt_mixed,
    fmt_params,
    fmt_prob,
    fmt_seconds,
    fmt_shape,
    fmt_text,
    fmt_value,
    layers_phrase,
    num,
    table,
    vertical,
)

# ---- per-result layouts ---------------------------------------------------------------

_LAYOUTS: dict[type, Callable[[Any, bool], list[str]]] = {}


def _layout(cls: type):
    def deco(fn):
        _LAYOUTS[cls] = fn
        return fn

    return deco


# ---- looking inside (issue 15) --------------------------------------------------------


@_layout(R.WalkResult)
def _walk(r: R.WalkResult, timing: bool) -> list[str]:
    out = [(f"walk {prompt_text(r.prompt)}: the query is the embedding of its last token "
           f"{token(r.query_token, r.query_id)} (id {r.query_id}); the top {r.top} features per layer by |gate score|")]
    rows, first = [], []
    for lay in r.layers:
        for j, h in enumerate(lay.features):
            rows.append([str(lay.layer), str(h.feature), f"{h.score:.2f}", token_list(h.tokens)])
            first.append(j == 0)
    out += table([num("layer"), num("feature"), num("gate score"), "writes"], layer_groups(rows, first))
    tail = fields([*skipped_fields(r.skipped), *metadata_fields(r.metadata, timing), time(r.seconds, timing)])
    return out + tail


@_layout(R.DescribeResult)
def _describe(r: R.DescribeResult, timing: bool) -> list[str]:
    own = ", ".join(token(t, i) for t, i in zip(r.prompt.tokens, r.prompt.ids))
    out = [(f"describe {fmt_text(r.entity)} (tokens {own}): {r.passing:,} feature(s) with gate score > {r.threshold:g} "
           f"in {layers_phrase(r.layers)}")]
    if r.excluded:
        out.append(f"{r.excluded:,} of them write the entity's own tokens ({', '.join(fmt_text(t) for t in r.excluded_tokens)}) "
                   "and are left out")
    if not r.edges:
        out.append("no edges: no feature passes the threshold (SET threshold = n to lower it)")
    else:
        shown = f"the top {len(r.edges)}" if len(r.edges) < r.total_edges else "all"
        out.append(f"{r.total_edges:,} edge(s), {shown} by best gate score:")
        out += table(
            ["edge", num("best gate"), "at", "layers", num("features"), "also writes"],
            [[f"{e.source} -> {token(e.target, e.target_id)}", f"{e.best_score:.2f}", f"L{e.best_layer}:{e.best_feature}",
              f"{e.first_layer}-{e.last_layer}" if e.first_layer != e.last_layer else str(e.first_layer), str(e.count),
              ", ".join(token(t, i) for t, i in zip(e.also, e.also_ids)) or "-"] for e in r.edges],
        )
    tail = fields([*skipped_fields(r.skipped), *metadata_fields(r.metadata, timing), time(r.seconds, timing)])
    return out + tail


def _feature_cell(col: str, x: R.FeatureRow) -> str:
    if col == "token":
        return token(x.token, x.token_id)
    if col == "score":
        return f"{x.score:.4f}"
    return str(getattr(x, col))


@_layout(R.SelectFeaturesResult)
def _select(r: R.SelectFeaturesResult, timing: bool) -> list[str]:
    cols = r.columns
    if r.rows:
        out = table([c if c == "token" else num(c) for c in cols], [[_feature_cell(c, x) for c in cols] for x in r.rows])
    else:
        out = ["no feature matches"]
    limit = r.query.limit
    count = (f"{len(r.rows):,} of {r.total:,} matching features (LIMIT {limit})" if limit is not None and r.total > len(r.rows)
             else f"{r.total:,} matching feature{'' if r.total == 1 else 's'}")
    tail = fields([("rows", f"{count} in {layers_phrase(r.layers)}"), ("score", r.score) if "score" in cols else ("", None),
                   *skipped_fields(r.skipped), *metadata_fields(r.metadata, timing), time(r.seconds, timing)])
    return out + tail


@_layout(R.ShowFeaturesResult)
def _show_features(r: R.ShowFeaturesResult, timing: bool) -> list[str]:
    k = len(r.rows[0].tokens) if r.rows else 0
    out = [(f"layer {r.layer}: {r.features:,} features ({r.ffn} after {r.mixer}); the top {k} tokens each down column "
           "writes, with their logits")]
    out += table([num("feature"), "writes"], [[str(x.feature), token_list(x.tokens, logits=True)] for x in r.rows])
    if len(r.rows) < r.features:
        out.append(f"{len(r.rows):,} of {r.features:,} features shown")
    return out + fields(metadata_fields(r.metadata, timing))


@_layout(R.FeatureActivityResult)
def _activity(r: R.FeatureActivityResult, timing: bool) -> list[str]:
    pos_tok = r.prompt.tokens[r.position] if r.position < len(r.prompt.tokens) else None
    out = [(f"features most active at position {r.position} ({token(pos_tok, r.prompt.ids[r.position])}, the last) "
           f"of {prompt_text(r.prompt)}: {r.slice}, {layers_phrase(r.executed_layers)}")]
    out += fields([("ablated", intervention(r.intervention)),
                   ("next token", f"{token(r.next_token, r.next_id)} (id {r.next_id})"),
                   ("activation", ("the coefficient the feature's down column is written with (ranked by size); "
                                  "gate: its gate pre-activation"))])
    headers = [num("layer"), num("feature"), num("activation"), num("gate"), "writes"]
    ablation = r.intervention is not None
    if ablation:
        headers.insert(4, "ablated")
    rows, first = [], []
    for lay in r.layers:
        for j, f in enumerate(lay.features):
            row = [str(lay.layer), str(f.feature), f"{f.activation:.4f}", f"{f.gate:.2f}", token_list(f.tokens)]
            if ablation:
                row.insert(4, "yes (zeroed)" if f.ablated else "")
            rows.append(row)
            first.append(j == 0)
    out += table(headers, layer_groups(rows, first))
    tail = fields([*skipped_fields(r.skipped), *metadata_fields(r.metadata, timing), time(r.seconds, timing)])
    return out + tail


@_layout(R.TraceForResult)
def _trace_for(r: R.TraceForResult, timing: bool) -> list[str]:
    where = "the last position" if r.positions == "last" else "every position"
    out = [(f"trace {prompt_text(r.prompt)} for {token(r.target, r.target_id)} (id {r.target_id}): {r.slice}, "
           f"{layers_phrase(r.executed_layers)}, {where}")]
    if r.intervention is not None:
        out.append(f"with {intervention(r.intervention)}")
    out.append("logit lens: the model's own final norm and head read the residual after each layer")
    out += table(
        ["layer", "operator", num("pos"), num("rank"), num("probability"), num("logit"), "top-1", num("top-1 prob")],
        [["embedding" if x.layer is None else str(x.layer), x.operator, str(x.position), str(x.rank), fmt_prob(x.prob),
          f"{x.logit:.4f}", token(x.top_token, x.top_id), fmt_prob(x.top_prob)] for x in r.rows],
    )
    f = r.final
    out += fields([("output", (f"rank {f.rank}, probability {fmt_prob(f.prob)}, logit {f.logit:.4f}; top-1 "
                              f"{token(f.top_token, f.top_id)} ({fmt_prob(f.top_prob)})"))])
    d = r.decomposition
    if d is not None:
        base = f"logit before the softcap {d.logit_before_softcap:.4f}" if d.logit_before_softcap is not None else None
        out += ["", (f"decomposition of the logit of {token(d.token, d.token_id)} at position {d.position}: each part is "
                    "a write read through the head with the final norm's scale frozen")]
        out += table(["part", "site", num("logit"), num("share")],
                     [[x.name, x.site, f"{x.logit:.4f}", share(x.share)] for x in d.parts])
        out += fields([
            ("final logit", f"{d.final_logit:.4f}"),
            ("before softcap", base),
            ("sum of parts", f"{d.sum_of_parts:.4f} ({len(d.parts)} parts; {_residue(d)})"),
            *[("note" if i == 0 else "", n) for i, n in enumerate(d.notes)],
        ])
    out += fields([("saved", None if r.saved is None else
                    f"{r.saved.path} ({len(r.saved.arrays)} arrays, {fmt_bytes(r.saved.bytes)})"),
                   time(r.seconds, timing)])
    return out


def _residue(d: R.Decomposition) -> str:
    """The residue as a bound, never its value (its last digits depend on the order of float
    additions); a residue past the bound is printed, since it is no longer rounding."""
    if abs(d.unexplained) <= d.bound:
        return "equal to the logit up to float32 rounding, within 1e-5 of the parts' absolute sum"
    return f"{d.unexplained:.1e} unexplained, more than float32 rounding's {d.bound:.1e}"


@_layout(R.ObserveResult)
def _observe(r: R.ObserveResult, timing: bool) -> list[str]:
    out = [f"recorded {prompt_text(r.prompt)} into {r.path}: {r.status}"]
    n = len(r.generated_ids)
    out += fields([
        ("slice", f"{r.slice} ({layers_phrase(r.executed_layers)})"),
        ("ablated", intervention(r.intervention)),
        ("generated", None if not n else f"{n} token{'' if n == 1 else 's'} {fmt_value(r.generated_ids)} "
                                         f"{fmt_text(r.generated_text) if r.generated_text is not None else ''}".rstrip()),
        ("lens", None if not r.lens_tokens else fmt_value(r.lens_tokens)),
        ("events", f"{r.events:,} ({r.write_events:,} writes, {r.token_events:,} tokens)"),
        ("receipt", f"sha256 {r.sha256}, run {r.run_id}"),
        ("check", f"vindex3 record verify {r.path}"),
        time(r.seconds, timing),
    ])
    return out


@_layout(R.BuildFeaturesResult)
def _build_features(r: R.BuildFeaturesResult, timing: bool) -> list[str]:
    m = r.metadata
    built = [x.layer for x in r.layers if x.built]
    read = [x.layer for x in r.layers if not x.built]
    out = [(f"feature metadata: the top {m.k} tokens each feature's down column writes, "
           f"{layers_phrase([x.layer for x in r.layers])} ({len(r.layers)} of {r.ffn_layers} FFN layers)")]
    out += fields([
        ("built now", (layers_phrase(built) + (f" in {fmt_seconds(m.build_seconds)}" if timing else "")) if built else "none"),
        ("already fresh", layers_phrase(read) if read else None),
        ("rebuilt", m.rebuilt),
        ("stored", f"{r.directory} in the container: {r.files} file(s), {fmt_bytes(r.bytes)}" if m.cached
         else f"kept in memory only: {m.note}"),
        *skipped_fields(r.skipped),
    ])
    headers = [num("layer"), "mixer", "ffn", num("features"), "status"] + (["build time"] if timing else [])
    rows = []
    for x in r.layers:
        row = [str(x.layer), x.mixer, x.ffn, fmt_int(x.features), "built now" if x.built else "fresh"]
        if timing:
            row.append(fmt_seconds(x.seconds))
        rows.append(row)
    return out + [""] + table(headers, rows)


# ---- entry points ---------------------------------------------------------------------


def to_text(result: R.Result, *, timing: bool = True, width: int | None = None, expanded: str = "off") -> str:
    """The result as aligned text (no trailing newline). ``width``: fit tables to it (cells
    cut with an ellipsis, never wrapped); ``expanded``: on, off or auto (one field per line
    when a table does not fit)."""
    layout = _LAYOUTS.get(type(result))
    with fitting(width, expanded):
        lines = layout(result, timing) if layout is not None else result.layout(timing)
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


# ---- errors as text: the one formatter ------------------------------------------------


def error_fragments(err: BaseException, *, where: str = "", show_statement: bool = False) -> list[tuple[str, str]]:
    """An error as styled fragments (style class, text): a syntax error with its line and a
    caret, a refusal with its message, the statement (with ``where`` or ``show_statement``)
    and its hint. ``where`` (a file name, ``<-e>``) prefixes ``where:line:column:``."""
    from .errors import LqlError, LqlSyntaxError, caret_window

    if isinstance(err, LqlSyntaxError):
        head = (f"{where}:{err.line}:{err.column}: syntax error: " if where
                else f"syntax error at line {err.line}, column {err.column}: ")
        shown, col = caret_window(err.source_line, err.column)
        pad = "".join("\t" if ch == "\t" else " " for ch in shown[: col - 1])
        frags = [("class:error", f"{head}{err.message}\n"), ("", f"  {shown}\n"),
                 ("class:error.caret", f"  {pad}^")]
        if err.hint:
            frags.append(("class:warning", f"\n  hint: {err.hint}"))
        return frags
    if isinstance(err, LqlError):
        loc = (f"{where}:{err.line}:{err.column}: " if where and err.line is not None
               else (f"{where}: " if where else ""))
        frags = [("class:error", f"{loc}error: {err.message}")]
        if err.statement and (show_statement or where):
            frags.append(("", f"\n  in: {clip_statement(err.statement)}"))
        if err.hint:
            frags.append(("class:warning", f"\n  hint: {err.hint}"))
        return frags
    from .errors import describe_exception

    return [("class:error", f"internal error: {describe_exception(err)}")]


def clip_statement(text: str, limit: int = 300) -> str:
    """A statement's text as an error shows it: at most ``limit`` characters."""
    return text if len(text) <= limit else text[: limit - 40] + " … " + text[-30:]


def error_text(err: BaseException, *, where: str = "", show_statement: bool = False) -> str:
    """`error_fragments` as plain text."""
    return "".join(t for _, t in error_fragments(err, where=where, show_statement=show_statement))


def internal_error_text(err: BaseException, *, where: str = "", line: int | None = None, column: int | None = None,
                        statement: str | None = None, debug: bool = False) -> str:
    """A bug's one-line report (the traceback is shown separately, with --debug)."""
    from .errors import describe_exception

    loc = f"{where}:{line}:{column}: " if where and line is not None else (f"{where}: " if where else "")
    out = f"{loc}internal error: {describe_exception(err)}"
    if statement:
        out += f"\n  in: {clip_statement(statement)}"
    if not debug:
        out += "\n  this is a bug in lql or vindex3; run with --debug for the traceback"
    return out


# ---- rows: CSV, TSV, Markdown, JSON lines, pandas, HTML -------------------------------

_RECORDS: dict[type, Callable[[Any], list[dict[str, Any]]]] = {}


def _records_of(cls: type):
    def deco(fn):
        _RECORDS[cls] = fn
        return fn

    return deco


_flat, _dump = R.flat, R.dump


def records(result: R.Result) -> list[dict[str, Any]]:
    """The result's rows as flat dicts: one per layer for SHOW LAYERS, one per candidate for
    INFER ... TOP, one per generated token for GENERATE alone, one per position for TRACE and
    SCORE DRAFT, one per depth for DRAFT LADDER, one per operand for SHOW OPERANDS and
    EXPLAIN, one per finding for PLAN; a single row of fields otherwise."""
    fn = _RECORDS.get(type(result))
    return fn(result) if fn is not None else result.records()


@_records_of(R.WalkResult)
def _rec_walk(r: R.WalkResult) -> list[dict[str, Any]]:
    return [{"layer": lay.layer, "mixer": lay.mixer, "ffn": lay.ffn, "feature": h.feature, "score": h.score,
             "tokens": [t.text for t in h.tokens], "token_ids": [t.id for t in h.tokens],
             "token_logits": [t.logit for t in h.tokens]} for lay in r.layers for h in lay.features]


@_records_of(R.DescribeResult)
def _rec_describe(r: R.DescribeResult) -> list[dict[str, Any]]:
    return [_dump(e) for e in r.edges]


@_records_of(R.SelectFeaturesResult)
def _rec_select(r: R.SelectFeaturesResult) -> list[dict[str, Any]]:
    cols = list(r.columns) + (["token_id"] if "token" in r.columns else [])
    return [{c: getattr(x, c) for c in cols} for x in r.rows]


@_records_of(R.ShowFeaturesResult)
def _rec_show_features(r: R.ShowFeaturesResult) -> list[dict[str, Any]]:
    return [{"layer": r.layer, "feature": x.feature, "tokens": [t.text for t in x.tokens],
             "token_ids": [t.id for t in x.tokens], "token_logits": [t.logit for t in x.tokens]} for x in r.rows]


@_records_of(R.FeatureActivityResult)
def _rec_activity(r: R.FeatureActivityResult) -> list[dict[str, Any]]:
    return [{"layer": lay.layer, "mixer": lay.mixer, "ffn": lay.ffn, "feature": f.feature, "activation": f.activation,
             "gate": f.gate, "ablated": f.ablated, "tokens": [t.text for t in f.tokens],
             "token_ids": [t.id for t in f.tokens]} for lay in r.layers for f in lay.features]


@_records_of(R.TraceForResult)
def _rec_trace_for(r: R.TraceForResult) -> list[dict[str, Any]]:
    """The lens rows (``row: lens``), then with DECOMPOSE the parts (``row: part``)."""
    out = [{"row": "lens", **_dump(x)} for x in r.rows]
    if r.decomposition is not None:
        out += [{"row": "part", **_dump(p)} for p in r.decomposition.parts]
    return out


@_records_of(R.BuildFeaturesResult)
def _rec_build_features(r: R.BuildFeaturesResult) -> list[dict[str, Any]]:
    return [_dump(x) for x in r.layers]


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


def to_delimited(result: R.Result, delimiter: str = ",") -> str:
    """CSV (or TSV with a tab) of `records`: a header line, then one line per row."""
    rows = records(result)
    if not rows:
        return ""
    cols = _columns(rows)
    buf = io.StringIO()
    if delimiter == "\t":  # TSV: no quoting; tabs and newlines inside a value are escaped
        esc = str.maketrans({"\t": "\\t", "\n": "\\n", "\r": "\\r", "\\": "\\\\"})
        buf.write("\t".join(cols) + "\n")
        for row in rows:
            buf.write("\t".join(_cell(row.get(c)).translate(esc) for c in cols) + "\n")
    else:
        w = csv.writer(buf, delimiter=delimiter, lineterminator="\n")
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
                  expanded: str = "off", indent: int | None = None) -> str:
    """The result in one of `FORMATS` (no trailing newline)."""
    if fmt == "json":
        return dumps_json(to_json(result), indent=indent)
    if fmt == "jsonl":
        return to_jsonl(result)
    if fmt == "csv":
        return to_delimited(result, ",")
    if fmt == "tsv":
        return to_delimited(result, "\t")
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
                           hint="pip install 'lql-vindex3[notebook]' (or pandas)") from None
    return pd.DataFrame.from_records(records(result), columns=_columns(records(result)) or None)


def to_html(result: R.Result) -> str:
    """An HTML view for notebooks: the rows as a table (a single row as field/value pairs),
    the statement as a caption, and the text layout in a collapsible block."""
    rows = records(result)
    esc = html.escape
    caption = esc(result.statement.text) if result.statement else esc(result.kind)
    parts = ['<div class="lql-result">', f"<table><caption><code>{caption}</code></caption>"]
    if len(rows) == 1:
        parts.append("<tr><th>field</th><th>value</th></tr>")
        parts += [f"<tr><td>{esc(k)}</td><td>{esc(_cell(v))}</td></tr>" for k, v in rows[0].items()]
    elif rows:
        cols = _columns(rows)
        parts.append("<tr>" + "".join(f"<th>{esc(c)}</th>" for c in cols) + "</tr>")
        parts += ["<tr>" + "".join(f"<td>{esc(_cell(r.get(c)))}</td>" for c in cols) + "</tr>" for r in rows]
    parts.append("</table>")
    parts.append(f"<details><summary>text</summary><pre>{esc(to_text(result))}</pre></details></div>")
    return "\n".join(parts)


# ---- the ladder chart ------------------------------------------------------------------

# ---- vindex3's own reports, laid out here ----------------------------------------------


def admission_text(plan) -> str:
    """A vindex3 AdmissionPlan as text (the ``vindex3 plan`` command prints this)."""
    from .commands.container import plan_result

    return to_text(plan_result(plan))


def verify_text(report) -> str:
    """A vindex3 VerifyReport as text (the ``vindex3 verify`` command prints this)."""
    from .commands.container import verify_result

    return to_text(verify_result(report, show_path=True))


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
