"""Decode of SmolLM2-135M-Instruct: vindex3's encodings under ``activations = 'exact' | 'q8'``
against llama.cpp at equal bits (int8 and int8h vs Q8_0, q4 vs Q4_1, f32 vs F32) and bf16 against
our own f32, at 1 and 2 threads (int8h: int8 codes with half-precision block scales, Q8_0's
bytes). Every arm runs in its own process; arms are interleaved (round r
runs every arm once) and each reports its best over ``--repeats`` inside the process; ratios
are of medians over rounds. Our arms also report kernel launches per token (numba calls of the
rows kernels; q/k/v and gate/up are one fused launch each where the encoding has the kernel),
operand bytes per token and the fraction of the measured streaming bandwidth (per CPU-second
against one thread's copy rate, and by wall clock against what that many threads read). Our arms run with
fused decode layers (vindex3.exec.ops.fused_layer: one numba call a layer); the ``unfused`` arms
turn them off (VINDEX3_FUSED_LAYERS=0) to measure what the fusion gives. ``--select`` keeps the
arms whose name contains one of its comma-separated parts (a short run on a busy machine).
``--resident`` adds our fused arms again with ``VINDEX3_WEIGHTS=resident`` (each segment read
into private memory asked for in huge pages instead of mapped; same bytes, same results), and
the peer's arms again with ``use_mmap=False`` (llama.cpp's own read-into-memory load).
``--malloc-ab`` adds our arms again with glibc's own malloc thresholds (``VINDEX3_MALLOC_TUNE=0``,
vindex3.exec.heap).

Decode: prefill 16 prompt tokens, then ``--steps`` greedy steps (argmax in numpy, as the peer
arm of bench/llamacpp_peer.py does, whose llama.cpp arm this reuses). Without llama-cpp-python
(scripts/bench-setup) the peer arms are skipped and the ratios are against our own
float-lane kernels (activations = 'exact').

Prefill (``--prefill``): each arm instead times one prefill of 512 prompt tokens on an empty
cache (llama.cpp: one eval with n_batch = n_ubatch = 512; ours: ``prefill(ids, last_only=True)``),
best of ``--repeats`` after a warm-up, wall clock and CPU time; our q8 arms run every product
through the integer kernels (vindex3.codecs.inttiles), the exact arms decode tiles for BLAS.

    python bench/intdot_vs_llamacpp.py [--rounds 3] [--threads 1 2] [--steps 32] [--path vnni512]
        [--select "int8 q8,q4 q8,Q8_0,Q4_1"] [--prefill] [--drop-cache]

``--drop-cache`` first drops every arm's files from the page cache (vindex3/segments.py says why
it matters: a file's pages map 2 MB at a time only where the cache holds them in 2 MB folios);
every arm reports how many kB of its weights were mapped so (``file_pmd_mapped_kb``).
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
from machine import facts, omp_labels, peer_omp_env, pin_threads

TEXT = " ".join(["The quick brown fox jumps over the lazy dog while the model keeps counting tokens."] * 8)


def pmd_mapped_kb() -> int:
    """kB of this process's file mappings of weights (container segments, GGUF files) that the
    kernel maps 2 MB at a time (/proc/self/smaps FilePmdMapped; 0 where it is not reported)."""
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    total, weights = 0, False
    for line in lines:
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's header line
            weights = len(head) >= 6 and head[-1].endswith((".bin", ".gguf"))
        elif weights and line.startswith("FilePmdMapped:"):
            total += int(head[1])
    return total


def drop_page_cache(paths: list[Path]) -> None:
    """POSIX_FADV_DONTNEED every regular file under ``paths`` (a container directory's
    segments, a GGUF file): their clean pages leave the page cache unless a process maps them."""
    files = [f for p in paths for f in ([p] if p.is_file() else sorted(p.rglob("*.bin")))]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    print(f"dropped {len(files)} files from the page cache", flush=True)


def stream_bandwidth() -> float:
    """Bytes/s one thread moves copying a 256 MiB float32 array into another (read + write
    counted, best of 3): the memory ceiling a decode step that streams its weights once runs
    against. Measured in the driver, before the arms."""
    import numpy as np

    a = np.ones(1 << 26, np.float32)
    b = np.empty_like(a)
    best = 1e9
    for _ in range(3):
        t = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t)
    return 2 * a.nbytes / best


def read_bandwidth(threads: int) -> float:
    """Bytes/s that ``threads`` threads read together, each summing its own 256 MiB float32 array
    four times (numpy's sum releases the GIL; best of 3): the ceiling for a decode step at that thread count
    that streams its weights once, by wall clock. Measured in the driver, before the arms."""
    import threading

    import numpy as np

    arrays = [np.full(1 << 26, i + 1, np.float32) for i in range(threads)]
    passes = 4  # each thread's share long enough (~40 ms) that starting the threads does not count

    def read(x):
        for _ in range(passes):
            np.sum(x)

    best = 1e9
    for _ in range(3):
        workers = [threading.Thread(target=read, args=(x,)) for x in arrays]
        t = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - t)
    return passes * sum(x.nbytes for x in arrays) / best


PREFILL_T = 512


def prefill_ids(encode) -> list[int]:
    """The first 512 tokens of the peer bench's long text (bench/llamacpp_peer.py)."""
    from llamacpp_peer import TEXT as LONG

    ids = list(encode(LONG))[:PREFILL_T]
    assert len(ids) == PREFILL_T, len(ids)
    return ids


def _timed(fn, repeats: int) -> tuple[float, float]:
    """Best wall and best CPU seconds of ``fn()`` over ``repeats`` runs after a warm-up."""
    best = best_cpu = 1e9
    for i in range(repeats + 1):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        if i:
            best = min(best, time.perf_counter() - t0)
            best_cpu = min(best_cpu, time.process_time() - c0)
    return best, best_cpu


def prefill_ours(path: str, activations: str, repeats: int) -> dict:
    import numpy as np

    import vindex3
    from vindex3.codecs import intrinsics

    c = vindex3.open(path)
    ex = c.executor(activations=activations)
    ids = prefill_ids(c.tokenizer.encode)
    wall, cpu = _timed(lambda: ex.start().prefill(ids, last_only=True), repeats)
    q = c.tokenizer.encode("The capital of France is")
    ans = c.tokenizer.decode([int(np.argmax(ex.start().prefill(q, last_only=True)[-1]))])
    return {"prefill_tok_s": PREFILL_T / wall, "prefill_tok_per_cpu_s": PREFILL_T / cpu, "answer": ans,
            "answer_ok": ans == " Paris", "intdot_path": intrinsics.chosen() if activations == "q8" else None}


def prefill_llama(path: str, threads: int, repeats: int) -> dict:
    import llama_cpp

    m = llama_cpp.Llama(model_path=path, n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=threads,
                        n_threads_batch=threads, verbose=False, seed=0)
    ids = prefill_ids(lambda t: m.tokenize(t.encode(), add_bos=False))

    def run():
        m.reset()
        m.eval(ids)

    wall, cpu = _timed(run, repeats)
    return {"prefill_tok_s": PREFILL_T / wall, "prefill_tok_per_cpu_s": PREFILL_T / cpu}


def arm_ours(path: str, activations: str, steps: int, repeats: int) -> dict:
    import numpy as np

    import vindex3
    from vindex3.codecs import base, intrinsics

    c = vindex3.open(path)
    ex = c.executor(activations=activations)
    ids = c.tokenizer.encode(TEXT)[:16]
    out: dict = {"weight_bytes": c.weight_bytes, "intdot_path": intrinsics.chosen() if activations == "q8" else None}
    # one untimed pass counting the kernel launches of a step (every rows kernel, single or
    # fused, enters vindex3.codecs.threads.launch() once), the weight products (Weight.mm, and
    # fused groups from vindex3.codecs.base.products) and the operand bytes it touched
    from vindex3.codecs import threads

    launches, products = [0], [0]
    real = threads._LAUNCH

    class Counting(type(real)):
        def __enter__(self):
            launches[0] += 1
            return real.__enter__()

    orig = {}
    for cls in _weight_classes(base.Weight):
        if "mm" in cls.__dict__:
            orig[cls] = cls.__dict__["mm"]

            def counted(self, x, _f=cls.__dict__["mm"]):
                products[0] += 1
                return _f(self, x)

            cls.mm = counted
    threads._LAUNCH = Counting()
    st = ex.start()
    logits = st.prefill(ids, last_only=True)[-1]
    launches[0] = products[0] = 0
    st.step(int(np.argmax(logits)))
    out["calls_per_token"] = launches[0]
    out["mm_calls_per_token"] = products[0]  # single products; a fused group is one launch
    out["bytes_per_token"] = st.trace.step_bytes[-1]
    threads._LAUNCH = real
    for cls, f in orig.items():
        cls.mm = f
    best = best_cpu = 1e9
    for _ in range(repeats + 1):  # the first is a warm-up (compiles)
        st = ex.start()
        logits = st.prefill(ids, last_only=True)[-1]
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(steps):
            logits = st.step(int(np.argmax(logits)))
        best = min(best, time.perf_counter() - t0)
        best_cpu = min(best_cpu, time.process_time() - c0)
    out["decode_tok_s"] = steps / best
    out["decode_tok_per_cpu_s"] = steps / best_cpu
    out["answer_ok"] = None
    if activations in ("exact", "q8"):
        q = c.tokenizer.encode("The capital of France is")
        out["answer_ok"] = c.tokenizer.decode([int(np.argmax(ex.start().prefill(q, last_only=True)[-1]))]) == " Paris"
    return out


def _weight_classes(root):
    seen, todo = [], [root]
    while todo:
        k = todo.pop()
        seen.append(k)
        todo.extend(k.__subclasses__())
    return seen


def arm_llama(path: str, threads: int, steps: int, repeats: int, use_mmap: bool = True) -> dict:
    import llama_cpp
    import numpy as np

    m = llama_cpp.Llama(model_path=path, n_ctx=512, n_batch=512, n_ubatch=512, n_threads=threads,
                        n_threads_batch=threads, verbose=False, seed=0, use_mmap=use_mmap)
    V = m.n_vocab()
    ids = m.tokenize(TEXT.encode(), add_bos=False)[:16]

    def last_logits():
        return np.ctypeslib.as_array(m._ctx.get_logits(), shape=(V,))

    best = best_cpu = 1e9
    for _ in range(repeats + 1):
        m.reset()
        m.eval(ids)
        nxt = int(np.argmax(last_logits()))
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(steps):
            m.eval([nxt])
            nxt = int(np.argmax(last_logits()))
        best = min(best, time.perf_counter() - t0)
        best_cpu = min(best_cpu, time.process_time() - c0)
    return {"decode_tok_s": steps / best, "decode_tok_per_cpu_s": steps / best_cpu}


def run_arm(spec: dict, threads: int, steps: int, repeats: int, path_force: str | None, prefill: bool = False) -> dict:
    cmd = [sys.executable, __file__, "--arm", json.dumps(spec), "--arm-threads", str(threads),
           "--steps", str(steps), "--repeats", str(repeats)] + (["--prefill"] if prefill else [])
    extra = os.environ.get("PYTHONPATH")  # e.g. where a bench-only llama-cpp-python build lives
    env = dict(os.environ, VINDEX3_DECODE_THREADS=str(threads),
               PYTHONPATH=str(HERE.parent) + (os.pathsep + extra if extra else ""))
    if path_force:
        env["VINDEX3_INTDOT_PATH"] = path_force
    env["VINDEX3_FUSED_LAYERS"] = "0" if spec.get("fused") is False else "1"
    env["VINDEX3_WEIGHTS"] = spec.get("weights", "mapped")  # vindex3.switches.weights_mode
    env["VINDEX3_TEAMS"] = "0" if spec.get("team") is False else "1"  # vindex3.codecs.threads
    if spec.get("malloc") is False:  # the process's allocator left as glibc sets it (vindex3.exec.heap)
        env["VINDEX3_MALLOC_TUNE"] = "0"
    if spec.get("spin") is not None:  # numba's OpenMP workers spin this long, then sleep
        env.pop("OMP_WAIT_POLICY", None)
        env["GOMP_SPINCOUNT"] = str(spec["spin"])
    if spec["kind"] == "llama":
        peer_omp_env(env)
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=1800, env=env)
    if p.returncode:
        raise SystemExit(f"arm {spec} t={threads} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def prefill_main(a, arms: list[tuple[str, dict]]) -> int:
    from llamacpp_peer import _llama_build, _llama_version

    runs: dict = {}
    for r in range(a.rounds):
        for th in a.threads:
            for name, spec in arms:
                res = run_arm(spec, th, a.steps, a.repeats, a.path, prefill=True)
                res["loadavg"] = os.getloadavg()[0]
                runs.setdefault(name, {}).setdefault(f"threads_{th}", []).append(res)
                print(f"round {r} t={th} {name}: prefill-512 {res['prefill_tok_s']:.1f} tok/s, "
                      f"{res['prefill_tok_per_cpu_s']:.1f} tok/cpu-s (load {res['loadavg']:.1f})", flush=True)
    keys = ("prefill_tok_s", "prefill_tok_per_cpu_s")
    summary: dict = {}
    for name, by_t in runs.items():
        for tk, lst in by_t.items():
            s = {k + "_median": statistics.median(x[k] for x in lst) for k in keys}
            s |= {k + "_best": max(x[k] for x in lst) for k in keys}
            s["loadavg_range"] = [min(x["loadavg"] for x in lst), max(x["loadavg"] for x in lst)]
            for k in ("answer", "answer_ok", "intdot_path"):
                if k in lst[0]:
                    s[k] = lst[0][k]
            summary.setdefault(name, {})[tk] = s
    pairs = [("vindex3 int8 q8", "llama.cpp Q8_0"), ("vindex3 q4 q8", "llama.cpp Q4_1"),
             ("vindex3 int8 exact", "llama.cpp Q8_0"), ("vindex3 q4 exact", "llama.cpp Q4_1"),
             ("vindex3 f32 exact", "llama.cpp F32"), ("vindex3 int8 q8", "vindex3 int8 exact"),
             ("vindex3 q4 q8", "vindex3 q4 exact"), ("vindex3 int8h q8", "llama.cpp Q8_0"),
             ("vindex3 int8h q8", "vindex3 int8 q8")]
    ratios: dict = {}
    for mine, other in pairs:
        for tk in summary.get(mine, {}):
            if tk in summary.get(other, {}):
                ratios.setdefault(f"{mine} / {other}", {})[tk] = {
                    k: summary[mine][tk][k + "_median"] / summary[other][tk][k + "_median"] for k in keys}
    doc = {
        "benchmark": "intdot_vs_llamacpp --prefill",
        "model": "SmolLM2-135M-Instruct (our encodings by vindex3.represent, peer GGUFs by bench/make_peer_ggufs.py)",
        "llama_cpp_python": _llama_version(), "llama_cpp_build": _llama_build(), "prefill_tokens": PREFILL_T,
        "rounds": a.rounds, "repeats": a.repeats, "forced_path": a.path,
        "omp_wait_policy": omp_labels(),
        "machine": facts(None) | {"loadavg": a.loadavg_start, "loadavg_end": list(os.getloadavg())},
        "summary": summary, "ratios": ratios, "runs": runs,
    }
    out = a.out if a.out != str(HERE / "results" / "intdot_vs_llamacpp.json") else str(HERE / "results" / "intdot_prefill_vs_llamacpp.json")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(doc, indent=2) + "\n")
    for name, by_t in summary.items():
        for tk, s in by_t.items():
            print(f"{name:<24} t={tk[-1]}  prefill-512 med {s['prefill_tok_s_median']:.1f} tok/s, "
                  f"{s['prefill_tok_per_cpu_s_median']:.1f} tok/cpu-s  answer {s.get('answer', '-')!r}")
    for pair, by_t in ratios.items():
        for tk, r in by_t.items():
            print(f"{pair:<42} t={tk[-1]}  prefill {r['prefill_tok_s']:.2f}x  per cpu-s {r['prefill_tok_per_cpu_s']:.2f}x")
    print("wrote", out)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--path", help="force an integer dot path (vnni512 | vnni256 | avx2 | plain)")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--dir", help="peer GGUF directory (default: <vindex3 cache>/peer-ggufs)")
    ap.add_argument("--out", default=str(HERE / "results" / "intdot_vs_llamacpp.json"))
    ap.add_argument("--select", help="comma-separated parts of arm names: run only the arms that contain one "
                                     "(a part starting with '=' names an arm exactly)")
    ap.add_argument("--prefill", action="store_true", help="time prefill-512 instead of decode")
    ap.add_argument("--resident", action="store_true",
                    help="also run our fused arms with VINDEX3_WEIGHTS=resident (weights read into huge pages)")
    ap.add_argument("--team-ab", action="store_true",
                    help="add arms of ours with a parallel region per product (VINDEX3_TEAMS=0)")
    ap.add_argument("--malloc-ab", action="store_true",
                    help="add arms of ours with glibc's own malloc thresholds (VINDEX3_MALLOC_TUNE=0)")
    ap.add_argument("--spin", type=int, help="add arms of ours whose OpenMP workers spin GOMP_SPINCOUNT=N, then sleep")
    ap.add_argument("--drop-cache", action="store_true",
                    help="first drop every arm's files (our segments, the peer's GGUFs) from the page cache, so that "
                         "each engine's first process reads them from disk its own way")
    ap.add_argument("--arm", help=argparse.SUPPRESS)
    ap.add_argument("--arm-threads", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.arm:
        pin_threads(a.arm_threads)
        spec = json.loads(a.arm)
        if a.prefill:
            r = (prefill_llama(spec["path"], a.arm_threads, a.repeats) if spec["kind"] == "llama"
                 else prefill_ours(spec["path"], spec["activations"], a.repeats))
            print(json.dumps(r))
            return 0
        r = (arm_llama(spec["path"], a.arm_threads, a.steps, a.repeats, spec.get("mmap", True)) if spec["kind"] == "llama"
             else arm_ours(spec["path"], spec["activations"], a.steps, a.repeats))
        r["file_pmd_mapped_kb"] = pmd_mapped_kb()
        print(json.dumps(r))
        return 0

    a.loadavg_start = list(os.getloadavg())  # facts() runs after the arms; the run's start is kept apart
    from llamacpp_peer import _llama_build, _llama_version, our_containers
    from make_peer_ggufs import peer_dir, peer_files

    arms: list[tuple[str, dict]] = []
    peer = not a.no_peer and _llama_version() != "not installed"
    if peer:
        files = peer_files(peer_dir(a.dir))
        for t in ("F32", "Q8_0", "Q4_1"):
            if files[t].exists():
                arms.append((f"llama.cpp {t}", {"kind": "llama", "path": str(files[t])}))
                if a.resident:  # the peer's own way of holding weights in memory: read, not mapped
                    arms.append((f"llama.cpp {t} no-mmap", {"kind": "llama", "path": str(files[t]), "mmap": False}))
            else:
                print(f"peer GGUF {t} missing: run bench/make_peer_ggufs.py", file=sys.stderr)
    ours = our_containers(["f32", "bf16", "int8", "int8h", "q4"], peer_dir(a.dir))
    for enc, acts in (("f32", ["exact"]), ("bf16", ["exact"]), ("int8", ["exact", "q8"]), ("int8h", ["exact", "q8"]),
                      ("q4", ["exact", "q8"])):
        for act in acts:
            arms.append((f"vindex3 {enc} {act}", {"kind": "ours", "path": ours[enc], "activations": act}))
            arms.append((f"vindex3 {enc} {act} unfused", {"kind": "ours", "path": ours[enc], "activations": act,
                                                          "fused": False}))
            if a.team_ab:
                arms.append((f"vindex3 {enc} {act} per-product", {"kind": "ours", "path": ours[enc],
                                                                  "activations": act, "team": False}))
            if a.spin is not None:
                arms.append((f"vindex3 {enc} {act} spin", {"kind": "ours", "path": ours[enc], "activations": act,
                                                           "spin": a.spin}))
            if a.malloc_ab:
                arms.append((f"vindex3 {enc} {act} malloc-off", {"kind": "ours", "path": ours[enc],
                                                                 "activations": act, "malloc": False}))
            if a.resident:
                arms.append((f"vindex3 {enc} {act} resident", {"kind": "ours", "path": ours[enc], "activations": act,
                                                               "weights": "resident"}))
    if a.prefill:  # fusion is a decode matter: prefill products run one weight at a time
        arms = [(n, s) for n, s in arms if s.get("fused") is not False]
    if a.select:
        parts = [p.strip() for p in a.select.split(",") if p.strip()]
        arms = [(n, s) for n, s in arms if any(n == p[1:] if p.startswith("=") else p in n for p in parts)]
    if a.drop_cache:
        drop_page_cache([Path(spec["path"]) for _, spec in arms])
    if a.prefill:
        return prefill_main(a, arms)
    bw = stream_bandwidth()
    read_bw = {th: read_bandwidth(th) for th in a.threads}
    print("read bandwidth " + ", ".join(f"{th} thread(s) {v / 1e9:.1f} GB/s" for th, v in read_bw.items()), flush=True)
    runs: dict = {}
    for r in range(a.rounds):
        for th in a.threads:
            for name, spec in arms:
                res = run_arm(spec, th, a.steps, a.repeats, a.path)
                res["loadavg"] = os.getloadavg()[0]
                runs.setdefault(name, {}).setdefault(f"threads_{th}", []).append(res)
                extra = f", {res['calls_per_token']} calls/token" if "calls_per_token" in res else ""
                print(f"round {r} t={th} {name}: {res['decode_tok_s']:.1f} tok/s, "
                      f"{res['decode_tok_per_cpu_s']:.1f} tok/cpu-s{extra} (load {res['loadavg']:.1f})", flush=True)
    summary: dict = {}
    for name, by_t in runs.items():
        for tk, lst in by_t.items():
            s = {}
            for k in ("decode_tok_s", "decode_tok_per_cpu_s"):
                vals = [x[k] for x in lst]
                s[k + "_best"] = max(vals)
                s[k + "_median"] = statistics.median(vals)
            for k in ("calls_per_token", "mm_calls_per_token", "bytes_per_token", "intdot_path", "answer_ok",
                      "file_pmd_mapped_kb"):
                if k in lst[0]:
                    s[k] = lst[0][k]
            if "bytes_per_token" in s:  # operand bytes read per CPU-second, against the copy rate
                s["weight_bytes_per_cpu_s"] = s["bytes_per_token"] * s["decode_tok_per_cpu_s_median"]
                s["bandwidth_fraction_per_cpu_s"] = s["weight_bytes_per_cpu_s"] / bw
                th = int(tk.split("_")[1])  # by wall clock, against what that many threads read
                s["read_bandwidth_fraction_wall"] = s["bytes_per_token"] * s["decode_tok_s_median"] / read_bw[th]
            summary.setdefault(name, {})[tk] = s
    pairs = [("vindex3 int8 q8", "llama.cpp Q8_0"), ("vindex3 q4 q8", "llama.cpp Q4_1"),
             ("vindex3 int8 exact", "llama.cpp Q8_0"), ("vindex3 q4 exact", "llama.cpp Q4_1"),
             ("vindex3 f32 exact", "llama.cpp F32"), ("vindex3 bf16 exact", "vindex3 f32 exact"),
             ("vindex3 int8 q8", "vindex3 int8 exact"), ("vindex3 q4 q8", "vindex3 q4 exact"),
             ("vindex3 int8 q8 unfused", "llama.cpp Q8_0"), ("vindex3 q4 q8 unfused", "llama.cpp Q4_1"),
             ("vindex3 int8h q8", "llama.cpp Q8_0"), ("vindex3 int8h q8", "vindex3 int8 q8"),
             ("vindex3 int8h exact", "vindex3 int8 exact")]
    pairs += [("vindex3 int8 q8 resident", "llama.cpp Q8_0"), ("vindex3 q4 q8 resident", "llama.cpp Q4_1"),
              ("vindex3 f32 exact resident", "llama.cpp F32"), ("vindex3 int8 q8 resident", "llama.cpp Q8_0 no-mmap"),
              ("vindex3 q4 q8 resident", "llama.cpp Q4_1 no-mmap"), ("vindex3 f32 exact resident", "llama.cpp F32 no-mmap"), ("vindex3 bf16 exact resident", "vindex3 f32 exact resident")]
    pairs += [(f"vindex3 {e} {act} {v}", peer) for e, act, peer in (("int8", "q8", "llama.cpp Q8_0"),
              ("q4", "q8", "llama.cpp Q4_1"), ("f32", "exact", "llama.cpp F32")) for v in ("per-product", "spin")]
    pairs += [(f"vindex3 {e} {act}", f"vindex3 {e} {act} per-product") for e, act in (("int8", "q8"), ("q4", "q8"), ("f32", "exact"))]
    pairs += [(f"vindex3 {e} {act} resident", f"vindex3 {e} {act}")
              for e, act in (("int8", "q8"), ("int8h", "q8"), ("q4", "q8"), ("f32", "exact"), ("bf16", "exact"))]
    pairs += [(f"vindex3 {e} {act}", f"vindex3 {e} {act} unfused")
              for e, act in (("int8", "q8"), ("q4", "q8"), ("int8", "exact"), ("q4", "exact"), ("f32", "exact"), ("bf16", "exact"))]
    ratios: dict = {}
    for mine, other in pairs:
        if mine in summary and other in summary:
            for tk in summary[mine]:
                if tk in summary[other]:
                    ratios.setdefault(f"{mine} / {other}", {})[tk] = {
                        k: summary[mine][tk][k + "_median"] / summary[other][tk][k + "_median"]
                        for k in ("decode_tok_s", "decode_tok_per_cpu_s")}
    doc = {
        "benchmark": "intdot_vs_llamacpp",
        "model": "SmolLM2-135M-Instruct (our encodings by vindex3.represent, peer GGUFs by bench/make_peer_ggufs.py)",
        "llama_cpp_python": _llama_version(), "llama_cpp_build": _llama_build(),
        "decode_steps": a.steps, "rounds": a.rounds, "repeats": a.repeats, "forced_path": a.path,
        "omp_wait_policy": {**omp_labels(),
                            "ours 'spin' arms": None if a.spin is None else f"unset, GOMP_SPINCOUNT={a.spin}"},
        "stream_bandwidth_bytes_per_s": bw,
        "read_bandwidth_bytes_per_s": {f"threads_{th}": v for th, v in read_bw.items()},
        "machine": facts(None) | {"loadavg": a.loadavg_start, "loadavg_end": list(os.getloadavg())},
        "summary": summary, "ratios": ratios, "runs": runs,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"{'arm':<24}{'thr':>4}{'tok/s med':>11}{'tok/cpu-s med':>15}{'calls':>7}{'MB/tok':>8}{'GB/cpu-s':>9}{'bw frac':>8}{'read frac':>10}")
    for name, by_t in summary.items():
        for tk, s in by_t.items():
            mb = f"{s['bytes_per_token'] / 1e6:.0f}" if "bytes_per_token" in s else "-"
            gb = f"{s['weight_bytes_per_cpu_s'] / 1e9:.1f}" if "bytes_per_token" in s else "-"
            fr = f"{s['bandwidth_fraction_per_cpu_s']:.2f}" if "bytes_per_token" in s else "-"
            rf = f"{s['read_bandwidth_fraction_wall']:.2f}" if "bytes_per_token" in s else "-"
            print(f"{name:<24}{tk[-1]:>4}{s['decode_tok_s_median']:>11.1f}{s['decode_tok_per_cpu_s_median']:>15.1f}"
                  f"{s.get('calls_per_token', '-'):>7}{mb:>8}{gb:>9}{fr:>8}{rf:>10}")
    for pair, by_t in ratios.items():
        for tk, r in by_t.items():
            print(f"{pair:<42} t={tk[-1]}  decode {r['decode_tok_s']:.2f}x  per cpu-s {r['decode_tok_per_cpu_s']:.2f}x")
    print("wrote", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
