"""Upcycle an in-memory residual causal LM into an mHC model that computes the same function."""

from __future__ import annotations

import copy
import os
import warnings

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from hf_mhc.configuration_mhc import MHCConfig, check_backbone_type, check_hc_options
from hf_mhc.model_card import source_name
from hf_mhc.modeling_mhc import HC_MODULE_NAMES, MHCForCausalLM, function_preserving_hc_tensors


def is_hc_parameter(name: str) -> bool:
    """Whether a state-dict key belongs to the mHC maps (kept in float32), not to the backbone."""
    return any(part in HC_MODULE_NAMES for part in name.split(".")[:-1])


def mhc_config_for(backbone_config, hc_mult: int = MHCConfig.hc_mult, **hc_options) -> MHCConfig:
    """An :class:`MHCConfig` wrapping a copy of ``backbone_config`` (function-preserving initialisation), with the
    source it names recorded as ``upcycled_from`` (:func:`~hf_mhc.model_card.source_name` of its ``name_or_path``).
    ``hc_options`` must be mHC fields (``ValueError`` naming the closest one otherwise)."""
    check_hc_options(hc_options, "mhc_config_for")
    check_backbone_type(getattr(backbone_config, "model_type", None))
    if hc_options.get("hc_init", "function_preserving") != "function_preserving":
        raise ValueError("Upcycling needs hc_init='function_preserving', the initialisation that keeps the function.")
    backbone = copy.deepcopy(backbone_config)
    return MHCConfig(backbone_config=backbone, hc_mult=hc_mult, upcycled_from=source_name(backbone.name_or_path),
                     **hc_options)


# upcycle's residual_map, an alias of the MHCConfig field hc_residual_map: accepted, with a FutureWarning, until this
# release.
RESIDUAL_MAP_ALIAS_REMOVED_IN = "0.2.0"


def upcycle(model: PreTrainedModel | str | os.PathLike, hc_mult: int = MHCConfig.hc_mult,
            **hc_options) -> MHCForCausalLM:
    """Build an n-stream mHC model from a causal LM of a supported family (``SUPPORTED_BACKBONES``), copying its
    weights.

    Args:
        model: a loaded ``*ForCausalLM`` or a path / Hub id that ``AutoModelForCausalLM`` loads.
        hc_mult: number of residual streams (default: :class:`MHCConfig`'s).
        **hc_options: other :class:`MHCConfig` fields: ``hc_residual_map`` (``"sinkhorn"``, mHC, the default;
            ``"unconstrained"``, Hyper-Connections; ``"identity"``, streams carried unmixed, HY-V4; or
            ``"permutations"``, mHC-lite, ``hc_mult <= 4``; each has its own function-preserving initialisation),
            ``hc_sinkhorn_iters``, ``hc_eps``, ``hc_init_*``, ``hc_recompute``. Any other name raises ``ValueError``
            with the closest field, before ``model`` is loaded. ``residual_map``, the former name of
            ``hc_residual_map``, is still accepted with a ``FutureWarning`` until hf-mhc 0.2.0.

    Returns:
        An :class:`MHCForCausalLM` on the source's device, backbone weights in the source's dtype, HC weights in
        float32, whose logits equal the source's up to ``hc_eps``. A source partitioned by DeepSpeed ZeRO-3 (loaded
        by ``from_pretrained`` under ``zero.Init``, i.e. after a ``TrainingArguments`` with a stage-3 config) is
        gathered one parameter at a time, and the mHC model is partitioned the same way (``deepspeed.zero.Init``
        with the active config, which sets the dtype of every parameter, HC ones included); the source stays
        partitioned.
    """
    if "residual_map" in hc_options:
        residual_map = hc_options.pop("residual_map")
        warnings.warn(f"upcycle's residual_map is deprecated and will be removed in hf-mhc "
                      f"{RESIDUAL_MAP_ALIAS_REMOVED_IN}: pass hc_residual_map={residual_map!r} (the MHCConfig field).",
                      FutureWarning, stacklevel=2)
        if hc_options.setdefault("hc_residual_map", residual_map) != residual_map:
            raise ValueError(f"upcycle got residual_map={residual_map!r} and hc_residual_map="
                             f"{hc_options['hc_residual_map']!r}; give hc_residual_map alone.")
    check_hc_options(hc_options, "upcycle")
    if isinstance(model, (str, os.PathLike)):
        model = AutoModelForCausalLM.from_pretrained(model)
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"upcycle expects a transformers PreTrainedModel or a path, got {type(model).__name__}.")
    config = mhc_config_for(model.config, hc_mult=hc_mult, **hc_options)
    config._attn_implementation = model.config._attn_implementation
    config._experts_implementation = getattr(model.config, "_experts_implementation", None)
    partitioned = _zero3_partitioned(model)
    source_state = _gathered_state_dict(model) if partitioned else model.state_dict()
    with torch.device("meta"):  # no memory and no random initialisation: every tensor is assigned below
        mhc_model = MHCForCausalLM(config)
    expected = {name for name in mhc_model.state_dict() if not is_hc_parameter(name)}
    missing = sorted(expected - set(source_state))
    unexpected = sorted(set(source_state) - expected)
    if missing or unexpected:
        raise ValueError(
            f"{type(model).__name__} does not match an mHC {config.backbone_config.model_type} layout: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}."
        )
    first = next(model.parameters())
    dtype, device = first.dtype, first.device
    parameter_names = {name for name, _ in mhc_model.named_parameters(remove_duplicate=False)}
    state = {  # copies: the source model stays independent of the new one
        name: source_state[name].detach().to(device=device, dtype=dtype if name in parameter_names else None,
                                            copy=True)
        for name in expected
    }
    hc_tensors = function_preserving_hc_tensors(config)
    state.update({name: tensor.to(device).contiguous() for name, tensor in hc_tensors.items()})
    mhc_model.load_state_dict(state, strict=True, assign=True)
    mhc_model.tie_weights()
    rotary = mhc_model.model.rotary_emb  # its inverse frequencies are non-persistent buffers: computed, not loaded
    mhc_model.model.rotary_emb = type(rotary)(config=config.backbone_config).to(device)
    tensors = (*mhc_model.named_parameters(), *mhc_model.named_buffers())
    still_meta = [name for name, tensor in tensors if tensor.is_meta]
    if still_meta:
        raise RuntimeError(f"upcycle left tensors without data: {still_meta[:5]}; please report this as a bug.")
    mhc_model.generation_config = copy.deepcopy(model.generation_config)
    mhc_model.train(model.training)
    if partitioned:
        _zero3_partition(mhc_model, dtype)
    return mhc_model


def _zero3_partitioned(model: torch.nn.Module) -> bool:
    """Whether DeepSpeed ZeRO-3 holds ``model``'s parameters as partitions (``ds_id`` on each; their ``data`` is
    empty outside ``deepspeed.zero.GatheredParameters``)."""
    return any(hasattr(parameter, "ds_id") for parameter in model.parameters())


def _gathered_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict of a ZeRO-3 model, copied: each parameter gathered in turn (read-only, so DeepSpeed
    re-partitions it unchanged). Every rank then holds the whole source once, as upcycling an unpartitioned model
    does; only one parameter is gathered at a time."""
    import deepspeed

    gathered = {}
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for name, parameter in module.named_parameters(recurse=False):
            with deepspeed.zero.GatheredParameters([parameter], modifier_rank=None):
                gathered[prefix + name] = parameter.detach().clone()
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                gathered[prefix + name] = buffer
    return gathered


def _zero3_partition(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Partition ``model`` in place as ``from_pretrained`` under ZeRO-3 would have: every parameter in ``dtype``
    (the dtype ``zero.Init`` gave the source's parameters: bfloat16 with DeepSpeed's ``bf16`` enabled, which casts
    the HC parameters too, as its engine does; float32 otherwise), then ``deepspeed.zero.Init`` on the allocated
    module, with transformers' active DeepSpeed config when there is one."""
    import deepspeed
    from transformers.integrations.deepspeed import deepspeed_config, is_deepspeed_zero3_enabled

    for parameter in model.parameters():
        if parameter.is_floating_point() and parameter.dtype != dtype:
            parameter.data = parameter.data.to(dtype)
    config = deepspeed_config() if is_deepspeed_zero3_enabled() else None
    deepspeed.zero.Init(module=model, config_dict_or_path=config)
