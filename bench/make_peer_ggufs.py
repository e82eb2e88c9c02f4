"""Write the llama.cpp peer's GGUF files of SmolLM2-135M-Instruct, all made from the shipped
Q4_1 GGUF's weights, into a cache directory outside git (never committed):

  F32   every tensor dequantized exactly to float32
  Q8_0  every 2-D tensor dequantized, then quantized by the gguf package's Q8_0 quantizer
  Q4_0  the same with its Q4_0 quantizer, except the token embedding (also the tied head),
        which keeps the shipped file's Q8_0 bytes as in the shipped Q4_1 file. Measured: this
        file does NOT answer " Paris" (" capitalised as it"; with a Q4_0 embedding too,
        " approximately 31"): moving Q4_1's asymmetric 16-level grid onto Q4_0's symmetric one
        is a second rounding the model does not survive. It stays a speed peer only; the
        answer-preserving 4-bit peer is the shipped Q4_1 file (which vindex3's q4 re-encodes
        without loss).
  Q4_1  the shipped file itself (its 2-D tensors are Q4_1, its token embedding Q8_0)

1-D tensors (norms) stay F32 in every file, as in the shipped one. Metadata (architecture,
hyper-parameters, tokenizer) is copied field by field; ``general.file_type`` names the new type.
Then each file is loaded by llama.cpp in its own process and must continue
"The capital of France is" greedily with " Paris".

    python bench/make_peer_ggufs.py [--dir DIR] [--force] [--no-check]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

TYPES = ("F32", "Q8_0", "Q4_0")
# llama.cpp's LLAMA_FTYPE values for general.file_type
FILE_TYPE = {"F32": 0, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7}
PROMPT = "The capital of France is"
# a failed answer check that is a recorded finding, not a broken tool
KNOWN_WRONG = {"Q4_0": "Q4_1 weights re-quantized to Q4_0 lose the answer (second 4-bit rounding)"}


def peer_dir(arg: str | None = None) -> Path:
    if arg:
        return Path(arg)
    from vindex3.default_model import cache_dir

    return cache_dir() / "peer-ggufs"


def peer_files(d: Path) -> dict[str, Path]:
    """Every peer file by type name; Q4_1 is the shipped GGUF."""
    from vindex3.default_model import gguf_path

    files = {t: d / f"SmolLM2-135M-Instruct.{t}.gguf" for t in TYPES}
    files["Q4_1"] = gguf_path()
    return files


def write(src: Path, out: Path, qname: str) -> dict:
    import gguf
    import numpy as np
    from gguf.quants import dequantize, quantize

    qtype = gguf.GGMLQuantizationType[qname]
    r = gguf.GGUFReader(src, "r")
    arch = str(r.fields["general.architecture"].contents())
    tmp = out.with_name(out.name + ".tmp")
    w = gguf.GGUFWriter(tmp, arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type", "general.alignment"):
            continue
        vtype = f.types[0]
        sub = f.types[1] if vtype == gguf.GGUFValueType.ARRAY and len(f.types) > 1 else None
        w.add_key_value(name, f.contents(), vtype, sub_type=sub)
    w.add_file_type(FILE_TYPE[qname])
    counts: dict[str, int] = {}
    low_bit = qtype not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0)
    for t in r.tensors:
        if low_bit and t.name == "token_embd.weight" and t.tensor_type == gguf.GGMLQuantizationType.Q8_0:
            w.add_tensor(t.name, np.array(t.data), raw_shape=t.data.shape, raw_dtype=t.tensor_type)
            counts["Q8_0"] = counts.get("Q8_0", 0) + 1
            continue
        a = dequantize(t.data, t.tensor_type)  # exact: float32 [rows, cols]
        if a.ndim >= 2 and qtype != gguf.GGMLQuantizationType.F32:
            data = quantize(np.ascontiguousarray(a, dtype=np.float32), qtype)
            w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=qtype)
            counts[qname] = counts.get(qname, 0) + 1
        else:
            w.add_tensor(t.name, np.ascontiguousarray(a, dtype=np.float32))
            counts["F32"] = counts.get("F32", 0) + 1
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, out)
    return {"tensors_by_type": counts, "bytes": out.stat().st_size}


def check(path: Path) -> dict:
    """In its own process: llama.cpp loads the file and continues PROMPT greedily."""
    code = f"""
import json, llama_cpp
m = llama_cpp.Llama(model_path={str(path)!r}, n_ctx=256, n_threads=2, verbose=False, seed=0)
o = m.create_completion({PROMPT!r}, max_tokens=4, temperature=0.0, top_k=1)
print(json.dumps({{"completion": o["choices"][0]["text"]}}))
"""
    p = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=600)
    if p.returncode:
        return {"ok": False, "error": p.stderr.strip().splitlines()[-1:] or ["exit " + str(p.returncode)]}
    got = json.loads(p.stdout.strip().splitlines()[-1])["completion"]
    return {"ok": got.startswith(" Paris"), "completion": got}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", help="where to write (default: <vindex3 cache>/peer-ggufs)")
    ap.add_argument("--force", action="store_true", help="rewrite files that exist")
    ap.add_argument("--no-check", action="store_true", help="skip the llama.cpp ' Paris' check")
    a = ap.parse_args()
    d = peer_dir(a.dir)
    d.mkdir(parents=True, exist_ok=True)
    files = peer_files(d)
    report: dict = {"dir": str(d), "files": {}}
    for q, path in files.items():
        entry: dict = {"path": str(path)}
        if q in TYPES and (a.force or not path.exists()):
            t = time.perf_counter()
            entry.update(write(files["Q4_1"], path, q))
            entry["write_seconds"] = round(time.perf_counter() - t, 1)
        entry["bytes"] = path.stat().st_size
        if not a.no_check:
            entry["check"] = check(path)
        report["files"][q] = entry
        print(q, json.dumps(entry))
    for q, e in report["files"].items():
        if "check" in e and not e["check"]["ok"] and q in KNOWN_WRONG:
            e["check"]["known"] = KNOWN_WRONG[q]
    (d / "peers.json").write_text(json.dumps(report, indent=2) + "\n")
    bad = [q for q, e in report["files"].items() if "check" in e and not e["check"]["ok"] and q not in KNOWN_WRONG]
    if bad:
        print("llama.cpp did not answer ' Paris' for:", ", ".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
