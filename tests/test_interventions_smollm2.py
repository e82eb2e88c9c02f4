"""Interventions on real weights: SmolLM2-135M-Instruct (the default model) against transformers
5.24.0 loading the same GGUF, with forward hooks doing the same intervention."""

from __future__ import annotations

import numpy as np
import pytest

import vindex3
from vindex3.exec.intervention import Patch, Steer, site_key

pytestmark = pytest.mark.numeric  # compares numbers: scripts/test runs it again under a second numba target

PROMPT = "I think that you are"
LAYER = 6


def _hooked(ref, layer: int, edit):
    """A pre-hook on decoder layer ``layer`` replacing its input residual with edit(residual)."""
    def pre(m, args, kwargs):
        if args:
            return (edit(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": edit(kwargs["hidden_states"])}

    return list(ref.model.layers)[layer].register_forward_pre_hook(pre, with_kwargs=True)


def test_steered_greedy_continuation_is_the_references_for_16_tokens(smollm2_container, smollm2_reference):
    """STEER AT LAYER 6 WITH 'Love' MINUS 'Hate' SCALE 4: the residual difference of the two prompts
    entering layer 6 at their last positions, added at every position of every pass; 16 greedy
    tokens decoded step by step here, by the reference's own greedy generate (KV cache, the hook on
    every step) there."""
    import torch

    c = vindex3.open(smollm2_container)
    ex = c.executor()
    tok = c.tokenizer
    key = site_key(LAYER, "residual")
    vec = (ex.run_with_cache(tok.encode("Love"), sites=[key])[key][-1]
           - ex.run_with_cache(tok.encode("Hate"), sites=[key])[key][-1]).astype(np.float32)
    steer = Steer(LAYER, vec, 4.0, source="'Love' MINUS 'Hate'")
    ids = tok.encode(PROMPT)
    st = ex.start(interventions=[steer])
    logits = st.prefill(ids)[-1]
    ours = []
    for _ in range(16):
        t = int(np.argmax(logits))
        ours.append(t)
        logits = st.step(t)
    plain_st = ex.start()
    logits = plain_st.prefill(ids)[-1]
    plain = []
    for _ in range(16):
        t = int(np.argmax(logits))
        plain.append(t)
        logits = plain_st.step(t)
    add = torch.from_numpy(steer.addend.copy())
    h = _hooked(smollm2_reference, LAYER, lambda x: x + add)
    try:
        with torch.no_grad():
            out = smollm2_reference.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False,
                                             min_new_tokens=16, pad_token_id=0)
    finally:
        h.remove()
    theirs = [int(t) for t in out[0, len(ids):]]
    assert ours == theirs, (tok.decode(ours), tok.decode(theirs))
    assert ours != plain  # the steering changed the continuation


def test_patched_residual_logits_match_the_hooked_reference(smollm2_container, smollm2_reference):
    """PATCH RESIDUAL AT LAYER 12 POSITION 3 of 'The Colosseum is in the city of' with 'The Eiffel
    Tower is in the city of': ours against the reference with a hook putting its own clean values
    there."""
    import torch

    c = vindex3.open(smollm2_container)
    ex = c.executor()
    tok = c.tokenizer
    clean, corrupt = tok.encode("The Eiffel Tower is in the city of"), tok.encode("The Colosseum is in the city of")
    key = site_key(12, "residual")
    vals = ex.run_with_cache(clean, sites=[key])[key][3:4]
    ours = ex.forward(corrupt, interventions=[Patch("residual", 12, (3,), vals, source="clean")])
    seen = {}
    def keep(x):
        seen["x"] = x.clone()
        return x

    h = _hooked(smollm2_reference, 12, keep)
    try:
        with torch.no_grad():
            smollm2_reference(torch.tensor([clean]))
    finally:
        h.remove()
    src = seen["x"][0, 3].clone()

    def put(x):
        x = x.clone()
        x[0, 3] = src
        return x

    h = _hooked(smollm2_reference, 12, put)
    try:
        with torch.no_grad():
            want = smollm2_reference(torch.tensor([corrupt])).logits[0].float().numpy()
    finally:
        h.remove()
    err = float(np.max(np.abs(ours - want)))
    # 1e-4 (the bar): 2.4x the patched reference's own fp32-vs-fp64 spread on this pair,
    # measured 4.1e-5 (logits up to 27); ours measured 5.4e-5
    assert err <= 1e-4, err
