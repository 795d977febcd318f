"""The bytes autograd holds for backward after a training forward, counted on fake tensors (no memory, no weights).

:func:`activations_held` builds ``config``'s causal LM under ``FakeTensorMode`` (shapes and dtypes only) and runs its
own transformers forward on ``batch`` unpadded, unpacked sequences of ``tokens`` tokens with labels, counting with
:func:`hf_mhc.profiling.held_for_backward` what its ops save (``saved_tensors_hooks``) and what its checkpoints keep
(their inputs and a copy of the CPU random state each), parameters excluded: exactly what the same forward holds on
real CPU tensors. Counts are by decoder layer (the storages first held inside each layer) and outside the layers
(embeddings, final norm, logits, loss).

Kernels counted: the config's attention implementation (default SDPA) with torch's kernels, as on CPU (SDPA's fused
kernel: ``q, k, v``, output, log-sum-exp; ``eager``: the ``T × T`` probabilities), except that an SDPA attention whose
``q``/``k`` and ``v`` head dims differ (MLA) is counted as CUDA's memory-efficient kernel, which keeps the same set,
where the CPU would keep the ``T × T`` probabilities; float32 / float16 MoE experts as transformers' grouped-mm
fallback (torch's grouped-mm kernel takes bfloat16). Gradient checkpointing holds each layer's inputs.

To run so, :func:`_forward_as_in_training` replaces three globals while a count runs (transformers' packed-sequence
detection and grouped-mm check, and ``torch.nn.functional.scaled_dot_product_attention``), for fake tensors only and
one thread at a time (a lock); each is restored on exit.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import threading
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from transformers import AutoModelForCausalLM, PreTrainedConfig, masking_utils
from transformers.initialization import no_init_weights

from .compat import require
from .configuration_mhc import MHCConfig
from .profiling import held_for_backward

# Held while _forward_as_in_training's substitutions are in place: counts in two threads take turns, so each
# restores the originals it found.
_SUBSTITUTING = threading.RLock()
# The training setups whose activations a plan counts: (name, mHC model?, hc_recompute, gradient checkpointing).
ACTIVATION_CASES = (
    ("residual", False, False, False),
    ("residual + gradient checkpointing", False, False, True),
    ("mhc", True, False, False),
    ("mhc + hc_recompute", True, True, False),
    ("mhc + gradient checkpointing", True, False, True),
)


@contextlib.contextmanager
def _forward_as_in_training() -> Iterator[None]:
    """Runs a transformers forward on fake tensors the way it runs on real ones in training, for the planned workload.

    Three substitutions, for fake tensors only (a real-tensor call, say from another thread, runs the original),
    undone on exit, one thread at a time: the batch is declared unpacked (transformers would read the fake position
    ids to find packed sequences, and under fake tensors keeps a materialised mask instead); MoE experts in float32
    or float16 take transformers' grouped-mm fallback (torch's grouped-mm checks its inputs are bfloat16 under fake
    tensors); an SDPA call without a mask whose ``q``/``k`` and ``v`` head dims differ runs CUDA's memory-efficient
    kernel op (shapes only), as on a GPU.
    """

    def unpacked(position_ids):
        return None if isinstance(position_ids, FakeTensor) else find_packed(position_ids)

    def grouped_mm_takes(input, weight, offs) -> bool:
        fake_not_bf16 = isinstance(weight, FakeTensor) and weight.dtype != torch.bfloat16
        return not fake_not_bf16 and can_use_grouped_mm(input, weight, offs)

    def attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if (not isinstance(query, FakeTensor) or attn_mask is not None or query.shape[-1] == value.shape[-1]
                or enable_gqa or dropout_p):
            return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            query, key, value, None, True, is_causal=is_causal, scale=scale)[0]

    with _SUBSTITUTING:  # the originals are read, and back, before another thread takes its own
        moe = importlib.import_module("transformers.integrations.moe")
        find_packed = require("transformers.masking_utils:find_packed_sequence_indices")
        can_use_grouped_mm = require("transformers.integrations.moe:_can_use_grouped_mm")
        sdpa = torch.nn.functional.scaled_dot_product_attention
        masking_utils.find_packed_sequence_indices = unpacked
        moe._can_use_grouped_mm = grouped_mm_takes
        torch.nn.functional.scaled_dot_product_attention = attention
        try:
            yield
        finally:
            masking_utils.find_packed_sequence_indices, moe._can_use_grouped_mm = find_packed, can_use_grouped_mm
            torch.nn.functional.scaled_dot_product_attention = sdpa


def activations_held(config: PreTrainedConfig, dtype: torch.dtype, *, batch: int, tokens: int,
                     cases: tuple[tuple[bool, bool], ...] = ((False, False),)) -> list[dict[int | None, int]]:
    """Bytes autograd holds for backward after a training forward (labels, no cache) of ``config``'s causal LM on
    ``batch × tokens`` tokens, run on fake tensors; one dict per ``(hc_recompute, gradient_checkpointing)`` case, by
    decoder-layer index (``None``: outside the layers).

    ``config``: a backbone config or an :class:`MHCConfig` (left unchanged: each case sets ``hc_recompute`` on a
    copy); weights in ``dtype`` (mHC maps float32). Parameters count zero. See the module docstring for what is
    counted and how.
    """
    config = copy.deepcopy(config)  # the model's own, which the cases change
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, _forward_as_in_training():
        with no_init_weights():  # the values are never read, and some initialisations check them
            model = AutoModelForCausalLM.from_config(config, dtype=dtype).train()
        return held_by_case(model, mode.from_tensor(torch.zeros(batch, tokens, dtype=torch.long)), cases)


def held_by_case(model: torch.nn.Module, input_ids: torch.Tensor,
                 cases: tuple[tuple[bool, bool], ...]) -> list[dict[int | None, int]]:
    """For each ``(hc_recompute, gradient_checkpointing)`` case, the bytes autograd holds for backward after a
    training forward of causal LM ``model`` (in train mode) on ``input_ids``, by decoder-layer index (``None``:
    outside the layers): what :func:`activations_held` counts on fake tensors, on any tensors."""
    is_mhc = isinstance(model.config, MHCConfig)
    if not is_mhc and any(hc_recompute for hc_recompute, _ in cases):
        raise ValueError("hc_recompute applies to an mHC model; give an MHCConfig to count it")
    owner: list[int | None] = [None]
    hooks = []
    for index, layer in enumerate(model.model.layers):
        hooks.append(layer.register_forward_pre_hook(lambda module, args, index=index: owner.__setitem__(0, index)))
        hooks.append(layer.register_forward_hook(lambda module, args, output: owner.__setitem__(0, None)))
    results = []
    for hc_recompute, gradient_checkpointing in cases:
        if is_mhc:
            model.config.hc_recompute = hc_recompute
        if gradient_checkpointing:
            model.activation_checkpointing_enable()
        results.append(held_for_backward(lambda: model(input_ids, labels=input_ids, use_cache=False).loss,
                                         exclude=tuple(model.parameters()), owner=lambda: owner[0]))
        if gradient_checkpointing:
            model.activation_checkpointing_disable()
    for hook in hooks:
        hook.remove()
    return results


__all__ = ["ACTIVATION_CASES", "activations_held", "held_by_case"]
