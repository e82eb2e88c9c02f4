"""Execution records (OBSERVE ... RECORD INTO): a JSON-lines account of one run, and its check.

A record is UTF-8 JSON, one object per line:

1. a **header** (``type: header``): format and version, a run id, the container's digest, name and
   component, the slice and the layers it executes, the prompt ids (and text), how many tokens
   were to be generated, the intervention if any (or null), the lens tokens, library versions;
2. one **write** event per position, executed layer and slot, in execution order (``type:
   write``: pass, position, layer, site ``mixer`` | ``ffn``, operator, the L2 norm of the write —
   exactly what was added to the residual — and of the residual after it, and, when lens tokens
   were asked for, their logit, probability and rank under the model's own final norm and head
   applied to that residual);
3. one **token** event per emitted token (``type: token``: index, position, id, text, logit,
   probability);
4. a **receipt** (``type: receipt``): the number of lines between the header and the receipt,
   the SHA-256 of the header and those lines exactly as written (each with its newline), and
   ``status`` ``complete`` or ``interrupted`` (with the reason).

Lines are written as the run goes, so a run killed midway leaves a record without a receipt,
which `verify_record` names as truncated; an edit anywhere before the receipt changes the
SHA-256 and is named as an edit. A draft slice records only the layers it executes.
"""

from __future__ import annotations

import hashlib
import platform
import time
import uuid
from datetime import UTC, datetime
from typing import Literal

import numpy as np
from pydantic import BaseModel

from .. import jsonio
from ..errors import RecordError
from ..exec.engine import Executor, Observer
from .common import Prompt, output_path
from .model import ModelView

FORMAT = "vindex3-record"
FORMAT_VERSION = 1


class ObserveResult(BaseModel):
    kind: Literal["observe"] = "observe"
    path: str
    run_id: str
    prompt: Prompt
    generated_ids: list[int]
    generated_text: str | None
    slice: str
    executed_layers: list[int]
    intervention: dict | None
    lens_tokens: list[int]
    events: int
    write_events: int
    token_events: int
    sha256: str
    status: Literal["complete", "interrupted"]
    seconds: float


class RecordVerifyReport(BaseModel):
    path: str
    ok: bool  # the record is intact (complete, or an honest record of an interrupted run)
    status: Literal["complete", "interrupted", "truncated", "edited", "malformed"]
    run_id: str | None
    events: int | None
    problems: list[str]

    def to_text(self) -> str:
        if self.ok:
            what = "complete" if self.status == "complete" else "intact, but the run was interrupted"
            return f"record {self.path}: {what} ({self.events} events, run {self.run_id}); the receipt matches"
        return "\n".join([f"RECORD {self.status.upper()}: {self.path}"] + [f"  - {p}" for p in self.problems])


def _norms(a: np.ndarray) -> np.ndarray:
    return np.sqrt(np.sum(np.square(a), axis=-1, dtype=np.float32))


class _Lines:
    def __init__(self, f):
        self.f = f
        self.sha = hashlib.sha256()
        self.events = 0

    def put(self, obj: dict, *, event: bool = True) -> None:
        """An event (or the header, ``event=False``): written and hashed."""
        data = (jsonio.dumps(obj, indent=None) + "\n").encode("utf-8")
        self.f.write(data)
        self.sha.update(data)
        if event:
            self.events += 1

    def close(self, status: str, reason: str | None) -> str:
        """The receipt: the count and SHA-256 of everything before it."""
        digest = self.sha.hexdigest()
        receipt = {"type": "receipt", "events": self.events, "sha256": digest, "status": status, "reason": reason}
        self.f.write((jsonio.dumps(receipt, indent=None) + "\n").encode("utf-8"))
        return digest


LENS_ROWS = 64  # residuals read through the head per GEMM (the head is read once per block)


class _Recorder(Observer):
    """Writes one event per position and write. Without lens tokens each write's events go out
    at once; with them a pass's writes wait for ``flush()`` (after the pass), so that all their
    residuals are read through the head in a few GEMMs instead of one per write."""

    def __init__(self, lines: _Lines, ex: Executor, view: ModelView, lens_ids: list[int]):
        self.lines = lines
        self.ex = ex
        self.lens_ids = np.asarray(lens_ids, dtype=np.int64)
        self.kinds = {(lo.index, op.role): op.kind for lo in ex.plan.layers for op in lo.slot_ops()}
        self.passno = 0
        self.writes = 0
        self.pending: list[tuple[dict, np.ndarray]] = []

    def write(self, layer, site, p0, write, residual):
        wn, rn = _norms(write), _norms(residual)
        kind = self.kinds[(layer, site)]
        for r in range(write.shape[0]):
            ev = {"type": "write", "pass": self.passno, "position": p0 + r, "layer": layer, "site": site, "operator": kind,
                  "write_norm": float(wn[r]), "residual_norm": float(rn[r])}
            if self.lens_ids.size:
                self.pending.append((ev, residual[r]))
            else:
                self.lines.put(ev)
                self.writes += 1

    def flush(self) -> None:
        """Compute the lens readouts of the pending writes and write their events, in order."""
        for b in range(0, len(self.pending), LENS_ROWS):
            block = self.pending[b:b + LENS_ROWS]
            logits = self.ex.readout(np.stack([h for _, h in block]))  # [rows, vocab]
            e = np.exp(logits - logits.max(axis=-1, keepdims=True))
            z = e.sum(axis=-1, dtype=np.float32)
            sel = logits[:, self.lens_ids]
            ranks = (logits[:, None, :] > sel[:, :, None]).sum(axis=-1)
            for r, (ev, _) in enumerate(block):
                ev["lens"] = [{"id": int(t), "logit": float(sel[r, j]), "prob": float(e[r, t] / z[r]),
                               "rank": int(ranks[r, j])} for j, t in enumerate(self.lens_ids)]
                self.lines.put(ev)
                self.writes += 1
        self.pending = []


def library_versions() -> dict:
    from importlib import metadata

    from ..draft.machine import library_version

    out = {"vindex3": library_version(), "numpy": np.__version__, "python": platform.python_version()}
    for name in ("tokenizers", "numba"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def observe(view: ModelView, ex: Executor, prompt: Prompt, path, *, generate: int = 0, lens_ids: list[int] = (),
            overwrite: bool = False, draft_depth: int | None = None) -> ObserveResult:
    """Run ``prompt`` (then ``generate`` greedy tokens, as INFER does) and write its record."""
    if isinstance(generate, bool) or not isinstance(generate, int) or generate < 0:
        raise RecordError(f"OBSERVE GENERATE must be a non-negative integer, got {generate!r}")
    p = output_path(path, suffix=".jsonl", what="OBSERVE ... RECORD INTO", overwrite=overwrite)
    c = view.container
    run_id = uuid.uuid4().hex
    t0 = time.perf_counter()
    header = {
        "type": "header", "format": FORMAT, "format_version": FORMAT_VERSION, "run_id": run_id,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "container": c.name, "container_digest": c.digest, "component": c.graph.component.name,
        "model_layers": c.graph.num_layers, "slice": ex.slice.describe(), "draft_depth": draft_depth,
        "executed_layers": list(ex.layers), "prompt_ids": prompt.ids, "prompt_text": prompt.text, "generate": generate,
        "intervention": ex.intervention.record() if ex.intervention is not None else None,
        "activations": ex.activations,
        "lens_tokens": [{"id": int(t), "text": view.text(int(t))} for t in lens_ids],
        "library_versions": library_versions(), "numerics": "float32",
    }
    generated: list[int] = []
    tokens = 0
    with open(p, "wb") as f:
        lines = _Lines(f)
        lines.put(header, event=False)
        rec = _Recorder(lines, ex, view, list(lens_ids))
        status, reason = "complete", None
        try:
            st = ex.start(observer=rec)
            logits = np.asarray(st.prefill(prompt.ids))[-1]
            rec.flush()
            for i in range(generate):
                tok = int(np.argmax(logits))
                e = np.exp(logits - logits.max())
                generated.append(tok)
                lines.put({"type": "token", "index": i, "position": len(prompt.ids) + i, "id": tok, "text": view.text(tok),
                           "logit": float(logits[tok]), "prob": float(e[tok] / e.sum(dtype=np.float32))})
                tokens += 1
                if i + 1 < generate:
                    rec.passno += 1
                    logits = st.step(tok)
                    rec.flush()
        except BaseException as err:
            status, reason = "interrupted", f"{type(err).__name__}: {err}"
            raise
        finally:
            try:
                rec.flush()  # the writes a pass had made when it stopped are observations too
            finally:
                digest = lines.close(status, reason)
    text = c.tokenizer.decode(generated) if generated and view.has_tokenizer else None
    return ObserveResult(path=str(p), run_id=run_id, prompt=prompt, generated_ids=generated, generated_text=text,
                         slice=ex.slice.describe(), executed_layers=list(ex.layers), intervention=header["intervention"],
                         lens_tokens=[int(t) for t in lens_ids], events=lines.events, write_events=rec.writes,
                         token_events=tokens, sha256=digest, status=status, seconds=time.perf_counter() - t0)


#: The largest record `verify_record` reads (a record of a run the limits allow is far smaller).
MAX_RECORD_BYTES = 1 << 30


def verify_record(path) -> RecordVerifyReport:
    """Check a record against its receipt: intact (complete or interrupted), truncated (no
    receipt, or a last line cut short), edited (count or SHA-256 differ, lines after the
    receipt), or malformed (not a record at all)."""
    from .. import paths

    p = paths.existing_file(path, "record")  # a name no file system holds, a directory, a FIFO: refused by name
    try:
        data = paths.read_regular(p, "record", max_bytes=MAX_RECORD_BYTES)
    except OSError as e:  # a file that stat calls regular but that cannot be read (/proc/self/mem)
        raise RecordError(f"record {str(p)[:200]!r} cannot be read: {e.strerror or e}") from None

    def report(status, problems, run_id=None, events=None) -> RecordVerifyReport:
        return RecordVerifyReport(path=str(p), ok=status in ("complete", "interrupted") and not problems, status=status,
                                  run_id=run_id, events=events, problems=problems)

    if not data:
        return report("truncated", ["the file is empty: not even a header was written"])
    chunks = data.split(b"\n")
    tail = chunks[-1]  # bytes after the last newline: the writer stopped mid-line
    cut = tail != b""
    lines = chunks[:-1]  # complete lines
    if not lines:
        return report("truncated", ["the record ends inside its header line"])
    try:
        header = jsonio.loads(lines[0].decode("utf-8"), source=p.name)
    except Exception as e:  # noqa: BLE001 - any unreadable header
        return report("malformed", [f"line 1 is not a JSON header ({e})"])
    if not isinstance(header, dict) or header.get("type") != "header" or header.get("format") != FORMAT:
        return report("malformed", [f"line 1 is not a {FORMAT} header"])
    if header.get("format_version") != FORMAT_VERSION:
        return report("malformed", [f"record format version {header.get('format_version')!r}; this build reads {FORMAT_VERSION}"])
    run_id = header.get("run_id")
    receipts = []
    for i, raw in enumerate(lines[1:], start=2):
        try:
            obj = jsonio.loads(raw.decode("utf-8"), source=p.name)
        except Exception:  # noqa: BLE001 - an unreadable line is an edit or a cut, judged below
            obj = None
        if obj is None or not isinstance(obj, dict):  # the writer writes whole lines: this one was changed
            return report("edited", [f"line {i} is not a JSON object"], run_id)
        if obj.get("type") == "receipt":
            receipts.append((i, obj))
    if not receipts:
        n = len(lines) - 1
        msg = f"no receipt: the record stops after {n} event line(s)"
        if cut:
            msg += f" and a last line cut short ({len(tail)} bytes without a newline)"
        return report("truncated", [msg + "; the run did not finish writing it"], run_id, n)
    at, receipt = receipts[0]
    problems = []
    if len(receipts) > 1 or at != len(lines) or cut:
        problems.append(f"the receipt is on line {at} but the file goes on after it")
    body = lines[: at - 1]
    n = len(body) - 1
    if receipt.get("events") != n:
        problems.append(f"{n} event line(s) before the receipt, which counts {receipt.get('events')!r}")
    sha = hashlib.sha256(b"".join(x + b"\n" for x in body)).hexdigest()
    if sha != receipt.get("sha256"):
        problems.append(f"the SHA-256 of the lines before the receipt is {sha[:16]}…, the receipt records "
                        f"{str(receipt.get('sha256'))[:16]}…: the record was edited")
    if problems:
        return report("edited", problems, run_id, n)
    status = receipt.get("status")
    if status not in ("complete", "interrupted"):
        return report("malformed", [f"the receipt's status {status!r} is neither complete nor interrupted"], run_id, n)
    return report(status, [], run_id, n)
