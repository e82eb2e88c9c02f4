"""How time per token grows from SmolLM2-135M to a 1.1B-parameter llama shape, vindex3 against
llama.cpp at equal bits (f32 vs F32, int8 and int8h vs Q8_0, q4 vs Q4_1), plus prefill-512 against llama.cpp
and against transformers fp32.

Shapes and their files:
  135m  SmolLM2-135M-Instruct: the peer GGUFs of bench/make_peer_ggufs.py (F32, Q8_0, the shipped
        Q4_1) and our default container with its REPRESENTations (bench/llamacpp_peer.our_containers)
  1.1b  TinyLlama's geometry (hidden 2048, 22 layers, FFN 5632, 32 heads / 4 KV heads, vocab 32000)
        with seeded random weights, written once as an F32 GGUF; Q8_0 / Q4_1 quantized from the
        same float32 arrays by the gguf package; our f32 imported from the F32 GGUF, our int8 / int8h /
        q4 REPRESENTed from that container (bench/scale_shape.py, files in <vindex3 cache>/scale-1b)
Both shapes also run our native import of the Q8_0 / Q4_1 GGUFs (their block bytes as stored).

Token ids, not text: the driver tokenizes one English text with the shape's tokenizer (the 1.1b
file carries SmolLM2's vocabulary cut to 32000) and hands every arm the same ids.

Every arm runs in its own process (one model loaded at a time); arms are interleaved (round r
runs every arm once) and report their best over ``--repeats`` inside the process; figures are
medians over rounds. Decode: prefill 16 ids, then greedy steps (argmax in numpy on both sides).
Prefill-512: one pass over 512 ids on an empty cache (llama.cpp n_batch = n_ubatch = 512),
last position's logits only, after a 32-id warm-up pass. Bytes per token: ours from the trace
(operand bytes a step touched), llama.cpp's from the GGUF (every tensor but the token embedding,
plus one embedding row); their fraction of the stream bandwidth (bench/intdot_vs_llamacpp.py's
one-thread copy rate) uses wall-clock tokens/s. The load average is recorded beside every arm.

    python bench/scaling_1b.py [--shapes 135m 1.1b] [--rounds 2] [--threads 1 2] [--no-prefill]
                               [--transformers-1b]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from intdot_vs_llamacpp import stream_bandwidth
from machine import facts, peer_omp_env, pin_threads

SENTENCE = "The quick brown fox jumps over the lazy dog while the model keeps counting tokens and the benchmark keeps time."
TEXT = " ".join([SENTENCE] * 60)
STEPS = {"135m": 32, "1.1b": 8}
PREFILL = 512
WARM = 32
# ours vs llama.cpp at equal bits; the native imports against the file they import
PAIRS = [("vindex3 f32 exact", "llama.cpp F32"), ("vindex3 int8 q8", "llama.cpp Q8_0"), ("vindex3 q4 q8", "llama.cpp Q4_1"),
         ("vindex3 int8h q8", "llama.cpp Q8_0"), ("vindex3 int8h q8", "vindex3 int8 q8"),
         ("vindex3 int8 exact", "llama.cpp Q8_0"), ("vindex3 q4 exact", "llama.cpp Q4_1"),
         ("vindex3 q8_0(native) q8", "llama.cpp Q8_0"), ("vindex3 q4_1(native) q8", "llama.cpp Q4_1"),
         ("vindex3 f32 exact", "transformers fp32")]


# ------------------------------------------------------------------------------- arms (own process)

def _timed_decode(prefill, step, ids: list[int], steps: int, repeats: int) -> dict:
    import numpy as np

    best = best_cpu = 1e9
    greedy: list[int] = []
    for r in range(repeats + 1):  # the first is a warm-up (compiles, faults the pages in)
        logits = prefill(ids[:16])
        n = 2 if r == 0 else steps
        greedy = []
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(n):
            greedy.append(int(np.argmax(logits)))
            logits = step(greedy[-1])
        if r:
            best = min(best, time.perf_counter() - t0)
            best_cpu = min(best_cpu, time.process_time() - c0)
    # the greedy ids show both engines run the same model (equal at equal bits, up to rounding)
    return {"decode_ms_per_token": 1e3 * best / steps, "decode_tok_s": steps / best,
            "decode_tok_per_cpu_s": steps / best_cpu, "greedy": greedy}


def _timed_prefill(prefill, ids: list[int], repeats: int) -> dict:
    prefill(ids[:WARM])
    best = 1e9
    for _ in range(repeats):
        t = time.perf_counter()
        prefill(ids[:PREFILL])
        best = min(best, time.perf_counter() - t)
    return {"prefill_512_tok_s": PREFILL / best}


def arm_ours(spec: dict, ids: list[int], steps: int, repeats: int, do_prefill: bool) -> dict:
    import vindex3

    c = vindex3.open(spec["path"])
    ex = c.executor(activations=spec["activations"])
    box: dict = {}

    def prefill(x):
        box["st"] = ex.start()
        return box["st"].prefill(x, last_only=True)[-1]

    out = {"weight_bytes": c.weight_bytes}
    out |= _timed_decode(prefill, lambda t: box["st"].step(t), ids, steps, repeats)
    out["bytes_per_token"] = int(box["st"].trace.step_bytes[-1])
    if do_prefill:
        out |= _timed_prefill(prefill, ids, repeats)
    return out


def arm_llama(spec: dict, threads: int, ids: list[int], steps: int, repeats: int, do_prefill: bool) -> dict:
    import llama_cpp
    import numpy as np

    m = llama_cpp.Llama(model_path=spec["path"], n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=threads,
                        n_threads_batch=threads, verbose=False, seed=0)
    V = m.n_vocab()

    def prefill(x):
        m.reset()
        m.eval(x)
        return np.ctypeslib.as_array(m._ctx.get_logits(), shape=(V,))

    def step(t):
        m.eval([t])
        return np.ctypeslib.as_array(m._ctx.get_logits(), shape=(V,))

    out = _timed_decode(prefill, step, ids, steps, repeats)
    if do_prefill:
        out |= _timed_prefill(prefill, ids, repeats)
    return out


def arm_transformers(spec: dict, threads: int, ids: list[int], repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    g = Path(spec["path"])
    m = AutoModelForCausalLM.from_pretrained(g.parent, gguf_file=g.name, dtype=torch.float32).eval()
    out = {"attn_implementation": m.config._attn_implementation, "torch_threads": torch.get_num_threads()}
    with torch.inference_mode():
        out |= _timed_prefill(lambda x: m(torch.tensor([x]), use_cache=True, logits_to_keep=1).logits, ids, repeats)
    return out


# ------------------------------------------------------------------------------- driver

def read_bandwidth() -> float:
    """Bytes/s one thread reads streaming two 256 MiB float32 arrays through a BLAS dot product
    (best of 3): the ceiling of a step that only reads its weights. The copy rate of
    `stream_bandwidth` counts a write per read and sits below it."""
    import numpy as np

    a = np.ones(1 << 26, np.float32)
    b = np.ones(1 << 26, np.float32)
    best = 1e9
    for _ in range(3):
        t = time.perf_counter()
        np.dot(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * a.nbytes / best


def run_arm(spec: dict, threads: int, ids: list[int], steps: int, repeats: int, do_prefill: bool) -> dict:
    cmd = [sys.executable, __file__, "--arm", json.dumps(spec), "--arm-threads", str(threads), "--ids", json.dumps(ids),
           "--steps", str(steps), "--repeats", str(repeats)] + ([] if do_prefill else ["--no-prefill"])
    extra = os.environ.get("PYTHONPATH")  # e.g. where a bench-only llama-cpp-python build lives
    env = dict(os.environ, VINDEX3_DECODE_THREADS=str(threads), VINDEX3_FUSED_LAYERS=os.environ.get("VINDEX3_FUSED_LAYERS", "1"),
               PYTHONPATH=str(HERE.parent) + (os.pathsep + extra if extra else ""))
    if spec["kind"] == "llama":  # the caller's wait settings, not those vindex3 sets for itself
        peer_omp_env(env)
    load0 = os.getloadavg()[0]
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=3600, env=env)
    if p.returncode:  # recorded and reported; the other arms still run
        print(f"arm {spec} t={threads} failed:\n{p.stderr[-3000:]}", file=sys.stderr, flush=True)
        r = {"error": (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]}
    else:
        r = json.loads(p.stdout.strip().splitlines()[-1])
    r["loadavg_before"], r["loadavg_after"] = load0, os.getloadavg()[0]
    return r


def gguf_step_bytes(path: Path) -> int:
    """Bytes of a llama.cpp decode step's weights: every tensor but the token embedding, plus one
    row of it (the file's own encoding of each); a file without output.weight reads the whole
    embedding again as its tied head."""
    import gguf

    r = gguf.GGUFReader(path, "r")
    tied = all(t.name != "output.weight" for t in r.tensors)
    total = 0
    for t in r.tensors:
        n = int(t.n_bytes)
        if t.name == "token_embd.weight":
            total += n if tied else 0
            n //= int(t.shape[-1])  # one row; shape[-1] is the row count (ggml order)
        total += n
    return total


def arms_of(shape: str, transformers_1b: bool) -> tuple[list[tuple[str, dict]], dict]:
    """(arm name, spec) of the shape, and the peer files (for their step bytes)."""
    if shape == "135m":
        from llamacpp_peer import our_containers
        from make_peer_ggufs import peer_dir, peer_files

        from vindex3.encode import encode

        d = peer_dir()
        peers = {t: peer_files(d)[t] for t in ("F32", "Q8_0", "Q4_1")}
        ours = our_containers(["f32", "int8", "int8h", "q4"], d)
        for t in ("Q8_0", "Q4_1"):  # our native import of the peer's block file
            p = d / f"smollm2-135m-instruct.{t.lower()}-native.vindex3"
            if not p.exists():
                encode(peers[t], p, native=True)
            ours[t.lower()] = str(p)
        tf = str(peers["F32"])
    else:
        import scale_shape

        from vindex3.default_model import cache_dir

        f = scale_shape.build(cache_dir() / "scale-1b", "1.1b")
        peers = {t: f[t] for t in ("F32", "Q8_0", "Q4_1")}
        ours = {k: str(f[k]) for k in ("f32", "int8", "int8h", "q4", "q8_0", "q4_1")}
        tf = str(f["F32"]) if transformers_1b else None
    arms = [(f"llama.cpp {t}", {"kind": "llama", "path": str(p)}) for t, p in peers.items()]
    for enc, acts in (("f32", ["exact"]), ("int8", ["q8", "exact"]), ("int8h", ["q8", "exact"]), ("q4", ["q8", "exact"]),
                      ("q8_0", ["q8"]), ("q4_1", ["q8"])):
        label = enc if enc in ("f32", "int8", "int8h", "q4") else f"{enc}(native)"
        for act in acts:
            arms.append((f"vindex3 {label} {act}", {"kind": "ours", "path": ours[enc], "activations": act}))
    if tf:
        arms.append(("transformers fp32", {"kind": "transformers", "path": tf}))
    return arms, peers


def shape_ids(arms: list[tuple[str, dict]]) -> list[int]:
    import vindex3

    path = next(s["path"] for n, s in arms if n == "vindex3 f32 exact")
    ids = vindex3.open(path).tokenizer.encode(TEXT)
    assert len(ids) >= PREFILL, len(ids)
    return list(ids[:PREFILL])


def summarize(runs: dict, peer_bytes: dict, bw: float, rbw: float | None) -> tuple[dict, dict, dict]:
    """Medians over rounds per arm, ratios at equal bits, growth from 135m to 1.1b."""
    summary: dict = {}
    for shape, by_arm in runs.items():
        for name, by_t in by_arm.items():
            for tk, lst in by_t.items():
                errors = [x["error"] for x in lst if "error" in x]
                lst = [x for x in lst if "error" not in x]
                if errors:
                    summary.setdefault(shape, {}).setdefault(name, {})[tk] = {"errors": errors}
                if not lst:
                    continue
                s: dict = {"errors": errors} if errors else {}
                s["loadavg"] = [x["loadavg_before"] for x in lst] + [lst[-1]["loadavg_after"]]
                for k in ("decode_ms_per_token", "decode_tok_s", "decode_tok_per_cpu_s", "prefill_512_tok_s"):
                    vals = [x[k] for x in lst if k in x]
                    if vals:
                        s[k + "_median"] = statistics.median(vals)
                        s[k + "_best"] = (min if k == "decode_ms_per_token" else max)(vals)
                bpt = lst[0].get("bytes_per_token", peer_bytes.get(shape, {}).get(name))
                if bpt and "decode_tok_s_median" in s:
                    s["bytes_per_token"] = bpt
                    s["bandwidth_fraction"] = bpt * s["decode_tok_s_median"] / bw
                    s["bandwidth_fraction_per_cpu_s"] = bpt * s["decode_tok_per_cpu_s_median"] / bw
                    if rbw:
                        s["read_bandwidth_fraction"] = bpt * s["decode_tok_s_median"] / rbw
                s["peak_rss_bytes"] = max(x["peak_rss_bytes"] for x in lst)
                if "greedy" in lst[0]:
                    s["greedy"] = lst[0]["greedy"]
                summary.setdefault(shape, {}).setdefault(name, {})[tk] = s
    ratios: dict = {}
    for shape, by_arm in summary.items():
        for mine, other in PAIRS:
            if mine in by_arm and other in by_arm:
                for tk in by_arm[mine]:
                    if tk in by_arm[other]:
                        r = {k: by_arm[mine][tk][k + "_median"] / by_arm[other][tk][k + "_median"]
                             for k in ("decode_tok_s", "decode_tok_per_cpu_s", "prefill_512_tok_s")
                             if k + "_median" in by_arm[mine][tk] and k + "_median" in by_arm[other][tk]}
                        ga, gb = by_arm[mine][tk].get("greedy"), by_arm[other][tk].get("greedy")
                        if ga and gb:  # greedy ids the two arms agree on before the first difference
                            r["greedy_equal_prefix"] = next((i for i, (x, y) in enumerate(zip(ga, gb)) if x != y), len(ga))
                        ratios.setdefault(shape, {}).setdefault(f"{mine} / {other}", {})[tk] = r
    growth: dict = {}  # ms/token at 1.1b over ms/token at 135m, beside the bytes ratio
    if "135m" in summary and "1.1b" in summary:
        for name in summary["1.1b"]:
            for tk, big in summary["1.1b"][name].items():
                small = summary["135m"].get(name, {}).get(tk)
                if small and "decode_ms_per_token_median" in big and "decode_ms_per_token_median" in small:
                    g = {"ms_per_token_135m": small["decode_ms_per_token_median"],
                         "ms_per_token_1.1b": big["decode_ms_per_token_median"],
                         "time_ratio": big["decode_ms_per_token_median"] / small["decode_ms_per_token_median"],
                         "cpu_time_ratio": small["decode_tok_per_cpu_s_median"] / big["decode_tok_per_cpu_s_median"]}
                    if "bytes_per_token" in big and "bytes_per_token" in small:
                        g["bytes_ratio"] = big["bytes_per_token"] / small["bytes_per_token"]
                    growth.setdefault(name, {})[tk] = g
    return summary, ratios, growth


def print_report(summary: dict, ratios: dict, growth: dict) -> None:
    # cpu-ms/tok: CPU time a token took (the machine is shared: wall time includes waiting for a core)
    print(f"{'shape':<6}{'arm':<28}{'thr':>4}{'ms/tok':>9}{'cpu-ms':>8}{'MB/tok':>9}{'bw frac':>8}{'rd frac':>8}{'pf512 tok/s':>12}  load")
    for shape, by_arm in summary.items():
        for name, by_t in by_arm.items():
            for tk, s in by_t.items():
                if "loadavg" not in s:
                    print(f"{shape:<6}{name:<28}{tk[-1]:>4}  failed: {s['errors'][-1]}")
                    continue
                ms = f"{s['decode_ms_per_token_median']:.1f}" if "decode_ms_per_token_median" in s else "-"
                mb = f"{s['bytes_per_token'] / 1e6:.0f}" if "bytes_per_token" in s else "-"
                cms = f"{1e3 / s['decode_tok_per_cpu_s_median']:.1f}" if "decode_tok_per_cpu_s_median" in s else "-"
                fr = f"{s['bandwidth_fraction']:.2f}" if "bandwidth_fraction" in s else "-"
                rf = f"{s['read_bandwidth_fraction']:.2f}" if "read_bandwidth_fraction" in s else "-"
                pf = f"{s['prefill_512_tok_s_median']:.0f}" if "prefill_512_tok_s_median" in s else "-"
                ld = "/".join(f"{x:.1f}" for x in s["loadavg"])
                print(f"{shape:<6}{name:<28}{tk[-1]:>4}{ms:>9}{cms:>8}{mb:>9}{fr:>8}{rf:>8}{pf:>12}  {ld}")
    for shape, rs in ratios.items():
        for pair, by_t in rs.items():
            for tk, r in by_t.items():
                print(f"{shape:<6}{pair:<50} t={tk[-1]}  "
                      + "  ".join(f"{k} {v:.2f}x" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()))
    for name, by_t in growth.items():
        for tk, g in by_t.items():
            br = f"  bytes x{g['bytes_ratio']:.1f}" if "bytes_ratio" in g else ""
            print(f"growth {name:<28} t={tk[-1]}  {g['ms_per_token_135m']:.1f} -> {g['ms_per_token_1.1b']:.1f} ms/tok "
                  f"(x{g['time_ratio']:.1f}; per cpu-s x{g['cpu_time_ratio']:.1f}){br}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["135m", "1.1b"], choices=["135m", "1.1b"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="timed repeats inside a 135m arm (best kept)")
    ap.add_argument("--repeats-1b", type=int, default=1, help="timed repeats inside a 1.1b arm")
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--prefill-shapes", nargs="+", default=["135m", "1.1b"], help="shapes whose arms also time prefill-512")
    ap.add_argument("--skip-exact", action="store_true", help="leave out the int8/q4 arms under activations = 'exact'")
    ap.add_argument("--skip-native", action="store_true", help="leave out our native imports of the Q8_0/Q4_1 files")
    ap.add_argument("--only", nargs="+", help="run only the arms with these exact names")
    ap.add_argument("--transformers-1b", action="store_true", help="also time transformers' prefill of the 1.1b F32 GGUF")
    ap.add_argument("--out", default=str(HERE / "results" / "scaling_1b.json"))
    ap.add_argument("--resummarize", metavar="JSON", help="recompute a result file's summary from its runs, and print it")
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--arm-threads", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.arm:
        pin_threads(a.arm_threads)
        spec, ids, pre = json.loads(a.arm), json.loads(a.ids), not a.no_prefill
        if spec["kind"] == "llama":
            r = arm_llama(spec, a.arm_threads, ids, a.steps, a.repeats, pre)
        elif spec["kind"] == "transformers":
            r = arm_transformers(spec, a.arm_threads, ids, a.repeats)
        else:
            r = arm_ours(spec, ids, a.steps, a.repeats, pre)
        import resource

        r["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        print(json.dumps(r))
        return 0

    if a.resummarize:
        doc = json.loads(Path(a.resummarize).read_text())
        peer_bytes = doc.get("peer_step_bytes") or {
            shape: {f"llama.cpp {t}": gguf_step_bytes(p) for t, p in arms_of(shape, False)[1].items()} for shape in doc["runs"]}
        doc["peer_step_bytes"] = peer_bytes
        doc["summary"], doc["ratios"], doc["growth"] = summarize(doc["runs"], peer_bytes, doc["stream_bandwidth_bytes_per_s"],
                                                                 doc.get("read_bandwidth_bytes_per_s"))
        Path(a.resummarize).write_text(json.dumps(doc, indent=2) + "\n")
        print_report(doc["summary"], doc["ratios"], doc["growth"])
        return 0
    pin_threads(1)  # the driver's bandwidths are one thread's (set before it imports numpy; each arm sets its own)
    from llamacpp_peer import _llama_version

    if _llama_version() == "not installed":
        print("llama-cpp-python is not importable (set PYTHONPATH to its bench build; scripts/bench-setup)",
              file=sys.stderr)
        return 2
    load_start = os.getloadavg()
    plan: dict = {}
    for shape in a.shapes:
        arms, peers = arms_of(shape, a.transformers_1b)
        ids = shape_ids(arms)  # from the f32 container, which --only may leave out
        if a.skip_exact:
            arms = [(n, s) for n, s in arms if not n.endswith(("int8 exact", "int8h exact", "q4 exact"))]
        if a.only:
            arms = [(n, s) for n, s in arms if n in a.only]
        if a.skip_native:
            arms = [(n, s) for n, s in arms if "(native)" not in n]
        if shape not in a.prefill_shapes or a.no_prefill:
            arms = [(n, s) for n, s in arms if s["kind"] != "transformers"]
        plan[shape] = {"arms": arms, "ids": ids,
                       "peer_step_bytes": {f"llama.cpp {t}": gguf_step_bytes(p) for t, p in peers.items()}}
    bw, rbw = stream_bandwidth(), read_bandwidth()
    print(f"stream bandwidth {bw / 1e9:.1f} GB/s copy, {rbw / 1e9:.1f} GB/s read (load {os.getloadavg()[0]:.1f})",
          flush=True)
    runs: dict = {}
    for r in range(a.rounds):
        for shape, p in plan.items():
            pre = shape in a.prefill_shapes and not a.no_prefill
            for th in a.threads:
                for name, spec in p["arms"]:
                    reps = a.repeats if shape == "135m" else a.repeats_1b
                    res = run_arm(spec, th, p["ids"], STEPS[shape], reps, pre)
                    runs.setdefault(shape, {}).setdefault(name, {}).setdefault(f"threads_{th}", []).append(res)
                    if "error" in res:
                        continue
                    dec = f"decode {res['decode_ms_per_token']:.1f} ms/tok" if "decode_ms_per_token" in res else ""
                    pf = f" prefill-512 {res['prefill_512_tok_s']:.0f} tok/s" if "prefill_512_tok_s" in res else ""
                    print(f"round {r} {shape} t={th} {name}: {dec}{pf} (load {res['loadavg_before']:.1f}"
                          f"->{res['loadavg_after']:.1f})", flush=True)
    peer_bytes = {shape: p["peer_step_bytes"] for shape, p in plan.items()}
    summary, ratios, growth = summarize(runs, peer_bytes, bw, rbw)
    doc = {
        "benchmark": "scaling_1b",
        "shapes": {"135m": "SmolLM2-135M-Instruct (peer GGUFs by bench/make_peer_ggufs.py; Q4_1 = the shipped file)",
                   "1.1b": "seeded random llama, hidden 2048, 22 layers, FFN 5632, 32/4 heads, vocab 32000 "
                           "(bench/scale_shape.py, seed 26)"},
        "llama_cpp_python": _llama_version(),
        # how our arms held their weights (VINDEX3_WEIGHTS, inherited by every arm; the peer maps)
        "our_weights": os.environ.get("VINDEX3_WEIGHTS") or "mapped",
        "decode_steps": {s: STEPS[s] for s in plan}, "prefill_positions": PREFILL, "rounds": a.rounds,
        "repeats": {"135m": a.repeats, "1.1b": a.repeats_1b}, "threads": a.threads,
        "stream_bandwidth_bytes_per_s": bw, "read_bandwidth_bytes_per_s": rbw,
        "machine": facts(None) | {"loadavg_start": load_start, "loadavg_end": os.getloadavg()},
        "peer_step_bytes": peer_bytes, "summary": summary, "ratios": ratios, "growth": growth, "runs": runs,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=2) + "\n")
    print_report(summary, ratios, growth)
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
