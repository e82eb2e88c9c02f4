"""EXPORT (issue 30, the reference dialect's COMPILE ... INTO MODEL): a container, with an edit
overlay's overrides applied, written back as a checkpoint another runtime loads.

``format='safetensors'``: a Hugging Face checkpoint directory — ``config.json``,
``model.safetensors`` (float32; a tensor stored in another encoding is written as it decodes)
and every capability file the container carries (tokenizer, generation config, chat
template) — that transformers 5.24 loads with ``AutoModelForCausalLM``. Nothing here knows a
model family: the family registers the inverse of its lowering next to it
(`vindex3.families.base.HfExport`: config from the graph, the Hugging Face prefix of each
object), and before anything is written the planned config and tensor names are lowered again
by the family's own admission; unless that gives back exactly the container's graph and, for
every tensor, the very placement it has, the export is refused by name (a graph the family
cannot state — a drafter component, a fact a config key cannot carry — is never written as
something else). A family with no registered inverse is refused by name with the list of those
that have one.

``format='gguf'``: one ``model.gguf`` for the llama architecture, the inverse of our own GGUF
import (`vindex3.sources.gguf`: its tensor-name tables, its q/k row order, the metadata keys it
reads), float32 or, with ``precision='f16'``, matrices in float16 (norms stay float32, as
llama.cpp writes them). Whatever that import refuses is refused here first, by name (rope
scaling, biases, an activation other than silu, a head width other than hidden / heads, no
context length). The container's byte-level BPE tokenizer is written as ``tokenizer.ggml.*``
metadata when the import can rebuild it (a plain byte-level pre-tokenizer); otherwise the file
has no tokenizer and the result says why.

Both write ``vindex3_export.json`` beside the weights: the source container (name, digest,
generation), the edited tensors and the caller's ``provenance`` (e.g. the patch). The write is
atomic (a temporary sibling directory renamed into place, cleaned when a writer dies), never
inside a container (the source or any other), and an existing non-empty target is refused
unless ``overwrite=True`` (a container is never replaced, nor a directory holding the source).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import numpy as np

from . import __version__, jsonio
from .container import Container
from .errors import EncodeError, OutputRefused, VindexError
from .paths import CONTAINER_MARKERS, hidden_sibling, is_within, output_dir
from .sources.base import CheckpointSource, TensorSpec

FORMATS = ("safetensors", "gguf")
PRECISIONS = ("f32", "f16")
GGUF_ARCHITECTURES = ("llama",)
SIDECAR = "vindex3_export.json"
WEIGHTS = {"safetensors": "model.safetensors", "gguf": "model.gguf"}


class ExportRefused(EncodeError):
    """The container (or this request) cannot be written in the asked format: the message says
    what, and what is supported."""


@dataclass
class ExportResult:
    path: Path
    format: str
    model_type: str
    files: list[str]
    tensors: int
    bytes: int  # of the weights file
    edited: list[str] = field(default_factory=list)
    decoded: list[str] = field(default_factory=list)  # tensors stored in another encoding, written as they decode
    tokenizer: str | None = None  # gguf: None when written, else why the file has none
    replaced: bool = False


# ---- the inverse of admission -----------------------------------------------------------------

class _Planned(CheckpointSource):
    """What an export is about to write, as admission reads a checkpoint: config and tensor
    specs only (nothing is loaded)."""

    kind = "hf"

    def __init__(self, name: str, config: dict, shapes: dict[str, tuple[int, ...]]):
        self._name = name
        self.path = Path("export")
        self.config = config
        self._specs = {n: TensorSpec(n, "F32", s) for n, s in shapes.items()}

    @property
    def name(self) -> str:
        return self._name

    def tensor_specs(self) -> dict[str, TensorSpec]:
        return dict(self._specs)


def _first_difference(a: Any, b: Any, where: str = "") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                return f"{where}.{k} ({'absent' if k not in a else json.dumps(a[k])[:60]} vs "\
                       f"{'absent' if k not in b else json.dumps(b[k])[:60]})"
            d = _first_difference(a[k], b[k], f"{where}.{k}")
            if d:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{where} ({len(a)} vs {len(b)} entries)"
        for i, (x, y) in enumerate(zip(a, b)):
            d = _first_difference(x, y, f"{where}[{i}]")
            if d:
                return d
        return None
    return None if type(a) is type(b) and a == b else f"{where} ({json.dumps(a)[:60]} vs {json.dumps(b)[:60]})"


@dataclass
class HfPlan:
    """A container as a Hugging Face checkpoint: its model_type, architecture class, config.json
    (token ids included) and, per container tensor label, the name it is written under."""

    model_type: str
    architecture: str
    config: dict
    names: dict[str, str]  # "object/tensor" -> Hugging Face tensor name


def hf_plan(c: Container) -> HfPlan:
    """The checkpoint ``c`` is written as, checked by lowering it again with the family's own
    admission (the module docstring); refused by name when it does not come back the same."""
    from . import families  # noqa: F401  (registers the families and their inverses)
    from .admit import lower
    from .families.base import registered_exports

    graph = c.graph.raw
    model_type = (graph.get("model") or {}).get("family")
    exports = registered_exports()
    spec = exports.get(model_type)
    if spec is None:
        raise ExportRefused(f"{c.path.name}: model family {model_type!r} has no checkpoint export in this build "
                            f"(families with one: {', '.join(sorted(exports))})")
    comps = graph.get("components") or []
    if len(comps) != 1:
        raise ExportRefused(f"{c.path.name}: the graph has {len(comps)} components "
                            f"({', '.join(str(x.get('name')) for x in comps)}); a {model_type} checkpoint holds one, "
                            "the primary text model")
    config = dict(spec.config(graph))
    config["architectures"] = [spec.architecture]
    config.update(_token_ids(c))
    prefix_of: dict[str, list[str]] = {}
    for p, obj in spec.prefixes:
        prefix_of.setdefault(obj, []).append(p)
    names: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for obj, seg in sorted(c.segments.items()):
        prefixes = prefix_of.get(obj, [])
        if len(prefixes) != 1:
            raise ExportRefused(f"{c.path.name}: object {obj!r} has {'no' if not prefixes else len(prefixes)} "
                                f"{model_type} tensor prefix; it cannot be written as a {model_type} checkpoint")
        for name, e in seg.entries.items():
            names[f"{obj}/{name}"] = prefixes[0] + name
            shapes[prefixes[0] + name] = tuple(e.shape)
    plan, lowering = lower(_Planned(str((graph.get("model") or {}).get("name")), config, shapes))
    if not plan.admissible or lowering is None:
        blocks = [f"{f.key}: {f.message}" for f in plan.findings if f.blocks]
        raise ExportRefused(f"{c.path.name}: the {model_type} config this export would write is not admissible "
                            f"({'; '.join(blocks[:3])}); refusing to write a checkpoint that does not mean this model")
    diff = _first_difference(json.loads(jsonio.dumps(lowering.graph)), graph, "graph")
    if diff is not None:
        raise ExportRefused(f"{c.path.name}: a {model_type} config cannot state this graph: written and read back "
                            f"it differs at {diff}; refusing to export something else")
    placed = {f"{p.object}/{p.name}": p.source_name for p in lowering.placements
              if not (p.sources or p.transform or p.codec)}
    if placed != names:
        odd = sorted(set(placed.items()) ^ set(names.items()))
        raise ExportRefused(f"{c.path.name}: tensor {odd[0][0]} would be written as {odd[0][1]!r}, which admission "
                            "does not place back where it came from; refusing to export")
    return HfPlan(model_type=model_type, architecture=spec.architecture, config=config, names=names)


def _token_ids(c: Container) -> dict[str, Any]:
    """bos / eos / pad ids as the container's generation config states them; an id it does not
    state is written null (absent is a fact: the config class's default is another model's)."""
    gen: dict = {}
    if "generation_config.json" in c.manifest.capabilities:
        try:
            gen = jsonio.loads(jsonio.decode_text(c.capability_bytes("generation_config.json"), "generation_config.json"),
                               source="generation_config.json")
        except VindexError:
            gen = {}
    return {k: gen.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}


# ---- the target directory -----------------------------------------------------------------------

def _target(out: str | os.PathLike, source: Path, overwrite: bool) -> tuple[Path, bool]:
    """The directory to write (checked before any work), and whether something is there."""
    what = "export target"
    p = output_dir(out, what, exist_ok=True, forbid_inside=[source])
    if p.name in ("", ".", ".."):
        raise OutputRefused(f"{what} {os.fspath(out)!r} names no directory of its own; name the directory to write")
    if not p.exists():
        return p, False
    if all((p / m).is_file() for m in CONTAINER_MARKERS):
        raise OutputRefused(f"{what} {os.fspath(out)!r} is a container; an export never replaces one",
                            hint="write the checkpoint beside the container")
    if is_within(source, p):
        raise OutputRefused(f"{what} {os.fspath(out)!r} holds the source container {source.name}; "
                            "replacing it would delete what is being exported")
    if any(p.iterdir()) and not overwrite:
        raise OutputRefused(f"{what} {os.fspath(out)!r} exists and is not empty; refusing to overwrite it",
                            hint="choose another directory, or pass overwrite=True (OVERWRITE) to replace it")
    return p, True


class _Staging:
    """A temporary sibling directory (with the encode's marker, so a dead writer's leftovers are
    cleaned by the next write into the same parent), renamed into place by ``finish``."""

    def __init__(self, target: Path, overwrite: bool):
        from .encode import MARKER, TMP_INFIX, clean_stale_temporaries

        self.target = target
        self.overwrite = overwrite
        self.cleaned = clean_stale_temporaries(target.parent)
        self.tmp = hidden_sibling(target, f"{TMP_INFIX}{os.getpid()}")
        self.marker = MARKER
        self.done = False

    def __enter__(self) -> Self:
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.tmp.mkdir()
        jsonio.write_atomic(self.tmp / self.marker, {"pid": os.getpid(), "host": socket.gethostname()})
        return self

    def finish(self) -> bool:
        (self.tmp / self.marker).unlink()
        replaced = False
        if self.target.is_dir() and not any(self.target.iterdir()):
            os.rmdir(self.target)  # an empty directory is a place to write, not something replaced
        if self.target.exists() and not self.overwrite:
            raise OutputRefused(f"export target {self.target} appeared while writing; refusing to overwrite it")
        if self.target.exists():
            old = hidden_sibling(self.target, f".replaced-{os.getpid()}")
            os.rename(self.target, old)
            try:
                os.rename(self.tmp, self.target)
            except BaseException:
                os.rename(old, self.target)
                raise
            shutil.rmtree(old, ignore_errors=True)
            replaced = True
        else:
            os.rename(self.tmp, self.target)
        self.done = True
        return replaced

    def __exit__(self, et, e, tb) -> bool:
        if not self.done:
            shutil.rmtree(self.tmp, ignore_errors=True)
            if e is not None and not isinstance(e, (VindexError, KeyboardInterrupt, SystemExit)):
                raise EncodeError(f"export to {self.target.name} failed ({type(e).__name__}: {e}); nothing was written") from e
        return False


# ---- the export ---------------------------------------------------------------------------------

def export_checkpoint(container: Container | str | os.PathLike, out_dir: str | os.PathLike, format: str = "safetensors",
                      overrides: Mapping[str, np.ndarray] | None = None, *, provenance: Mapping[str, Any] | None = None,
                      overwrite: bool = False, precision: str = "f32") -> ExportResult:
    """Write ``container`` (a `Container` or its path), with ``overrides`` (labels
    ``"object/tensor"``, `vindex3.compile.check_overrides`) applied, as a checkpoint in
    ``out_dir``: ``format`` 'safetensors' (a Hugging Face directory) or 'gguf' (llama
    architecture; ``precision`` 'f32' or 'f16' for its matrices). ``provenance`` (e.g. the
    patch) is recorded in ``vindex3_export.json``. See the module docstring for what is refused."""
    from .compile import _jsonable, check_overrides

    if format not in FORMATS:
        raise ExportRefused(f"export format {format!r} is not supported (supported: {', '.join(FORMATS)})")
    if precision not in PRECISIONS or (format == "safetensors" and precision != "f32"):
        ok = ", ".join(PRECISIONS) if format == "gguf" else "f32"
        raise ExportRefused(f"export precision {precision!r} is not supported for {format} (supported: {ok})")
    c = container if isinstance(container, Container) else Container(container)
    c.check_unchanged()  # an open container: its files are still the ones verified when it was opened
    edits = check_overrides(c, overrides)
    patch = _jsonable(provenance)
    plan = hf_plan(c)
    gguf_plan = _gguf_plan(c, plan) if format == "gguf" else None
    target, _ = _target(out_dir, c.path, overwrite)
    decoded: list[str] = []

    def tensor(label: str) -> np.ndarray:
        if label in edits:
            return edits[label]
        obj, _, name = label.partition("/")
        c.check_tensor(obj, name)  # its bytes against the index, and finite, on first use
        w = c.segments[obj].weight(name)
        if c.segments[obj].entries[name].dtype != "f32":
            decoded.append(label)
        return np.ascontiguousarray(w.dense(), dtype=np.float32)

    with _Staging(target, overwrite) as st:
        weights = st.tmp / WEIGHTS[format]
        tok_note = None
        if format == "safetensors":
            from safetensors.numpy import save_file

            save_file({plan.names[lb]: tensor(lb) for lb in sorted(plan.names)}, str(weights), metadata={"format": "pt"})
            jsonio.write_atomic(st.tmp / "config.json", {**plan.config, "dtype": "float32"})
            files = ["config.json", WEIGHTS[format]]
            for name in sorted(c.manifest.capabilities):
                (st.tmp / name).write_bytes(c.capability_bytes(name))
                files.append(name)
        else:
            assert gguf_plan is not None
            tok_note = _write_gguf(c, plan, gguf_plan, weights, tensor, precision)
            files = [WEIGHTS[format]]
        record = {
            "method": "vindex3 export", "writer": f"vindex3 {__version__}",
            "written_at": _dt.datetime.now(_dt.UTC).replace(microsecond=0).isoformat(),
            "format": format, "precision": precision, "model_type": plan.model_type,
            "source": {"name": c.path.name, "digest": c.digest, "generation": c.generation,
                       "index_sha256": c.index.get("index_sha256")},
            "edited": sorted(edits), "decoded": sorted(decoded), "tokenizer_not_written": tok_note,
            "patches": [patch] if patch else [],
        }
        jsonio.write_atomic(st.tmp / SIDECAR, record)
        files.append(SIDECAR)
        nbytes = weights.stat().st_size
        replaced = st.finish()
    return ExportResult(path=target, format=format, model_type=plan.model_type, files=files, tensors=len(plan.names),
                        bytes=nbytes, edited=sorted(edits), decoded=sorted(decoded), tokenizer=tok_note, replaced=replaced)


# ---- GGUF: the inverse of vindex3.sources.gguf --------------------------------------------------

@dataclass
class _GgufPlan:
    names: dict[str, str]  # Hugging Face name -> GGUF name
    heads: dict[str, int]  # Hugging Face name of a q/k projection -> its head count (rows re-ordered)


def _gguf_plan(c: Container, plan: HfPlan) -> _GgufPlan:
    """Refuse by name what our GGUF import would refuse or misread; map every tensor name."""
    from .sources import gguf as src

    cfg = plan.config
    why = None
    if plan.model_type not in GGUF_ARCHITECTURES:
        why = f"model family {plan.model_type!r} (GGUF export writes: {', '.join(GGUF_ARCHITECTURES)})"
    elif (cfg.get("rope_parameters") or {}).get("rope_type", "default") != "default":
        why = f"rope scaling {cfg['rope_parameters']['rope_type']!r} (the GGUF import reads unscaled rope only)"
    elif "partial_rotary_factor" in (cfg.get("rope_parameters") or {}):
        why = "partial rotary (the GGUF import rotates whole heads)"
    elif cfg.get("hidden_act") != "silu":
        why = f"activation {cfg.get('hidden_act')!r} (a llama GGUF is read as silu)"
    elif cfg.get("attention_bias") or cfg.get("mlp_bias"):
        why = "projection biases (a llama GGUF has none)"
    elif cfg["head_dim"] * cfg["num_attention_heads"] != cfg["hidden_size"]:
        why = (f"head width {cfg['head_dim']} x {cfg['num_attention_heads']} heads != hidden size {cfg['hidden_size']} "
               "(a llama GGUF's head width is hidden / heads)")
    elif cfg.get("max_position_embeddings") is None:
        why = "no context length (llama.context_length is required and never defaulted)"
    elif (c.graph.raw.get("model") or {}).get("name") == "mistral":
        why = "model name 'mistral' (the reference loader reads a llama file so named as a Mistral model)"
    if why is not None:
        raise ExportRefused(f"{c.path.name}: cannot be written as a llama GGUF: {why}")
    inverse_global = {hf: g for g, hf in src._GLOBAL_TENSORS.items()}
    inverse_layer = {hf: g for g, hf in src._LAYER_TENSORS.items()}
    names, heads = {}, {}
    for hf in plan.names.values():
        g = inverse_global.get(hf)
        if g is None and hf.startswith("model.layers."):
            idx, _, rest = hf[len("model.layers."):].partition(".")
            module, _, kind = rest.rpartition(".")
            if module in inverse_layer and kind == "weight":
                g = f"blk.{idx}.{inverse_layer[module]}.weight"
        if g is None:
            raise ExportRefused(f"{c.path.name}: tensor {hf} has no llama GGUF name")
        names[hf] = g
        if hf.endswith(".self_attn.q_proj.weight"):
            heads[hf] = cfg["num_attention_heads"]
        elif hf.endswith(".self_attn.k_proj.weight"):
            heads[hf] = cfg["num_key_value_heads"]
    return _GgufPlan(names=names, heads=heads)


def permute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order from Hugging Face's: within each head the two rotary halves are
    interleaved (rows 0, h/2, 1, h/2+1, ...). The inverse of
    `vindex3.sources.gguf._unpermute_rotary`; a pure copy."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return np.ascontiguousarray(w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def _write_gguf(c: Container, plan: HfPlan, gp: _GgufPlan, path: Path, tensor, precision: str) -> str | None:
    import gguf

    cfg = plan.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(str((c.graph.raw.get("model") or {}).get("name")))
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if precision == "f32" else gguf.LlamaFileType.MOSTLY_F16)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_vocab_size(cfg["vocab_size"])
    tok = _gguf_tokenizer(c, cfg["vocab_size"])
    note = tok if isinstance(tok, str) else None
    if not isinstance(tok, str):
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt2")
        w.add_token_list(tok["tokens"])
        w.add_token_types(tok["types"])
        w.add_token_merges(tok["merges"])
        for key, fn in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id), ("pad", w.add_pad_token_id)):
            if tok.get(key) is not None:
                fn(tok[key])
        if tok.get("add_bos") is not None:
            w.add_add_bos_token(tok["add_bos"])
        if tok.get("chat_template") is not None:
            w.add_chat_template(tok["chat_template"])
    for label in sorted(plan.names):
        hf = plan.names[label]
        a = tensor(label)
        if hf in gp.heads:
            a = permute_rotary(a, gp.heads[hf])
        if precision == "f16" and a.ndim >= 2:
            a = a.astype(np.float16)
        w.add_tensor(gp.names[hf], np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return note


def _gguf_tokenizer(c: Container, vocab: int) -> dict | str:
    """The container's tokenizer as gpt2-model GGUF metadata, or why it cannot be (a string)."""
    from .sources.gguf import _byte_alphabet

    if "tokenizer.json" not in c.manifest.capabilities:
        return "the container carries no tokenizer"
    try:
        tj = json.loads(c.capability_bytes("tokenizer.json"))
    except ValueError as e:
        return f"tokenizer.json is not JSON ({e})"
    model, pre = tj.get("model") or {}, tj.get("pre_tokenizer") or {}
    if model.get("type") != "BPE":
        return f"tokenizer model {model.get('type')!r} (a GGUF written here holds byte-level BPE only)"
    if pre.get("type") != "ByteLevel" or pre.get("add_prefix_space") or pre.get("use_regex") is False:
        return "its pre-tokenizer is not plain byte-level (the GGUF import rebuilds only that split for 'gpt2')"
    by_id = {i: t for t, i in (model.get("vocab") or {}).items()}
    for a in tj.get("added_tokens") or []:
        by_id.setdefault(a["id"], a["content"])
    n = len(by_id)
    if sorted(by_id) != list(range(n)) or n > vocab:
        return f"token ids are not 0 .. {n - 1} within the model's {vocab} rows"
    alphabet = set(_byte_alphabet())
    special = {a["content"] for a in tj.get("added_tokens") or [] if a.get("special")}
    tokens = [by_id[i] for i in range(n)]
    bad = [t for t in tokens if t not in special and not set(t) <= alphabet]
    if bad:
        return f"token {bad[0]!r} is not spelled in the byte alphabet"
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    tcfg: dict = {}
    if "tokenizer_config.json" in c.manifest.capabilities:
        try:
            tcfg = json.loads(c.capability_bytes("tokenizer_config.json"))
        except ValueError:
            tcfg = {}
    ids = {t: i for i, t in enumerate(tokens)}

    def tok_id(key: str) -> int | None:
        v = tcfg.get(key)
        v = v.get("content") if isinstance(v, dict) else v
        return ids.get(v) if isinstance(v, str) else None

    gen = _token_ids(c)
    return {
        "tokens": tokens, "types": [3 if t in special else 1 for t in tokens], "merges": merges,
        "bos": gen.get("bos_token_id") if gen.get("bos_token_id") is not None else tok_id("bos_token"),
        "eos": gen.get("eos_token_id") if gen.get("eos_token_id") is not None else tok_id("eos_token"),
        "pad": gen.get("pad_token_id"),
        "add_bos": tcfg.get("add_bos_token") if isinstance(tcfg.get("add_bos_token"), bool) else None,
        "chat_template": tcfg.get("chat_template") if isinstance(tcfg.get("chat_template"), str) else None,
    }
