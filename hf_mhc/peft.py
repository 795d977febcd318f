"""PEFT for mHC models: LoRA on the backbone projections, the small HC maps trained in full.

The mHC models keep every backbone tensor under the backbone's own name, so LoRA targets the usual projections.
The HC modules (``attn_hc``, ``ffn_hc``, ``hc_head``) have no ``nn.Linear`` for LoRA to adapt; they are small
(``fn`` is ``(n+2)·n × n·C`` per site: about ``16 / C`` of a Llama layer's weights for n = 4, 0.4 % at C = 4096)
and decide how the streams mix, so they are trained in full through PEFT's ``modules_to_save``: the adapter
checkpoint carries them, ``PeftModel.from_pretrained`` restores them and ``merge_and_unload()`` puts them back
into a plain :class:`~hf_mhc.MHCForCausalLM`.

An adapter names its base model in ``adapter_config.json`` (``base_model_name_or_path``, taken from the model's
``name_or_path`` when the adapter is created or saved). A model upcycled in memory (``hf_mhc.upcycle(llama)``) exists
nowhere on disk, so an adapter trained on it names no base (``null``) and cannot be reloaded:
:func:`save_adapter_base` saves such a model and points its ``name_or_path`` at the saved folder first;
:func:`adapter_base` reads an adapter's base and says what is wrong when there is none.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, TaskType
from torch import nn

from .common import folder_error
from .modeling_mhc import HC_MODULE_NAMES, backbone_classes

ADAPTER_CONFIG_NAME = "adapter_config.json"

BACKBONE_PROJECTIONS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_target_modules(model_type: str) -> tuple[str, ...]:
    """The projections LoRA adapts in a backbone family, by module name in order of appearance: every ``nn.Linear``
    of the attention and MLP / MoE blocks of the family's own decoder layers (Llama: ``q_proj`` ... ``down_proj``;
    Phi-3: ``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``; DeepSeek-V3's latent attention:
    ``q_a_proj``, ``kv_b_proj``, ...), except one-output gates. Read off the first and last decoder layer of the
    family's default config, built on the meta device (no memory)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    layer_class = backbone_classes(model_type).decoder_layer
    names: dict[str, None] = {}
    with torch.device("meta"):
        for index in sorted({0, config.num_hidden_layers - 1}):
            layer = layer_class(config, index)
            for block in (layer.self_attn, layer.mlp):
                for name, module in block.named_modules():
                    if isinstance(module, nn.Linear) and module.out_features > 1:
                        names[name.rsplit(".", 1)[-1]] = None
    return tuple(names)


def mhc_lora_config(
    r: int = 8,
    lora_alpha: int = 16,
    target_modules: Iterable[str] | str | None = None,
    model_type: str | None = None,
    **kwargs: Any,
) -> LoraConfig:
    """A ``peft.LoraConfig`` for an mHC model: LoRA on the backbone projections, the HC maps fully trainable.

    Args:
        r: LoRA rank.
        lora_alpha: LoRA scaling numerator (the update is scaled by ``lora_alpha / r``).
        target_modules: module names (or a regex string) that get LoRA; default the attention and MLP projections
            of ``model_type`` (:func:`lora_target_modules`), or without it Llama's ``q_proj, k_proj, v_proj,
            o_proj, gate_proj, up_proj, down_proj``. HC modules are not allowed here.
        model_type: the backbone family (``model.config.backbone_config.model_type``), for the default targets.
        **kwargs: any other ``LoraConfig`` field (``lora_dropout``, ``bias``, ``task_type``, ...). A
            ``modules_to_save`` list is extended with the HC modules; ``task_type`` defaults to ``CAUSAL_LM``.

    Returns:
        ``LoraConfig`` with ``modules_to_save`` containing ``attn_hc``, ``ffn_hc`` and ``hc_head``.

    Example::

        from peft import get_peft_model
        model = get_peft_model(hf_mhc.upcycle("path/to/llama"), mhc_lora_config(r=16))
        phi3 = hf_mhc.upcycle("path/to/phi3")  # fused qkv_proj and gate_up_proj
        model = get_peft_model(phi3, mhc_lora_config(r=16, model_type=phi3.config.backbone_config.model_type))
    """
    if target_modules is None:
        target_modules = list(BACKBONE_PROJECTIONS if model_type is None else lora_target_modules(model_type))
    elif not isinstance(target_modules, str):
        target_modules = list(target_modules)
        if not target_modules:
            raise ValueError("target_modules is empty: name the backbone projections that get LoRA.")
        hc_targets = sorted(set(target_modules) & set(HC_MODULE_NAMES))
        if hc_targets:
            raise ValueError(
                f"target_modules {hc_targets} are HC modules, which have no Linear layer for LoRA; "
                "they are trained in full through modules_to_save."
            )
    modules_to_save = list(kwargs.pop("modules_to_save", None) or [])
    modules_to_save += [name for name in HC_MODULE_NAMES if name not in modules_to_save]
    kwargs.setdefault("task_type", TaskType.CAUSAL_LM)
    return LoraConfig(
        r=r, lora_alpha=lora_alpha, target_modules=target_modules, modules_to_save=modules_to_save, **kwargs
    )


def save_adapter_base(model: Any, base_dir: str | os.PathLike, tokenizer: Any = None) -> Path:
    """Save ``model`` (an mHC model without adapters, e.g. fresh from ``hf_mhc.upcycle``) to ``base_dir`` as the base
    of the adapters to be trained on it, and set ``model.name_or_path`` to that folder (absolute).

    ``peft.get_peft_model(model, ...)`` then records the folder as the adapter's ``base_model_name_or_path``, so that
    ``peft.AutoPeftModelForCausalLM.from_pretrained(ADAPTER_DIR)`` and ``hf-mhc inspect ADAPTER_DIR`` find the base.
    Call it before ``get_peft_model``. ``tokenizer``, when given, is saved beside the model. Returns the folder.
    """
    from peft import PeftModel

    if isinstance(model, PeftModel) or getattr(model, "_hf_peft_config_loaded", False):
        raise TypeError("save_adapter_base needs the model without adapters: call it before get_peft_model.")
    base_dir = Path(base_dir).expanduser().absolute()
    model.save_pretrained(base_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(base_dir)
    model.name_or_path = str(base_dir)
    return base_dir


def adapter_base(adapter_dir: str | os.PathLike) -> str:
    """The base model of the PEFT adapter in folder ``adapter_dir``: ``base_model_name_or_path`` of its
    ``adapter_config.json`` (a folder or a Hub id).

    Raises ValueError with a one-line reason when the adapter names no base (it was trained on a model that existed
    only in memory: save the base model first, see :func:`save_adapter_base`), when its base looks like a local path
    that does not exist, and when ``adapter_config.json`` is missing or not JSON.
    """
    config_path = Path(adapter_dir) / ADAPTER_CONFIG_NAME
    try:
        base = json.loads(config_path.read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError) as error:
        raise ValueError(f"cannot read the PEFT adapter config {config_path}: {error}") from error
    if not base:
        raise ValueError(
            f"the PEFT adapter {adapter_dir} names no base model (base_model_name_or_path {base!r} in {config_path}; "
            "it was trained on a model that existed only in memory, e.g. just upcycled): save the base model first "
            "and set base_model_name_or_path to its folder (hf_mhc.peft.save_adapter_base does both)"
        )
    missing = folder_error(base)
    if missing is not None:
        raise ValueError(f"{missing} (the base model named by {config_path})")
    return base


__all__ = [
    "ADAPTER_CONFIG_NAME",
    "BACKBONE_PROJECTIONS",
    "HC_MODULE_NAMES",
    "adapter_base",
    "lora_target_modules",
    "mhc_lora_config",
    "save_adapter_base",
]
