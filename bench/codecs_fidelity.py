"""What each weight encoding does to SmolLM2-135M-Instruct, before the executor runs encodings
natively (phase B): every 2-D tensor of the default f32 container (projections, FFN matrices,
the embedding, which is also the tied head) is encoded, decoded exactly (the codec's dense()),
and handed to today's executor in place of the f32 tensor; 1-D tensors stay f32. The logits then
differ from a native run only by summation order.

Per encoding: per-tensor fidelity (max abs error, relative RMS error, bits per weight), and
against the f32 model on the frozen prompt bank: KL(f32 || enc) over every position (p50, p95,
max), top-1 agreement, greedy-32 agreement (tokens equal to f32's, up to the first difference,
averaged over prompts), and the greedy continuation of "The capital of France is".

An encoding spelled ``A+embB`` encodes the embedding object (also the tied head) with B and
every other 2-D tensor with A (``q4+embint8``: 4-bit matrices, 8-bit embedding, the mix the
shipped Q4_1 GGUF has).

    python bench/codecs_fidelity.py [--encodings bf16 f16 int8 int8_row q4 q4+embint8] [--prompts N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from machine import facts

GREEDY = 32


class DecodedSegment:
    """A segment whose 2-D tensors read as encode -> decode of the original."""

    def __init__(self, seg, codec, record):
        self._seg, self._codec, self._record = seg, codec, record
        self.entries = seg.entries
        self._cache: dict = {}

    def names(self):
        return self._seg.names()

    def tensor(self, name):
        a = self._seg.tensor(name)
        if a.ndim < 2:
            return a
        if name not in self._cache:
            from vindex3.codecs.fidelity import compare

            raw = self._codec.encode(a)
            d = self._codec.weight(raw, a.shape).dense()
            self._record[name] = compare(a, d, self._codec.name, raw.nbytes).as_dict()
            self._cache[name] = d
        return self._cache[name]


def run_model(c, prompts):
    import numpy as np

    ex = c.executor()
    logits, greedy = [], []
    for p in prompts:
        ids = c.tokenizer.encode(p)
        logits.append(ex.forward(ids))
        st = ex.start()
        lg = st.prefill(ids, last_only=True)[-1]
        toks = []
        for _ in range(GREEDY):
            t = int(np.argmax(lg))
            toks.append(t)
            lg = st.step(t)
        greedy.append(toks)
    return logits, greedy


def log_softmax(x):
    import numpy as np

    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--encodings", nargs="+", default=["bf16", "f16", "int8", "int8_row", "q4", "q4+embint8"])
    ap.add_argument("--prompts", type=int, default=0, help="use the first N prompts of the bank (0: all)")
    ap.add_argument("--out", default=str(HERE / "results" / "codecs_fidelity.json"))
    a = ap.parse_args()

    import numpy as np

    import vindex3
    from vindex3 import codecs, default_model
    from vindex3.codecs.int8 import Int8RowCodec

    def codec(name):
        return Int8RowCodec() if name == "int8_row" else codecs.get(name)
    from vindex3.draft.bank import default_bank, load_prompts

    bank = default_bank()
    prompts = [p.text for p in load_prompts(bank)]
    if a.prompts:
        prompts = prompts[: a.prompts]
    prompts = ["The capital of France is", *[p for p in prompts if p != "The capital of France is"]]
    path = default_model.ensure()
    base = vindex3.open(path)
    ref_logits, ref_greedy = run_model(base, prompts)
    ref_lp = [log_softmax(x) for x in ref_logits]
    tok = base.tokenizer
    results: dict = {}
    for enc in a.encodings:
        main_enc, _, emb_enc = enc.partition("+emb")
        t0 = time.perf_counter()
        c = vindex3.open(path)
        record: dict = {}
        c.segments = {
            o: DecodedSegment(s, codec(emb_enc if (emb_enc and o == "embedding") else main_enc), record)
            for o, s in c.segments.items()
        }
        logits, greedy = run_model(c, prompts)
        kl, top1 = [], []
        for lp_ref, lg in zip(ref_lp, logits):
            lp = log_softmax(lg)
            kl.extend((np.exp(lp_ref) * (lp_ref - lp)).sum(-1).tolist())
            top1.extend((lp_ref.argmax(-1) == lp.argmax(-1)).tolist())
        agree = []
        for g_ref, g in zip(ref_greedy, greedy):
            n = 0
            while n < GREEDY and g_ref[n] == g[n]:
                n += 1
            agree.append(n / GREEDY)
        enc_bytes = sum(r["encoded_bytes"] for r in record.values())
        elems = sum(r["elements"] for r in record.values())
        results[enc] = {
            "encoded_tensors": len(record),
            "encoded_bytes": enc_bytes,
            "f32_bytes_of_those_tensors": 4 * elems,
            "bits_per_weight": 8 * enc_bytes / elems,
            "max_abs_error_max": max(r["max_abs_error"] for r in record.values()),
            "rel_rms_error_median": statistics.median(r["rel_rms_error"] for r in record.values()),
            "rel_rms_error_max": max(r["rel_rms_error"] for r in record.values()),
            "exact_tensors": sum(r["exact"] for r in record.values()),
            "kl_p50": float(np.percentile(kl, 50)),
            "kl_p95": float(np.percentile(kl, 95)),
            "kl_max": float(np.max(kl)),
            "top1_agreement": float(np.mean(top1)),
            "greedy32_agreement": float(np.mean(agree)),
            "paris_continuation": tok.decode(greedy[0][:4]),
            "paris_ok": tok.decode(greedy[0][:1]) == " Paris",
            "seconds": time.perf_counter() - t0,
            "per_tensor": record,
        }
        r = results[enc]
        print(f"{enc:<13} bpw {r['bits_per_weight']:.3f}  KL p50 {r['kl_p50']:.2e} p95 {r['kl_p95']:.2e}  "
              f"top1 {r['top1_agreement']:.4f}  greedy32 {r['greedy32_agreement']:.3f}  "
              f"relRMS med {r['rel_rms_error_median']:.2e}  exact {r['exact_tensors']}/{r['encoded_tensors']}  "
              f"{r['paris_continuation']!r}", flush=True)
    doc = {
        "what": "encode -> exact decode of every 2-D tensor, run by today's f32 executor, against the f32 model",
        "prompt_bank": bank.name,
        "prompts": len(prompts),
        "positions": int(sum(x.shape[0] for x in ref_logits)),
        "reference_paris_continuation": tok.decode(ref_greedy[0][:4]),
        "machine": facts(None),
        "encodings": results,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=2) + "\n")
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
