"""The container's weights as the internals queries read them: the embedding, the final readout,
each FFN layer's features, and the container's own vocabulary. Built from the op plan and the
registered operators only: a layer's features exist when its FFN operator opts into
`vindex3.operators.FeatureFfn`; a layer with no FFN (a Mamba2 mixer-only layer) is skipped with
the reason, never given features it does not have."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..errors import QueryRefused, TokenizerMissing
from ..exec.engine import PreparedOperands, Readout, make_readout, slot_operands
from ..exec.ops.norm import make_weight, norm_fn
from ..operators import FFN, FeatureFfn, FeatureView, no_features_reason
from .common import Prompt, SkippedLayer, layer_list

F32 = np.float32


@dataclass
class FfnLayer:
    """One FFN layer's features and the norms its FFN reads the residual through."""

    layer: int
    mixer: str  # the layer's mixer operator (softmax, mamba2, ...)
    operator: str  # the FFN operator (gated_ffn, ...)
    view: FeatureView
    norms: list  # pre-FFN norms, in order: x [n, hidden] -> normed x

    @property
    def count(self) -> int:
        return self.view.count

    def ffn_input(self, h: np.ndarray) -> np.ndarray:
        """What this layer's FFN would read if the residual were ``h`` [n, hidden]."""
        for norm in self.norms:
            h = norm(h)
        return h

    def gate_scores(self, h: np.ndarray) -> np.ndarray:
        """gate · ffn_input(h), [n, features]."""
        return self.view.scores(self.ffn_input(h))


class ModelView:
    """Read-only access to a container's weights for analysis (no executor, no state)."""

    def __init__(self, container):
        self.container = container
        self.plan = container.op_plan()
        self._W = PreparedOperands(container.tensor_source())
        self._layers: dict[int, FfnLayer | SkippedLayer] = {}
        self._texts: dict[int, str] = {}

    @property
    def num_layers(self) -> int:
        return len(self.plan.layers)

    # -- ends ----------------------------------------------------------------------------------
    @cached_property
    def embedding(self):
        return self._W.weight(self.plan.embedding.operands["weight"])

    @cached_property
    def embedding_multiplier(self) -> np.float32:
        return F32(self.plan.embedding.params.multiplier)

    @cached_property
    def readout(self) -> Readout:
        return make_readout(self.plan, self._W)

    def embed(self, ids: Sequence[int]) -> np.ndarray:
        """The residual a token starts as: its embedding row times the embedding multiplier."""
        ids = np.asarray(ids, dtype=np.int64)
        V = self.embedding.shape[0]
        if ids.size and (ids.min() < 0 or ids.max() >= V):
            raise QueryRefused(f"token id {int(ids[(ids < 0) | (ids >= V)][0])} is outside the vocabulary [0, {V})")
        h = self.embedding.take(ids)
        return h * self.embedding_multiplier if self.embedding_multiplier != 1 else h

    # -- FFN layers ----------------------------------------------------------------------------
    def ffn_layer(self, i: int) -> FfnLayer | SkippedLayer:
        """Layer ``i``'s features, or why it has none."""
        got = self._layers.get(i)
        if got is None:
            got = self._layers[i] = self._ffn_layer(i)
        return got

    def _ffn_layer(self, i: int) -> FfnLayer | SkippedLayer:
        lo = self.plan.layers[i]
        ffn = next((op for op in lo.slot_ops() if op.role == FFN), None)
        if ffn is None:
            return SkippedLayer(layer=i, operator=lo.operator, reason=f"{lo.operator} layer with no FFN (mixer only): it has no features")
        if ffn.operator is None:
            return SkippedLayer(layer=i, operator=lo.operator, reason=f"FFN kind {ffn.kind!r} has no executor in this build")
        if not isinstance(ffn.operator, FeatureFfn):
            return SkippedLayer(layer=i, operator=lo.operator, reason=no_features_reason(ffn.kind, ffn.operator))
        view = ffn.operator.feature_view(ffn.params, slot_operands(ffn, self._W))
        k = lo.ops.index(ffn)
        norms = []
        j = k - 1
        # the FFN's pre-norms sit right before it (a parallel fork norms the layer's input)
        while j >= 0 and lo.ops[j].kind in ("rms_norm", "layer_norm", "parallel_fork"):
            op = lo.ops[j]
            kind = "layer" if op.kind == "layer_norm" else getattr(op.params, "norm", "rms")
            bias = self._W.array(op.operands["bias"]) if "bias" in op.operands else None
            norms.insert(0, norm_fn(kind, make_weight(self._W.array(op.operands["weight"]), op.params.weight_offset), bias,
                                    F32(op.params.eps)))
            j -= 1
        post = lo.ops[k + 1] if k + 1 < len(lo.ops) else None
        if post is not None and post.kind == "rms_norm" and post.params.post:
            # a post-norm (Gemma 2 / 3, OLMo 2) rescales the write per channel by its weight before
            # the residual: a feature's value reaches the residual as weight ⊙ down column (up to
            # the positive RMS factor of the position)
            w = make_weight(self._W.array(post.operands["weight"]), post.params.weight_offset)
            view = FeatureView(view.keys, (view.values * w[:, None]).astype(F32), view.activations)
        return FfnLayer(i, lo.operator, ffn.kind, view, norms)

    def ffn_layers(self, layers, what: str) -> tuple[list[FfnLayer], list[SkippedLayer]]:
        """The chosen layers (all when None) split into those with features and the skipped."""
        got, skipped = [], []
        for i in layer_list(layers, self.num_layers, what):
            x = self.ffn_layer(i)
            (skipped if isinstance(x, SkippedLayer) else got).append(x)
        return got, skipped

    # -- vocabulary ----------------------------------------------------------------------------
    @cached_property
    def has_tokenizer(self) -> bool:
        return self.container.has_tokenizer

    def text(self, token_id: int) -> str | None:
        if not self.has_tokenizer:
            return None
        t = self._texts.get(token_id)
        if t is None:
            t = self._texts[token_id] = self.container.tokenizer.token_text(int(token_id))
        return t

    def prompt(self, prompt: str | Sequence[int], what: str, *, special: bool = True) -> Prompt:
        """Text (tokenised as INFER does, or without special tokens when ``special`` is False)
        or token ids."""
        if isinstance(prompt, str):
            if not self.has_tokenizer:
                raise TokenizerMissing(f"{what}: the container carries no tokenizer, so {prompt!r} cannot be tokenised",
                                       hint="give token ids instead")
            tok = self.container.tokenizer
            ids = tok.encode(prompt) if special else tok.pieces(prompt)
            text = prompt
        else:
            ids, text = [int(t) for t in prompt], None
        if not ids:
            raise QueryRefused(f"{what}: {prompt!r} has no tokens")
        V = self.plan.vocab
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise QueryRefused(f"{what}: token id {bad[0]} is outside the vocabulary [0, {V})")
        return Prompt(text=text, ids=ids, tokens=[self.text(t) for t in ids])

    def token(self, token: str | int, what: str) -> int:
        """A single vocabulary entry: an id, or a text that is exactly one token."""
        V = self.plan.vocab
        if isinstance(token, bool):
            raise QueryRefused(f"{what}: {token!r} is not a token")
        if isinstance(token, int):
            if not 0 <= token < V:
                raise QueryRefused(f"{what}: token id {token} is outside the vocabulary [0, {V})")
            return token
        if not self.has_tokenizer:
            raise TokenizerMissing(f"{what}: the container carries no tokenizer, so {token!r} cannot be looked up",
                                   hint="give a token id instead")
        ids = self.container.tokenizer.pieces(token)
        if len(ids) == 1:
            return ids[0]
        pieces = ", ".join(f"{self.text(t)!r}" for t in ids) or "nothing"
        hint = None
        if not token.startswith(" "):
            alt = self.container.tokenizer.pieces(" " + token)
            if len(alt) == 1:
                hint = f"{' ' + token!r} (with its leading space) is one token, id {alt[0]}"
        raise QueryRefused(f"{what}: {token!r} is not one token of this vocabulary (it is {len(ids)}: {pieces})", hint=hint)
