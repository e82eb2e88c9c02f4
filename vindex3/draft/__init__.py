"""Reduced-depth drafts made measurable: logit dumps with provenance sidecars, draft-vs-target
scoring, the depth ladder, and self-speculative decoding. See docs/draft.md."""

from .dumps import dump_logits, read_dump, read_meta, sidecar_path
from .score import ArrayScore, PositionScore, ScoreReport, ScoreSummary, score_arrays, score_files

__all__ = [
    "ArrayScore", "PositionScore", "ScoreReport", "ScoreSummary", "dump_logits", "read_dump",
    "read_meta", "score_arrays", "score_files", "sidecar_path",
]
