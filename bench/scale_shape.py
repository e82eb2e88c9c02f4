"""A seeded random llama checkpoint of a given shape, written once as an F32 GGUF (the one source
of bytes for every arm of bench/scaling_1b.py), then quantized from those same float32 arrays to
Q8_0 and Q4_1 GGUFs by the gguf package (bench/make_peer_ggufs.write), and encoded for vindex3:
the f32 container imports the F32 GGUF, int8 and q4 are REPRESENTed from that container, and the
Q8_0 / Q4_1 GGUFs are also imported natively (their block bytes kept as stored).

Weights: every tensor from its own generator, ``numpy.random.default_rng([seed, crc32(name)])``,
matrices ``0.02 * N(0, 1)`` (activations stay O(1): each RMSNorm rescales the residual and the
head's logits have a spread of about 0.02 * sqrt(hidden)), norm weights ``1 + 0.02 * N(0, 1)``.
Arrays are drawn in Hugging Face layout; the q/k rows are permuted into llama.cpp's rotary
order when written, as llama.cpp's converter does (vindex3's GGUF import undoes it).

Tokenizer: SmolLM2's byte-level BPE vocabulary (from the shipped GGUF) cut to the shape's vocab:
the first ``vocab`` tokens, and the merges whose two parts and result all lie among them (its
merges add tokens in id order, so the cut is a working smaller tokenizer). llama.cpp needs a
vocabulary to load the file; the bench feeds the same token ids to every arm.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np

SHAPES: dict[str, dict] = {
    # TinyLlama-1.1B's geometry
    "1.1b": {"hidden": 2048, "layers": 22, "ffn": 5632, "heads": 32, "kv_heads": 4, "vocab": 32000,
             "context": 2048, "rope_theta": 10000.0, "eps": 1e-5},
    # for the test: the same code path in a few kilobytes
    "tiny": {"hidden": 64, "layers": 2, "ffn": 96, "heads": 4, "kv_heads": 2, "vocab": 320,
             "context": 256, "rope_theta": 10000.0, "eps": 1e-5},
}
SEED = 26
FILE_TYPE_F32 = 0


def tensor_shapes(s: dict) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> numpy (row-major, Hugging Face) shape."""
    h, f, v = s["hidden"], s["ffn"], s["vocab"]
    kv = s["kv_heads"] * (h // s["heads"])
    out: dict[str, tuple[int, ...]] = {"token_embd.weight": (v, h)}
    for i in range(s["layers"]):
        b = f"blk.{i}."
        out |= {b + "attn_norm.weight": (h,), b + "attn_q.weight": (h, h), b + "attn_k.weight": (kv, h),
                b + "attn_v.weight": (kv, h), b + "attn_output.weight": (h, h), b + "ffn_norm.weight": (h,),
                b + "ffn_gate.weight": (f, h), b + "ffn_up.weight": (f, h), b + "ffn_down.weight": (h, f)}
    out |= {"output_norm.weight": (h,), "output.weight": (v, h)}
    return out


def hf_array(name: str, shape: tuple[int, ...], seed: int = SEED) -> np.ndarray:
    """The tensor ``name`` in Hugging Face layout (q/k rows un-permuted), float32."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    w = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
    if len(shape) == 1:
        w += np.float32(1.0)
    return w


def permute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Hugging Face q/k row order -> llama.cpp's (each head's two rotary halves interleaved)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_array(name: str, shape: tuple[int, ...], s: dict, seed: int = SEED) -> np.ndarray:
    w = hf_array(name, shape, seed)
    if name.endswith("attn_q.weight"):
        return permute_rotary(w, s["heads"])
    if name.endswith("attn_k.weight"):
        return permute_rotary(w, s["kv_heads"])
    return w


def _tokenizer_fields(vocab: int) -> dict:
    import gguf

    from vindex3.default_model import gguf_path

    r = gguf.GGUFReader(gguf_path(), "r")
    tokens = list(r.fields["tokenizer.ggml.tokens"].contents())[:vocab]
    types = list(r.fields["tokenizer.ggml.token_type"].contents())[:vocab]
    have = set(tokens)
    merges = [m for m in r.fields["tokenizer.ggml.merges"].contents()
              if all(p in have for p in m.split(" ")) and m.replace(" ", "") in have]
    return {"tokens": tokens, "types": types, "merges": merges,
            "pre": str(r.fields["tokenizer.ggml.pre"].contents())}


def write_f32_gguf(path: Path, shape: str, seed: int = SEED) -> dict:
    """Write the F32 GGUF of SHAPES[shape], one tensor at a time (never the whole model in memory)."""
    import os

    import gguf

    s = SHAPES[shape]
    names = tensor_shapes(s)
    tok = _tokenizer_fields(s["vocab"])
    tmp = path.with_name(path.name + ".tmp")
    w = gguf.GGUFWriter(tmp, "llama")
    w.add_name(f"vindex3 scaling bench {shape} (seeded random, seed {seed})")
    w.add_context_length(s["context"])
    w.add_embedding_length(s["hidden"])
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_freq_base(s["rope_theta"])
    w.add_layer_norm_rms_eps(s["eps"])
    w.add_rope_dimension_count(s["hidden"] // s["heads"])
    w.add_vocab_size(s["vocab"])
    w.add_file_type(FILE_TYPE_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(tok["pre"])
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    for name, shp in names.items():
        w.add_tensor_info(name, shp, np.dtype(np.float32), int(np.prod(shp)) * 4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shp in names.items():
        w.write_tensor_data(gguf_array(name, shp, s, seed))
    w.close()
    os.replace(tmp, path)
    return {"bytes": path.stat().st_size, "tensors": len(names), "merges": len(tok["merges"]),
            "parameters": int(sum(np.prod(x) for x in names.values()))}


def files(d: Path, shape: str) -> dict[str, Path]:
    """Every artifact of the shape: peer GGUFs by type, our containers by arm encoding."""
    stem = f"llama-{shape}"
    return {"F32": d / f"{stem}.F32.gguf", "Q8_0": d / f"{stem}.Q8_0.gguf", "Q4_1": d / f"{stem}.Q4_1.gguf",
            "f32": d / f"{stem}.f32.vindex3", "int8": d / f"{stem}.int8.vindex3", "int8h": d / f"{stem}.int8h.vindex3",
            "q4": d / f"{stem}.q4.vindex3",
            "q8_0": d / f"{stem}.q8_0.vindex3", "q4_1": d / f"{stem}.q4_1.vindex3"}


def build(d: Path, shape: str, seed: int = SEED, log=print) -> dict[str, Path]:
    """Write whatever of `files` is missing (each step atomic: a file exists only when complete)."""
    import time

    from make_peer_ggufs import write

    from vindex3.encode import encode
    from vindex3.represent import represent

    d.mkdir(parents=True, exist_ok=True)
    f = files(d, shape)
    steps = [
        ("F32", lambda: write_f32_gguf(f["F32"], shape, seed)),
        ("Q8_0", lambda: write(f["F32"], f["Q8_0"], "Q8_0")),
        ("Q4_1", lambda: write(f["F32"], f["Q4_1"], "Q4_1")),
        ("f32", lambda: encode(f["F32"], f["f32"])),
        ("int8", lambda: represent(f["f32"], f["int8"], "int8")),
        ("int8h", lambda: represent(f["f32"], f["int8h"], "int8h")),
        ("q4", lambda: represent(f["f32"], f["q4"], "q4")),
        ("q8_0", lambda: encode(f["Q8_0"], f["q8_0"], native=True)),
        ("q4_1", lambda: encode(f["Q4_1"], f["q4_1"], native=True)),
    ]
    for key, run in steps:
        if f[key].exists():
            continue
        t = time.perf_counter()
        run()
        log(f"wrote {f[key].name} in {time.perf_counter() - t:.0f} s")
    return f
