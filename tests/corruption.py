"""Damaged containers, case by case: the corruption matrix (tests/test_corruption.py) and the
longer randomized run (bench/corruption.py) share these edits and this probe.

A *case* edits a copy of a pristine container. The *probe* then opens it, tokenizes a prompt
with its tokenizer, runs the full model, compares the logits with the pristine container's
(``np.array_equal``) and runs VERIFY, each step bounded in time. The outcome is one of:

* ``refused``      a named refusal (a `VindexError` with a message) at OPEN, at first use or at
                   VERIFY, and never a changed output;
* ``internal``     any other exception, at any step;
* ``wrong``        the run finished and its logits differ, with no refusal before them;
* ``hang``         a step did not finish within the time bound;
* ``unnoticed``    same output and VERIFY passed: the edit went unseen (a defect of the matrix
                   or of VERIFY: every case changes bytes that VERIFY hashes).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

PROMPT = "The capital of France is Paris."
STEP_SECONDS = 10


class Hang(BaseException):
    """Raised by the alarm when a step runs past the bound (a BaseException so that no
    ``except Exception`` in the code under test can swallow it)."""


@dataclass
class Outcome:
    kind: str  # refused | internal | wrong | hang | unnoticed
    stage: str  # open | use | verify | -
    detail: str
    seconds: float = 0.0

    def ok(self) -> bool:
        return self.kind == "refused"


@dataclass
class Case:
    name: str
    edit: Callable[[Path], None]
    must_refuse_before_use: bool = True  # output-changing edits: refused at OPEN or first use
    tags: tuple[str, ...] = field(default=())


def _bounded(fn, seconds: int = STEP_SECONDS):
    def on_alarm(signum, frame):
        raise Hang(f"did not finish within {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        return fn()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def baseline(container: Path) -> np.ndarray:
    import vindex3

    c = vindex3.open(container)
    return c.executor().forward(c.tokenizer.encode(PROMPT))


def probe(container: Path, expected: np.ndarray) -> Outcome:
    """Open, use and verify a (possibly damaged) container; classify what happened."""
    import vindex3
    from vindex3.errors import VindexError

    t0 = time.perf_counter()

    def done(kind: str, stage: str, detail: str) -> Outcome:
        return Outcome(kind, stage, detail[:300], time.perf_counter() - t0)

    def named(e: BaseException) -> bool:
        return isinstance(e, VindexError) and bool(str(e).strip())

    use_refusal = None
    try:
        c = _bounded(lambda: vindex3.open(container))
    except Hang as e:
        return done("hang", "open", str(e))
    except Exception as e:  # noqa: BLE001 - classified
        if named(e):
            use_refusal = ("open", str(e))
        else:
            return done("internal", "open", f"{type(e).__name__}: {e}")
    if use_refusal is None:
        try:
            logits = _bounded(lambda: c.executor().forward(c.tokenizer.encode(PROMPT)))
        except Hang as e:
            return done("hang", "use", str(e))
        except Exception as e:  # noqa: BLE001 - classified
            if not named(e):
                return done("internal", "use", f"{type(e).__name__}: {e}")
            use_refusal = ("use", str(e))
        else:
            if logits.shape != expected.shape or not np.array_equal(logits, expected):
                return done("wrong", "use", "the run finished with different logits and no refusal")
    try:
        rep = _bounded(lambda: vindex3.verify(container))
    except Hang as e:
        return done("hang", "verify", str(e))
    except Exception as e:  # noqa: BLE001 - classified
        if not named(e):
            return done("internal", "verify", f"{type(e).__name__}: {e}")
        return done("refused", use_refusal[0] if use_refusal else "verify", use_refusal[1] if use_refusal else str(e))
    if use_refusal is not None:
        return done("refused", *use_refusal)
    if not rep.ok:
        return done("refused", "verify", "; ".join(rep.problems))
    return done("unnoticed", "-", "same output and VERIFY passed")


def snapshot(container: Path) -> dict[str, tuple]:
    """What is on disk under ``container``, file by file: kind, size and sha256 of a regular
    file, the target of a symlink (never followed), the kind alone of anything else (a FIFO is
    never opened). Two snapshots are equal iff nothing was written, removed or added."""
    out: dict[str, tuple] = {}
    for root, dirs, files in os.walk(container, followlinks=False):
        for name in sorted(dirs + files):
            p = Path(root) / name
            rel = str(p.relative_to(container))
            st = os.lstat(p)
            if os.path.islink(p):
                out[rel] = ("symlink", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir",)
            elif p.is_file():
                out[rel] = ("file", st.st_size, hashlib.sha256(p.read_bytes()).hexdigest())
            else:
                out[rel] = ("other", st.st_mode & 0o170000)
    return out


def probe_while_open(container: Path, edit: Callable[[Path], None]) -> Outcome:
    """An LQL session opens the container and runs; ``edit`` changes it on disk while it is
    open; the session's next statement must be refused by name (never run on the changed
    bytes), and a session that opens it afresh must get a new, verified container: refused by
    name, or the answer a process that never saw the old bytes computes."""
    import lql

    t0 = time.perf_counter()

    def done(kind: str, stage: str, detail: str) -> Outcome:
        return Outcome(kind, stage, detail[:300], time.perf_counter() - t0)

    infer = f"INFER '{PROMPT}' TOP 1"
    s = lql.connect(container)
    before = s.execute_one(infer).logits.copy()
    edit(container)
    edited = snapshot(container)
    out = _while_open(container, s, before, infer, done)
    if out.ok() and snapshot(container) != edited:
        return done("wrong", "disk", "the container on disk changed after the edit (something wrote to it)")
    return out


def _while_open(container: Path, s, before: np.ndarray, infer: str, done) -> Outcome:
    import lql
    from lql.errors import LqlError

    try:
        after = _bounded(lambda: s.execute_one(infer))
    except Hang as e:
        return done("hang", "use", str(e))
    except LqlError as e:
        if "on disk while the container was open" not in str(e):
            return done("internal", "use", f"refused, but not as changed on disk: {e}")
    except Exception as e:  # noqa: BLE001 - classified
        return done("internal", "use", f"{type(e).__name__}: {e}")
    else:
        same = np.array_equal(after.logits, before)
        return done("unnoticed" if same else "wrong", "use", "the open session ran on after the change")
    fresh = lql.Session()
    try:
        res = _bounded(lambda: fresh.execute(f"OPEN '{container}'; {infer}"))
    except Hang as e:
        return done("hang", "reopen", str(e))
    except LqlError as e:
        if fresh.prepared is not None and fresh.prepared is s.prepared:
            return done("wrong", "reopen", "a fresh OPEN was handed the stale container")
        return done("refused", "use", f"refused at the next statement; a fresh OPEN refused it too: {e}")
    except Exception as e:  # noqa: BLE001 - classified
        return done("internal", "reopen", f"{type(e).__name__}: {e}")
    if fresh.prepared is s.prepared:
        return done("wrong", "reopen", "a fresh OPEN was handed the stale container")
    try:  # what a process that never saw the old bytes computes (vindex3 alone, no shared state)
        want = baseline(container)[-1]
    except Exception as e:  # noqa: BLE001 - classified
        return done("wrong", "reopen", f"a fresh OPEN ran where vindex3 alone refuses ({type(e).__name__}: {e})")
    if not np.array_equal(res[-1].logits, want):
        return done("wrong", "reopen", "a fresh OPEN ran with other logits than a fresh process computes")
    return done("refused", "use", "refused at the next statement; a fresh OPEN verified it and ran")


def _in_place(rel: str, fn: Callable[[bytearray], None], *, keep_mtime: bool = False) -> Callable[[Path], None]:
    """Change ``rel`` in place (the same inode, written through), optionally putting its
    modification time back."""

    def run(c: Path) -> None:
        p = c / rel
        st = p.stat()
        data = bytearray(p.read_bytes())
        fn(data)
        with open(p, "r+b") as f:
            f.write(bytes(data))
            f.truncate(len(data))
        if keep_mtime:
            os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))

    return run


def _flip_payload(data: bytearray) -> None:
    hlen = struct.unpack("<Q", bytes(data[:8]))[0]
    data[8 + hlen + (len(data) - 8 - hlen) // 2] ^= 0x5A


def _replace_by_copy(rel: str, change: bool) -> Callable[[Path], None]:
    def run(c: Path) -> None:
        p = c / rel
        data = bytearray(p.read_bytes())
        if change:
            _flip_payload(data)
        tmp = p.with_name(p.name + ".new")
        tmp.write_bytes(bytes(data))
        os.replace(tmp, p)  # a new inode under the old name

    return run


def while_open_cases() -> list[Case]:
    """Edits made to a container while an LQL session has it open: in place (same inode), with
    the modification time put back, replaced by rename, truncated, extended, deleted, resealed
    with a huge value, the graph rewritten. Each must be refused by name at the session's next
    statement."""
    cases: list[Case] = []
    for rel in ("segments/decoder_stack.bin", "segments/embedding.bin", "segments/final_norm.bin"):
        cases += [
            Case(f"{rel}: a payload byte flipped in place while open", _in_place(rel, _flip_payload)),
            Case(f"{rel}: a payload byte flipped in place, mtime put back, while open",
                 _in_place(rel, _flip_payload, keep_mtime=True)),
            Case(f"{rel}: the same bytes written again while open", _in_place(rel, lambda d: None)),
            Case(f"{rel}: replaced by a changed copy while open", _replace_by_copy(rel, True)),
            Case(f"{rel}: replaced by an identical copy while open", _replace_by_copy(rel, False)),
            Case(f"{rel}: truncated by one byte while open", _in_place(rel, lambda d: d.__delitem__(slice(-1, None)))),
            Case(f"{rel}: a byte appended while open", _in_place(rel, lambda d: d.extend(b"x"))),
            Case(f"{rel}: deleted while open", lambda c, rel=rel: (c / rel).unlink()),
        ]
    cases.append(Case("segments/decoder_stack.bin: 3e38 written and resealed while open",
                      huge_into("segments/decoder_stack.bin", "0.mlp.down_proj.weight", 3e38)))
    cases.append(Case("system_graph.json: theta changed and resealed while open",
                      edit_json("system_graph.json", setter(("layers", 0, "position", "theta"), 20000.0), seal=True)))
    return cases


# ---- edits -----------------------------------------------------------------------------------


def reseal(container: Path, *, tensors: bool = True) -> None:
    """Record the container's current hashes in its index (see fixtures.reseal); with
    ``tensors=False`` the per-tensor hashes are left as they were."""
    from fixtures import reseal as full

    if tensors:
        full(container)
        return
    idx = json.loads((container / "index.json").read_text())
    keep = {k: r.get("tensor_sha256") for k, r in idx["representations"].items()}
    full(container)
    idx = json.loads((container / "index.json").read_text())
    for k, r in idx["representations"].items():
        r["tensor_sha256"] = keep[k]
    from vindex3.manifest import seal

    (container / "index.json").write_text(json.dumps(seal(idx), indent=2))


def _json(path: Path):
    return json.loads(path.read_text())


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2))


def edit_json(rel: str, fn: Callable[[object], object | None], *, seal: bool = False) -> Callable[[Path], None]:
    """Parse ``rel``, let ``fn`` change it (in place, or return a replacement), write it back."""

    def run(c: Path) -> None:
        obj = _json(c / rel)
        new = fn(obj)
        _write_json(c / rel, obj if new is None else new)
        if seal:
            reseal(c)

    return run


def edit_bytes(rel: str, fn: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    def run(c: Path) -> None:
        p = c / rel
        p.write_bytes(fn(p.read_bytes()))

    return run


def flip(offset_fn: Callable[[int], int]) -> Callable[[bytes], bytes]:
    def run(b: bytes) -> bytes:
        i = offset_fn(len(b))
        return b[:i] + bytes([b[i] ^ 0x5A]) + b[i + 1:]

    return run


def segment_header(raw: bytes) -> tuple[int, dict]:
    hlen = struct.unpack("<Q", raw[:8])[0]
    return hlen, json.loads(raw[8:8 + hlen])


def edit_header(rel: str, fn: Callable[[dict], None], *, seal: str | None = None) -> Callable[[Path], None]:
    """Change a segment's JSON header in place (same length, space padded); ``seal``: None
    (index untouched), "all" (every hash re-recorded) or "not tensors" (tensor hashes kept)."""

    def run(c: Path) -> None:
        p = c / rel
        raw = p.read_bytes()
        hlen, header = segment_header(raw)
        fn(header)
        text = json.dumps(header, separators=(",", ":")).encode()
        n = hlen if len(text) <= hlen else len(text) + (-(8 + len(text)) % 16)  # grown: realigned
        p.write_bytes(struct.pack("<Q", n) + text + b" " * (n - len(text)) + raw[8 + hlen:])
        if seal == "all":
            reseal(c)
        elif seal == "not tensors":
            reseal(c, tensors=False)

    return run


def replace_file(rel: str, how: str, outside: Path) -> Callable[[Path], None]:
    """Put something that is not the file where the file was."""

    def run(c: Path) -> None:
        p = c / rel
        data = p.read_bytes()
        p.unlink()
        if how == "missing":
            return
        if how == "directory":
            p.mkdir()
        elif how == "fifo":
            os.mkfifo(p)
        elif how == "symlink out":  # the very same bytes, outside the container
            outside.mkdir(parents=True, exist_ok=True)
            target = outside / f"{p.name}-{hashlib.sha256(str(c).encode()).hexdigest()[:8]}"
            target.write_bytes(data)
            p.symlink_to(target)
        elif how == "symlink device":
            p.symlink_to("/dev/zero")
        elif how == "symlink loop":
            p.symlink_to(p.name)
        else:
            raise ValueError(how)

    return run


def _set_path(obj, path: tuple, value) -> None:
    for k in path[:-1]:
        obj = obj[k]
    obj[path[-1]] = value


def _del_path(obj, path: tuple) -> None:
    for k in path[:-1]:
        obj = obj[k]
    del obj[path[-1]]


def _rename(obj, path: tuple, new: str) -> None:
    for k in path[:-1]:
        obj = obj[k]
    obj[new] = obj.pop(path[-1])


def setter(path: tuple, value):
    return lambda o: _set_path(o, path, value)


def deleter(path: tuple):
    return lambda o: _del_path(o, path)


def renamer(path: tuple, new: str):
    return lambda o: _rename(o, path, new)


DEEP = "[" * 200_000 + "]" * 200_000


def _nan_into(rel: str, tensor: str, value: float, seal: bool) -> Callable[[Path], None]:
    def run(c: Path) -> None:
        p = c / rel
        raw = bytearray(p.read_bytes())
        hlen, header = segment_header(bytes(raw))
        t = next(t for t in header["tensors"] if t["name"] == tensor)
        at = 8 + hlen + t["offset"] + 4 * (t["len"] // 8)
        raw[at:at + 4] = np.float32(value).tobytes()
        p.write_bytes(bytes(raw))
        if seal:
            reseal(c)

    return run


def huge_into(rel: str, tensor: str, value: float, *, where: str = "one", seal: bool = True) -> Callable[[Path], None]:
    """Write a finite but huge ``value`` into ``tensor`` through its own encoding, as a tool that
    writes containers by hand would (resealed: every hash agrees): in f32, bf16 or f16 the
    value itself; in int8 a block scale (the codes stay, so the weights it makes are ``value``
    times them; int8h's half scale, infinite past 65504). ``where``: "one" value (or scale) in the middle, or "all" of them."""

    def run(c: Path) -> None:
        from vindex3 import codecs

        p = c / rel
        raw = bytearray(p.read_bytes())
        hlen, header = segment_header(bytes(raw))
        t = next(t for t in header["tensors"] if t["name"] == tensor)
        buf = np.frombuffer(raw, np.uint8, count=t["len"], offset=8 + hlen + t["offset"])  # writable: over raw
        w = codecs.get(t["dtype"]).weight(buf, tuple(t["shape"]))
        if t["dtype"] == "f32":
            target, v = w.a.reshape(-1), np.float32(value)
        elif t["dtype"] in ("bf16", "f16"):
            target = w.h.reshape(-1)
            v = (np.float32(value).view(np.uint32) >> 16).astype(np.uint16) if t["dtype"] == "bf16" else \
                np.float16(value).view(np.uint16)
        elif t["dtype"] == "int8":
            target, v = w.s.reshape(-1), np.float32(value)
        elif t["dtype"] == "int8h":  # a half scale: a value past 65504 is stored as infinity
            with np.errstate(over="ignore"):
                target, v = w.s.reshape(-1), np.float16(value).view(np.uint16)
        else:
            raise ValueError(f"huge_into does not write {t['dtype']}")
        if where == "all":
            target[:] = v
        else:
            target[target.size // 2] = v
        p.write_bytes(bytes(raw))
        if seal:
            reseal(c)

    return run


def matrix(pristine: Path, outside: Path) -> list[Case]:
    """Every targeted case over every file of the tiny llama container at ``pristine``."""
    cases: list[Case] = []
    files = sorted(str(p.relative_to(pristine)) for p in pristine.rglob("*") if p.is_file())
    idx = _json(pristine / "index.json")
    reps = idx["representations"]

    def add(name, edit, **kw):
        cases.append(Case(name, edit, **kw))

    # -- every file: truncated, flipped bytes, missing, not a regular file ------------------
    for rel in files:
        size = (pristine / rel).stat().st_size
        add(f"{rel}: truncated to 0 bytes", edit_bytes(rel, lambda b: b""))
        add(f"{rel}: truncated to half", edit_bytes(rel, lambda b: b[: len(b) // 2]))
        add(f"{rel}: last byte cut", edit_bytes(rel, lambda b: b.rstrip()[:-1]))  # not a trailing newline
        add(f"{rel}: a byte appended", edit_bytes(rel, lambda b: b + b"x"))
        for where, fn in (("first", lambda n: 0), ("middle", lambda n: n // 2), ("last", lambda n: n - 1)):
            add(f"{rel}: {where} byte flipped", edit_bytes(rel, flip(fn)))
        for how in ("missing", "directory", "fifo", "symlink out", "symlink device", "symlink loop"):
            add(f"{rel}: {how}", replace_file(rel, how, outside))
        if rel.startswith("segments/"):
            hlen = segment_header((pristine / rel).read_bytes())[0]
            for where, off in (("header length prefix", 2), ("header JSON start", 9), ("header JSON middle", 8 + hlen // 2),
                               ("first payload byte", 8 + hlen), ("middle payload byte", 8 + hlen + (size - 8 - hlen) // 2)):
                add(f"{rel}: {where} flipped", edit_bytes(rel, flip(lambda n, off=off: off)))
    add("segments: the directory replaced by a file", lambda c: (shutil.rmtree(c / "segments"), (c / "segments").write_text("x")))

    # -- index.json: types, keys, paths -------------------------------------------------------
    I = "index.json"
    first = min(reps)
    add(f"{I}: not an object", edit_json(I, lambda o: [o]))
    add(f"{I}: nested too deeply", edit_bytes(I, lambda b: b[:-2] + b', "x": ' + DEEP.encode() + b"}"))
    for key in ("format", "version", "generation", "model", "authority", "profiles", "graph", "representations",
                "segments", "capabilities", "provenance"):
        add(f"{I}: missing {key}", edit_json(I, deleter((key,))))
    for path, value in ((("generation",), "1"), (("version",), "3"), (("model",), "llama"), (("graph",), []),
                        (("representations",), []), (("representations", first), "x"), (("segments",), {}),
                        (("capabilities",), []), (("graph", "sha256"), 7), (("representations", first, "tensors"), "1"),
                        (("representations", first, "segment_bytes"), 1.5), (("representations", first, "segment"), 5),
                        (("representations", first, "tensor_sha256"), []), (("profiles",), "exact")):
        add(f"{I}: {'.'.join(path)} of the wrong type", edit_json(I, setter(path, value)))
    for key in ("payload_sha256", "segment_sha256", "header_sha256", "tensor_sha256", "segment", "object"):
        add(f"{I}: {first}.{key} renamed", edit_json(I, renamer(("representations", first, key), key + "_x")))
        add(f"{I}: {first}.{key} missing", edit_json(I, deleter(("representations", first, key))))
    add(f"{I}: graph.sha256 renamed", edit_json(I, renamer(("graph", "sha256"), "sha")))
    add(f"{I}: capabilities tokenizer.json renamed", edit_json(I, renamer(("capabilities", "tokenizer.json"), "tokenizer2.json")))
    add(f"{I}: empty representations", edit_json(I, setter(("representations",), {})))
    seg0 = reps[first]["segment"]
    add(f"{I}: absolute segment path", edit_json(I, lambda o: _abs_segment(o, first, pristine)))
    add(f"{I}: '..' segment path", edit_json(I, lambda o: _dotdot_segment(o, first, pristine)))
    add(f"{I}: segment path /etc/passwd", edit_json(I, lambda o: _retarget(o, first, "/etc/passwd")))
    add(f"{I}: segment path is the container directory", edit_json(I, lambda o: _retarget(o, first, ".")))
    add(f"{I}: segment path empty", edit_json(I, lambda o: _retarget(o, first, "")))
    add(f"{I}: capability named ../x", edit_json(I, lambda o: o["capabilities"].update({"../index.json": o["capabilities"]["tokenizer.json"]})))
    same = [k for k in sorted(reps) if k != first and reps[k]["segment_bytes"] == reps[first]["segment_bytes"]]
    if same:
        add(f"{I}: segments of {first} and {same[0]} swapped", edit_json(I, lambda o: _swap(o, first, same[0])))
    add(f"{I}: segment_bytes off by one", edit_json(I, lambda o: _bump(o, first, "segment_bytes", 1)))
    add(f"{I}: payload_bytes off by 16", edit_json(I, lambda o: _bump(o, first, "payload_bytes", 16)))
    add(f"{I}: tensors count off by one", edit_json(I, lambda o: _bump(o, first, "tensors", 1)))
    add(f"{I}: a tensor hash changed", edit_json(I, lambda o: _zero_tensor_hash(o, first)))
    add(f"{I}: a tensor hash removed", edit_json(I, lambda o: _drop_tensor_hash(o, first)))
    add(f"{I}: graph path elsewhere", edit_json(I, setter(("graph", "path"), "segments/../system_graph.json")))
    add(f"{I}: unknown format version", edit_json(I, setter(("version",), 4)))
    add(f"{I}: a second representation of an object",
        edit_json(I, lambda o: o["representations"].update({first.split("@")[0] + "@f16": dict(reps[first], encoding="f16")})))
    del seg0

    # -- system_graph.json: types, keys, values (as tampered, and as hand-written) -------------
    G = "system_graph.json"
    graph_edits = [
        ("not an object", lambda o: [o]),
        ("layers not a list", setter(("layers",), {})),
        ("no layers", setter(("layers",), [])),
        ("layer 0 operator of the wrong type", setter(("layers", 0, "operator"), ["softmax"])),
        ("layer 0 ffn of the wrong type", setter(("layers", 0, "ffn"), {"dense": 1})),
        ("layer 0 window 0", lambda o: o["layers"][0].update(span="sliding", window=0)),
        ("layer 0 window -3", lambda o: o["layers"][0].update(span="sliding", window=-3)),
        ("layer 0 window 2.5", lambda o: o["layers"][0].update(span="sliding", window=2.5)),
        ("layer 0 theta 0", setter(("layers", 0, "position", "theta"), 0)),
        ("layer 0 theta -1", setter(("layers", 0, "position", "theta"), -1.0)),
        ("layer 0 theta NaN", setter(("layers", 0, "position", "theta"), {"__float__": "NaN"})),
        ("layer 0 theta renamed", renamer(("layers", 0, "position", "theta"), "thetb")),
        ("layer 0 rotary dims odd", setter(("layers", 0, "position", "rotary_dims"), 15)),
        ("layer 0 rotary dims past head_dim", setter(("layers", 0, "position", "rotary_dims"), 64)),
        ("layer 0 window renamed", renamer(("layers", 0, "window"), "windw")),
        ("layer 0 rope scaling deleted", deleter(("layers", 0, "position", "scaling"))),
        ("bias k deleted", deleter(("surface", "attention", "bias", "k"))),
        ("layer 0 index changed", setter(("layers", 0, "index"), 3)),
        ("layer 0 unknown key", lambda o: o["layers"][0].update(extra=1)),
        ("score scale NaN", setter(("surface", "attention", "score_scale"), {"__float__": "NaN"})),
        ("score scale 0", setter(("surface", "attention", "score_scale"), 0.0)),
        ("score scale -0.25", setter(("surface", "attention", "score_scale"), -0.25)),
        ("query scale inf", setter(("surface", "attention", "query_scale"), {"__float__": "Infinity"})),
        ("heads 2 (heads x head_dim no longer the q width)", setter(("surface", "attention", "heads"), 2)),
        ("head_dim 8", setter(("surface", "attention", "head_dim"), 8)),
        ("kv_heads 3", setter(("surface", "attention", "kv_heads"), 3)),
        ("norm eps -1e-5", setter(("surface", "norms", "eps"), -1e-5)),
        ("norm eps NaN", setter(("surface", "norms", "eps"), {"__float__": "NaN"})),
        ("norm eps renamed", renamer(("surface", "norms", "eps"), "epsilon")),
        ("norm eps a string", setter(("surface", "norms", "eps"), "1e-5")),
        ("norm placement unknown", setter(("surface", "norms", "placement"), "sandwich")),
        ("activation unknown", setter(("surface", "ffn", "activation"), "relu6")),
        ("intermediate size 95", setter(("surface", "ffn", "intermediate_size"), 95)),
        ("head softcap 0", setter(("surface", "head", "softcap"), 0.0)),
        ("head softcap -30", setter(("surface", "head", "softcap"), -30.0)),
        ("head multiplier 0", setter(("surface", "head", "multiplier"), 0.0)),
        ("head multiplier NaN", setter(("surface", "head", "multiplier"), {"__float__": "NaN"})),
        ("embedding multiplier inf", setter(("surface", "embedding", "multiplier"), {"__float__": "Infinity"})),
        ("residual multiplier 0", setter(("surface", "residual", "multiplier"), 0.0)),
        ("hidden size 63", setter(("surface", "hidden_size"), 63)),
        ("hidden size true", setter(("surface", "hidden_size"), True)),
        ("vocab 0", setter(("surface", "head", "vocab"), 0)),
        ("context length 0", setter(("surface", "context_length"), 0)),
        ("context length a string", setter(("surface", "context_length"), "256")),
        ("head tied (its own weights exist)", setter(("surface", "head", "tied"), True)),
        ("an unknown surface group", lambda o: o["surface"].update(moe={})),
        ("components empty", setter(("components",), [])),
        ("component names an undeclared object", lambda o: o["components"][0]["objects"].append("vision")),
        ("objects.decoder_stack.layers 5", setter(("objects", "decoder_stack", "layers"), 5)),
        ("an operand renamed to a missing tensor", setter(("layers", 1, "operands", "q_proj"), "1.self_attn.nope.weight")),

        ("schema 5", setter(("schema",), 5)),
        ("schema '6'", setter(("schema",), "6")),
        ("nested too deeply", None),
    ]
    for name, fn in graph_edits:
        if fn is None:
            add(f"{G}: {name}", edit_bytes(G, lambda b: b[:-2] + b', "x": ' + DEEP.encode() + b"}"))
            add(f"{G}: {name} (resealed)", lambda c: (edit_bytes(G, lambda b: b[:-2] + b', "x": ' + DEEP.encode() + b"}")(c), reseal(c)))
            continue
        add(f"{G}: {name}", edit_json(G, fn))
        add(f"{G}: {name} (resealed)", edit_json(G, fn, seal=True))
    # valid edits that change the meaning: only the hash can tell (never resealed here)
    for name, fn in (("activation silu -> gelu", setter(("surface", "ffn", "activation"), "gelu")),
                     ("layer 0 made sliding, window 3", lambda o: o["layers"][0].update(span="sliding", window=3)),
                     ("layer 0 theta 10000 -> 20000", setter(("layers", 0, "position", "theta"), 20000.0)),
                     ("norm eps 1e-5 -> 1e-3", setter(("surface", "norms", "eps"), 1e-3)),
                     ("score scale halved", lambda o: o["surface"]["attention"].update(score_scale=o["surface"]["attention"]["score_scale"] / 2)),
                     ("embedding multiplier 2", setter(("surface", "embedding", "multiplier"), 2.0)),
                     ("context length 4", setter(("surface", "context_length"), 4)),
                     ("two layers' q_proj operands swapped", _swap_operands)):
        add(f"{G}: {name}", edit_json(G, fn))

    # -- segments: headers (tampered, resealed but for tensor hashes, and fully resealed) -----
    D = "segments/decoder_stack.bin"
    hdr_edits = [
        ("two same-shape tensor names swapped", _swap_names("0.self_attn.k_proj.weight", "0.self_attn.v_proj.weight")),
        ("a tensor's offset moved by 16", _entry_edit(1, lambda t: t.update(offset=t["offset"] + 16))),
        ("a tensor's offset misaligned", _entry_edit(1, lambda t: t.update(offset=t["offset"] + 2))),
        ("two tensors overlapping", _overlap),
        ("a tensor past the end of the file", _entry_edit(-1, lambda t: t.update(offset=t["offset"] + 10**6))),
        ("a tensor's len wrong", _entry_edit(0, lambda t: t.update(len=t["len"] - 4))),
        ("a tensor's shape changed, same size", _named_edit("0.mlp.down_proj.weight", lambda t: t.update(shape=list(reversed(t["shape"]))))),
        ("a tensor's shape a string", _entry_edit(0, lambda t: t.update(shape="64"))),
        ("a tensor's name empty", _entry_edit(0, lambda t: t.update(name=""))),
        ("a tensor listed twice", lambda h: h["tensors"].append(dict(h["tensors"][0]))),
        ("tensors an object", lambda h: h.update(tensors={})),
        ("schema '1'", lambda h: h.update(schema="1")),
        ("representation renamed", lambda h: h.update(representation="decoder_stack@f16")),
        ("dtype unknown", _entry_edit(0, lambda t: t.update(dtype="f33"))),
    ]
    for name, fn in hdr_edits:
        add(f"{D} header: {name}", edit_header(D, fn))
        add(f"{D} header: {name} (resealed but for tensor hashes)", edit_header(D, fn, seal="not tensors"))
    for name, fn in hdr_edits[1:]:  # a swap of same-shape names, resealed whole, is a legitimate other model
        add(f"{D} header: {name} (resealed)", edit_header(D, fn, seal="all"))
    add(f"{D}: header length shifted by 16", edit_bytes(D, lambda b: struct.pack("<Q", struct.unpack("<Q", b[:8])[0] + 16) + b[8:]))
    add(f"{D}: header length shifted by -16", edit_bytes(D, lambda b: struct.pack("<Q", struct.unpack("<Q", b[:8])[0] - 16) + b[8:]))
    add(f"{D}: header length 2**63", edit_bytes(D, lambda b: struct.pack("<Q", 2**63) + b[8:]))
    add(f"{D}: header deeply nested", edit_header_raw(D, lambda n: (b"[" * (n // 2) + b"]" * (n // 2)).ljust(n)))
    add(f"{D}: header not UTF-8", edit_header_raw(D, lambda n: b"\xff" * n))
    for tensor, obj in (("0.self_attn.q_proj.weight", D), ("weight", "segments/embedding.bin"), ("weight", "segments/final_norm.bin")):
        for value, vname in ((np.nan, "NaN"), (np.inf, "inf"), (-np.inf, "-inf")):
            add(f"{obj}: {vname} in {tensor}", _nan_into(obj, tensor, value, seal=False))
            add(f"{obj}: {vname} in {tensor} (resealed)", _nan_into(obj, tensor, value, seal=True))

    # -- finite but huge values, resealed: every hash agrees; the first-use scan bounds them ----
    for tensor, obj in (("0.mlp.down_proj.weight", D), ("1.self_attn.q_proj.weight", D),
                        ("weight", "segments/embedding.bin"), ("weight", "segments/final_norm.bin")):
        for value, vname in ((3e38, "3e38"), (-1e30, "-1e30"), (2.0**64, "2**64")):
            add(f"{obj}: {vname} in {tensor} (resealed)", huge_into(obj, tensor, value), tags=("huge",))

    # -- capability files ---------------------------------------------------------------------
    add("tokenizer_config.json: add_bos_token flipped", edit_json("tokenizer_config.json", lambda o: o.update(add_bos_token=not o.get("add_bos_token", True))))
    add("tokenizer_config.json: not an object (resealed)", edit_json("tokenizer_config.json", lambda o: [o], seal=True))
    add("tokenizer_config.json: add_bos_token a string (resealed)", edit_json("tokenizer_config.json", lambda o: o.update(add_bos_token="yes"), seal=True))
    add("tokenizer.json: not a tokenizer (resealed)", edit_json("tokenizer.json", lambda o: {"model": 5}, seal=True))
    add("tokenizer_config.json: bos_token not a token (resealed)",
        edit_json("tokenizer_config.json", lambda o: o.update(bos_token="silu", add_bos_token=True), seal=True))
    # the bos_token taken away while add_bos_token asks for one (the edit used to be a no-op that
    # relied on the fixture carrying no bos_token, which depends on how transformers writes it)
    add("tokenizer_config.json: add_bos_token without a bos_token (resealed)",
        edit_json("tokenizer_config.json", lambda o: {**{k: v for k, v in o.items() if k != "bos_token"},
                                                      "add_bos_token": True}, seal=True))
    add("tokenizer_config.json: eos_token not a token (resealed)",
        edit_json("tokenizer_config.json", lambda o: o.update(eos_token="<nope>"), seal=True))
    add("tokenizer.json: a merge removed", edit_json("tokenizer.json", lambda o: o["model"]["merges"].pop(0)))
    return cases


def edit_header_raw(rel: str, fn: Callable[[int], bytes]) -> Callable[[Path], None]:
    """Replace a segment's header bytes (same length) with ``fn(length)``."""

    def run(c: Path) -> None:
        p = c / rel
        raw = p.read_bytes()
        hlen = struct.unpack("<Q", raw[:8])[0]
        p.write_bytes(raw[:8] + fn(hlen)[:hlen] + raw[8 + hlen:])

    return run


def _entry_edit(i: int, fn):
    def run(h: dict) -> None:
        fn(h["tensors"][i])

    return run


def _named_edit(name: str, fn):
    def run(h: dict) -> None:
        fn(next(t for t in h["tensors"] if t["name"] == name))

    return run


def _swap_names(a: str, b: str):
    def run(h: dict) -> None:
        ta = next(t for t in h["tensors"] if t["name"] == a)
        tb = next(t for t in h["tensors"] if t["name"] == b)
        ta["name"], tb["name"] = b, a

    return run


def _overlap(h: dict) -> None:
    h["tensors"][1]["offset"] = h["tensors"][0]["offset"] + 16


def _abs_segment(o: dict, key: str, pristine: Path) -> None:
    o["representations"][key]["segment"] = str((pristine / o["representations"][key]["segment"]).resolve())
    _sync_segments(o)


def _dotdot_segment(o: dict, key: str, pristine: Path) -> None:
    rel = o["representations"][key]["segment"]
    o["representations"][key]["segment"] = f"segments/../../{pristine.name}/{rel}"
    _sync_segments(o)


def _retarget(o: dict, key: str, target: str) -> None:
    o["representations"][key]["segment"] = target
    _sync_segments(o)


def _sync_segments(o: dict) -> None:
    o["segments"] = [{"path": r["segment"], "bytes": r["segment_bytes"], "sha256": r["segment_sha256"]}
                     for r in o["representations"].values()]


def _swap(o: dict, a: str, b: str) -> None:
    ra, rb = o["representations"][a], o["representations"][b]
    ra["segment"], rb["segment"] = rb["segment"], ra["segment"]


def _bump(o: dict, key: str, field_: str, by: int) -> None:
    o["representations"][key][field_] += by
    _sync_segments(o)


def _zero_tensor_hash(o: dict, key: str) -> None:
    th = o["representations"][key]["tensor_sha256"]
    name = min(th)
    th[name] = "0" * 64


def _drop_tensor_hash(o: dict, key: str) -> None:
    th = o["representations"][key]["tensor_sha256"]
    del th[min(th)]


def _swap_operands(o: dict) -> None:
    a, b = o["layers"][0]["operands"], o["layers"][1]["operands"]
    a["q_proj"], b["q_proj"] = b["q_proj"], a["q_proj"]
