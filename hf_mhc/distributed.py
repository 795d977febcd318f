"""Distributed training of mHC models: FSDP2 sharding and pipeline-parallel stages.

- :func:`apply_fsdp2` shards an mHC model with FSDP2 (``torch.distributed.fsdp.fully_shard``): one unit per
  decoder layer, one per float32 hyper-connection module (``attn_hc``, ``ffn_hc``, ``hc_head``) and the root.
  FSDP2 flattens each unit's parameters into one buffer of one dtype, and the HC parameters stay float32 in a
  bf16 model (``_keep_in_fp32_modules_strict``), so they cannot share a unit with the backbone weights.
- :func:`split_pipeline` cuts an :class:`~hf_mhc.MHCForCausalLM` into stage modules for
  ``torch.distributed.pipelining`` (``PipelineStage`` plus any schedule). Between stages travel the mHC streams
  ``[B, T, n, C]``, which transformers' own pipeline plan (one hidden state ``[B, T, C]``) cannot carry.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
from torch import nn

from .modeling_mhc import (
    HC_MODULE_NAMES,
    MHCDecoderLayer,
    MHCForCausalLM,
    MHCHyperHead,
    MHCModel,
    attention_masks,
    expand_to_streams,
    hc_modules,
    rotary_embeddings,
    run_decoder_layers,
    scale_embeddings,
    scale_logits,
    shard_hc_units,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = ["MHCPipelineStageModule", "apply_fsdp2", "split_pipeline"]


def _mesh_device_type(model: nn.Module) -> str:
    """The device type of the model's parameters; the current accelerator (else CPU) for a model on ``meta``."""
    device = next(model.parameters()).device
    if device.type != "meta":
        return device.type
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return accelerator.type if accelerator is not None else "cpu"


def apply_fsdp2(
    model: nn.Module,
    mesh: DeviceMesh | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Shard an mHC model in place with FSDP2 and return it.

    Units, innermost first: every ``MHCHyperConnection`` (``attn_hc``, ``ffn_hc``) and the ``MHCHyperHead``
    (``hc_head``) on its own, then every ``MHCDecoderLayer`` (attention, MLP, norms), then the root (embedding,
    final norm, ``lm_head``, tied or not). The HC units ignore ``mp_policy``: they gather and compute in their own
    parameter dtype (float32 in an mHC model, even a bf16 one), reduce gradients in float32 and leave the streams
    they receive uncast, so ``param_dtype=torch.bfloat16`` never rounds the Sinkhorn inputs. ``mp_policy`` applies
    to the decoder layers and the root.

    Args:
        model: an mHC model (``MHCForCausalLM``, ``MHCModel``, ``MHCForSequenceClassification``, or one wrapped by
            PEFT), on CPU, on its accelerator, or on ``meta`` for deferred initialisation.
        mesh: a 1-D device mesh to shard over. Default: all ranks of the default process group, on the device type
            of the model's parameters (the current accelerator for a ``meta`` model).
        mp_policy: FSDP2 mixed precision for the backbone units, e.g.
            ``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``. Default: none.
        reshard_after_forward: free the gathered parameters of the layer and HC units after their forward (ZeRO-3)
            rather than keeping them until backward (ZeRO-2). The root unit always keeps them: backward starts
            with ``lm_head``.

    Returns:
        ``model`` itself, now an ``FSDPModule`` whose parameters are sharded ``DTensor``s. Build the optimizer after
        this call. Gather a full state dict with ``torch.distributed.checkpoint.state_dict.get_model_state_dict``.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    decoder_layers = [module for module in model.modules() if isinstance(module, MHCDecoderLayer)]
    if not decoder_layers:
        raise ValueError(f"apply_fsdp2 needs an mHC model (e.g. MHCForCausalLM); {type(model).__name__} is not one.")
    if mesh is None:
        if not dist.is_initialized():
            raise RuntimeError("apply_fsdp2 needs a process group: call torch.distributed.init_process_group() first.")
        mesh = init_device_mesh(_mesh_device_type(model), (dist.get_world_size(),))

    backbone_policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    shard_hc_units(hc_modules(model), mesh=mesh, reshard_after_forward=reshard_after_forward)
    for layer in decoder_layers:
        fully_shard(layer, mesh=mesh, mp_policy=backbone_policy, reshard_after_forward=reshard_after_forward)
    # The root (embedding, final norm, lm_head) is gathered for the whole forward and needed first in backward.
    fully_shard(model, mesh=mesh, mp_policy=backbone_policy, reshard_after_forward=False)
    return model


class _StageTrunk(nn.Module):
    """The ``model.*`` part of one stage: the embedding (first stage), a slice of the decoder layers (keyed by their
    index in the full model), ``hc_head`` and the final norm (last stage), and the parameter-free rotary
    embedding (every stage)."""

    def __init__(
        self,
        source: MHCModel,
        layer_indices: range,
        is_first: bool,
        is_last: bool,
    ):
        super().__init__()
        self.embed_tokens: nn.Embedding | None = source.embed_tokens if is_first else None
        self.layers = nn.ModuleDict({str(index): source.layers[index] for index in layer_indices})
        self.hc_head: MHCHyperHead | None = source.hc_head if is_last else None
        self.norm: nn.Module | None = source.norm if is_last else None
        self.rotary_emb = source.rotary_emb
        self.rotary_per_layer_type = source.rotary_per_layer_type


class MHCPipelineStageModule(nn.Module):
    """One pipeline stage of an :class:`~hf_mhc.MHCForCausalLM`, made by :func:`split_pipeline`.

    Inputs and outputs (``n = hc_mult``, ``C = hidden_size``):

    - first stage: ``input_ids [B, T]`` (int64) in; the embedding is copied into ``n`` streams;
    - other stages: ``streams [B, T, n, C]`` (model dtype) in;
    - last stage: ``logits [B, T, vocab]`` out (after ``hc_head``, the final norm and ``lm_head``);
    - other stages: ``streams [B, T, n, C]`` out, in ``boundary_dtype`` when it is set.

    The streams are ``n`` times the residual model's hidden state, and so is what crosses each stage boundary (the
    streams forward, their gradient backward). They are in the stage's compute dtype: the backbone weights' dtype,
    or float32 for float32 weights under ``torch.autocast``. ``boundary_dtype=torch.bfloat16`` sends them (and
    hence their gradient) in bf16 instead, half the bytes of float32; the receiving stage casts them back to its
    :attr:`stream_dtype`. The streams are then rounded to bf16 once per boundary, as a bf16 model keeps them anyway.

    Parameters keep the names they have in the full model (``model.layers.3.attn_hc.fn``, ``lm_head.weight``), so
    ``stage.load_state_dict(full_state_dict, strict=False)`` fills a stage and stage state dicts merge into a full
    checkpoint. Rotary position embeddings and the causal (and sliding-window) masks are rebuilt on every stage from
    the sequence length: positions are ``0 .. T-1``, attention is causal, and there is no padding mask or KV cache.
    For batches of unequal lengths, pad on the right and label the padding ``-100``: causal attention keeps it out of
    the real tokens.
    """

    def __init__(
        self,
        model: MHCForCausalLM,
        layer_indices: range,
        stage_index: int,
        num_stages: int,
        lm_head: nn.Linear | None,
        boundary_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.config = model.config
        self.boundary_dtype = boundary_dtype
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.model = _StageTrunk(model.model, layer_indices, self.is_first, self.is_last)
        self.lm_head = lm_head
        self._attention_kinds = tuple(sorted({layer.attention_type for layer in self.model.layers.values()}))

    @property
    def stream_dtype(self) -> torch.dtype:
        """The dtype the stage computes its streams in: that of its backbone weights (the float32 HC modules
        aside)."""
        layer = next(iter(self.model.layers.values()))
        hc_parameters = {id(parameter) for name in HC_MODULE_NAMES if hasattr(layer, name)
                         for parameter in getattr(layer, name).parameters()}
        return next(parameter.dtype for parameter in layer.parameters() if id(parameter) not in hc_parameters)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """``input_ids [B, T]`` (first stage) or ``streams [B, T, n, C]`` in; ``streams [B, T, n, C]`` or, from the
        last stage, ``logits [B, T, vocab]`` out."""
        trunk = self.model
        backbone = self.config.backbone_config
        if self.is_first:
            if inputs.dim() != 2:
                raise ValueError(f"Stage 0 takes input_ids [B, T]; got a tensor of shape {tuple(inputs.shape)}.")
            embeddings = scale_embeddings(backbone, trunk.embed_tokens(inputs), from_tokens=True)
            streams = expand_to_streams(embeddings, self.config.hc_mult)
        else:
            if inputs.dim() != 4:
                raise ValueError(
                    f"Stage {self.stage_index} takes streams [B, T, n, C]; got a tensor of shape {tuple(inputs.shape)}."
                )
            streams = inputs.to(self.stream_dtype)  # a no-op unless boundary_dtype rounded them
            embeddings = streams[:, :, 0]  # stands for the [B, T, C] hidden state: shape, dtype and device only
        position_ids = torch.arange(streams.shape[1], device=streams.device).unsqueeze(0)
        position_embeddings = rotary_embeddings(trunk.rotary_emb, trunk.rotary_per_layer_type, self._attention_kinds,
                                                embeddings, position_ids)
        masks = attention_masks(backbone, self._attention_kinds, embeddings, None, None, position_ids)
        streams, _, _ = run_decoder_layers(trunk.layers.values(), streams, masks, position_embeddings, position_ids)
        if not self.is_last:
            return streams if self.boundary_dtype is None else streams.to(self.boundary_dtype)
        return scale_logits(backbone, self.lm_head(trunk.norm(trunk.hc_head(streams))))


def pipeline_layer_split(num_layers: int, num_stages: int) -> list[range]:
    """Decoder-layer indices of each stage: as even as possible, earlier stages taking the remainder (the last stage
    also runs ``hc_head``, the final norm and ``lm_head``)."""
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}.")
    if num_stages > num_layers:
        raise ValueError(f"num_stages={num_stages} exceeds the model's {num_layers} decoder layers; use fewer stages.")
    base, extra = divmod(num_layers, num_stages)
    splits, start = [], 0
    for stage in range(num_stages):
        size = base + (1 if stage < extra else 0)
        splits.append(range(start, start + size))
        start += size
    return splits


def split_pipeline(
    model: MHCForCausalLM,
    num_stages: int,
    untie_word_embeddings: bool = False,
    boundary_dtype: torch.dtype | None = None,
) -> list[MHCPipelineStageModule]:
    """Cut ``model`` into ``num_stages`` consecutive stage modules for ``torch.distributed.pipelining``.

    Stage ``s`` holds decoder layers :func:`pipeline_layer_split` gives it; stage 0 also holds ``embed_tokens``, the
    last stage ``hc_head``, the final norm and ``lm_head``. Every stage shares its parameters with ``model`` (nothing
    is copied), so each rank keeps the stage(s) it runs, wraps them in ``PipelineStage``, and drops the rest.

    Tied embeddings (``lm_head.weight is embed_tokens.weight``) live on the first and the last stage. With more than
    one stage this raises unless ``untie_word_embeddings=True``, which gives the last stage its own copy of
    ``lm_head`` (a separate parameter from then on, as with ``tie_word_embeddings=False``: set
    ``model.config.tie_word_embeddings`` and ``model.config.backbone_config.tie_word_embeddings`` to ``False``
    before saving the merged stage state dicts, as ``examples/pipeline_finetune.py`` does).

    Example (two ranks, one stage each)::

        stages = split_pipeline(model, num_stages=2, untie_word_embeddings=True)  # a no-op for untied embeddings
        stage = PipelineStage(stages[rank], rank, 2, device)
        schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=loss_fn)
        schedule.step(input_ids) if rank == 0 else schedule.step(target=labels, losses=losses)

    Args:
        model: the causal LM to split, in training or eval mode.
        num_stages: number of stages, from 1 to the number of decoder layers.
        untie_word_embeddings: give the last stage a copy of a tied ``lm_head`` instead of raising.
        boundary_dtype: the dtype the streams cross the stage boundaries in, e.g. ``torch.bfloat16`` for a float32
            model trained under bf16 autocast: half the bytes of float32. Default: the stages' own stream dtype
            (that of the backbone weights), uncast.

    Returns:
        ``num_stages`` :class:`MHCPipelineStageModule` s, in pipeline order.
    """
    if not isinstance(model, MHCForCausalLM):
        raise TypeError(f"split_pipeline needs an MHCForCausalLM (it ends in logits); got {type(model).__name__}.")
    splits = pipeline_layer_split(len(model.model.layers), num_stages)
    lm_head = model.lm_head
    if num_stages > 1 and lm_head.weight is model.model.embed_tokens.weight:
        if not untie_word_embeddings:
            raise ValueError(
                f"lm_head is tied to embed_tokens, which sit on different stages: call split_pipeline(model, "
                f"{num_stages}, untie_word_embeddings=True) to give the last stage its own copy of lm_head."
            )
        lm_head = copy.deepcopy(lm_head)
    return [
        MHCPipelineStageModule(
            model,
            layer_indices,
            stage_index=index,
            num_stages=num_stages,
            lm_head=lm_head if index == num_stages - 1 else None,
            boundary_dtype=boundary_dtype,
        )
        for index, layer_indices in enumerate(splits)
    ]
