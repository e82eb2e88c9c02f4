"""Layout pieces several statement families' results share: a prompt's fields, timings, an
intervention in words, token lists, the operand-read and placement summaries, skipped layers and
feature metadata notes. Each family's own layouts live with its result classes; everything here
is built from `lql.text` and the shared result pieces in `lql.results`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from . import results as R
from .text import (
    Col,
    _wants_vertical,
    fields,
    fmt_bpw,
    fmt_bytes,
    fmt_int,
    fmt_layers,
    fmt_params,
    fmt_seconds,
    fmt_shape,
    fmt_text,
    fmt_value,
    layers_phrase,
    num,
    table,
    vertical,
)


def placement(p: R.PlacementInfo | None) -> list[str]:
    """The shard placement of a sharded model: who holds which layers, and the bytes that cross."""
    if p is None:
        return []
    out = ["", f"placement ({p.slice}; state at {p.positions:,} positions)"]
    rows = [["driver", ", ".join(p.driver_holds), "-", "-", fmt_int(p.driver_weight_bytes), "-", "-", "-"]]
    rows += [[s.name, layers_phrase(list(range(s.layers[0], s.layers[1] + 1))), s.actor or "(not started)",
              "-" if s.pid is None else str(s.pid), fmt_int(s.weight_bytes), fmt_int(s.state_bytes_per_position),
              fmt_int(s.fixed_state_bytes), fmt_int(s.state_bytes)] for s in p.shards]
    out += table(["part", "holds", "actor", "pid", num("weight bytes"), num("state bytes/position"), num("fixed state bytes"),
                  num("state bytes")], rows)
    out += fields([
        ("not called", ", ".join(p.untouched) if p.untouched else None),
        ("crossing", (f"{fmt_bytes(p.bytes_per_hop_per_position)} per hop per position, {p.hops_per_position} hops: "
                     f"{fmt_bytes(p.bytes_moved_per_position)} per position "
                     f"({fmt_bytes(p.bytes_between_shards_per_position)} between shards)")),
    ])
    return out


def pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def reads(x: R.ReadsInfo | None, title: str) -> list[str]:
    """What a position reads, when it reads part of an expert bank (a model without routed
    experts reads every operand at every position: nothing to split, no section)."""
    if x is None or not x.expert_bank_bytes:
        return []
    rows = [
        ("  always read", f"{fmt_bytes(x.always_bytes)} (every operand outside the expert banks and the embedding)"),
        ("  expert banks", (f"{fmt_bytes(x.expert_bank_bytes)} over {len(x.expert_layers)} routed layer(s) "
                            f"({fmt_layers(x.expert_layers)}); a position reads its k of E experts of each")),
    ]
    if x.embedding_bytes:
        rows.append(("  embedding", f"{fmt_bytes(x.embedding_bytes)}; a position reads one row"))
    rows.append(("  per position", (f"{fmt_bytes(x.per_position_bytes)} of {fmt_bytes(x.total_bytes)} "
                                    f"({pct(x.per_position_bytes, x.total_bytes)})")))
    return ["", title] + fields(rows)


def operand_rows(ops: Sequence[R.OpInfo], with_params: bool, skip_params_of: str | None = None) -> list[list[str]]:
    rows: list[list[str]] = []
    for op in ops:
        params = fmt_params(op.params) if with_params and op.role != skip_params_of else ""
        if not op.operands:
            rows.append([op.kind, op.role, "-", "", "", "", "", params])
            continue
        for j, o in enumerate(op.operands):
            rows.append([
                op.kind if j == 0 else "", op.role if j == 0 else "", o.role, f"{o.object}/{o.tensor}",
                o.dtype, fmt_shape(o.shape), fmt_int(o.bytes), params if j == 0 else "",
            ])
    return rows


def table_with_banners(columns: Sequence[str | Col], rows: list[list[str]]) -> list[str]:
    """A table in which rows starting with '[' are section banners spanning the line; banners
    do not widen the columns."""
    plain = [r for r in rows if not r[0].startswith("[")]
    headers = [c.header if isinstance(c, Col) else c for c in columns]
    if _wants_vertical(headers, plain):
        out, n = [], 1
        for r in rows:
            if r[0].startswith("["):
                out.append(r[0][1:-1])
            else:
                out += vertical(headers, [r], start=n)
                n += 1
        return out
    laid = table(columns, plain)
    it = iter(laid[2:])
    out = laid[:2]
    for r in rows:
        out.append(r[0][1:-1] if r[0].startswith("[") else next(it))
    return out


def prompt_fields(p: R.PromptInfo) -> list[tuple[str, Any]]:
    return [
        ("prompt", fmt_text(p.text) + (" (in the chat template)" if p.chat else "") if p.text is not None else None),
        ("prompt ids", fmt_value(p.ids)),
    ]


def generated(n: int, interrupted: bool, stopped_at: int | None = None) -> str:
    out = f"{n} token{'' if n == 1 else 's'}"
    if interrupted:
        return out + " (interrupted: the tokens produced before Ctrl-C)"
    if stopped_at is not None:
        return out + f" (stopped at end-of-sequence id {stopped_at})"
    return out


def timing_fields(t: R.Timing, extra: Sequence[tuple[str, Any]] = ()) -> list[str]:
    return fields([
        ("prepare", fmt_seconds(t.prepare_seconds) if t.prepare_seconds is not None else None),
        ("prefill", fmt_seconds(t.prefill_seconds) if t.prefill_seconds is not None else None),
        ("decode", fmt_seconds(t.decode_seconds) if t.decode_seconds is not None else None),
        ("per token", f"{t.ms_per_token:.2f} ms" if t.ms_per_token is not None else None),
        ("speed", f"{t.tokens_per_second:.1f} tok/s" if t.tokens_per_second is not None else None),
        *extra,
    ])


def intervention(rec: dict[str, Any] | None) -> str | None:
    """An intervention as the run recorded it: 'ABLATE FEATURES (1:3, 2:7)'."""
    if rec is None:
        return None
    return str(rec.get("text") or rec.get("kind") or rec)


def time(seconds: float, timing: bool) -> tuple[str, str | None]:
    """The statement's own time, shown only with timing on (machine-dependent)."""
    return ("time", fmt_seconds(seconds) if timing else None)


def token(text: str | None, token_id: int) -> str:
    return fmt_text(text) if text is not None else f"#{token_id}"


def token_list(tokens: Sequence[R.TokenLogit], logits: bool = False) -> str:
    return ", ".join(token(t.text, t.id) + (f" {t.logit:.2f}" if logits else "") for t in tokens)


def skipped_fields(skipped: Sequence[R.SkippedLayer]) -> list[tuple[str, Any]]:
    """Skipped layers grouped by reason: ('skipped', 'layers 1-2: mamba2 layer with no FFN ...')."""
    groups: dict[str, list[int]] = {}
    for x in skipped:
        groups.setdefault(x.reason, []).append(x.layer)
    return [("skipped" if i == 0 else "", f"{layers_phrase(ls)}: {reason}") for i, (reason, ls) in enumerate(groups.items())]


def metadata_fields(m: R.MetadataNote, timing: bool) -> list[tuple[str, Any]]:
    """What using the feature metadata involved; nothing when it was read as it was."""
    out: list[tuple[str, Any]] = []
    if m.built_layers:
        built = f"built now for {layers_phrase(m.built_layers)}"
        if timing:
            built += f" in {fmt_seconds(m.build_seconds)}"
        out.append(("metadata", built))
    if m.rebuilt:
        out.append(("rebuilt", m.rebuilt))
    if not m.cached:
        out.append(("not stored", f"kept in memory only: {m.note}"))
    return out


def layer_groups(rows: list[list[str]], first: list[bool]) -> list[list[str]]:
    """Blank the layer cell of every row but the first of its layer."""
    return [r if f else [""] + r[1:] for r, f in zip(rows, first)]


def prompt_text(p: R.InternalsPrompt) -> str:
    return fmt_text(p.text) if p.text is not None else "TOKENS (" + ", ".join(str(i) for i in p.ids) + ")"


def short(s: str, n: int = 40) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


def shares(rows: Sequence[R.EncodingShare]) -> list[str]:
    return table(["encoding", num("tensors"), num("parameters"), num("bytes"), num("bits/weight")],
                 [[e.encoding, fmt_int(e.tensors), fmt_int(e.parameters), fmt_int(e.bytes), fmt_bpw(e.bits_per_weight)]
                  for e in rows])


def summary_fields(s: dict[str, Any]) -> list[tuple[str, Any]]:
    def f(key: str, fmt: str = "{:.4f}") -> str | None:
        v = s.get(key)
        return None if v is None else fmt.format(v)

    return [
        ("positions", f("positions", "{}")),
        ("top-1 agreement", f("top1")),
        ("KL mean", f("kl_mean")),
        ("KL p50 / p90 / p99", " / ".join(f"{s[k]:.4f}" for k in ("kl_p50", "kl_p90", "kl_p99") if k in s) or None),
        ("KL max", f("kl_max")),
        ("median target rank", f("median_target_rank", "{:g}")),
        ("top-5 containment", f("top5")),
        ("top-20 containment", f("top20")),
        ("median next-token rank", None if s.get("median_next_rank_draft") is None else
         f"draft {s['median_next_rank_draft']:g}, target {s.get('median_next_rank_target', float('nan')):g}"),
    ]


def share(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def flatten(d: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(d, dict) and d:
        out = []
        for k, v in d.items():
            out += flatten(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    return [(prefix, d)]
