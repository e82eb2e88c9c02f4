"""Reduced-depth drafts made measurable: logit dumps with provenance sidecars, draft-vs-target
scoring, the depth ladder, and self-speculative decoding. See docs/draft.md."""

from .dumps import dump_logits, read_dump, read_meta, sidecar_path
from .ladder import LadderReport, LadderRow, run_ladder
from .lookup import DEFAULT_NGRAM, LookupIndex, lookup_generate
from .score import ArrayScore, PositionScore, ScoreReport, ScoreSummary, score_arrays, score_files
from .speculative import PlainResult, SpecResult, greedy_generate, speculative_generate

__all__ = [
    "DEFAULT_NGRAM", "ArrayScore", "LadderReport", "LadderRow", "LookupIndex", "PlainResult", "PositionScore", "ScoreReport",
    "ScoreSummary", "SpecResult", "dump_logits", "greedy_generate", "lookup_generate",
    "read_dump", "read_meta", "run_ladder", "score_arrays", "score_files", "sidecar_path",
    "speculative_generate",
]
