"""Fuzzing LQL: statements generated from the grammar itself, hostile mutations of them, and a
sandbox that runs each one (through the Python API or through `lql`'s `main`) under a time
limit and classifies what happened. Shared by tests/test_lql_fuzz.py (hypothesis, a few thousand
cases in CI) and bench/fuzz_lql.py (a longer seeded run that writes its counts as JSON).

* The generator reads ``lql.parser.LARK``'s compiled rules and terminals, so a statement added
  to grammar/lql.lark is generated as soon as it is merged: keywords in random case, strings
  and numbers from pools that hit the interesting values (files that exist, are FIFOs,
  directories, inside the container, too long; numbers at int64's edge and past it; prompts
  past the context length), and for a terminal it does not know, a value from the pools that
  matches the terminal's own regex.
* Mutations: insert NUL, lone surrogates, \\U escapes past U+10FFFF, numbers of thousands of
  digits, long or unterminated strings, line and paragraph separators, quotes, comments; delete,
  duplicate or swap spans; flip case.
* Every case ends in one of: ``result`` (every statement ran), ``refusal`` (an LqlError with a
  message, not an internal error), ``internal`` (InternalError, or any other exception out of
  the API: a bug), ``timeout`` (past the per-case limit), ``overwrite`` (a file that existed was
  changed or removed though nothing in the case said OVERWRITE, or anything in the container
  changed), ``wrong`` (the reference INFER, run after the case, no longer gives the same
  logits). Through the CLI: ``internal`` is an exit status outside 0/1/2, a traceback or an
  "internal error" line.

The harness keeps the run hermetic: OPEN DEFAULT binds a copy of the fixture container (it would
otherwise encode SmolLM2), a sharded model refuses to start Ray actors, and host names other than
loopback do not resolve (USE REMOTE's URLs). These are stated, and they are the only stubs."""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import shutil
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# ---- choosing -------------------------------------------------------------------------------


class Chooser:
    """Where the generator's choices come from: a seeded `random.Random` (the bench) or
    hypothesis's ``draw`` (the tests, which can then shrink a failing case)."""

    def below(self, n: int) -> int:  # 0 <= k < n
        raise NotImplementedError

    def pick(self, seq):
        return seq[self.below(len(seq))]

    def chance(self, p: float) -> bool:
        return self.below(1000) < int(p * 1000)

    def between(self, lo: int, hi: int) -> int:
        return lo + self.below(hi - lo + 1)


class RandomChooser(Chooser):
    def __init__(self, rng: random.Random):
        self.rng = rng

    def below(self, n: int) -> int:
        return self.rng.randrange(n)


class DrawChooser(Chooser):
    def __init__(self, draw):
        from hypothesis import strategies as st

        self.draw, self.st = draw, st

    def below(self, n: int) -> int:
        return self.draw(self.st.integers(0, n - 1)) if n > 1 else 0


# ---- pools: values that reach the interesting branches ----------------------------------------

LONG_NAME = "n" * 300 + ".f32"

PATHS = [
    "tiny.vindex3", "other.vindex3", "tiny-checkpoint", "prompts.jsonl", "full.f32", "draft.f32", "keep.txt",
    "fifo", "dir", "dir/", "link-out.txt", "dangling", "new.f32", "new2.f32", "new.json", "new.png", "new.svg",
    "out.vindex3", "bank-big.jsonl", "bank-bad.jsonl", "tiny.vindex3/index.json", "tiny.vindex3/new.f32",
    "tiny.vindex3/segments/embedding.bin", "tiny.vindex3/system_graph.json", "/dev/null", "/etc/passwd", "/",
    ".", "..", "", "nowhere/x.f32", LONG_NAME, "dir/" + "d" * 250, "\\u00e9t\\u00e9.f32", "\\U0001F600.f32",
    "a\\tb", "~", "~/x", "dir/../keep.txt", "./new.f32", "script.lql", "\\0", "a\\u0000b",
]
PROMPTS = ["Water boils", "Hello there", "x", "", " ", "a b c d e f", "\\n", "\\t\\r", "é€😀", "\\u00e9", "\\U0001F600",
           "<s>", "</s>", "'", '"', "\\\\", "The capital of France is", "a" * 300, "ab " * 200,
           "\\uD83D\\uDE00", "\\x", "\\uZZZZ"]
URLS = ["http://127.0.0.1:9", "https://127.0.0.1:9", "http://localhost:9", "ftp://example", "http://",
        "http://[::1]:9", "http://127.0.0.1:9/x?y=1", "HTTP://127.0.0.1:9", "http:// 127.0.0.1"]
SETTING_STRINGS = ["8 GiB", "512 MiB", "1 KiB", "2GB", "lots", "-1 GiB", "1.5 GiB", "0", "text", "json", "vi",
                   "history.txt", "model"]
INTS = [0, 1, 2, 3, 4, 5, 6, 7, 8, 16, 64, 100, 255, 256, 257, 319, 320, 1000, 4096, 4097, 65536, 10**9, 10**12,
        2**31, 2**32, 2**63 - 1, 2**63, 2**64, -1]
WORDS = ["on", "off", "auto", "model", "text", "json", "csv", "tsv", "markdown", "jsonl", "emacs", "vi", "yes", "no",
         "true", "x", "_", "a1", "openx", "default", "nan", "inf"]
NASTY = ["\x00", "\ud800", "\udfff", "\udcff", "'", '"', "\\", "\\U00110000", "\\UFFFFFFFF", "\\uD800", "\\0",
         "\\u0000", ";", "--", "\n", "\r", "\r\n", "\u2028", "\u2029", "\x0b", "\x0c", "\x1c", "\x85", "(", ")",
         ",", "=", "-", "😀", "\u202e", "\u0301", "\ufeff", "\t", "  ", "\\n", "OPEN", "INTO", "OVERWRITE", "TOKENS",
         "é", "\x7f", "\x1b[31m", "%s", "{}", "\\x00"]


def _keyword_text(ch: Chooser, name: str) -> str:
    return ch.pick([name, name.lower(), name.capitalize(), "".join(
        c.lower() if ch.chance(0.5) else c for c in name)])


def _quote(ch: Chooser, body: str) -> str:
    if ch.chance(0.8):
        return "'" + body.replace("'", "\\'") + "'"
    return '"' + body.replace('"', '\\"') + '"'


# What usually follows a keyword, so that a good share of generated statements run (the rest of
# the time, any pool value). A keyword not listed here (a statement added later) gets the pools.
AFTER = {
    "OPEN": ["tiny.vindex3", "other.vindex3"], "USE": ["tiny.vindex3", "other.vindex3"],
    "PLAN": ["tiny-checkpoint"], "ENCODE": ["tiny-checkpoint"], "INTO": ["new.f32", "new2.f32", "new.json", "out.vindex3",
                                                                        "new.svg", "keep.txt"],
    "ON": ["prompts.jsonl"], "DRAFT": ["draft.f32"], "AGAINST": ["full.f32"], "INFER": PROMPTS[:9],
    "TRACE": PROMPTS[:9], "LOGITS": PROMPTS[:9], "REMOTE": URLS[:3], "MODEL": ["tiny", "x"],
    "REPRESENTATIONS": ["norm", "*norm*", "[", "embedding@f32", ""],
}
INT_AFTER = {"DEPTH": (1, 4), "TOP": (1, 10), "GENERATE": (1, 24), "LOOKAHEAD": (1, 8), "AT": (1, 5000),
             "LAYER": (0, 3), "RANGE": (0, 3), "-": (0, 3), "SHARDS": (1, 2), "(": (0, 319), ",": (0, 319)}


def _string(ch: Chooser, prev: str = "") -> str:
    hint = AFTER.get(prev.upper())
    if hint and ch.chance(0.7):
        return _quote(ch, ch.pick(hint))
    kind = ch.below(10)
    if kind < 4:
        body = ch.pick(PATHS)
    elif kind < 7:
        body = ch.pick(PROMPTS)
    elif kind < 8:
        body = ch.pick(URLS)
    elif kind < 9:
        body = ch.pick(SETTING_STRINGS)
    else:
        body = ch.pick(NASTY) * ch.between(1, 3)
    return _quote(ch, body)


def _int(ch: Chooser, prev: str = "") -> str:
    hint = INT_AFTER.get(prev.upper())
    if hint and ch.chance(0.8):
        return str(ch.between(*hint))
    k = ch.below(20)
    if k < 14:
        return str(ch.pick(INTS[:9]))
    if k < 19:
        return str(abs(ch.pick(INTS)))
    return "9" * ch.pick([19, 20, 100, 4301, 5000])


def _float(ch: Chooser, prev: str = "") -> str:
    return ch.pick(["1.5", "0.0", "1.0", "4096.0", "1.0e308", "1.0e309", "0.5e-400", "3.25"])


def _name(ch: Chooser, prev: str = "") -> str:
    from lql import catalog

    names = [s.name for s in catalog.SETTINGS] + ["editing_mode", "history"] + WORDS
    return ch.pick(names)


GENERATORS: dict[str, Callable[[Chooser, str], str]] = {"STRING": _string, "INT": _int, "FLOAT": _float, "NAME": _name}


# ---- the grammar-driven generator --------------------------------------------------------------


class Grammar:
    """``LARK``'s compiled rules (every ``?``, ``[ ]`` and ``*`` already expanded into plain
    alternatives) and terminals, with each nonterminal's shortest derivation depth, so that
    generation can always finish."""

    def __init__(self, lark=None):
        if lark is None:
            from lql.parser import LARK as lark
        self.rules: dict[str, list[list]] = {}
        for r in lark.rules:
            self.rules.setdefault(r.origin.name, []).append(list(r.expansion))
        self.terminals = {t.name: t for t in lark.terminals}
        self.depth = self._min_depths()
        self.statements = sorted(self.rules.get("_statement", []), key=lambda e: e[0].name)

    def _min_depths(self) -> dict[str, int]:
        inf = 10**9
        d = dict.fromkeys(self.rules, inf)
        changed = True
        while changed:
            changed = False
            for name, alts in self.rules.items():
                for exp in alts:
                    v = 1 + max([0] + [d.get(s.name, inf) if not s.is_term else 0 for s in exp])
                    if v < d[name]:
                        d[name], changed = v, True
        return d

    def terminal(self, ch: Chooser, name: str, prev: str = "") -> str:
        t = self.terminals[name]
        if t.pattern.type == "str":
            return t.pattern.value
        if name in GENERATORS:
            return GENERATORS[name](ch, prev)
        value = t.pattern.value
        if value.endswith(r"\b"):  # a keyword: /open\b/i
            return _keyword_text(ch, name)
        # a terminal this generator does not know: a pool value its own regex matches
        rx = re.compile(t.pattern.to_regexp(), re.IGNORECASE if "i" in t.pattern.flags else 0)
        pool = [g(ch, "") for g in GENERATORS.values()] + WORDS + [str(i) for i in INTS]
        fits = [p for p in pool if rx.fullmatch(p)]
        return ch.pick(fits) if fits else name

    def expand(self, ch: Chooser, symbol: str, budget: int, out: list[str]) -> None:
        alts = self.rules[symbol]
        if budget <= self.depth[symbol]:  # only what still fits: the shallowest alternatives
            best = min(self._exp_depth(e) for e in alts)
            alts = [e for e in alts if self._exp_depth(e) == best]
        exp = ch.pick(alts)
        for s in exp:
            if s.is_term:
                out.append(self.terminal(ch, s.name, out[-1] if out else ""))
            else:
                self.expand(ch, s.name, budget - 1, out)

    def _exp_depth(self, exp) -> int:
        return max([0] + [self.depth[s.name] for s in exp if not s.is_term])

    def statement(self, ch: Chooser, budget: int = 8) -> str:
        """One statement of the grammar (any of `_statement`'s alternatives), as text."""
        out: list[str] = []
        exp = ch.pick(self.statements)
        for s in exp:
            if s.is_term:
                out.append(self.terminal(ch, s.name, out[-1] if out else ""))
            else:
                self.expand(ch, s.name, budget, out)
        return _join(ch, out)

    def script(self, ch: Chooser, max_statements: int = 3) -> str:
        n = ch.between(1, max_statements)
        parts = [self.statement(ch) for _ in range(n)]
        return ";\n".join(parts) + (";" if ch.chance(0.5) else "")


def _join(ch: Chooser, toks: list[str]) -> str:
    seps = [" "] * 12 + ["\n", "\t", "  ", " -- c\n", "\r\n"]
    out = toks[0] if toks else ""
    for t in toks[1:]:
        out += ch.pick(seps) + t
    return out


# ---- mutation --------------------------------------------------------------------------------


def mutate(ch: Chooser, text: str, rounds: int | None = None) -> str:
    """``text`` after 1-3 hostile edits (bounded: at most a few megabytes)."""
    for _ in range(rounds if rounds is not None else ch.between(1, 3)):
        k = ch.below(11)
        i = ch.below(len(text) + 1)
        j = min(len(text), i + ch.between(0, 12))
        if k < 3:
            text = text[:i] + ch.pick(NASTY) + text[i:]
        elif k == 3:
            text = text[:i] + text[j:]
        elif k == 4:
            text = text[:j] + text[i:j] + text[j:]
        elif k == 5:
            text = text[:i] + "9" * ch.pick([20, 400, 4301, 20000]) + text[i:]
        elif k == 6:  # a long string, closed or not
            n = ch.pick([1000, 70000, (1 << 20) + 1, 3 << 20])
            text = text[:i] + "'" + "a" * n + ("'" if ch.chance(0.5) else "") + text[i:]
        elif k == 7:
            text = text.swapcase()
        elif k == 8:  # swap two spans
            a, b = sorted((ch.below(len(text) + 1), ch.below(len(text) + 1)))
            text = text[:i] + text[a:b] + text[i:]
        elif k == 9:
            text = text[:i] + "".join(ch.pick(NASTY) for _ in range(ch.between(2, 6))) + text[i:]
        else:
            text = text + ";" + text[: ch.between(0, len(text))]
    return text


# ---- the sandbox -------------------------------------------------------------------------------


class CaseTimeout(BaseException):
    """The per-case time limit passed (a BaseException, so no `except Exception` swallows it)."""


def time_limit(seconds: float):
    """The per-case limit: the suite's own alarm (fixtures.bounded) raising CaseTimeout."""
    from fixtures import bounded

    return bounded(seconds, "the case", exc=CaseTimeout)


@dataclass
class Counts:
    cases: int = 0
    statements_ok: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    max_seconds: float = 0.0
    failures: list[dict] = field(default_factory=list)  # the first few non-clean cases
    refusal_kinds: dict[str, int] = field(default_factory=dict)

    def add(self, outcome: str, text: str, seconds: float, detail: str = "") -> None:
        self.cases += 1
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        self.max_seconds = max(self.max_seconds, seconds)
        if outcome == "refusal":
            self.refusal_kinds[detail] = self.refusal_kinds.get(detail, 0) + 1
        if outcome not in ("result", "refusal") and len(self.failures) < 50:
            self.failures.append({"outcome": outcome, "text": text[:400], "chars": len(text), "detail": detail[:2000],
                                  "seconds": round(seconds, 3)})

    @property
    def bad(self) -> int:
        return sum(v for k, v in self.outcomes.items() if k not in ("result", "refusal"))


BAD = ("internal", "timeout", "overwrite", "wrong")


class Sandbox:
    """A working directory of files the pools name, restored after every case, and a session
    bound to its container. ``run_api(text)`` and ``run_cli(text, fmt)`` return (outcome,
    detail)."""

    def __init__(self, root: Path, container: Path, checkpoint: Path, *, limit: float = 10.0):
        self.root, self.limit = Path(root), limit
        self.root.mkdir(parents=True, exist_ok=True)
        self.outside = self.root.parent / (self.root.name + "-outside")
        self.outside.mkdir(exist_ok=True)
        r = self.root
        shutil.copytree(container, r / "tiny.vindex3")
        shutil.copytree(container, r / "other.vindex3")
        shutil.copytree(container, self.outside / "default.vindex3")
        shutil.copytree(checkpoint, r / "tiny-checkpoint")
        bank = [{"id": "a", "category": "c", "text": "Water boils"}, {"id": "b/../x", "category": "d", "text": "Hi"},
                {"id": "c", "category": "c", "token_ids": [1, 5, 9]}]
        (r / "prompts.jsonl").write_text("".join(json.dumps(b) + "\n" for b in bank))
        (r / "bank-big.jsonl").write_text("".join(json.dumps({"id": f"p{i}", "category": "c", "text": "x"}) + "\n"
                                                  for i in range(1200)))
        (r / "bank-bad.jsonl").write_text('{"id": 1}\nnot json\n')
        (r / "keep.txt").write_text("precious\n")
        (r / "script.lql").write_text("STATS;\nSHOW LAYERS;\n")
        (r / "dir").mkdir()
        os.mkfifo(r / "fifo")
        (self.outside / "target.txt").write_text("outside\n")
        os.symlink(self.outside / "target.txt", r / "link-out.txt")
        os.symlink(r / "nothing-here", r / "dangling")
        import lql

        with _chdir(r):
            s = lql.connect("tiny.vindex3")
            s.execute("DUMP LOGITS 'Water boils' INTO 'full.f32'; DUMP LOGITS 'Water boils' DRAFT DEPTH 2 INTO 'draft.f32'")
        self.pristine = {self.root: self.root.parent / (self.root.name + "-pristine"),
                         self.outside: self.root.parent / (self.root.name + "-outside-pristine")}
        for live, copy in self.pristine.items():
            shutil.copytree(live, copy, symlinks=True, ignore=shutil.ignore_patterns("fifo"))
        self.before = self._snapshot()
        self.session = None
        self._reference = None

    # -- state -----------------------------------------------------------------------------
    def _snapshot(self) -> dict[str, tuple]:
        snap: dict[str, tuple] = {}
        for base in (self.root, self.outside):
            for dirpath, dirnames, filenames in os.walk(base):
                for name in dirnames + filenames:
                    p = os.path.join(dirpath, name)
                    st = os.lstat(p)
                    snap[p] = (st.st_mode, st.st_size, st.st_mtime_ns, st.st_ino)
        return snap

    def changed(self) -> list[str]:
        """Files that existed before the case and were changed or removed."""
        now = self._snapshot()
        return [p for p, v in self.before.items() if now.get(p) != v and not os.path.isdir(p)]

    def restore(self) -> None:
        now = self._snapshot()
        if now == self.before:
            return
        for p in sorted(set(now) - set(self.before), key=len, reverse=True):
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p, ignore_errors=True)
            elif os.path.lexists(p):
                os.unlink(p)
        for p in self.changed():
            base = self.outside if p.startswith(str(self.outside) + os.sep) else self.root
            rel = os.path.relpath(p, base)
            src = self.pristine[base] / rel
            if os.path.lexists(p) and not (os.path.isdir(p) and not os.path.islink(p)):
                os.unlink(p)
            if os.path.islink(src):
                os.symlink(os.readlink(src), p)
            elif os.path.lexists(src):
                shutil.copy2(src, p)
            elif rel == "fifo":
                os.mkfifo(p)
        self.before = self._snapshot()

    def fresh_session(self):
        import lql

        with _chdir(self.root):
            self.session = lql.connect("tiny.vindex3")
        return self.session

    def reset_session(self) -> None:
        """Between cases: default settings and no draft depth; rebound to the sandbox container
        if a case bound another one (or a remote, or nothing)."""
        from lql import catalog

        s = self.session
        if s is None or s.base_container is None or Path(s.base_container.path).resolve() != (self.root / "tiny.vindex3").resolve() \
                or s.remote is not None or s.container is not s.base_container:
            self.fresh_session()
            s = self.session
        s.settings = catalog.Settings()
        s.draft_depth = None
        s.on_token = s.on_progress = s.on_notice = None

    def reference(self) -> np.ndarray:
        with _chdir(self.root):
            return self.session.execute_one("INFER 'Water boils' TOP 5").logits

    # -- running ---------------------------------------------------------------------------
    def run_api(self, text: str, *, render_formats: bool = True) -> tuple[str, str, float]:
        from lql import render
        from lql.errors import InternalError, LqlError

        self.reset_session()
        detail = ""
        t0 = time.perf_counter()
        try:
            with _chdir(self.root), time_limit(self.limit):
                try:
                    results = self.session.execute(text)
                    outcome = "result"
                    if render_formats:
                        for r in results:
                            for fmt in render.FORMATS:
                                render.format_result(r, fmt, timing=True)
                            json.loads(render.dumps_json(r.to_dict()))
                except InternalError as e:
                    outcome, detail = "internal", _trace(e.original or e)
                except LqlError as e:
                    if not e.message or not str(e):
                        outcome, detail = "internal", f"an LqlError without a message: {type(e).__name__}"
                    else:
                        outcome, detail = "refusal", e.kind
                        render.error_text(e, where="<fuzz>", show_statement=True)
                        render.dumps_json(render.error_json(e, None))
        except CaseTimeout:
            outcome, detail = "timeout", f"{time.perf_counter() - t0:.1f} s"
        except Exception as e:  # noqa: BLE001 - the API let an exception out: a bug
            outcome, detail = "internal", _trace(e)
        seconds = time.perf_counter() - t0
        outcome, detail = self._after(text, outcome, detail)
        return outcome, detail, seconds

    def run_cli(self, text: str, fmt: str = "text", *, stdin: bytes | None = None,
                keep_going: bool = False) -> tuple[str, str, float]:
        """``lql -c tiny.vindex3 --format FMT --execute TEXT``; with ``stdin`` (bytes, which need
        not be UTF-8), the script is read from standard input instead (``text`` only labels it)."""
        from lql import cli

        t0 = time.perf_counter()
        out, err = io.StringIO(), io.StringIO()
        argv = ["--container", "tiny.vindex3", "--no-timing", "--format", fmt] + (["--keep-going"] if keep_going else [])
        argv += ["-"] if stdin is not None else ["--execute=" + text]
        inp = io.TextIOWrapper(io.BytesIO(stdin if stdin is not None else b""), encoding="utf-8")
        try:
            with _chdir(self.root), time_limit(self.limit):
                try:
                    rc = cli.main(argv, stdin=inp, stdout=out, stderr=err)
                except SystemExit as e:
                    rc = e.code if isinstance(e.code, int) else 2
            e_text = err.getvalue()
            if rc not in (0, 1, 2) or "Traceback" in e_text or "internal error" in e_text or "Traceback" in out.getvalue():
                outcome, detail = "internal", f"exit {rc}\n{e_text[-1500:]}"
            else:
                outcome, detail = ("result" if rc == 0 else "refusal"), f"exit {rc}"
        except CaseTimeout:
            outcome, detail = "timeout", f"{time.perf_counter() - t0:.1f} s"
        except Exception as e:  # noqa: BLE001 - main let an exception out: a bug
            outcome, detail = "internal", _trace(e)
        seconds = time.perf_counter() - t0
        outcome, detail = self._after(text, outcome, detail, cli=True)
        return outcome, detail, seconds

    def _derived_only(self, p: str) -> bool:
        """Whether a change to the container is feature metadata being kept in it (BUILD FEATURES,
        or WALK / DESCRIBE / SELECT building it on demand: derived data, documented): its
        index.json differs from the pristine one only in ``derived``, ``generation`` and the
        index's own hash. New files under ``derived/`` are not "changed" (they did not exist)."""
        if os.path.basename(p) != "index.json":
            return False
        base = self.outside if p.startswith(str(self.outside) + os.sep) else self.root
        rel = os.path.relpath(p, base)
        try:
            now = json.loads(Path(p).read_text())
            was = json.loads((self.pristine[base] / rel).read_text())
        except (OSError, ValueError):
            return False
        drop = ("derived", "generation", "index_sha256")
        if now.get("derived") == was.get("derived"):
            return False  # no derived data was kept: any change is a change to the container
        return {k: v for k, v in now.items() if k not in drop} == {k: v for k, v in was.items() if k not in drop}

    def _after(self, text: str, outcome: str, detail: str, cli: bool = False) -> tuple[str, str]:
        changed = [p for p in self.changed() if not self._derived_only(p)]
        container = [p for p in changed if "tiny.vindex3" in p.split(os.sep)]
        said = "overwrite" in text.lower()
        if container or (changed and not said):
            outcome, detail = "overwrite", f"changed: {changed[:5]}"
        self.restore()
        if outcome in ("result", "refusal") and not cli and self._reference is not None and self._check_due():
            try:
                with time_limit(self.limit):
                    self.reset_session()
                    if not np.array_equal(self.reference(), self._reference):
                        outcome, detail = "wrong", "the reference INFER gives other logits after this case"
            except CaseTimeout:
                outcome, detail = "timeout", "the reference INFER after this case"
        return outcome, detail

    _n = 0

    def _check_due(self) -> bool:
        self._n += 1
        return self._n % 10 == 0

    def start(self) -> None:
        """Bind the session and record the reference logits (from a fresh session)."""
        self.fresh_session()
        self._reference = self.reference()


def _trace(e: BaseException) -> str:
    import traceback

    return "".join(traceback.format_exception(e))[-3000:]


@contextlib.contextmanager
def _chdir(path: Path) -> Iterator[None]:
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


@contextlib.contextmanager
def hermetic(sandbox: Sandbox) -> Iterator[None]:
    """The harness's only stubs (see the module docstring), undone on exit."""
    from vindex3 import default_model
    from vindex3.errors import VindexError
    from vindex3.shards import pipeline

    real_ensure, real_runtime, real_gai = default_model.ensure_detailed, pipeline.ShardedModel._runtime, socket.getaddrinfo
    calls = [0]

    def ensure_detailed(progress=None, notice=None, *, rebuild=False):
        calls[0] += 1
        why = "it does not open (the fuzz harness says so every other time)" if calls[0] % 2 else None
        if why and notice is not None:
            notice(f"the cached default model is being rebuilt: {why}")
        return default_model.Ensured(sandbox.outside / "default.vindex3", bool(why), why)

    def runtime(self):
        raise VindexError("the fuzz harness does not start Ray actors")

    def getaddrinfo(host, *a, **k):
        if host not in ("127.0.0.1", "localhost", "::1", b"127.0.0.1", b"localhost"):
            raise socket.gaierror(socket.EAI_NONAME, "the fuzz harness resolves loopback only")
        return real_gai(host, *a, **k)

    default_model.ensure_detailed = ensure_detailed
    pipeline.ShardedModel._runtime = runtime
    socket.getaddrinfo = getaddrinfo
    try:
        yield
    finally:
        default_model.ensure_detailed, pipeline.ShardedModel._runtime = real_ensure, real_runtime
        socket.getaddrinfo = real_gai


# The documented statements name files the sandbox holds under other names.
_DOC_NAMES = {"model.vindex3": "tiny.vindex3", "path/to/hf-checkpoint": "tiny-checkpoint"}
_LQL_BLOCK = re.compile(r"```lql\n(.*?)```", re.DOTALL)


def documented(root: Path | None = None) -> list[str]:
    """The documented statements: every statement's catalog example and every ```lql block of
    docs/lql.md (a block is one script), with the file names they use mapped to the sandbox's."""
    from lql import registry

    root = root or Path(__file__).resolve().parent.parent
    texts = [d.example for d in registry.docs()]
    doc = root / "docs" / "lql.md"
    if doc.is_file():
        texts += [m.group(1).strip() for m in _LQL_BLOCK.finditer(doc.read_text(encoding="utf-8"))]
    out = []
    for t in texts:
        for a, b in _DOC_NAMES.items():
            t = t.replace(a, b)
        out.append(t)
    return out


def case(ch: Chooser, grammar: Grammar, mutate_p: float = 0.5, docs: list[str] | None = None,
         docs_p: float = 0.25) -> str:
    """One fuzz case: with probability ``docs_p`` (when ``docs`` is given) a documented statement,
    else 1-3 generated statements; mutated with probability ``mutate_p``."""
    text = ch.pick(docs) if docs and ch.chance(docs_p) else grammar.script(ch)
    return mutate(ch, text) if ch.chance(mutate_p) else text


def as_stdin(ch: Chooser, text: str) -> bytes:
    """``text`` as the bytes of a script on standard input: UTF-8 (lone surrogates kept as the
    bytes a careless writer produces), sometimes with bytes that are not UTF-8 at all."""
    data = text.encode("utf-8", "surrogatepass")
    if ch.chance(0.3):
        i = ch.below(len(data) + 1)
        data = data[:i] + ch.pick([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x00", b"\xef\xbb\xbf", b"\x80\x80"]) + data[i:]
    return data


def statement_kinds(grammar: Grammar) -> list[str]:
    """The statement rules the generator draws from (for the report)."""
    return [e[0].name for e in grammar.statements]

