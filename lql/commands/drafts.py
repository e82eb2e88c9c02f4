"""DRAFT DEPTH / DRAFT OFF (the session's default slice), DUMP LOGITS, SCORE DRAFT and DRAFT
LADDER (vindex3.draft: drafts made measurable)."""

from __future__ import annotations

from pathlib import Path

from .. import planner
from .. import results as R
from ..binding import draft_module, slice_of
from ..errors import FileRefusal, LimitError
from . import command


@command(planner.SetDraft)
def set_draft(session, node: planner.SetDraft) -> R.DraftResult:
    session.draft_depth = node.depth
    sl = node.slice
    if sl is None:  # DRAFT OFF with nothing bound
        return R.DraftResult(depth=None, model_layers=0, executed_layers=[],
                             reads=R.ReadCost(ends_reads=0, ends_bytes=0, layer_reads=0, layer_bytes=0,
                                              total_reads=0, total_bytes=0))
    return R.DraftResult(depth=node.depth, model_layers=session.catalog.num_layers,
                         executed_layers=sl.executed_layers, reads=sl.reads)


@command(planner.Dump)
def dump(session, node: planner.Dump) -> R.DumpResult:
    draft = draft_module("DUMP LOGITS")
    c = session.container
    path = Path(node.into)
    try:
        meta = draft.dump_logits(c, list(node.prompt.ids), slice_of(node.slice.depth), path, overwrite=node.overwrite,
                                 max_positions=session.settings.get("max_positions"), intervention=node.intervention)
    except OSError as e:
        raise FileRefusal(f"cannot write {path}: {e.strerror or e}") from None
    sidecar = draft.sidecar_path(path) if hasattr(draft, "sidecar_path") else Path(f"{path}.meta.json")
    return R.DumpResult(path=str(path), sidecar=str(sidecar), depth=meta.get("draft_depth"),
                        positions=int(meta["positions"]), vocab=int(meta["vocab"]),
                        executed_layers=list(meta.get("executed_layers", [])), meta=meta)


@command(planner.Score)
def score(session, node: planner.Score) -> R.ScoreResult:
    draft = draft_module("SCORE DRAFT")
    for key in ("draft", "target"):
        if not Path(getattr(node, key)).exists():
            raise FileRefusal(f"SCORE DRAFT: the {key} dump {getattr(node, key)} does not exist")
    rep = draft.score_files(node.draft, node.target)
    positions = [p.model_dump(mode="json") for p in rep.positions]
    # Token text beside ids, when the bound container is the one both dumps were made on.
    tokens = False
    if session.bound and session.catalog.has_tokenizer and session.container.digest == rep.container_digest:
        tokens = True
        for p in positions:
            p["target_token"] = session.catalog.token_text(p["target_argmax"])
            p["draft_token"] = session.catalog.token_text(p["draft_argmax"])
    return R.ScoreResult(
        draft=node.draft, target=node.target, depth=rep.draft_depth, model_layers=rep.model_layers,
        summary=rep.summary.model_dump(mode="json"), positions=positions, tokens=tokens,
        draft_intervention=rep.draft_intervention, target_intervention=rep.target_intervention,
    )


def ladder_result(rep, *, prompts_file: str, into: str | None, plot_path: str | None = None) -> R.LadderResult:
    """A vindex3 ladder report as a result (also used by the vindex3 command's printer)."""
    full = rep.model_dump(mode="json")
    rows = full.pop("rows")
    return R.LadderResult(prompts_file=prompts_file, into=into, model_layers=rep.model_layers,
                          depths=list(rep.depths), rows=rows, target=full.get("target", {}), report=full,
                          plot_path=plot_path)


@command(planner.Ladder)
def ladder(session, node: planner.Ladder) -> R.LadderResult:
    draft = draft_module("DRAFT LADDER")
    prompts = Path(node.prompts)
    into = node.into
    if node.plot is not None:
        from ..render import require_matplotlib

        require_matplotlib("DRAFT LADDER ... PLOT INTO")  # before the long run, not after it
    _check_ladder_memory(session, node)
    finished: list = []
    try:
        rep = draft.run_ladder(session.container, list(node.depths), prompts, out_path=into,
                               progress=session.on_progress, on_row=finished.append, overwrite=node.overwrite,
                               max_prompts=session.settings.get("max_prompts"),
                               max_positions=session.settings.get("max_positions"))
    except KeyboardInterrupt:  # Ctrl-C: the depths finished so far
        return R.LadderResult(prompts_file=str(prompts), into=None, model_layers=session.catalog.num_layers,
                              depths=[r.depth for r in finished], rows=[r.model_dump(mode="json") for r in finished],
                              target={}, report={}, interrupted=True)
    result = ladder_result(rep, prompts_file=str(prompts), into=into, plot_path=node.plot)
    if node.plot is not None:
        from ..files import container_paths, output_file
        from ..render import ladder_figure, save_figure

        # checked again: the ladder ran for a while, and a file may have appeared meanwhile
        output_file(node.plot, "DRAFT LADDER chart", overwrite=node.overwrite, inside=container_paths(session.container))
        try:
            save_figure(ladder_figure(result), node.plot)
        except OSError as e:
            raise FileRefusal(f"cannot write {node.plot}: {e.strerror or e}") from None
    return result


def _check_ladder_memory(session, node: planner.Ladder) -> None:
    """The ladder's arrays for its longest prompt (each dump holds one prompt's logits), before
    any work: the bank is read (``max_prompts`` refused by vindex3 as it reads) and tokenised."""
    from vindex3.draft.bank import load_prompts
    from vindex3.errors import LimitExceeded

    from .. import limits

    cat = session.catalog
    limit = session.settings.get("max_prompts")
    try:
        bank = load_prompts(node.prompts, max_prompts=limit)
    except LimitExceeded:
        raise LimitError(f"DRAFT LADDER: the prompt bank {node.prompts!r} holds more than {limit:,} prompts; "
                         f"max_prompts is {limit:,}", hint="use a smaller bank, or SET max_prompts = n to allow more") from None
    longest = max((len(p.token_ids) if p.token_ids is not None else len(cat.tokenize(p.text)) for p in bank), default=0)
    if longest < 1:
        return
    for d in (None, *node.depths):
        need = limits.Need().add("one step at the end", cat.estimate(1, d, start=longest - 1)).add(
            f"the logits of the longest prompt [{longest:,}, {cat.vocab:,}] and their bytes", extra=2 * longest * cat.vocab * 4)
        need.check(session.settings, f"DRAFT LADDER (its longest prompt, {longest:,} tokens)")



