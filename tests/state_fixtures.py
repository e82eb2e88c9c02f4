"""Tiny random checkpoints of the families whose layers keep new kinds of state (Mamba1,
Falcon-Mamba, LFM2, Falcon-H1, RecurrentGemma), registered into tests/fixtures.py's tables on
import so that the session fixtures (``checkpoint_dirs``, ``containers``) build them.

Odd widths wherever the reference allows; every SSM parameter (A_log, D, dt biases), every norm
and conv bias and every gate re-randomised away from its initialisation; matrices at a gain that
puts logits at O(1–10), so that a 1e-4 tolerance means something."""

from __future__ import annotations

import math

import fixtures
from fixtures import FAMILIES, REFINE, VOCAB

SSM_BASE = {"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}

FAMILIES["mamba"] = dict(SSM_BASE, hidden_size=45, state_size=13, num_hidden_layers=3, conv_kernel=3, expand=2,
                         use_bias=True, use_conv_bias=True, time_step_rank=5, layer_norm_epsilon=1e-5,
                         tie_word_embeddings=False)
FAMILIES["falcon_mamba"] = dict(SSM_BASE, hidden_size=45, state_size=11, num_hidden_layers=3, conv_kernel=4, expand=2,
                                use_bias=False, use_conv_bias=True, layer_norm_epsilon=1e-5, mixer_rms_eps=1e-6,
                                tie_word_embeddings=True)

# LFM2: conv, attention, conv, conv, attention; the pattern declared by full_attn_idxs (the
# reference writes layer_types from it on save, so the saved config carries both, agreeing)
FAMILIES["lfm2"] = dict(SSM_BASE, hidden_size=48, num_hidden_layers=5, num_attention_heads=3, num_key_value_heads=1,
                        intermediate_size=80, block_multiple_of=1, block_ffn_dim_multiplier=1.0, conv_L_cache=4,
                        conv_bias=True, full_attn_idxs=[1, 4], norm_eps=1e-5, max_position_embeddings=512,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)

# Falcon-H1: every multiplier away from 1 (the FFN's too: the gated_ffn_mup operator), an SSM width
# (mamba_d_ssm) of its own, n_groups = 3, a chunk size the prompts exceed without dividing.
FAMILIES["falcon_h1"] = dict(SSM_BASE, hidden_size=48, intermediate_size=70, num_hidden_layers=3, num_attention_heads=3,
                             num_key_value_heads=1, mamba_d_ssm=90, mamba_n_heads=6, mamba_d_head="auto", mamba_n_groups=3,
                             mamba_d_state=13, mamba_d_conv=3, mamba_chunk_size=8, mamba_proj_bias=True,
                             projectors_bias=True, rms_norm_eps=1e-5, max_position_embeddings=512,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, embedding_multiplier=1.5,
                             lm_head_multiplier=0.7, key_multiplier=0.8, attention_in_multiplier=1.2,
                             attention_out_multiplier=0.9, ssm_in_multiplier=0.8, ssm_out_multiplier=1.1,
                             ssm_multipliers=[0.9, 1.1, 0.7, 1.3, 0.6], mlp_multipliers=[1.3, 0.8], tie_word_embeddings=False)

# RecurrentGemma: recurrent, attention, recurrent, recurrent (block_types cycled), a local window
# of 7 keys the prompts exceed, partial rotary. lru_width equals hidden_size: the reference's
# first one-token decode step sizes its conv state by hidden_size and cannot run otherwise.
FAMILIES["recurrent_gemma"] = dict(SSM_BASE, hidden_size=48, intermediate_size=140, num_hidden_layers=4,
                                   num_attention_heads=3, num_key_value_heads=1, lru_width=48, attention_window_size=7,
                                   conv1d_width=4, logits_soft_cap=15.0, rms_norm_eps=1e-6,
                                   block_types=["recurrent", "attention", "recurrent"], attention_bias=True,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                    "partial_rotary_factor": 0.5})

# Bamba: mamba2, attention, mamba2, mamba2 (attn_layer_indices), n_groups = 3, half rotary.
FAMILIES["bamba"] = dict(SSM_BASE, hidden_size=48, intermediate_size=70, num_hidden_layers=4, num_attention_heads=3,
                         num_key_value_heads=1, attn_layer_indices=[1], mamba_n_heads=6, mamba_n_groups=3, mamba_d_state=13,
                         mamba_d_conv=3, mamba_chunk_size=8, mamba_expand=2, mamba_proj_bias=True, rms_norm_eps=1e-5,
                         max_position_embeddings=512, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})

NEW_STATE_FAMILIES = ["mamba", "falcon_mamba", "lfm2", "falcon_h1", "recurrent_gemma", "bamba"]


def _scale(model, gen, skip=(), head_gain=3.0) -> None:
    """Matrices at unit gain (std 1/sqrt(fan_in)), the embedding at std 1, the head at
    head_gain/sqrt(hidden)."""
    import torch

    for name, p in sorted(model.named_parameters()):
        if p.dim() < 2 or any(s in name for s in skip):
            continue
        fan_in = p.shape[-1] if p.dim() == 2 else math.prod(p.shape[1:])
        gain = 1.0
        if "embed" in name:  # also the head when tied: lower then, so logits stay O(10)
            gain, fan_in = (0.35 if model.config.tie_word_embeddings else 1.0), 1
        elif "lm_head" in name:
            gain = head_gain
        p.copy_(gain / math.sqrt(fan_in) * torch.randn(p.shape, generator=gen))


def _mamba1(model) -> None:
    """A_log [inner, state] uniform in [log 0.3, log 4], dt_proj's bias in [-3, 0.5] (Δ from 0.05
    to 1), D ~ N(0, 1), conv taps and biases, projections at unit gain (the head lower for
    Falcon-Mamba, whose normed B and C make the mixer's write larger)."""
    import torch

    gen = torch.Generator().manual_seed(2812)
    _scale(model, gen, skip=("A_log",), head_gain=1.0 if model.config.model_type == "falcon_mamba" else 3.0)
    for _, mod in sorted(model.named_modules(), key=lambda nm: nm[0]):
        if not hasattr(mod, "A_log"):
            continue
        mod.A_log.copy_(torch.empty(mod.A_log.shape).uniform_(math.log(0.3), math.log(4.0), generator=gen))
        mod.dt_proj.bias.copy_(torch.empty(mod.dt_proj.bias.shape).uniform_(-3.0, 0.5, generator=gen))
        mod.D.copy_(torch.randn(mod.D.shape, generator=gen))
        if mod.conv1d.bias is not None:
            mod.conv1d.bias.copy_(0.2 * torch.randn(mod.conv1d.bias.shape, generator=gen))
        for lin in (mod.in_proj, mod.out_proj):
            if lin.bias is not None:
                lin.bias.copy_(0.1 * torch.randn(lin.bias.shape, generator=gen))


def _lfm2(model) -> None:
    """Matrices at unit gain; every norm (layer, q/k, final) and conv bias keeps its re-randomised
    1 + 0.3·N(0, 1) from build_checkpoint."""
    import torch

    _scale(model, torch.Generator().manual_seed(2813))


def _falcon_h1(model) -> None:
    """Matrices at unit gain; A_log, dt_bias, D and the conv and projection biases of the SSM
    member re-randomised as for Mamba2 (tests/fixtures.py)."""
    import torch

    gen = torch.Generator().manual_seed(2814)
    _scale(model, gen)
    for _, mod in sorted(model.named_modules(), key=lambda nm: nm[0]):
        if not hasattr(mod, "A_log"):
            continue
        h = mod.A_log.shape[0]
        mod.A_log.copy_(torch.empty(h).uniform_(math.log(0.3), math.log(4.0), generator=gen))
        mod.dt_bias.copy_(torch.empty(h).uniform_(-3.0, 0.5, generator=gen))
        mod.D.copy_(torch.randn(h, generator=gen))
        mod.conv1d.bias.copy_(0.2 * torch.randn(mod.conv1d.bias.shape, generator=gen))
        for lin in (mod.in_proj, mod.out_proj):
            if lin.bias is not None:
                lin.bias.copy_(0.1 * torch.randn(lin.bias.shape, generator=gen))


def _recurrent_gemma(model) -> None:
    """Matrices at unit gain; the RG-LRU's block gates at 1/sqrt(block width), their biases at
    0.5·N(0, 1), Λ (recurrent_param) so that softplus(Λ) spans 0.1–2: decays from fast to slow."""
    import torch

    gen = torch.Generator().manual_seed(2815)
    _scale(model, gen, skip=("gate_weight", "gate_bias"))
    for name, p in sorted(model.named_parameters()):
        if name.endswith("gate_weight"):
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
        elif name.endswith("gate_bias"):
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))
        elif name.endswith("recurrent_param"):
            p.copy_(torch.empty(p.shape).uniform_(-2.2, 1.8, generator=gen))


REFINE["lfm2"] = _lfm2
REFINE["recurrent_gemma"] = _recurrent_gemma
REFINE["falcon_h1"] = _falcon_h1
REFINE["bamba"] = _falcon_h1  # the same Mamba2 parameters, the same treatment
REFINE["mamba"] = _mamba1
REFINE["falcon_mamba"] = _mamba1


def ids(n: int, seed: int = 7) -> list[int]:
    """n token ids, deterministic, spread over the vocabulary."""
    import numpy as np

    return [int(t) for t in np.random.default_rng(seed).integers(3, VOCAB, n)]


__all__ = ["FAMILIES", "NEW_STATE_FAMILIES", "fixtures", "ids"]
