"""llama.cpp as the peer: decode tok/s and prefill-512 tok/s of SmolLM2-135M-Instruct for each
peer GGUF (F32, Q8_0, Q4_0, and the shipped Q4_1; see bench/make_peer_ggufs.py) at 1 and 2
threads. Every arm runs in its own process; arms are interleaved (round r runs every arm
once) and each arm reports its best and median over rounds. The vindex3 executor (f32, as
wired today) runs as one more arm in the same rounds, so ratios come from one run.

Decode: prefill 16 prompt tokens, then 64 greedy steps (one eval per token, argmax of the
last logits in numpy, as our arm does). Prefill-512: one eval of 512 tokens on an empty cache
(n_batch = n_ubatch = 512). Needs llama-cpp-python built by scripts/bench-setup.

    python bench/llamacpp_peer.py [--rounds 3] [--threads 1 2] [--no-ours]
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
from machine import facts, pin_threads

DECODE_STEPS = 64
SENTENCE = "The quick brown fox jumps over the lazy dog while the model keeps counting tokens and the benchmark keeps time."
TEXT = " ".join([SENTENCE] * 60)


def arm_llama(path: str, threads: int, repeats: int) -> dict:
    import llama_cpp
    import numpy as np

    m = llama_cpp.Llama(model_path=path, n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=threads,
                        n_threads_batch=threads, verbose=False, seed=0)
    V = m.n_vocab()
    ids = m.tokenize(TEXT.encode(), add_bos=False)
    assert len(ids) >= 512, len(ids)

    def last_logits():
        return np.ctypeslib.as_array(m._ctx.get_logits(), shape=(V,))

    out: dict = {"n_vocab": V}
    best = 1e9
    for _ in range(repeats + 1):  # the first is a warm-up
        m.reset()
        t = time.perf_counter()
        m.eval(ids[:512])
        best = min(best, time.perf_counter() - t)
    out["prefill_512_tok_s"] = 512 / best
    best = best_cpu = 1e9
    for _ in range(repeats + 1):
        m.reset()
        m.eval(ids[:16])
        nxt = int(np.argmax(last_logits()))
        c = time.process_time()
        t = time.perf_counter()
        for _ in range(DECODE_STEPS):
            m.eval([nxt])
            nxt = int(np.argmax(last_logits()))
        best = min(best, time.perf_counter() - t)
        best_cpu = min(best_cpu, time.process_time() - c)
    out["decode_tok_s"] = DECODE_STEPS / best
    out["decode_tok_per_cpu_s"] = DECODE_STEPS / best_cpu
    import resource

    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def arm_ours(threads: int, repeats: int, path: str = "") -> dict:
    """The vindex3 executor on the default container (f32) or on one of its representations
    (bf16, int8, q4; see `our_containers`), same prompt and step count."""
    import numpy as np

    import vindex3
    from vindex3 import default_model

    c = vindex3.open(path or default_model.ensure())
    ex = c.executor()
    ids = c.tokenizer.encode(TEXT)
    assert len(ids) >= 512
    out: dict = {"weight_bytes": c.weight_bytes}
    best = 1e9
    for _ in range(repeats + 1):
        st = ex.start()
        t = time.perf_counter()
        st.prefill(ids[:512], last_only=True)
        best = min(best, time.perf_counter() - t)
    out["prefill_512_tok_s"] = 512 / best
    best = best_cpu = 1e9
    for _ in range(repeats + 1):
        st = ex.start()
        logits = st.prefill(ids[:16], last_only=True)[-1]
        c = time.process_time()
        t = time.perf_counter()
        for _ in range(DECODE_STEPS):
            logits = st.step(int(np.argmax(logits)))
        best = min(best, time.perf_counter() - t)
        best_cpu = min(best_cpu, time.process_time() - c)
    out["decode_tok_s"] = DECODE_STEPS / best
    out["decode_tok_per_cpu_s"] = DECODE_STEPS / best_cpu
    import resource

    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def our_containers(encodings: list[str], where: Path) -> dict[str, str]:
    """The default container and its representations in `encodings` (made once, beside the
    peer GGUFs, by vindex3.represent from the same shipped weights)."""
    from vindex3 import default_model
    from vindex3.represent import represent

    src = default_model.ensure()
    out = {}
    for enc in encodings:
        if enc == "f32":
            out[enc] = str(src)
            continue
        p = where / f"smollm2-135m-instruct.{enc}.vindex3"
        if not (p / "index.json").exists():
            print(f"representing the default container as {enc} -> {p}", flush=True)
            represent(src, p, enc)
        out[enc] = str(p)
    return out


def run_arm(kind: str, threads: int, repeats: int, path: str = "") -> dict:
    cmd = [sys.executable, __file__, "--arm", kind, "--arm-threads", str(threads), "--repeats", str(repeats)]
    if path:
        cmd += ["--path", path]
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=1200)
    if p.returncode:
        raise SystemExit(f"arm {kind} {path} t={threads} failed:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2, help="timed repeats inside one arm process (best kept)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--types", nargs="+", default=["F32", "Q8_0", "Q4_0", "Q4_1"])
    ap.add_argument("--dir", help="peer GGUF directory (default: <vindex3 cache>/peer-ggufs)")
    ap.add_argument("--no-ours", action="store_true")
    ap.add_argument("--ours", nargs="+", default=["f32", "bf16", "int8", "q4"],
                    help="encodings of our arms (default f32 bf16 int8 q4)")
    ap.add_argument("--out", default=str(HERE / "results" / "llamacpp_peer.json"))
    ap.add_argument("--arm", choices=["llama", "ours"], help=argparse.SUPPRESS)
    ap.add_argument("--arm-threads", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.arm:
        pin_threads(a.arm_threads)
        r = (arm_llama(a.path, a.arm_threads, a.repeats) if a.arm == "llama"
             else arm_ours(a.arm_threads, a.repeats, a.path or ""))
        print(json.dumps(r))
        return 0

    loadavg_start = list(os.getloadavg())  # facts() runs after the arms; the run's start is kept apart
    from make_peer_ggufs import peer_dir, peer_files

    files = peer_files(peer_dir(a.dir))
    missing = [t for t in a.types if not files[t].exists()]
    if missing:
        print(f"peer GGUFs missing for {missing}: run bench/make_peer_ggufs.py first", file=sys.stderr)
        return 2
    arms = [(f"llama.cpp {t}", "llama", str(files[t])) for t in a.types]
    if not a.no_ours:
        for enc, path in our_containers(a.ours, peer_dir(a.dir)).items():
            arms.append((f"vindex3 {enc}", "ours", path))
    runs: dict = {}
    for r in range(a.rounds):
        for th in a.threads:
            for name, kind, path in arms:
                res = run_arm(kind, th, a.repeats, path)
                res["loadavg"] = os.getloadavg()[0]
                runs.setdefault(name, {}).setdefault(f"threads_{th}", []).append(res)
                print(f"round {r} t={th} {name}: decode {res['decode_tok_s']:.1f} tok/s, "
                      f"prefill-512 {res['prefill_512_tok_s']:.1f} tok/s", flush=True)
    summary: dict = {}
    ratios: dict = {}
    for name, by_t in runs.items():
        for tk, lst in by_t.items():
            s = {}
            for k in ("decode_tok_s", "decode_tok_per_cpu_s", "prefill_512_tok_s"):
                vals = [x[k] for x in lst]
                s[k + "_best"] = max(vals)
                s[k + "_median"] = statistics.median(vals)
            s["peak_rss_bytes"] = max(x["peak_rss_bytes"] for x in lst)
            summary.setdefault(name, {})[tk] = s
    # the pairs at equal bits, median over rounds (arms interleaved, so each round's
    # machine load is shared); bf16 is compared with our own f32
    pairs = [("vindex3 f32", "llama.cpp F32"), ("vindex3 int8", "llama.cpp Q8_0"), ("vindex3 q4", "llama.cpp Q4_1"),
             ("vindex3 q4", "llama.cpp Q4_0"), ("vindex3 bf16", "vindex3 f32"), ("vindex3 f32", "llama.cpp Q4_1")]
    for ours, peer in pairs:
        if ours in summary and peer in summary:
            for tk in summary[ours]:
                if tk in summary[peer]:
                    ratios.setdefault(f"{ours} / {peer}", {})[tk] = {
                        k: summary[ours][tk][k + "_median"] / summary[peer][tk][k + "_median"]
                        for k in ("decode_tok_s", "decode_tok_per_cpu_s", "prefill_512_tok_s")}
    sizes = {t: files[t].stat().st_size for t in a.types}
    doc = {
        "benchmark": "llamacpp_peer",
        "model": "SmolLM2-135M-Instruct; peer GGUFs made from the shipped Q4_1 weights (bench/make_peer_ggufs.py)",
        "llama_cpp_python": _llama_version(),
        "build": _llama_build(),
        "decode_steps": DECODE_STEPS,
        "rounds": a.rounds,
        "file_bytes": sizes,
        "machine": facts(None) | {"loadavg": loadavg_start, "loadavg_end": list(os.getloadavg())},
        "summary": summary,
        "ratios": ratios,
        "runs": runs,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"{'arm':<30}{'thr':>4}{'decode med':>12}{'best':>8}{'per cpu-s':>10}{'prefill512 med':>16}{'best':>8}")
    for name, by_t in summary.items():
        for tk, s in by_t.items():
            print(f"{name:<30}{tk[-1]:>4}{s['decode_tok_s_median']:>12.1f}{s['decode_tok_s_best']:>8.1f}"
                  f"{s['decode_tok_per_cpu_s_best']:>10.1f}{s['prefill_512_tok_s_median']:>16.1f}{s['prefill_512_tok_s_best']:>8.1f}")
    for pair, by_t in ratios.items():
        for tk, r in by_t.items():
            print(f"{pair:<36} t={tk[-1]}  decode {r['decode_tok_s']:.2f}x  per cpu-s {r['decode_tok_per_cpu_s']:.2f}x  "
                  f"prefill-512 {r['prefill_512_tok_s']:.2f}x")
    print("wrote", a.out)
    return 0


def _llama_version() -> str:
    try:
        import llama_cpp

        return llama_cpp.__version__
    except ImportError:
        return "not installed"


def _llama_build() -> str:
    """What the peer's build says it was compiled for (scripts/bench-setup turns on the sets
    this CPU reports, AMX off): the instruction sets a ratio against it was measured with."""
    try:
        import llama_cpp

    except ImportError:
        return "not installed"
    try:
        return "scripts/bench-setup: " + llama_cpp.llama_print_system_info().decode(errors="replace").strip()
    except (AttributeError, OSError) as e:  # installed, but its build cannot say: named, not guessed
        return f"unknown (llama_print_system_info failed: {type(e).__name__}: {e})"


if __name__ == "__main__":
    sys.exit(main())
