"""MHCConfig: nesting, serialisation and clear errors for invalid values."""

from __future__ import annotations

import pytest
from conftest import tiny_backbone_config
from transformers import AutoConfig, GPT2Config, LlamaConfig, Qwen2Config

from hf_mhc import MHCConfig


def test_nested_backbone_from_config_or_dict():
    from_config = MHCConfig(backbone_config=tiny_backbone_config("qwen2"), hc_mult=3)
    from_dict = MHCConfig(backbone_config=tiny_backbone_config("qwen2").to_dict(), hc_mult=3)
    for config in (from_config, from_dict):
        assert isinstance(config.backbone_config, Qwen2Config)
        assert config.get_text_config() is config.backbone_config
        assert config.hc_mult == 3 and config.hc_sinkhorn_iters == 20 and config.hc_eps == 1e-6
    assert isinstance(MHCConfig().backbone_config, LlamaConfig)


def test_round_trip_through_json(tmp_path):
    config = MHCConfig(backbone_config=tiny_backbone_config("qwen3", tie_word_embeddings=True), hc_mult=5,
                       hc_sinkhorn_iters=7, hc_init_post_delta=0.2)
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, MHCConfig)
    assert loaded.backbone_config.to_dict() == config.backbone_config.to_dict()
    assert (loaded.hc_mult, loaded.hc_sinkhorn_iters, loaded.hc_init_post_delta) == (5, 7, 0.2)
    assert loaded.tie_word_embeddings is True


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(hc_mult=0), "hc_mult must be an integer from 1 to 8"),
        (dict(hc_mult=9), "hc_mult must be an integer from 1 to 8"),
        (dict(hc_sinkhorn_iters=0), "hc_sinkhorn_iters must be an integer >= 1"),
        (dict(hc_eps=0.0), "hc_eps must be > 0"),
        (dict(hc_eps=-1e-6), "hc_eps must be > 0"),
        (dict(hc_mult=4, hc_eps=0.3), "hc_eps must be smaller than 1/hc_mult"),
        (dict(hc_init_dynamic_scale=0.0), "hc_init_dynamic_scale must be non-zero"),
    ],
)
def test_invalid_values_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MHCConfig(backbone_config=tiny_backbone_config("llama"), **kwargs)


@pytest.mark.parametrize("backbone", [GPT2Config(), GPT2Config().to_dict(), {"model_type": "no-such-model"}, {}])
def test_unsupported_backbone_lists_the_supported_ones(backbone):
    with pytest.raises(ValueError, match="supported backbone families: llama, mistral, qwen2, qwen3"):
        MHCConfig(backbone_config=backbone)


def test_invalid_hc_init_is_rejected():
    with pytest.raises((ValueError, TypeError), match="hc_init"):
        MHCConfig(backbone_config=tiny_backbone_config("llama"), hc_init="zeros")
