"""PEFT for mHC models: LoRA on the backbone projections, the small HC maps trained in full.

The mHC models keep every backbone tensor under the backbone's own name, so LoRA targets the usual projections.
The HC modules (``attn_hc``, ``ffn_hc``, ``hc_head``) have no ``nn.Linear`` for LoRA to adapt; they are small
(``fn`` is ``(n+2)·n × n·C`` per site: about ``16 / C`` of a Llama layer's weights for n = 4, 0.4 % at C = 4096)
and decide how the streams mix, so they are trained in full through PEFT's ``modules_to_save``: the adapter
checkpoint carries them, ``PeftModel.from_pretrained`` restores them and ``merge_and_unload()`` puts them back
into a plain :class:`~hf_mhc.MHCForCausalLM`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from peft import LoraConfig, TaskType

from .modeling_mhc import HC_MODULE_NAMES

BACKBONE_PROJECTIONS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def mhc_lora_config(
    r: int = 8,
    lora_alpha: int = 16,
    target_modules: Iterable[str] | str | None = None,
    **kwargs: Any,
) -> LoraConfig:
    """A ``peft.LoraConfig`` for an mHC model: LoRA on the backbone projections, the HC maps fully trainable.

    Args:
        r: LoRA rank.
        lora_alpha: LoRA scaling numerator (the update is scaled by ``lora_alpha / r``).
        target_modules: module names (or a regex string) that get LoRA; default the attention and MLP projections
            ``q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj``. HC modules are not allowed here.
        **kwargs: any other ``LoraConfig`` field (``lora_dropout``, ``bias``, ``task_type``, ...). A
            ``modules_to_save`` list is extended with the HC modules; ``task_type`` defaults to ``CAUSAL_LM``.

    Returns:
        ``LoraConfig`` with ``modules_to_save`` containing ``attn_hc``, ``ffn_hc`` and ``hc_head``.

    Example::

        from peft import get_peft_model
        model = get_peft_model(hf_mhc.upcycle("path/to/llama"), mhc_lora_config(r=16))
    """
    if target_modules is None:
        target_modules = list(BACKBONE_PROJECTIONS)
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


__all__ = ["BACKBONE_PROJECTIONS", "HC_MODULE_NAMES", "mhc_lora_config"]
