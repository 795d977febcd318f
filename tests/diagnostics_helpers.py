"""Helpers shared by the tests of the diagnostics modules (the package ``hf_mhc.diagnostics``: ``report``,
``plots``, ``callback``, ``cli``): small mHC models with non-trivial maps."""

from __future__ import annotations

import torch
from conftest import tiny_backbone_config

from hf_mhc import MHCConfig, MHCForCausalLM


def three_layer_mhc_model(hc_mult=4, hc_init="function_preserving", **hc_options) -> MHCForCausalLM:
    """A 3-layer tiny Llama mHC model in eval mode; ``hc_options``: other :class:`MHCConfig` fields."""
    config = MHCConfig(
        backbone_config=tiny_backbone_config("llama", num_hidden_layers=3), hc_mult=hc_mult, hc_init=hc_init,
        **hc_options,
    )
    return MHCForCausalLM(config).eval()


def known_signed_maps(model, monkeypatch, shape, scale, seed=0):
    """Give every HC site of ``model`` known token-dependent maps: ``comb = scale * (I + 0.5 R)`` with ``R`` standard
    normal per token (entries of both signs, rows and columns far from summing to 1), returned by the site's ``maps``
    (what the report reads). Returns the float32 ``comb [B, T, n, n]`` of every site in depth order."""
    generator = torch.Generator().manual_seed(seed)
    n = model.config.hc_mult
    combs = []
    for layer in model.model.layers:
        for site in (layer.attn_hc, layer.ffn_hc):
            comb = scale * (torch.eye(n) + 0.5 * torch.randn(*shape, n, n, generator=generator))
            pre, post = torch.rand(*shape, n, generator=generator), 2 * torch.rand(*shape, n, generator=generator)
            monkeypatch.setattr(site, "maps", lambda streams, maps=(pre, post, comb): maps)
            combs.append(comb)
    return combs
