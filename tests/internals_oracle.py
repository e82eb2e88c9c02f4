"""Independent answers for the internals tests, from transformers 5.24.0 modules (forward hooks on
the reference model) and from the checkpoint's own tensors read with safetensors (never through a
container). Module and tensor spellings of each family live here, in the tests, as they do at
admission: nothing under vindex3/ is consulted."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import numpy as np


def checkpoint_tensors(ckpt: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(Path(ckpt).glob("*.safetensors")):
        out.update({k: v.astype(np.float32) for k, v in load_file(str(f)).items()})
    return out


def hf_parts(model):
    """(decoder layers, per layer (mixer module, ffn module or None, down-projection module or
    None), final norm, residual multiplier, head multiplier)."""
    cfg = model.config
    if hasattr(model, "backbone"):  # Mamba2ForCausalLM
        layers = list(model.backbone.layers)
        sites = [(l.mixer, None, None) for l in layers]
        return layers, sites, model.backbone.norm_f, 1.0, 1.0
    layers = list(model.model.layers)
    sites = []
    for l in layers:
        mixer = getattr(l, "mamba", None) or l.self_attn
        ffn = getattr(l, "shared_mlp", None) or l.mlp
        down = getattr(ffn, "output_linear", None) or ffn.down_proj
        sites.append((mixer, ffn, down))
    m = float(getattr(cfg, "residual_multiplier", 1.0) or 1.0)
    scale = getattr(cfg, "logits_scaling", None)
    return layers, sites, model.model.norm, m, (1.0 / scale if scale else 1.0)


def _out(o):
    return (o[0] if isinstance(o, tuple) else o).detach()[0].numpy().copy()


@contextmanager
def hooks(model, *, ablate: dict[int, list[int]] | None = None):
    """Record every layer's output (the residual after it), every mixer's and FFN's output and
    every FFN's input; optionally zero named features (the down projection's input columns)."""
    import torch

    layers, sites, _, _, _ = hf_parts(model)
    rec: dict = {"layer": {}, "mixer": {}, "ffn": {}, "ffn_in": {}}
    handles = []
    for i, (layer, (mixer, ffn, down)) in enumerate(zip(layers, sites)):
        handles.append(layer.register_forward_hook(lambda m, a, o, i=i: rec["layer"].__setitem__(i, _out(o))))
        handles.append(mixer.register_forward_hook(lambda m, a, o, i=i: rec["mixer"].__setitem__(i, _out(o))))
        if ffn is not None:
            handles.append(ffn.register_forward_hook(lambda m, a, o, i=i: rec["ffn"].__setitem__(i, _out(o))))
            handles.append(ffn.register_forward_pre_hook(lambda m, a, i=i: rec["ffn_in"].__setitem__(i, _out(a))))
        if ablate and i in ablate and down is not None:
            feats = torch.tensor(ablate[i])

            def zero(m, a, feats=feats):
                x = a[0].clone()
                x[..., feats] = 0
                return (x,)

            handles.append(down.register_forward_pre_hook(zero))
    try:
        yield rec
    finally:
        for h in handles:
            h.remove()


def hf_run(model, ids, ablate=None):
    """(logits [T, vocab], record) of one forward."""
    import torch

    with torch.no_grad(), hooks(model, ablate=ablate) as rec:
        logits = model(torch.tensor([ids])).logits[0].numpy()
    return logits, rec


def hf_readout(model, h: np.ndarray) -> np.ndarray:
    """The reference's own final norm and head applied to a residual [T, hidden]."""
    import torch

    _, _, norm, _, mult = hf_parts(model)
    with torch.no_grad():
        x = norm(torch.from_numpy(np.ascontiguousarray(h))[None])
        return (model.lm_head(x)[0] * mult).numpy()
