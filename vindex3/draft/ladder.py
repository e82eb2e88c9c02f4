"""The depth ladder: dump the full model's logits once per prompt, dump each draft depth, score
every depth against the target through the dump files (so that each comparison is checked by
its sidecars), and pool the scores per depth, per prompt and per category."""

from __future__ import annotations

import os
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from .. import jsonio
from ..errors import SliceError, TokenizerMissing, VindexError
from ..limits import check_context, context_limit
from ..paths import file_component, output_dir, output_file
from .bank import Prompt, file_sha256, load_prompts
from .dumps import dump_with
from .machine import machine_facts
from .score import PositionScore, ScoreSummary, score_files, summarize
from .slices import container_facts, make_executor, open_container, resolve_slice

Progress = Callable[[int, int, str], None]


class PromptScore(BaseModel):
    id: str
    category: str
    token_ids: list[int]
    summary: ScoreSummary
    detail: list[PositionScore]


class LadderRow(BaseModel):
    depth: int
    executed_layers: int
    summary: ScoreSummary  # pooled over every position of every prompt
    per_category: dict[str, ScoreSummary]
    per_prompt: list[PromptScore]
    prepare_seconds: float
    step_seconds: float
    ms_per_position: float
    adapter: dict[str, Any] | None = None  # the exit adapter this depth's draft was read through (its dumps' sidecars)


class TargetCost(BaseModel):
    positions: int
    prepare_seconds: float
    step_seconds: float
    ms_per_position: float


class LadderReport(BaseModel):
    """Plain data; DRAFT LADDER's table is laid out by lql.statements.drafts.ladder_text."""

    container_digest: str
    component: str | None
    model_layers: int
    prompts_file: str  # the bank's file name; its identity is the hash beside it
    prompts_sha256: str
    prompts: int
    categories: list[str]
    depths: list[int]
    target: TargetCost
    rows: list[LadderRow]
    seconds: float
    machine: dict[str, Any]


def _check_depths(depths: Sequence[int], layers: int) -> list[int]:
    out: list[int] = []
    for d in depths:
        if isinstance(d, bool) or not isinstance(d, int):
            raise SliceError(f"DRAFT LADDER depth {d!r} is not an integer")
        if d < 1:
            raise SliceError(f"DRAFT LADDER depth {d}: a draft needs at least one layer (1..{layers})")
        if d > layers:
            raise SliceError(f"DRAFT LADDER depth {d} is deeper than the model ({layers} layers)")
        if d in out:
            raise SliceError(f"DRAFT LADDER depth {d} is listed twice")
        out.append(d)
    if not out:
        raise SliceError("DRAFT LADDER needs at least one depth")
    return out


def _tokenize(container: Any, prompts: list[Prompt]) -> dict[str, list[int]]:
    texts = [p.id for p in prompts if p.text is not None]
    if texts and not container.has_tokenizer:
        raise TokenizerMissing(
            f"DRAFT LADDER needs a tokenizer for text prompts ({texts[0]!r} first) and this "
            "container carries none",
            hint="give the bank's prompts as token_ids instead of text",
        )
    ids = {}
    for p in prompts:
        if p.token_ids is not None:
            ids[p.id] = [int(t) for t in p.token_ids]
            continue
        toks = [int(t) for t in container.tokenizer.encode(p.text)]
        if not toks:
            raise VindexError(f"prompt {p.id!r} tokenizes to no tokens")
        ids[p.id] = toks
    return ids


def run_ladder(container: Any, depths: Sequence[int], prompts_path: str | os.PathLike,
               out_path: str | os.PathLike | None = None, progress: Progress | None = None,
               work_dir: str | os.PathLike | None = None,
               on_row: Callable[[LadderRow], None] | None = None, *, overwrite: bool = False,
               max_prompts: int | None = None, max_positions: int | None = None,
               adapters: bool = False) -> LadderReport:
    """Score draft depths against the full model over a prompt bank.

    For every prompt the full model's logits are dumped once, then each depth's; each depth is
    scored against the target through :func:`score_files`. Returns one row per depth with the
    pooled summary, per-category summaries and per-prompt detail; with ``out_path`` the whole
    report is also written there as JSON. ``progress(done, total, label)`` is called after every
    dump. Dumps go to ``work_dir`` (kept) or to a temporary directory (removed).

    Every path is checked before any work: ``out_path`` and ``work_dir`` must lie outside the
    container, an existing report or dump is replaced only with ``overwrite``, a bank of more
    than ``max_prompts`` prompts is refused, a prompt longer than the model's context length (or
    ``max_positions``, an explicit override) is refused before the first dump, and dump files are
    named after a file-name-safe rendering of each prompt id (an id holding '/' cannot leave the
    work directory).

    With ``adapters`` every depth's draft is read through the exit adapter the container stores
    for it (vindex3.draft.store; each one read and checked before the first dump, an absent or
    stale one refused by name), and each row names it.
    """
    t_start = time.perf_counter()
    c = open_container(container)
    facts = container_facts(c)
    layers = facts["num_layers"]
    depths = _check_depths(list(depths), layers)
    forbid = [c.path]
    if out_path is not None:
        output_file(out_path, "DRAFT LADDER report", overwrite=overwrite, forbid_inside=forbid)
    if work_dir is not None:
        output_dir(work_dir, "DRAFT LADDER work directory", exist_ok=True, forbid_inside=forbid)
    prompts = load_prompts(prompts_path, max_prompts=max_prompts)
    bank_sha = file_sha256(prompts_path)
    ids = _tokenize(c, prompts)
    limit, source = context_limit(c.graph.context_length, max_positions)
    for p in prompts:
        check_context(len(ids[p.id]), limit, source, f"DRAFT LADDER prompt {p.id!r} ({len(ids[p.id])} tokens)")
    names = {p.id: file_component(p.id) for p in prompts}
    stored = {}
    if adapters:
        from .store import load_adapter

        stored = {d: load_adapter(c, d) for d in depths}

    tmp = None
    if work_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="ladder-")
        wd = Path(tmp.name)
    else:
        wd = Path(work_dir)
        wd.mkdir(exist_ok=True)

    total = len(prompts) * (1 + len(depths))
    done = 0

    def tick(label: str) -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total, label)

    try:
        full_slice, _ = resolve_slice(c, None)
        ex, prep = make_executor(c, full_slice, max_positions=max_positions)
        t_step = 0.0
        for p in prompts:
            meta = dump_with(ex, c, ids[p.id], wd / f"target-{names[p.id]}.f32", prepare_seconds=prep,
                             draft_depth=None, overwrite=overwrite)
            t_step += meta["step_seconds"]
            tick(f"full: {p.id}")
        del ex
        n_pos = sum(len(v) for v in ids.values())
        target = TargetCost(positions=n_pos, prepare_seconds=prep, step_seconds=t_step,
                            ms_per_position=t_step * 1000.0 / n_pos)

        rows = []
        for d in depths:
            slice_obj, _ = resolve_slice(c, d)
            ex, prep = make_executor(c, slice_obj, max_positions=max_positions)
            record = None
            if d in stored:
                from .adapter import AdaptedReadout, check_adapter

                check_adapter(c, d, stored[d])
                ex.readout = AdaptedReadout(ex.readout, stored[d])
                f = stored[d].facts
                record = {"key": f"drafter_adapter_d{d}", "depth": d, "ridge": f.ridge, "positions": f.positions,
                          "corpus": f.corpus, "corpus_sha256": f.corpus_sha256, "container_digest": f.container_digest,
                          "method": f.method}
            step = 0.0
            per_prompt: list[PromptScore] = []
            executed = None
            for p in prompts:
                path = wd / f"d{d}-{names[p.id]}.f32"
                meta = dump_with(ex, c, ids[p.id], path, prepare_seconds=prep, draft_depth=d, overwrite=overwrite,
                                 adapter=record)
                step += meta["step_seconds"]
                executed = len(meta["executed_layers"])
                rep = score_files(path, wd / f"target-{names[p.id]}.f32")
                per_prompt.append(PromptScore(id=p.id, category=p.category, token_ids=ids[p.id],
                                              summary=rep.summary, detail=rep.positions))
                tick(f"depth {d}: {p.id}")
            del ex
            by_cat: dict[str, list[PositionScore]] = defaultdict(list)
            for ps in per_prompt:
                by_cat[ps.category].extend(ps.detail)
            pooled = [pos for ps in per_prompt for pos in ps.detail]
            rows.append(LadderRow(
                depth=d, executed_layers=int(executed or 0), summary=summarize(pooled),
                per_category={k: summarize(v) for k, v in by_cat.items()}, per_prompt=per_prompt,
                prepare_seconds=prep, step_seconds=step, ms_per_position=step * 1000.0 / len(pooled), adapter=record,
            ))
            if on_row is not None:
                on_row(rows[-1])
    finally:
        if tmp is not None:
            tmp.cleanup()

    report = LadderReport(
        container_digest=facts["digest"], component=facts["component"], model_layers=layers,
        prompts_file=Path(prompts_path).name, prompts_sha256=bank_sha,
        prompts=len(prompts), categories=sorted({p.category for p in prompts}), depths=depths,
        target=target, rows=rows, seconds=time.perf_counter() - t_start, machine=machine_facts(),
    )
    if out_path is not None:
        output_file(out_path, "DRAFT LADDER report", overwrite=overwrite, forbid_inside=forbid)
        jsonio.write_atomic(out_path, report.model_dump())
    return report
