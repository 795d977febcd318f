"""MHCConfig: nesting, serialisation and clear errors for invalid values."""

from __future__ import annotations

import ast
import json
import math
import typing
from pathlib import Path

import pytest
import torch
from conftest import assert_logits_close, assert_same_weights, tiny_backbone_config
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

from hf_mhc import MHCConfig, configuration_mhc, mhc_reference
from hf_mhc.configuration_mhc import MAX_SINKHORN_ITERS, hc_options


def test_nested_backbone_from_config_or_dict():
    from_config = MHCConfig(backbone_config=tiny_backbone_config("qwen2"), hc_mult=3)
    from_dict = MHCConfig(backbone_config=tiny_backbone_config("qwen2").to_dict(), hc_mult=3)
    for config in (from_config, from_dict):
        assert isinstance(config.backbone_config, Qwen2Config)
        # The mHC config is its own text config (one model, not a composite): serving engines that take a text
        # sub-config for a multimodal model's (vLLM) see a text model; it reads the backbone's settings through.
        assert config.get_text_config() is config.get_text_config(decoder=True) is config
        assert config.get_text_config().vocab_size == config.backbone_config.vocab_size
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


INVALID_VALUES = [
        (dict(hc_mult=0), "hc_mult must be an integer from 1 to 8"),
        (dict(hc_mult=9), "hc_mult must be an integer from 1 to 8"),
        (dict(hc_mult="4"), "hc_mult must be an integer from 1 to 8, got '4'"),
        (dict(hc_mult=4.0), "hc_mult must be an integer from 1 to 8, got 4.0"),
        (dict(hc_sinkhorn_iters=0), "hc_sinkhorn_iters must be an integer from 1 to 100"),
        (dict(hc_sinkhorn_iters=101), r"hc_sinkhorn_iters must be an integer from 1 to 100 \(each iteration"),
        (dict(hc_sinkhorn_iters="20"), "hc_sinkhorn_iters must be an integer from 1 to 100.*, got '20'"),
        (dict(hc_eps=0.0), "hc_eps must be > 0"),
        (dict(hc_eps=-1e-6), "hc_eps must be > 0"),
        (dict(hc_eps="1e-6"), "hc_eps must be a finite number, got '1e-6'"),
        (dict(hc_eps=math.nan), "hc_eps must be a finite number, got nan"),
        (dict(hc_eps=math.inf), "hc_eps must be a finite number, got inf"),
        (dict(hc_mult=4, hc_eps=0.3), "hc_eps must be smaller than 1/hc_mult"),
        (dict(hc_init=3), "hc_init must be one of function_preserving, deepseek_v4; got 3"),
        (dict(hc_init_post_delta=math.nan), "hc_init_post_delta must be a finite number, got nan"),
        (dict(hc_init_post_delta="0.1"), "hc_init_post_delta must be a finite number, got '0.1'"),
        (dict(hc_init_comb_diag=math.inf), "hc_init_comb_diag must be a finite number, got inf"),
        (dict(hc_init_comb_diag=-math.inf), "hc_init_comb_diag must be a finite number, got -inf"),
        (dict(hc_init_dynamic_scale=math.nan), "hc_init_dynamic_scale must be a finite number, got nan"),
        (dict(hc_init_dynamic_scale=True), "hc_init_dynamic_scale must be a finite number, got True"),
        (dict(hc_init_dynamic_scale=0.0), "hc_init_dynamic_scale must be non-zero"),
        (dict(hc_recompute="yes"), "hc_recompute must be True or False, got 'yes'"),
        (dict(hc_recompute=1), "hc_recompute must be True or False, got 1"),
        (dict(hc_residual_map="sinkhorn_knopp"),
         "hc_residual_map must be one of sinkhorn, unconstrained, identity, permutations; got 'sinkhorn_knopp'"),
        (dict(hc_residual_map=None), "hc_residual_map must be one of .*; got None"),
        (dict(hc_residual_map="permutations", hc_mult=5),
         r"hc_residual_map='permutations' supports hc_mult <= 4: .* grows as n! \(24 at n=4, 120 at n=5\); got "
         r"hc_mult=5"),
        (dict(hc_post_magnitude=0.0), "hc_post_magnitude must be > 0, got 0.0"),
        (dict(hc_post_magnitude=math.nan), "hc_post_magnitude must be a finite number, got nan"),
        (dict(hc_post_magnitude=3.0), "hc_post_magnitude applies to hc_residual_map='identity' only"),
        (dict(hc_implementation="cuda"), "hc_implementation must be one of auto, reference, torch, triton; got 'cuda'"),
        (dict(upcycled_from=3), "upcycled_from must be a Hub id or a folder name .or None., got 3"),
        (dict(upcycled_from=" "), "upcycled_from must be a Hub id or a folder name .or None., got ' '"),
]


def _case_id(value):
    return "-".join(f"{k}={v!r}" for k, v in value.items()) if isinstance(value, dict) else None


@pytest.mark.parametrize(("kwargs", "message"), INVALID_VALUES, ids=_case_id)
def test_invalid_values_raise_value_error(kwargs, message):
    """Wrong values and wrong types alike: one ``ValueError`` line (``@strict`` checks no types here: the field
    annotations are strings under ``from __future__ import annotations``, which huggingface_hub skips)."""
    with pytest.raises(ValueError, match=message) as error:
        MHCConfig(backbone_config=tiny_backbone_config("llama"), **kwargs)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(("kwargs", "message"), [case for case in INVALID_VALUES if len(case[0]) == 1], ids=_case_id)
def test_invalid_values_set_later_or_passed_to_from_pretrained_are_refused(kwargs, message, tmp_path):
    """transformers applies ``from_pretrained(path, **kwargs)`` with ``setattr``: checked like the constructor's, and
    a refused value leaves the config as it was."""
    config = MHCConfig(backbone_config=tiny_backbone_config("llama"))
    before = config.to_dict()
    ((name, value),) = kwargs.items()
    with pytest.raises(ValueError, match=message):
        setattr(config, name, value)
    assert config.to_dict() == before
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        AutoConfig.from_pretrained(tmp_path, **kwargs)


def test_valid_values_set_later_are_kept_and_misspelt_ones_refused():
    config = MHCConfig(backbone_config=tiny_backbone_config("llama"))
    config.hc_sinkhorn_iters, config.hc_recompute = 7, True
    assert (config.hc_sinkhorn_iters, config.hc_recompute) == (7, True)
    with pytest.raises(ValueError, match="did you mean 'hc_sinkhorn_iters'"):
        config.hc_sinkhorn_iter = 5


def test_sinkhorn_iterations_up_to_the_cap_are_accepted():
    config = MHCConfig(backbone_config=tiny_backbone_config("llama"), hc_sinkhorn_iters=MAX_SINKHORN_ITERS)
    assert config.hc_sinkhorn_iters == MAX_SINKHORN_ITERS == 100


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(hc_multt=4), r"MHCConfig got an unknown mHC option 'hc_multt' \(did you mean 'hc_mult'\?\)"),
        (dict(hc_sinkhorn_iter=5), r"unknown mHC option 'hc_sinkhorn_iter' \(did you mean 'hc_sinkhorn_iters'\?\)"),
        (dict(hc_recomput=True), r"'hc_recomput' \(did you mean 'hc_recompute'\?\)"),
        (dict(hc_zzz=1), r"unknown mHC option 'hc_zzz'; valid options: hc_mult, hc_sinkhorn_iters, hc_eps, hc_init,"),
    ],
)
def test_misspelt_hc_keywords_are_refused(kwargs, message):
    """A misspelt mHC field is refused with the closest field named, not stored as an extra attribute and ignored."""
    with pytest.raises(ValueError, match=message) as error:
        MHCConfig(backbone_config=tiny_backbone_config("llama"), **kwargs)
    assert "\n" not in str(error.value)


def test_every_value_survives_save_and_reload_and_a_misspelt_saved_key_is_refused(tmp_path):
    """Every mHC field set away from its default, and the backbone's settings, come back from ``config.json``
    through ``AutoConfig``, ``MHCConfig.from_pretrained`` and ``from_dict``; transformers' own bookkeeping keys
    (``transformers_version``, ``architectures``, ``auto_map``, ``dtype``) are accepted, an unknown ``hc_*`` key in a
    saved file is refused by name."""
    values = dict(hc_mult=3, hc_sinkhorn_iters=7, hc_eps=2e-5, hc_init="deepseek_v4", hc_init_post_delta=0.25,
                  hc_init_comb_diag=3, hc_init_dynamic_scale=-0.02, hc_recompute=True, hc_residual_map="identity",
                  hc_post_magnitude=3.0)
    assert set(values) | {"hc_implementation"} == set(hc_options())  # a new field must be added here
    backbone = tiny_backbone_config("qwen3", tie_word_embeddings=True, rms_norm_eps=1e-5)
    config = MHCConfig(backbone_config=backbone, architectures=["MHCForCausalLM"], dtype="bfloat16",
                       hc_implementation="triton", upcycled_from="tiny-org/tiny-qwen3", **values)
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "hc_implementation" not in saved  # the machine's choice, like attn_implementation: loads as "auto"
    for loaded in (AutoConfig.from_pretrained(tmp_path), MHCConfig.from_pretrained(tmp_path),
                   MHCConfig.from_dict(saved)):
        assert isinstance(loaded, MHCConfig)
        assert {name: getattr(loaded, name) for name in values} == values
        assert loaded.hc_implementation == "auto"
        assert type(loaded.hc_init_comb_diag) is int and type(loaded.hc_recompute) is bool
        assert loaded.backbone_config.to_dict() == config.backbone_config.to_dict()
        assert loaded.tie_word_embeddings is True and loaded.architectures == ["MHCForCausalLM"]
        assert loaded.upcycled_from == "tiny-org/tiny-qwen3"
        assert loaded.dtype == torch.bfloat16
        assert {k: v for k, v in loaded.to_dict().items() if k != "_name_or_path"} == {
            k: v for k, v in config.to_dict().items() if k != "_name_or_path"}
    assert {"transformers_version", "auto_map", "architectures", "dtype"} <= set(saved)
    saved["hc_sinkhorn_iter"] = saved.pop("hc_sinkhorn_iters")
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match=r"'hc_sinkhorn_iter' \(did you mean 'hc_sinkhorn_iters'\?\)"):
        AutoConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("backbone", [GPT2Config(), GPT2Config().to_dict(), {"model_type": "no-such-model"}, {}])
def test_unsupported_backbone_lists_the_supported_ones(backbone):
    with pytest.raises(ValueError, match="supported backbone families: llama, mistral, qwen2, qwen3"):
        MHCConfig(backbone_config=backbone)


@pytest.mark.parametrize(("backbone", "got"), [
    ("llama", r"got the string 'llama': pass AutoConfig.for_model\('llama'\) instead\.$"),
    (5, "got int.$"),
], ids=["string", "int"])
def test_a_backbone_config_of_another_type_says_what_to_pass(backbone, got):
    """transformers refuses a string for its other nested configs; as ``backbone_config`` it used to pass through
    unchanged and fail deep inside with ``'str' object has no attribute '_attn_implementation'``."""
    with pytest.raises(TypeError, match="^MHCConfig's backbone_config must be the backbone's config .*" + got) as error:
        MHCConfig(backbone_config=backbone)
    assert "\n" not in str(error.value)


def test_invalid_hc_init_is_rejected():
    with pytest.raises((ValueError, TypeError), match="hc_init"):
        MHCConfig(backbone_config=tiny_backbone_config("llama"), hc_init="zeros")


def test_backbone_settings_given_to_the_mhc_config_reach_the_backbone(tmp_path):
    """``use_cache`` too, which transformers drops from an mHC config's keywords as a generation setting, also from a
    top-level key of a hand-written config.json."""
    config = MHCConfig(backbone_config=tiny_backbone_config("llama"), use_cache=False, pad_token_id=3)
    assert (config.backbone_config.use_cache, config.backbone_config.pad_token_id) == (False, 3)
    assert MHCConfig(backbone_config=tiny_backbone_config("llama").to_dict(), use_cache=False).use_cache is False
    config = MHCConfig(backbone_config=tiny_backbone_config("llama"))
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**saved, "use_cache": False}))
    assert MHCConfig.from_pretrained(tmp_path).backbone_config.use_cache is False


@pytest.mark.parametrize("how", ["constructor", "setattr"])
def test_tying_set_on_the_mhc_config_is_the_backbones_and_survives_a_reload(how, tmp_path):
    from hf_mhc import MHCForCausalLM

    if how == "constructor":
        config = MHCConfig(backbone_config=tiny_backbone_config("llama"), tie_word_embeddings=True)
    else:
        config = MHCConfig(backbone_config=tiny_backbone_config("llama"))
        config.tie_word_embeddings = True
    assert config.tie_word_embeddings is True and config.backbone_config.tie_word_embeddings is True
    model = MHCForCausalLM(config).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    ids = torch.randint(0, 50, (1, 6))
    assert_same_weights(reloaded, model)
    with torch.no_grad():
        assert_logits_close(reloaded(ids).logits, model(ids).logits)


def test_each_choice_is_written_once_as_a_literal():
    """The residual maps, initialisations and implementations are each one ``Literal`` type, the config field's own
    annotation; the tuples the checks and commands read are ``typing.get_args`` of it."""
    hints = {name: eval(annotation, vars(configuration_mhc)) if isinstance(annotation, str) else annotation
             for name, annotation in vars(MHCConfig)["__annotations__"].items()}  # its own fields only
    for field, literal, choices in (("hc_residual_map", mhc_reference.ResidualMap, mhc_reference.RESIDUAL_MAPS),
                                    ("hc_init", configuration_mhc.HCInit, configuration_mhc.HC_INITS),
                                    ("hc_implementation", configuration_mhc.HCImplementation,
                                     configuration_mhc.HC_IMPLEMENTATIONS)):
        assert hints[field] is literal and choices == typing.get_args(literal), field
    assert (MHCConfig.hc_residual_map, MHCConfig.hc_post_magnitude) == (
        mhc_reference.DEFAULT_RESIDUAL_MAP, mhc_reference.POST_MAGNITUDE)


# The defaults that MHCConfig holds, by parameter name, and the constant a signature elsewhere must not repeat.
CONFIG_DEFAULTS = {"residual_map": "sinkhorn", "hc_residual_map": "sinkhorn", "post_magnitude": 2.0, "hc_mult": 4}


def test_no_signature_repeats_a_default_of_the_config():
    """``"sinkhorn"``, ``2.0`` and ``hc_mult=4`` are written in ``MHCConfig`` (and the flat ``mhc_reference``, which
    it takes them from) only: every other function of the package takes them from there."""
    root = Path(__file__).resolve().parents[1]
    repeated = []
    for path in sorted([*root.glob("hf_mhc/**/*.py"), *root.glob("kernels/*.py"), *root.glob("conversion/*.py"),
                        *root.glob("examples/*.py")]):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                arguments = [*node.args.posonlyargs, *node.args.args]
                pairs = [*zip(arguments[len(arguments) - len(node.args.defaults):], node.args.defaults, strict=True),
                         *zip(node.args.kwonlyargs, node.args.kw_defaults, strict=True)]
                repeated += [f"{path.relative_to(root)}:{node.lineno} {node.name}({argument.arg}=...)"
                             for argument, default in pairs if isinstance(default, ast.Constant)
                             and argument.arg in CONFIG_DEFAULTS and default.value == CONFIG_DEFAULTS[argument.arg]]
            elif isinstance(node, ast.keyword) and node.arg == "hc_mult" and isinstance(node.value, ast.Constant) \
                    and node.value.value == CONFIG_DEFAULTS["hc_mult"]:
                repeated.append(f"{path.relative_to(root)}:{node.value.lineno} hc_mult=4 in a call")
    assert not repeated, repeated
