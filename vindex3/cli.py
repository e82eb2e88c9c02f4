"""`vindex3` command line: plan, encode, represent, compact, diff, score-representation, inspect, verify, ops,
exec, shard, default, label, record verify."""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

from . import __version__, jsonio
from .errors import VindexError


def _print_json(obj) -> None:
    print(jsonio.dumps(obj))


def cmd_plan(a) -> int:
    from .admit import admit

    plan = admit(a.src)
    if a.json:
        _print_json(plan.model_dump())
    else:
        _print_report("admission", plan, False)
    return 0 if plan.admissible else 2


def cmd_encode(a) -> int:
    from .encode import encode_detailed
    from .progress import terminal_progress

    t0 = time.perf_counter()
    with terminal_progress(f"encoding {Path(a.src).name}", enabled=not a.json) as cb:
        r = encode_detailed(a.src, a.out, progress=cb, keep_dtype=a.keep_dtype, native=a.widen is None)
    secs = time.perf_counter() - t0
    if a.json:
        _print_json({"path": str(r.path), "tensors": r.tensors, "bytes": r.bytes, "seconds": round(secs, 3),
                     "dropped": [{"tensor": n, "why": w} for n, w in r.dropped], "not_carried": r.not_carried,
                     "kept_as_stored": r.native,
                     "cleaned": r.cleaned})
    else:
        print(f"encoded {a.src} -> {r.path}: {r.tensors} tensors, {r.bytes:,} bytes in {secs:.1f}s")
        if r.native:
            from . import codecs

            kept = ", ".join(f"{e} {n}" + ("" if codecs.is_known(e) else " (carried: no codec executes it)")
                             for e, n in sorted(r.native.items()))
            print(f"  kept as stored: {kept}; every other tensor written f32 (--widen f32 widens them all)")
        for n, w in r.dropped:
            print(f"  dropped {n}: {w}")
        if r.not_carried:
            print(f"  not carried from the source directory: {', '.join(r.not_carried)}")
        for name in r.cleaned:
            print(f"  removed {name}, left behind by an encode that was killed")
    return 0


def describe(c) -> dict:
    g = c.graph
    comp = g.component
    return {
        "path": str(c.path),
        "model": c.name,
        "format": f"{c.index['format']} v{c.index['version']}",
        "generation": c.generation,
        "authority": c.authority,
        "component": {"name": comp.name, "role": comp.role},
        "layers": [{"index": l.index, "operator": l.label(), "window": l.window,
                    "position": (l.position or {}).get("kind")} for l in g.layers],
        "operator_mix": g.operator_mix_text(),
        "representations": c.representations,
        "objects": c.objects(),
        "weight_bytes": c.weight_bytes,
        "tokenizer": c.has_tokenizer,
    }


def cmd_inspect(a) -> int:
    from .container import Container

    c = Container(a.path)
    d = describe(c)
    if a.json:
        _print_json(d)
        return 0
    print(f"{d['model']}  ({d['format']}, generation {d['generation']}, {d['authority']})")
    print(f"path        {d['path']}")
    print(f"component   {d['component']['name']} ({d['component']['role']})")
    print(f"layers      {len(d['layers'])}: {d['operator_mix']}")
    print(f"tokenizer   {'yes' if d['tokenizer'] else 'no'}")
    print(f"weights     {d['weight_bytes']:,} bytes")
    print("objects:")
    for o in d["objects"]:
        mixed = ", ".join(f"{e} {n}" for e, n in o["encodings"].items()) if len(o["encodings"]) > 1 else ""
        print(f"  {o['representation']:<24} {o['tensors']:>5} tensors {o['parameters']:>14,} params {o['bytes']:>14,} bytes"
              f" {o['bits_per_weight']:>6.2f} bits/weight" + (f"  ({mixed})" if mixed else ""))
    print("layers:")
    for l in d["layers"]:
        extra = f" window={l['window']}" if l["window"] else ""
        pos = f"  position={l['position']}" if l["position"] is not None else ""  # only attention has one
        print(f"  {l['index']:>3}  {l['operator']}{extra}{pos}")
    return 0


def cmd_verify(a) -> int:
    from .container import verify

    r = verify(a.path)
    if a.json:
        _print_json(r.model_dump())
    else:
        _print_report("verify", r, False, file=sys.stdout if r.ok else sys.stderr)
    return 0 if r.ok else 1


def cmd_ops(a) -> int:
    from .container import Container

    c = Container(a.path)
    plan = c.op_plan()

    def op_d(op):
        return {"kind": op.kind, "role": op.role, "params": dict(op.params),
                "operands": {k: {"object": r.object, "tensor": r.tensor, "dtype": r.dtype, "shape": list(r.shape)} for k, r in op.operands.items()}}

    if a.json:
        _print_json({
            "embedding": op_d(plan.embedding),
            "layers": [{"index": l.index, "operator": l.operator, "params": l.params, "continuation": l.geometry.describe(),
                        "ops": [op_d(o) for o in l.ops]} for l in plan.layers],
            "final_norm": op_d(plan.final_norm),
            "head": op_d(plan.head),
        })
        return 0

    def show(op, indent="  "):
        print(f"{indent}{op.describe()}")
        for role, r in op.operands.items():
            print(f"{indent}    {role:<14} {r.label}  {r.dtype}{list(r.shape)}")

    print("embedding:")
    show(plan.embedding)
    for l in plan.layers:
        print(f"layer {l.index} [{l.operator}] continuation {l.geometry.describe()}")
        for op in l.ops:
            show(op)
    print("final norm:")
    show(plan.final_norm)
    print("head:")
    show(plan.head)
    return 0


def cmd_exec(a) -> int:
    import numpy as np

    from .container import Container
    from .exec.slice import Draft, Full

    c = Container(a.path)
    if a.tokens:
        parts = [t.strip() for t in a.tokens.split(",")]
        # ASCII digits only (int() would take '١' and '1_0'), and no empty item ('1,,2')
        if not all(re.fullmatch(r"[0-9]{1,18}", t) for t in parts):
            raise VindexError(f"--tokens takes comma-separated whole numbers (ASCII digits), got {a.tokens!r}",
                              hint="e.g. --tokens 1,2,3")
        ids = [int(t) for t in parts]
    elif a.prompt is not None:
        ids = c.tokenizer.encode(a.prompt)
    else:
        raise VindexError("exec needs --tokens 1,2,3 or --prompt TEXT")
    if a.top < 1:
        raise VindexError(f"--top takes a positive number of tokens, got {a.top}")
    sl = Draft(a.draft_depth) if a.draft_depth is not None else Full()
    if a.logit_dump:
        from .draft import dump_logits

        meta = dump_logits(c, ids, sl, a.logit_dump, overwrite=a.overwrite, activations=a.activations)
        if a.json:
            _print_json(meta)
        else:
            print(f"wrote {meta.get('positions')} x {meta.get('vocab')} logits to {a.logit_dump} (+ sidecar)")
        return 0
    ex = c.executor(slice=sl, activations=a.activations)
    logits = ex.forward(ids)
    top = np.argsort(-logits[-1])[: a.top]
    out = {
        "tokens": ids,
        "slice": sl.describe(),
        "executed_layers": ex.trace.executed_layers,
        "activations": ex.trace.activations,
        "next_token": int(top[0]),
        "top": [{"id": int(t), "logit": float(logits[-1][t])} for t in top],
        "prepare_seconds": ex.trace.prepare_seconds,
        "step_seconds": ex.trace.total_step_seconds,
    }
    if c.has_tokenizer:
        for e in out["top"]:
            e["text"] = c.tokenizer.token_text(e["id"])
    if a.json:
        _print_json(out)
    else:
        print(f"{out['slice']}: ran layers {out['executed_layers'][0]}..{out['executed_layers'][-1]} over {len(ids)} positions")
        for e in out["top"]:
            print(f"  {e['id']:>7}  {e['logit']:>10.4f}  {e.get('text', '')!r}")
    return 0


def cmd_shard(a) -> int:
    from .shards import write_shards
    from .shards.store import read_manifest

    if (a.ranges is None) == (a.shards is None):
        raise VindexError("shard needs exactly one of --ranges 0-14,15-29 or --shards N")
    out = write_shards(a.src, a.out, a.ranges if a.ranges is not None else a.shards)
    m = read_manifest(out)
    if a.json:
        _print_json(m)
        return 0
    print(f"sharded {m['parent']['name']} (digest {m['parent']['digest'][:16]}…) -> {out}")
    print(f"  ends: embedding, final norm, head, tokenizer ({m['ends']['path']})")
    for e in m["shards"]:
        print(f"  {e['name']}: layers {e['layers'][0]}..{e['layers'][1] - 1} ({e['path']})")
    return 0


def cmd_default(a) -> int:
    from . import default_model
    from .progress import terminal_progress

    def notice(text: str) -> None:
        print(f"vindex3 default: {text}", file=sys.stderr)

    with terminal_progress(f"encoding {default_model.NAME} (first use)", enabled=not a.json) as cb:
        r = default_model.ensure_detailed(progress=cb, notice=notice, rebuild=a.rebuild)
    if a.json:
        _print_json({"path": str(r.path), "encoded": r.encoded, "rebuilt_because": r.rebuilt_because})
    else:
        print(r.path)
    return 0


def cmd_label(a) -> int:
    from .container import Container

    c = Container(a.path)
    model = dict(c.index.get("model", {}))
    model["name"] = a.name
    c.rewrite_index(model=model)
    print(f"{a.path}: model name set to {a.name!r} (generation {c.generation})")
    return 0


def _report_renderer():
    """The function that lays out this command's reports as text: the one an installed package
    offers through the ``vindex3.reports`` entry point (lql does: the text its statements print),
    or None. vindex3 itself imports no layer above it."""
    from importlib.metadata import entry_points

    for ep in entry_points(group="vindex3.reports"):
        try:
            return ep.load()
        except Exception:  # noqa: BLE001 - a broken plug-in: fall back to the report's own data
            return None
    return None


def _print_report(kind: str, report, as_json: bool, *, file=None) -> None:
    """A report through the installed renderer (text, or its JSON body), else as its own JSON."""
    render = _report_renderer()
    if render is None:
        _print_json(report.model_dump(mode="json"))
        return
    out = render(kind, report, as_json=as_json)
    if as_json:
        _print_json(out)
    else:
        print(out, file=file)


def cmd_represent(a) -> int:
    if (a.permute_experts is None) == (a.encoding is None):
        from .errors import ConfigError

        raise ConfigError("represent takes either --encoding or --permute-experts (one container per run)")
    if a.permute_experts is not None:
        from .permute import permute_experts

        p = permute_experts(a.src, a.out, a.permute_experts)
        if a.json:
            _print_json({"path": str(p.path), "tensors": p.tensors, "prompts": p.prompts,
                         "layers": {str(k): v for k, v in p.layers.items()}, "cleaned": p.cleaned})
        else:
            print(f"wrote {p.path}: {len(p.tensors)} expert banks reordered from {p.prompts} prompts")
            for k, v in sorted(p.layers.items()):
                print(f"  layer {k}: stored order {v}")
        return 0
    from .progress import terminal_progress
    from .represent import represent

    with terminal_progress(f"representing {Path(a.src).name} as {a.encoding}", enabled=not a.json) as cb:
        r = represent(a.src, a.out, a.encoding, progress=cb)
    _print_report("represent", r, a.json)
    return 0


def cmd_compact(a) -> int:
    from .compact import compact

    _print_report("compact", compact(a.src, a.out), a.json)
    return 0


def cmd_diff(a) -> int:
    from .diff import diff

    d = diff(a.a, a.b)
    _print_report("diff", d, a.json)
    return 0 if not d.logical else 1


def cmd_score_representation(a) -> int:
    from .evidence import score_representation
    from .progress import terminal_progress

    with terminal_progress(f"scoring {Path(a.candidate).name}", enabled=not a.json) as cb:
        s = score_representation(a.candidate, a.against, a.prompts, greedy=a.greedy, store=not a.no_store, progress=cb)
    _print_report("score_representation", s, a.json)
    return 0


def cmd_record_verify(a) -> int:
    """Exit 0: intact and complete; 3: intact record of an interrupted run; 1: truncated,
    edited or not a record."""
    from .internals.record import verify_record

    r = verify_record(a.path)
    if a.json:
        _print_json(r.model_dump())
    else:
        print(r.to_text(), file=sys.stdout if r.ok else sys.stderr)
    if not r.ok:
        return 1
    return 0 if r.status == "complete" else 3


def build_parser() -> argparse.ArgumentParser:
    from . import codecs

    p = argparse.ArgumentParser(prog="vindex3", description="VINDEX3 containers: admit, encode, inspect, verify, run.")
    p.add_argument("--version", action="version", version=f"vindex3 {__version__}")
    p.add_argument("--debug", action="store_true", help="show Python tracebacks")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("plan", help="grade a checkpoint's config and tensors (headers only)")
    s.add_argument("src")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_plan)

    s = sub.add_parser("encode", help="encode an HF checkpoint dir or a .gguf file into a container")
    s.add_argument("src")
    s.add_argument("out")
    s.add_argument("--keep-dtype", action="store_true",
                   help="keep bf16/f16 matrices 16-bit (exactly) instead of widening them to f32")
    s.add_argument("--widen", choices=["f32"], default=None,
                   help="write every tensor float32 (dequantized exactly), instead of keeping the matrices a GGUF "
                        "file stores in block encodings (q4_1, q6_k, ...) or 16-bit floats as they are")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_encode)

    s = sub.add_parser("represent", help="write a container in another weight encoding (same graph and objects)")
    s.add_argument("src")
    s.add_argument("out")
    s.add_argument("--encoding", choices=codecs.targets())
    s.add_argument("--permute-experts", metavar="PROMPTS", default=None,
                   help="instead of re-encoding: store every routed layer's expert banks most-used first, from router "
                        "statistics on this JSONL prompt bank (outputs identical; the order is recorded)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_represent)

    s = sub.add_parser("compact", help="copy only the files the index refers to; list every file left behind")
    s.add_argument("src")
    s.add_argument("out")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_compact)

    s = sub.add_parser("diff", help="logical vs physical differences of two containers (exit 1: logically different)")
    s.add_argument("a")
    s.add_argument("b")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_diff)

    s = sub.add_parser("score-representation",
                       help="KL, top-1 and greedy agreement of a representation against the same model on a prompt bank")
    s.add_argument("candidate")
    s.add_argument("--against", required=True, help="the reference container (e.g. the source it was represented from)")
    s.add_argument("--prompts", required=True, help="a JSONL prompt bank (tests/data/prompts-v1.jsonl)")
    s.add_argument("--greedy", type=int, default=32, help="greedy tokens compared per prompt (default 32)")
    s.add_argument("--no-store", action="store_true", help="do not record the result in the candidate's provenance")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_score_representation)

    s = sub.add_parser("inspect", help="describe a container (reads no tensor data)")
    s.add_argument("path")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_inspect)

    s = sub.add_parser("verify", help="re-hash every file against the index")
    s.add_argument("path")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_verify)

    s = sub.add_parser("ops", help="print the operand plan")
    s.add_argument("path")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_ops)

    s = sub.add_parser("exec", help="run tokens through the model (or a draft of it)")
    s.add_argument("path")
    s.add_argument("--tokens")
    s.add_argument("--prompt")
    s.add_argument("--draft-depth", type=int)
    s.add_argument("--top", type=int, default=5)
    s.add_argument("--logit-dump", metavar="FILE")
    s.add_argument("--overwrite", action="store_true", help="replace an existing --logit-dump file")
    s.add_argument("--activations", choices=["exact", "q8"], default="exact",
                   help="how int8/q4 decode products treat activations (q8: per-block int8, integer dots)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_exec)

    s = sub.add_parser("shard", help="write shard containers: each holds only its layers' segments, plus a manifest")
    s.add_argument("src")
    s.add_argument("out")
    s.add_argument("--ranges", help="inclusive layer ranges, e.g. 0-14,15-29")
    s.add_argument("--shards", type=int, help="an even split into N shards")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_shard)

    s = sub.add_parser("default", help="encode the built-in default model once and print its container path")
    s.add_argument("--rebuild", action="store_true", help="re-encode the cached default model even if it opens")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_default)

    s = sub.add_parser("label", help="rename the model in index.json (unknown keys are preserved)")
    s.add_argument("path")
    s.add_argument("--name", required=True)
    s.set_defaults(fn=cmd_label)

    s = sub.add_parser("record", help="execution records (OBSERVE ... RECORD INTO)")
    rsub = s.add_subparsers(dest="record_cmd", required=True)
    r = rsub.add_parser("verify", help="check a record against its receipt: complete, interrupted, truncated or edited")
    r.add_argument("path")
    r.add_argument("--json", action="store_true")
    r.set_defaults(fn=cmd_record_verify)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand behind one error boundary: a named refusal prints its message (exit 2;
    a failed verify exits 1), an unexpected exception prints ``internal error`` naming the
    command (exit 3), Ctrl-C exits 130; a traceback is shown only with --debug."""
    a = build_parser().parse_args(argv)
    try:
        return a.fn(a)
    except VindexError as e:
        if a.debug:
            raise
        print(f"vindex3 {a.cmd}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"vindex3 {a.cmd}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:
        if a.debug:
            raise
        what = "out of memory" if isinstance(e, MemoryError) else f"{type(e).__name__}: {e}"
        print(f"vindex3 {a.cmd}: internal error: {what}"[:2000], file=sys.stderr)
        print("  this is a defect in vindex3, not in your input; run again with --debug for the traceback",
              file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
