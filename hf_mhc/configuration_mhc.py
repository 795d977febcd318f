"""MHCConfig: a residual backbone's own config, nested, plus the mHC hyper-parameters."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from collections.abc import Iterable
from typing import Literal, get_args

from huggingface_hub.dataclasses import strict
from transformers import AutoConfig, PreTrainedConfig
from transformers.configuration_utils import SubConfigSpec
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from .mhc_reference import DEFAULT_RESIDUAL_MAP, POST_MAGNITUDE, RESIDUAL_MAPS, ResidualMap, check_permutation_streams


@dataclasses.dataclass(frozen=True)
class BackboneWiring:
    """How one backbone family wires its two sublayers (attention, then MLP or MoE block) into the residual stream.

    Names are the family's own: modules of its decoder layer and attributes of its config. With ``x`` the
    sublayer's (collapsed) input, the sublayer adds ``m · after(F(before(x)))`` to the residual, where ``before``
    and ``after`` apply the named layer modules in order and ``m`` is the config's ``residual_multiplier`` (1 when
    ``None``). Every other detail of a layer (attention kinds, rotary variants, NoPE layers, MoE or dense blocks,
    q/k norms, biases) comes from the backbone's own decoder-layer constructor.

    Attributes:
        attention_before, attention_after, mlp_before, mlp_after: decoder-layer modules around each sublayer
            (Llama: ``input_layernorm`` before attention, ``post_attention_layernorm`` before the MLP; Gemma 2/3
            add sandwich norms after each sublayer; OLMo 2 has post-norms only).
        residual_multiplier: config attribute scaling each sublayer output (Granite).
        embedding_multiplier: config attribute multiplying the embeddings, also ``inputs_embeds`` (Granite).
        embedding_scale_sqrt_hidden: token embeddings times ``sqrt(hidden_size)``, rounded to the weight dtype
            (Gemma; ``inputs_embeds`` given by the caller are used as they are, as in Gemma).
        logits_scaling: config attribute dividing the logits (Granite).
        final_logit_softcapping: config attribute ``c``: logits ``c · tanh(logits / c)`` when it is set (Gemma).
        final_norm_like: the decoder-layer norm whose class the final norm has.
        refused_settings: config attributes that must be off: settings of the family that a causal mHC model does
            not implement (Gemma 3's ``use_bidirectional_attention``).
    """

    attention_before: tuple[str, ...] = ("input_layernorm",)
    attention_after: tuple[str, ...] = ()
    mlp_before: tuple[str, ...] = ("post_attention_layernorm",)
    mlp_after: tuple[str, ...] = ()
    residual_multiplier: str | None = None
    embedding_multiplier: str | None = None
    embedding_scale_sqrt_hidden: bool = False
    logits_scaling: str | None = None
    final_logit_softcapping: str | None = None
    final_norm_like: str = "post_attention_layernorm"
    refused_settings: tuple[str, ...] = ()

    @property
    def pre_norm(self) -> bool:
        """Whether each sublayer starts with a norm, which makes its input scale-free: for such wiring the
        function-preserving initialisation reproduces the backbone to float32 rounding, not only to ``hc_eps``."""
        return bool(self.attention_before) and bool(self.mlp_before)


PRE_NORM = BackboneWiring()

# One entry per supported family (transformers' model_type); the decoder-layer classes come from transformers itself.
BACKBONE_WIRINGS: dict[str, BackboneWiring] = {
    "llama": PRE_NORM,
    "mistral": PRE_NORM,
    "qwen2": PRE_NORM,
    "qwen3": PRE_NORM,
    "smollm3": PRE_NORM,
    "phi3": BackboneWiring(attention_after=("resid_attn_dropout",), mlp_after=("resid_mlp_dropout",)),
    "granite": BackboneWiring(residual_multiplier="residual_multiplier", embedding_multiplier="embedding_multiplier",
                              logits_scaling="logits_scaling"),
    "gemma3_text": BackboneWiring(
        attention_after=("post_attention_layernorm",),
        mlp_before=("pre_feedforward_layernorm",),
        mlp_after=("post_feedforward_layernorm",),
        embedding_scale_sqrt_hidden=True,
        final_logit_softcapping="final_logit_softcapping",
        refused_settings=("use_bidirectional_attention",),
    ),
    "olmo2": BackboneWiring(attention_before=(), attention_after=("post_attention_layernorm",), mlp_before=(),
                            mlp_after=("post_feedforward_layernorm",)),
    # MoE: the MoE block sits where the MLP does (`mlp`); routing, shared experts, dense layers among MoE ones
    # (DeepSeek-V3's first_k_dense_replace, Qwen MoE's mlp_only_layers) and latent attention (DeepSeek-V3's MLA)
    # are the backbone's own modules.
    "mixtral": PRE_NORM,
    "qwen2_moe": PRE_NORM,
    "qwen3_moe": PRE_NORM,
    "olmoe": PRE_NORM,
    "deepseek_v3": PRE_NORM,
}
SUPPORTED_BACKBONES: tuple[str, ...] = tuple(BACKBONE_WIRINGS)
# The float32 mHC modules of a model, by attribute name (their tensor names: model.layers.{i}.attn_hc.fn, ...).
HC_MODULE_NAMES: tuple[str, ...] = ("attn_hc", "ffn_hc", "hc_head")
HCInit = Literal["function_preserving", "deepseek_v4"]
HC_INITS: tuple[str, ...] = get_args(HCInit)
HCImplementation = Literal["auto", "reference", "torch", "triton"]
HC_IMPLEMENTATIONS: tuple[str, ...] = get_args(HCImplementation)
MAX_HC_MULT = 8
MAX_SINKHORN_ITERS = 100  # each iteration is replayed in backward; beyond 100 Sinkhorn gains little


@strict
class MHCConfig(PreTrainedConfig):
    r"""Configuration of an mHC model: a residual backbone's own config, nested, plus the mHC hyper-parameters.

    Args:
        backbone_config (`PreTrainedConfig` or `dict`): the backbone family's own config (`LlamaConfig`, ... of a
            family in `SUPPORTED_BACKBONES`, or its dict with a `model_type`); `None` is a default Llama.
        hc_mult (`int`, defaults to 4): number of residual streams `n`, 1 to 8.
        hc_sinkhorn_iters (`int`, defaults to 20): Sinkhorn-Knopp iterations for `comb` (`"sinkhorn"` map), 1 to 100.
        hc_eps (`float`, defaults to 1e-6): the epsilon added to `pre`, `comb` and each Sinkhorn denominator; below
            `1 / hc_mult`.
        hc_init (`str`, defaults to `"function_preserving"`): `"function_preserving"` makes a new model compute its
            residual backbone exactly; `"deepseek_v4"` is DeepSeek-V4's random initialisation.
        hc_init_post_delta (`float`, defaults to 0.1): the function-preserving `post` values come in pairs
            `2σ(±k·δ)`, with mean 1 and no two streams alike.
        hc_init_comb_diag (`float`, defaults to 2.0): `c` in the function-preserving `comb_b = c·I`.
        hc_init_dynamic_scale (`float`, defaults to 0.01): initial `scale` of the token-dependent part; non-zero, so
            that `fn = 0` gets a gradient.
        hc_residual_map (`str`, defaults to `"sinkhorn"`): how `comb` mixes the streams: `"sinkhorn"` (mHC),
            `"unconstrained"` (Hyper-Connections), `"identity"` (no mixing, HY-V4) or `"permutations"` (mHC-lite,
            `hc_mult` at most 4).
        hc_post_magnitude (`float`, defaults to 2.0): `m` in the identity map's `post = m·σ(...) + hc_eps`; 2.0 for
            the other maps.
        hc_implementation (`str`, defaults to `"auto"`): the code that runs the maps, like `attn_implementation`:
            `"triton"`, `"torch"`, `"auto"` (Triton on CUDA tensors, torch otherwise) or `"reference"`; not saved.
        hc_recompute (`bool`, defaults to `False`): selective recomputation; backward recomputes the mHC
            coefficients, collapsed inputs and the streams between the sublayers instead of keeping them.
        tie_word_embeddings (`bool`, *optional*): the backbone's own flag, mirrored here; a value given is written to
            the backbone config.
        upcycled_from (`str`, *optional*): the residual model this one was upcycled from, as `hf_mhc.upcycle` and
            `hf-mhc convert` record it: a Hub id, or a local folder's name; the model card's `base_model`.

    Raises:
        ValueError: a backbone family without a wiring entry, or an mHC value out of range (one line naming it).
        TypeError: a `backbone_config` that is not a config, a dict or `None`.

    Example:

    ```python
    >>> from transformers import LlamaConfig
    >>> from hf_mhc import MHCConfig, MHCForCausalLM
    >>> config = MHCConfig(backbone_config=LlamaConfig(hidden_size=64, num_hidden_layers=2), hc_mult=4)
    >>> model = MHCForCausalLM(config)
    ```
    """

    model_type = "mhc"
    sub_configs_defaults = {"backbone_config": SubConfigSpec(config_class=AutoConfig, model_type="llama")}

    backbone_config: dict | PreTrainedConfig | None = None
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    hc_init: HCInit = "function_preserving"
    hc_init_post_delta: float = 0.1
    hc_init_comb_diag: float = 2.0
    hc_init_dynamic_scale: float = 0.01
    hc_residual_map: ResidualMap = DEFAULT_RESIDUAL_MAP
    hc_post_magnitude: float = POST_MAGNITUDE
    hc_implementation: HCImplementation = "auto"
    hc_recompute: bool = False
    tie_word_embeddings: bool | None = None  # None: the backbone's; a value given here is written to the backbone
    upcycled_from: str | None = None  # provenance, not an mHC option: set by upcycling, read by the model card

    def __post_init__(self, **kwargs):
        # Fields arrive as attributes, everything else (transformers_version, auto_map, ...) in kwargs: an hc_* key
        # there is a misspelt field, which would otherwise be stored and ignored.
        check_hc_options(kwargs, "MHCConfig", only_hc_prefixed=True)
        _check_backbone_config_type(self.backbone_config)
        if isinstance(self.backbone_config, dict):
            check_backbone_type(self.backbone_config.get("model_type"))
        # Backbone settings given here (use_cache=False, pad_token_id=3, ...) go to the backbone config, all alike:
        # transformers would drop some of them (the generation ones) from an mHC config's keywords.
        backbone_settings = {name: kwargs.pop(name) for name in list(kwargs) if name in self._backbone_fields()}
        super().__post_init__(**kwargs)
        check_backbone_type(self.backbone_config.model_type, self.backbone_config)
        for name, value in backbone_settings.items():
            setattr(self.backbone_config, name, value)
        self._check_hc_values()
        # One source of truth for tying: the backbone's own flag, mirrored where transformers looks for it.
        if self.tie_word_embeddings is None:
            self.tie_word_embeddings = bool(getattr(self.backbone_config, "tie_word_embeddings", False))
        else:
            self.backbone_config.tie_word_embeddings = bool(self.tie_word_embeddings)
            self.tie_word_embeddings = bool(self.tie_word_embeddings)

    def to_dict(self) -> dict:
        """The config as saved in ``config.json``, without ``hc_implementation`` (a runtime choice, as
        ``attn_implementation`` is), and without ``upcycled_from`` when it is unset: a model that was not upcycled
        saves the ``config.json`` it saved before the field existed."""
        output = super().to_dict()
        output.pop("hc_implementation", None)
        if output.get("upcycled_from") is None:
            output.pop("upcycled_from", None)
        return output

    def _backbone_fields(self) -> set[str]:
        """The settings of the backbone's config class that the mHC config does not have itself."""
        backbone = self.backbone_config
        if isinstance(backbone, PreTrainedConfig):
            backbone_class = type(backbone)
        elif isinstance(backbone, dict):  # its model_type is checked already
            backbone_class = CONFIG_MAPPING[backbone["model_type"]]
        else:  # None: the default backbone
            backbone_class = CONFIG_MAPPING[self.sub_configs_defaults["backbone_config"].model_type]
        return set(backbone_class.__dataclass_fields__) - set(type(self).__dataclass_fields__)

    def _check_hc_values(self) -> None:
        """One-line ``ValueError`` for the first mHC value out of range or of the wrong type."""
        _check_integer("hc_mult", self.hc_mult, MAX_HC_MULT)
        _check_integer("hc_sinkhorn_iters", self.hc_sinkhorn_iters, MAX_SINKHORN_ITERS,
                       why=" (each iteration is two normalisations per token per site, replayed in backward, and "
                           "beyond 100 Sinkhorn gains little; DeepSeek-V4 uses 20)")
        _check_finite("hc_eps", self.hc_eps)
        if not self.hc_eps > 0:
            raise ValueError(f"hc_eps must be > 0, got {self.hc_eps!r}.")
        if self.hc_eps >= 1.0 / self.hc_mult:
            raise ValueError(f"hc_eps must be smaller than 1/hc_mult = {1.0 / self.hc_mult}, got {self.hc_eps!r}.")
        if not isinstance(self.hc_init, str) or self.hc_init not in HC_INITS:
            raise ValueError(f"hc_init must be one of {', '.join(HC_INITS)}; got {self.hc_init!r}.")
        for name in ("hc_init_post_delta", "hc_init_comb_diag", "hc_init_dynamic_scale"):
            _check_finite(name, getattr(self, name))
        if self.hc_init_dynamic_scale == 0:
            raise ValueError("hc_init_dynamic_scale must be non-zero, or fn (initialised to 0) never gets a gradient.")
        if not isinstance(self.hc_residual_map, str) or self.hc_residual_map not in RESIDUAL_MAPS:
            raise ValueError(f"hc_residual_map must be one of {', '.join(RESIDUAL_MAPS)}; "
                             f"got {self.hc_residual_map!r}.")
        if self.hc_residual_map == "permutations":
            check_permutation_streams(self.hc_mult, "hc_mult", "hc_residual_map")
        _check_finite("hc_post_magnitude", self.hc_post_magnitude)
        if not self.hc_post_magnitude > 0:
            raise ValueError(f"hc_post_magnitude must be > 0, got {self.hc_post_magnitude!r}.")
        if self.hc_post_magnitude != POST_MAGNITUDE and self.hc_residual_map != "identity":
            raise ValueError(f"hc_post_magnitude applies to hc_residual_map='identity' only (the other maps' post is "
                             f"fixed: 2σ for sinkhorn and permutations, no σ for unconstrained); got "
                             f"{self.hc_post_magnitude!r} with hc_residual_map={self.hc_residual_map!r}.")
        if not isinstance(self.hc_implementation, str) or self.hc_implementation not in HC_IMPLEMENTATIONS:
            raise ValueError(f"hc_implementation must be one of {', '.join(HC_IMPLEMENTATIONS)}; got "
                             f"{self.hc_implementation!r}.")
        if not isinstance(self.hc_recompute, bool):
            raise ValueError(f"hc_recompute must be True or False, got {self.hc_recompute!r}.")

    # The backbone's own settings (vocab_size, hidden_size, num_attention_heads, use_cache, ...) read and write through
    # the mHC config too, as on any transformers config: `config.vocab_size` is `config.backbone_config.vocab_size`.
    def __getattr__(self, name: str):
        backbone = self.__dict__.get("backbone_config")
        if not name.startswith("_") and isinstance(backbone, PreTrainedConfig) and hasattr(backbone, name):
            return getattr(backbone, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __setattr__(self, name: str, value) -> None:
        backbone = self.__dict__.get("backbone_config")
        if (
            isinstance(backbone, PreTrainedConfig)
            and name not in type(self).__dataclass_fields__
            and name not in self.__dict__
            and name in type(backbone).__dataclass_fields__
        ):
            setattr(backbone, name, value)
        elif name == "upcycled_from":
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"upcycled_from must be a Hub id or a folder name (or None), got {value!r}.")
            super().__setattr__(name, value)
        elif name == "tie_word_embeddings" and value is not None and isinstance(backbone, PreTrainedConfig):
            backbone.tie_word_embeddings = value  # both places, or a saved checkpoint reloads untied
            super().__setattr__(name, value)
        elif name.startswith("hc_") and isinstance(backbone, PreTrainedConfig):
            # A value set after construction (also `from_pretrained(path, hc_...=...)`) is checked like one passed to
            # the constructor; a refused one leaves the config as it was.
            check_hc_options([name], type(self).__name__)
            previous = self.__dict__.get(name, getattr(type(self), name))
            super().__setattr__(name, value)
            try:
                self._check_hc_values()
            except ValueError:
                super().__setattr__(name, previous)
                raise
        else:
            super().__setattr__(name, value)

    @property
    def base_model_tp_plan(self) -> dict[str, str] | None:
        """The backbone's tensor-parallel plan. mHC keeps every backbone module name, and its float32 HC modules,
        which the plan does not name, stay replicated: each rank computes the maps on the full streams."""
        return getattr(self.backbone_config, "base_model_tp_plan", None)

    @property
    def base_model_ep_plan(self) -> dict[str, str] | None:
        """The backbone's expert-parallel plan (MoE families): the experts are the backbone's own modules, under their
        own names."""
        return getattr(self.backbone_config, "base_model_ep_plan", None)

    @property
    def base_model_fsdp_plan(self) -> dict[str, str] | None:
        """The backbone's FSDP2 plan, plus one unit per HC module (``layers.*.attn_hc``, ``layers.*.ffn_hc``,
        ``hc_head``). ``hf_mhc.distributed`` shards those itself, before transformers shards the rest, with a float32
        policy (``distribute_with_transformers``): they stay float32 under ``fsdp_mixed_precision=True``."""
        plan = getattr(self.backbone_config, "base_model_fsdp_plan", None)
        if plan is None:
            return None
        return {**plan, **dict.fromkeys(("layers.*.attn_hc", "layers.*.ffn_hc", "hc_head"), "free_full_weight")}

    @property
    def base_model_pp_plan(self) -> dict[str, tuple[list[str], list[str]]] | None:
        """The backbone's pipeline plan, with the head read-out between the layers and the final norm. The hidden
        state that crosses a stage boundary is the streams ``[B, T, n, C]``; ``hc_head`` runs on the last stage."""
        plan = getattr(self.backbone_config, "base_model_pp_plan", None)
        if plan is None:
            return None
        head = {"hc_head": (["hidden_states"], ["hidden_states"])}
        before_norm = {name: stage for name, stage in plan.items() if name != "norm"}
        return {**before_norm, **head, **{name: stage for name, stage in plan.items() if name == "norm"}}


def check_backbone_type(model_type: str | None, backbone_config: PreTrainedConfig | None = None,
                        misfit: str | None = None) -> None:
    """The one message for a backbone mHC does not support (config, modeling, upcycling, conversion): a family
    without a wiring entry, a setting of ``backbone_config`` its entry refuses, or ``misfit``, a line naming what of
    the family's modules does not fit the wiring."""
    if model_type not in BACKBONE_WIRINGS:
        misfit = misfit or "no wiring entry for this family"
    elif backbone_config is not None and misfit is None:
        wiring = BACKBONE_WIRINGS[model_type]
        refused = [name for name in wiring.refused_settings if getattr(backbone_config, name, None)]
        if refused:
            misfit = f"{refused[0]}={getattr(backbone_config, refused[0])!r} does not fit a causal mHC model"
    if misfit is not None:
        raise ValueError(
            f"Unsupported mHC backbone {model_type!r} ({misfit}); supported backbone families: "
            f"{', '.join(SUPPORTED_BACKBONES)}."
        )


def _check_backbone_config_type(backbone_config) -> None:
    """One-line ``TypeError`` for a ``backbone_config`` that is not a config, a dict or ``None``, as transformers
    raises for its other nested configs (a model_type string names no settings: the config says what to build)."""
    if backbone_config is None or isinstance(backbone_config, (dict, PreTrainedConfig)):
        return
    if isinstance(backbone_config, str):
        got = f"the string {backbone_config!r}: pass AutoConfig.for_model({backbone_config!r}) instead"
    else:
        got = type(backbone_config).__name__
    raise TypeError(
        "MHCConfig's backbone_config must be the backbone's config (e.g. LlamaConfig(...)), its dict with a "
        f"model_type, or None for the default Llama; got {got}."
    )


def backbone_wiring(model_type: str | None) -> BackboneWiring:
    """The wiring entry of a supported family (``ValueError`` from :func:`check_backbone_type` otherwise)."""
    check_backbone_type(model_type)
    return BACKBONE_WIRINGS[model_type]


def _check_integer(name: str, value, largest: int, why: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= largest:
        raise ValueError(f"{name} must be an integer from 1 to {largest}{why}, got {value!r}.")


def _check_finite(name: str, value) -> None:
    """A finite int or float (not a bool, a string or NaN / Inf)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}.")


def hc_options() -> tuple[str, ...]:
    """The mHC fields of :class:`MHCConfig`: ``hc_mult``, ``hc_sinkhorn_iters``, ``hc_eps``, ``hc_init``, ..."""
    return tuple(field.name for field in dataclasses.fields(MHCConfig) if field.name.startswith("hc_"))


def check_hc_options(names: Iterable[str], owner: str, *, only_hc_prefixed: bool = False) -> None:
    """One-line ``ValueError`` for the first name that is not an mHC field, with the closest field (``difflib``):
    ``hc_multt`` -> ``hc_mult``. With ``only_hc_prefixed``, names that do not start with ``hc_`` pass (other config
    keys)."""
    valid = hc_options()
    for name in names:
        if name in valid or (only_hc_prefixed and not name.startswith("hc_")):
            continue
        close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"{owner} got an unknown mHC option {name!r}{hint}; valid options: {', '.join(valid)}.")


def check_attention_heads(config: PreTrainedConfig) -> None:
    """One-line ``ValueError`` when ``config``'s query heads do not split evenly over its key/value heads, which
    transformers' config validation lets pass and its attention (``repeat_kv``) then fails on."""
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv_heads, int) and kv_heads > 0 and heads % kv_heads:
        raise ValueError(f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads}): "
                         "each key/value head serves the same number of query heads.")


def load_pretrained_config(name_or_path: str | os.PathLike) -> PreTrainedConfig:
    """``AutoConfig.from_pretrained(name_or_path)`` (a folder or Hub id; ``config.json`` only), checked by
    :func:`check_attention_heads`. A config that transformers' own validation rejects (it raises anything from
    ``KeyError`` to huggingface_hub's ``StrictDataclassClassValidationError``) raises ``ValueError`` naming the file,
    its ``model_type`` and the reason in one line; a missing file or Hub id raises ``OSError``."""
    source = os.fspath(name_or_path)
    raw, _ = PreTrainedConfig.get_config_dict(source)
    where = os.path.join(source, "config.json") if os.path.isdir(source) else source
    try:
        config = AutoConfig.from_pretrained(source)
        check_attention_heads(getattr(config, "backbone_config", None) or config)
    except OSError:
        raise
    except Exception as error:
        while error.__cause__ is not None:  # a validator's own error, wrapped by huggingface_hub
            error = error.__cause__
        reason = " ".join(str(error).split()) or type(error).__name__
        raise ValueError(f"{where} cannot be loaded as a {raw.get('model_type')} config ({reason}).") from None
    return config


MHCConfig.register_for_auto_class()

__all__ = ["BACKBONE_WIRINGS", "HC_MODULE_NAMES", "SUPPORTED_BACKBONES", "BackboneWiring", "MHCConfig",
           "backbone_wiring", "check_attention_heads", "check_backbone_type", "load_pretrained_config"]
