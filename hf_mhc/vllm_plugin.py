"""hf-mhc's vLLM plugin: :func:`register`, the ``vllm.general_plugins`` entry point ``hf_mhc_vllm``.

vLLM runs every general plugin in each of its processes (front end, engine core, workers) before it reads a model's
config. :func:`register` registers the architecture of hf-mhc checkpoints, ``MHCForCausalLM``, with
``vllm.ModelRegistry`` by its ``"module:Class"`` name: vLLM imports :mod:`hf_mhc.vllm_model` only when it inspects or
serves such a checkpoint, and neither ``import hf_mhc`` nor this module imports vLLM. Which implementation then serves
a checkpoint (the native model, or vLLM's Transformers backend) is chosen per model in :mod:`hf_mhc.vllm_model`.
"""

from __future__ import annotations

ARCHITECTURE = "MHCForCausalLM"  # the `architectures` entry of every hf-mhc causal-LM checkpoint
MODEL_CLASS = "hf_mhc.vllm_model:MHCForCausalLM"


def register() -> None:
    """Register :data:`ARCHITECTURE` as :data:`MODEL_CLASS` with vLLM's model registry, unless vLLM already has a class
    for it (its own, should it ship one). Safe to call more than once, as vLLM may."""
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)
