"""Distributed mHC models: FSDP2 units, transformers' ``DistributedConfig`` engine, and pipeline stages.

- :func:`apply_fsdp2` shards an mHC model with FSDP2 (``torch.distributed.fsdp.fully_shard``): one unit per decoder
  layer, one per float32 hyper-connection module (``attn_hc``, ``ffn_hc``, ``hc_head``) and the root. FSDP2 flattens
  each unit's parameters into one buffer of one dtype, and the HC parameters stay float32 in a bf16 model
  (``_keep_in_fp32_modules_strict``), so they cannot share a unit with the backbone weights.
- :func:`distribute_with_transformers` is what ``MHCPreTrainedModel.maybe_distribute_model`` runs under
  ``from_pretrained(..., distributed_config=DistributedConfig(...))``: transformers' own engine, with the HC modules
  sharded as float32 units of their own and, with ``pp_size > 1``, the streams ``[B, T, n, C]`` sent between stages.
- :func:`split_pipeline` cuts an :class:`~hf_mhc.MHCForCausalLM` into stage modules for
  ``torch.distributed.pipelining`` (``PipelineStage`` plus any schedule), which carry the streams between stages.

This file ships beside ``modeling_mhc.py`` in saved checkpoints, so a checkpoint loaded as remote code distributes
the same way.
"""

from __future__ import annotations

import copy
import functools
import inspect
import types
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers.distributed.pipeline_parallel import PipelineIdentityLayer, PipelineStage, _bind_forward_kwargs
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_mhc import HC_MODULE_NAMES

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers.modeling_utils import PreTrainedModel

    from .modeling_mhc import MHCForCausalLM

__all__ = ["MHCPipelineStageModule", "TiedEmbeddingSync", "apply_fsdp2", "split_pipeline"]


# --- FSDP2 ----------------------------------------------------------------------------------------------------------


def hc_mixed_precision() -> MixedPrecisionPolicy:
    """The FSDP2 policy of the HC units (``apply_fsdp2``, ``DistributedConfig(fsdp_size=...)`` and Accelerate's FSDP2
    path): gather and compute in the parameters' own dtype (float32), reduce gradients in float32, leave the streams
    they receive and the maps they return uncast."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32, output_dtype=None,
                                cast_forward_inputs=False)


def is_a(module: nn.Module, *class_names: str) -> bool:
    """Whether ``module`` is an instance of an mHC class of one of these names (``"MHCDecoderLayer"``, ...), also
    through a subclass (FSDP2's ``FSDPMHCDecoderLayer``). This file is imported by ``modeling_mhc.py`` (the
    ``maybe_distribute_model`` hook), so it names the mHC classes instead of importing them; by name, the check also
    holds for the classes of a checkpoint loaded as remote code."""
    return any(cls.__name__ in class_names for cls in type(module).__mro__)


def hc_modules(model: nn.Module) -> list[nn.Module]:
    """The HC modules of ``model`` (``attn_hc``, ``ffn_hc``, ``hc_head``), in module order."""
    return [module for module in model.modules() if is_a(module, "MHCHyperConnection", "MHCHyperHead")]


def shard_hc_units(modules: Iterable[nn.Module], **fully_shard_options) -> None:
    """``fully_shard`` each of ``modules`` as an FSDP2 unit of its own with :func:`hc_mixed_precision` (mesh,
    resharding and offload as ``fully_shard_options`` say): the one way every FSDP2 path here shards the HC modules."""
    from torch.distributed.fsdp import fully_shard

    for module in modules:
        fully_shard(module, mp_policy=hc_mixed_precision(), **fully_shard_options)


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

    decoder_layers = [module for module in model.modules() if is_a(module, "MHCDecoderLayer")]
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


# --- transformers' DistributedConfig --------------------------------------------------------------------------------


def distribute_with_transformers(distribute: Callable, model: PreTrainedModel, distributed_config, mesh_manager):
    """transformers' ``maybe_distribute_model`` (``distribute``) for an mHC model.

    With data parallelism (``fsdp_size`` or ``dp_replicate_size`` > 1) the HC modules become FSDP2 units of their own
    first, gathered and computed in float32 and their gradients reduced in float32 even with
    ``fsdp_mixed_precision=True`` (which gathers transformers' own units in bf16), on the mesh and with the CPU
    offload transformers would give them; transformers then shards the rest, its plan less those units. With
    ``pp_size > 1`` the stages exchange the streams ``[B, T, n, C]`` (:func:`_send_streams_between_stages`)."""
    if mesh_manager is None:
        return distribute(model, distributed_config, mesh_manager)
    pipelined = distributed_config.pp_size > 1
    if distributed_config.dp_size > 1:
        from torch.distributed.fsdp import CPUOffloadPolicy

        names = ("dp_replicate", "fsdp") if distributed_config.dp_replicate_size > 1 else "fsdp"
        options = {"offload_policy": CPUOffloadPolicy()} if distributed_config.fsdp_cpu_offload else {}
        shard_hc_units(hc_modules(model), mesh=mesh_manager.get_mesh(names), reshard_after_forward=True, **options)
        hc_ids = {id(module) for module in hc_modules(model)}
        hc_units = {name for name, module in model.named_modules() if id(module) in hc_ids}

        def plans_without_hc_units(self, config):
            tp_plan, ep_plan, fsdp_plan = type(self)._resolve_parallel_plans(self, config)
            return tp_plan, ep_plan, {name: style for name, style in fsdp_plan.items() if name not in hc_units}

        model._resolve_parallel_plans = types.MethodType(plans_without_hc_units, model)
    if pipelined:
        model._pp_forward_wrapped = True  # the forward that transformers would wrap sends [B, T, C]
    try:
        model = distribute(model, distributed_config, mesh_manager)
    finally:
        model.__dict__.pop("_resolve_parallel_plans", None)
    if pipelined:
        _send_streams_between_stages(model, mesh_manager.get_mesh("pp"))
    return model


class PipelineStageWithHCHead(PipelineStage):
    """transformers' pipeline-stage metadata, knowing that ``hc_head`` (run before the final norm) is the last
    stage's."""

    def find_rank_for_key(self, key: str, num_layers: int, base_model_prefix: str) -> int | None:
        if key.startswith(f"{base_model_prefix}.hc_head."):
            return self.pp_size - 1
        return super().find_rank_for_key(key, num_layers, base_model_prefix)


def _send_streams_between_stages(model: PreTrainedModel, pp_mesh) -> None:
    """Fit transformers' naive pipeline split (``apply_pipeline_parallelism``: the layers of other stages, and the
    embedding, norm and ``lm_head`` where unused, replaced by ``PipelineIdentityLayer``) to mHC: ``hc_head`` is the
    last stage's too, so a non-last stage's base model returns the streams, and ``forward`` sends and receives those
    (:func:`_pipeline_streams_forward`)."""
    model._pp_stage = PipelineStageWithHCHead(pp_mesh)
    if not model._pp_stage.pp_is_last_stage:
        model.base_model.hc_head = PipelineIdentityLayer()
    original_forward = model.forward
    signature = inspect.signature(original_forward)

    @functools.wraps(original_forward)
    def forward(*args, **kwargs):
        return _pipeline_streams_forward(model, original_forward, signature, *args, **kwargs)

    model.forward = forward


def _pipeline_streams_forward(model: PreTrainedModel, original_forward: Callable, signature: inspect.Signature,
                              *args, **kwargs) -> CausalLMOutputWithPast:
    """transformers' ``pipeline_parallel_naive_forward`` with the streams as the hidden state: a non-first stage
    receives ``[B, T, n, C]`` from the previous one and feeds it as ``inputs_embeds``, a non-last stage sends its base
    model's streams on, and the logits ``[B, T, vocab]`` of the last stage are broadcast to every stage. A stage's
    cache holds only its own layers, so with a cache the positions and masks are sized by the first layer of each
    attention kind the stage runs. Returns the logits and this stage's cache."""
    stage = model._pp_stage
    device, dtype = model.device, model.dtype
    forward_kwargs = _bind_forward_kwargs(signature, args, kwargs)
    forward_kwargs.update(forward_kwargs.pop("kwargs", None) or {})
    tokens = forward_kwargs.get("input_ids")
    batch, length = (tokens if tokens is not None else forward_kwargs["inputs_embeds"]).shape[:2]
    if not stage.pp_is_first_stage:
        forward_kwargs.pop("input_ids", None)
        shape = (batch, length, model.config.hc_mult, model.config.backbone_config.hidden_size)
        forward_kwargs["inputs_embeds"] = stage.communicate("recv_forward", device=device, dtype=dtype, shape=shape)
    cache = forward_kwargs.get("cache", forward_kwargs.get("past_key_values"))
    if cache is not None:
        forward_kwargs.update(_stage_positions_and_masks(model, cache, forward_kwargs, batch, length))
    if stage.pp_is_last_stage:
        outputs = original_forward(**forward_kwargs)
        logits, cache = outputs.logits, outputs.cache
    else:
        base_kwargs = {k: v for k, v in forward_kwargs.items() if k not in {"labels", "logits_to_keep"}}
        outputs = model.base_model(**base_kwargs)  # hc_head and norm are identities here: the streams
        stage.communicate("send_forward", device=device, dtype=dtype, tensor=outputs.last_hidden_state)
        logits, cache = None, outputs.cache
    logits = stage.broadcast_from_last(logits, dtype=dtype, device=device)
    return CausalLMOutputWithPast(logits=logits, cache=cache)


def _stage_positions_and_masks(model: PreTrainedModel, cache, forward_kwargs: dict, batch: int, length: int) -> dict:
    """``position_ids`` and the per-kind masks of a stage whose cache holds only its own layers: sized by the first
    layer of each attention kind the stage runs (the model's defaults read the cache's first layer)."""
    backbone = model.config.backbone_config
    first_layer: dict[str, int] = {}
    for index, layer in enumerate(model.base_model.layers):
        if is_a(layer, "MHCDecoderLayer"):
            first_layer.setdefault(layer.attention_type, index)
    updates = {}
    position_ids = forward_kwargs.get("position_ids")
    if position_ids is None:
        past = cache.get_seq_length(min(first_layer.values()))
        position_ids = (torch.arange(length, device=model.device) + past).unsqueeze(0)
        updates["position_ids"] = position_ids
    if not isinstance(forward_kwargs.get("attention_mask"), dict):
        hidden = torch.zeros((), dtype=model.dtype, device=model.device).expand(batch, length, backbone.hidden_size)
        build = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        mask_kwargs = dict(config=backbone, inputs_embeds=hidden, attention_mask=forward_kwargs.get("attention_mask"),
                           cache=cache, position_ids=position_ids)
        # A kind no layer of this stage has gets None: only the other stages' PipelineIdentityLayers receive it.
        updates["attention_mask"] = {kind: build[kind](**mask_kwargs, layer_idx=first_layer[kind])
                                     if kind in first_layer else None for kind in model.base_model.layer_types}
    return updates


# --- Pipeline stages for torch.distributed.pipelining ----------------------------------------------------------------


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
    :attr:`stream_dtype`.

    ``model`` is the full model's base model with the modules of other stages replaced by ``PipelineIdentityLayer``
    (as transformers' own pipeline split does), so parameters keep the names they have in the full model
    (``model.layers.3.attn_hc.fn``, ``lm_head.weight``): ``stage.load_state_dict(full_state_dict, strict=False)``
    fills a stage and stage state dicts merge into a full checkpoint. Each stage runs the model's own forward with
    positions ``0 .. T-1``, causal attention, no padding mask and no KV cache. For batches of unequal lengths, pad on
    the right and label the padding ``-100``: causal attention keeps it out of the real tokens.
    """

    def __init__(
        self,
        model: MHCForCausalLM,
        layer_indices: range,
        stage_index: int,
        num_stages: int,
        lm_head: nn.Linear | None,
        boundary_dtype: torch.dtype | None = None,
        holds_tied_embedding: bool = False,
    ):
        super().__init__()
        self.config = model.config
        self.boundary_dtype = boundary_dtype
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        trunk = copy.copy(model.model)  # the same modules, in a child table of its own
        trunk._modules = dict(trunk._modules)
        trunk.layers = nn.ModuleList([layer if index in layer_indices else PipelineIdentityLayer()
                                      for index, layer in enumerate(model.model.layers)])
        if not self.is_first:
            trunk.embed_tokens = PipelineIdentityLayer()
        if not self.is_last:
            trunk.hc_head, trunk.norm = PipelineIdentityLayer(), PipelineIdentityLayer()
        self.model = trunk
        self.lm_head = lm_head
        self.holds_tied_embedding = holds_tied_embedding
        # The last stage runs the causal LM's own forward (head read-out, final norm, lm_head, logit scaling) through a
        # copy of the model made of this stage's modules; held outside the module tree, which has them already.
        self._causal_lm = None
        if self.is_last:
            causal_lm = copy.copy(model)
            causal_lm._modules = {**causal_lm._modules, "model": trunk, "lm_head": lm_head}
            object.__setattr__(self, "_causal_lm", causal_lm)

    @property
    def tied_embedding(self) -> nn.Parameter | None:
        """The word embedding the first and the last stage of a tied model share (``embed_tokens.weight`` here,
        ``lm_head.weight`` there: one parameter; see :class:`TiedEmbeddingSync`), else ``None``."""
        if not self.holds_tied_embedding:
            return None
        return self.model.embed_tokens.weight if self.is_first else self.lm_head.weight

    @property
    def stream_dtype(self) -> torch.dtype:
        """The dtype the stage computes its streams in: that of its backbone weights (the float32 HC modules
        aside)."""
        layer = next(layer for layer in self.model.layers if is_a(layer, "MHCDecoderLayer"))
        hc_parameters = {id(parameter) for name in HC_MODULE_NAMES if hasattr(layer, name)
                         for parameter in getattr(layer, name).parameters()}
        return next(parameter.dtype for parameter in layer.parameters() if id(parameter) not in hc_parameters)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """``input_ids [B, T]`` (first stage) or ``streams [B, T, n, C]`` in; ``streams [B, T, n, C]`` or, from the
        last stage, ``logits [B, T, vocab]`` out."""
        if self.is_first and inputs.dim() != 2:
            raise ValueError(f"Stage 0 takes input_ids [B, T]; got a tensor of shape {tuple(inputs.shape)}.")
        if not self.is_first and inputs.dim() != 4:
            raise ValueError(
                f"Stage {self.stage_index} takes streams [B, T, n, C]; got a tensor of shape {tuple(inputs.shape)}."
            )
        # The boundary_dtype cast is undone here; a no-op without it. No cache, and no outputs recorded by hooks: the
        # layers are the full model's, whose own recording must not see a stage's.
        model_inputs = {"input_ids": inputs} if self.is_first else {"inputs_embeds": inputs.to(self.stream_dtype)}
        model_inputs.update(use_cache=False, output_hidden_states=False, output_attentions=False,
                            output_router_logits=False)
        if self.is_last:
            return self._causal_lm(**model_inputs).logits
        streams = self.model(**model_inputs).last_hidden_state  # hc_head and norm are identities
        return streams if self.boundary_dtype is None else streams.to(self.boundary_dtype)


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

    Tied embeddings (``lm_head.weight is embed_tokens.weight``) live on the first and the last stage, as
    ``embed_tokens`` there and ``lm_head`` here: with more than one stage the last stage holds a copy of the weight
    (``tied_embedding`` of both stage modules), and :class:`TiedEmbeddingSync` sums the gradients of the two copies
    after each backward (one all-reduce where two ranks hold them), so they take the same optimizer step and stay
    equal, as Megatron-LM keeps its tied embeddings; the merged stage state dicts save as the tied model they are.
    ``untie_word_embeddings=True`` lets the copy train on its own instead (a separate parameter from then on: set
    ``model.config.tie_word_embeddings`` and ``model.config.backbone_config.tie_word_embeddings`` to ``False``
    before saving).

    Example (two ranks, one stage each)::

        stages = split_pipeline(model, num_stages=2)
        tied = TiedEmbeddingSync(stages, stage_ranks=[0, 1])  # on every rank, before dropping the other stage
        stage = PipelineStage(stages[rank], rank, 2, device)
        schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=loss_fn)
        schedule.step(input_ids) if rank == 0 else schedule.step(target=labels, losses=losses)
        tied.all_reduce_grad()  # then clip and step the optimizer

    Args:
        model: the causal LM to split, in training or eval mode.
        num_stages: number of stages, from 1 to the number of decoder layers.
        untie_word_embeddings: give the last stage a copy of a tied ``lm_head`` instead of sharing the embedding.
        boundary_dtype: the dtype the streams cross the stage boundaries in, e.g. ``torch.bfloat16`` for a float32
            model trained under bf16 autocast: half the bytes of float32. Default: the stages' own stream dtype
            (that of the backbone weights), uncast.

    Returns:
        ``num_stages`` :class:`MHCPipelineStageModule` s, in pipeline order.
    """
    if not is_a(model, "MHCForCausalLM"):
        raise TypeError(f"split_pipeline needs an MHCForCausalLM (it ends in logits); got {type(model).__name__}.")
    splits = pipeline_layer_split(len(model.model.layers), num_stages)
    lm_head = model.lm_head
    tied = num_stages > 1 and lm_head.weight is model.model.embed_tokens.weight
    if tied:  # the last stage's copy; torch's zero-bubble schedules mishandle one parameter in two stages of a rank
        lm_head = copy.deepcopy(lm_head)
        tied = not untie_word_embeddings
    ends = (0, num_stages - 1)
    return [
        MHCPipelineStageModule(
            model,
            layer_indices,
            stage_index=index,
            num_stages=num_stages,
            lm_head=lm_head if index == num_stages - 1 else None,
            boundary_dtype=boundary_dtype,
            holds_tied_embedding=tied and index in ends,
        )
        for index, layer_indices in enumerate(splits)
    ]


class TiedEmbeddingSync:
    """The two copies of a tied word embedding in a model split by :func:`split_pipeline`, kept equal.

    The first stage uses the weight as ``embed_tokens``, the last stage its copy as ``lm_head``; each copy's gradient
    covers only its own use. :meth:`all_reduce_grad` gives both the sum, over a process group of the two ranks when
    different ranks hold them (one all-reduce, as Megatron-LM does), locally when one rank holds both (DualPipeV's V
    shape, or every stage in one process), so both take the same optimizer step and stay bit-equal. An untied model
    (or one kept in one stage) has nothing to keep.

    Build it on every rank (``torch.distributed.new_group`` is collective) from every stage module
    :func:`split_pipeline` returned, before dropping the ones this rank does not run; ``stage_ranks[s]`` is the rank
    that runs stage ``s``. Call :meth:`all_reduce_grad` on every rank after each backward, before clipping and the
    optimizer step. A gradient norm counts the weight once: not the last stage's copy (:attr:`duplicate`).
    """

    def __init__(self, stages: list[MHCPipelineStageModule], stage_ranks: list[int]):
        import torch.distributed as dist

        if len(stages) != len(stage_ranks):
            raise ValueError(f"TiedEmbeddingSync needs the rank of each of the {len(stages)} stages; got "
                             f"stage_ranks={stage_ranks}.")
        rank = dist.get_rank() if dist.is_initialized() else stage_ranks[0]
        first, last = stage_ranks[0], stage_ranks[-1]
        tied = stages[0].tied_embedding is not None
        # This rank's copies: the embedding of the first stage, the lm_head of the last (either, both or none).
        self.copies: list[nn.Parameter] = [stage.tied_embedding for stage, holder in ((stages[0], first),
                                           (stages[-1], last)) if tied and holder == rank]
        self.duplicate: nn.Parameter | None = stages[-1].tied_embedding if tied and rank == last else None
        self.group = dist.new_group([first, last]) if tied and first != last else None

    def all_reduce_grad(self) -> None:
        """Give both copies of the embedding the sum of their gradients (a no-op on a rank without a copy)."""
        import torch.distributed as dist

        if not self.copies:
            return
        total = sum(weight.grad if weight.grad is not None else torch.zeros_like(weight) for weight in self.copies)
        if self.group is not None:
            dist.all_reduce(total, group=self.group)
        for index, weight in enumerate(self.copies):
            weight.grad = total if index == 0 else total.clone()
