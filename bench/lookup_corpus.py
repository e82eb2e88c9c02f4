"""A corpus of the model's own greedy text for prompt lookup's CORPUS (vindex3.draft.lookup
`CorpusIndex`): what a speculating drafter must predict is the full model's greedy next token, so
the natural text to retrieve from is greedy text the model wrote itself. Openings are cut from
the sampled corpus of bench/draft_adapter.py (each seed text of vindex3.draft.seeds followed by
the model's sampled continuation; never the prompt bank) at ``--cuts`` tokens after its start,
and each is followed by ``--n`` greedy tokens of the full model (stopping at end-of-text). Writes
JSON lines ``{"token_ids": opening + continuation}`` and a sidecar JSON with the method, the
source corpus's SHA-256, counts, seconds and machine facts.

    python bench/lookup_corpus.py [--source bench/results/draft_adapter_cv8.corpus.jsonl]
        [--cuts 16,80] [--n 48] [--out bench/results/lookup_greedy.corpus.jsonl]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import vindex3
from vindex3 import default_model, jsonio
from vindex3.draft import greedy_generate
from vindex3.draft.adapter import read_corpus
from vindex3.draft.machine import machine_facts
from vindex3.draft.slices import make_executor


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--container", default=None)
    ap.add_argument("--source", default=str(ROOT / "bench" / "results" / "draft_adapter_cv8.corpus.jsonl"))
    ap.add_argument("--cuts", default="16,80", help="opening lengths, in tokens from a source text's start")
    ap.add_argument("--n", type=int, default=48, help="greedy tokens after each opening")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "lookup_greedy.corpus.jsonl"))
    args = ap.parse_args()
    c = vindex3.open(args.container or default_model.ensure())
    ex = make_executor(c, vindex3.Full())[0]
    eos = getattr(c.tokenizer, "eos_id", None)
    source = read_corpus(args.source)
    cuts = [int(x) for x in args.cuts.split(",")]
    openings, seen = [], set()
    for text in source:
        ids = list(c.tokenizer.encode(text)) if isinstance(text, str) else list(text)
        for cut in cuts:
            o = tuple(ids[:cut])
            if len(o) == cut and o not in seen:  # a text shorter than the cut, or an opening seen, adds none
                seen.add(o)
                openings.append(list(o))
    t0 = time.perf_counter()
    lines = []
    for i, o in enumerate(openings):
        cont = greedy_generate(c, o, args.n, ex=ex).tokens
        if eos is not None and eos in cont:
            cont = cont[:cont.index(eos) + 1]
        lines.append(json.dumps({"token_ids": o + cont}))
        if i % 50 == 0:
            print(f"{i}/{len(openings)} openings, {time.perf_counter() - t0:.0f} s", flush=True)
    out = Path(args.out)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(out)  # a reader sees the old file or the whole new one
    meta = {"benchmark": "lookup-corpus", "method": "greedy continuations of openings cut from the sampled corpus",
            "container": c.name, "container_digest": c.digest, "source": Path(args.source).name,
            "source_sha256": hashlib.sha256(Path(args.source).read_bytes()).hexdigest(), "cuts": cuts, "n": args.n,
            "texts": len(lines), "tokens": sum(len(json.loads(x)["token_ids"]) for x in lines),
            "sha256": hashlib.sha256(out.read_bytes()).hexdigest(), "seconds": time.perf_counter() - t0,
            "machine": machine_facts()}
    jsonio.write_atomic(out.with_suffix(".json"), meta)
    print(f"wrote {out} ({meta['texts']} texts, {meta['tokens']} tokens, {meta['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
