"""mHC models on residual backbones: any family with a wiring entry (``BACKBONE_WIRINGS``).

Decoder layers are the backbone family's own: each mHC layer instantiates the family's decoder layer (found through
transformers' registry: the base model of ``MODEL_MAPPING_NAMES[model_type]`` names it in ``_no_split_modules``) and
adopts its attention, MLP or MoE block and norms, so every backbone tensor keeps its name
(``model.layers.0.self_attn.q_proj.weight``) and every per-layer choice (sliding or full attention, NoPE, MoE or
dense) is the backbone constructor's. Rotary embeddings, masks and weight initialisation are the backbone's too.
Only the residual wiring is new: the hidden state is ``hc_mult`` streams ``[B, T, n, C]``, mixed around each
sublayer by ``attn_hc`` / ``ffn_hc`` and read out by ``model.hc_head`` (the formulas are in ``mhc_reference.py``;
names and numerics as transformers' DeepSeek-V4), and the family's wiring entry says which of its norms and
multipliers sit where.

This file, ``configuration_mhc.py`` and ``mhc_reference.py`` are copied flat into saved checkpoints, so a
machine without ``hf_mhc`` can load them with ``trust_remote_code=True``.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import transformers
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
from transformers.distributed.pipeline_parallel import PipelineIdentityLayer, PipelineStage, _bind_forward_kwargs
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_layers import GenericForSequenceClassification, GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    MoeCausalLMOutputWithPast,
    MoeModelOutputWithPast,
)
from transformers.modeling_utils import PreTrainedModel, slice_logits_to_keep
from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES
from transformers.utils import can_return_tuple, logging
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.output_capturing import OutputRecorder

from .configuration_mhc import MHCConfig, backbone_wiring, check_backbone_type
from .mhc_reference import (
    function_preserving_hc_base,
    function_preserving_head_base,
    map_sizes,
    mhc_coeffs,
    mhc_coeffs_pre,
    mhc_head,
    mhc_post_res,
    scale_size,
)

logger = logging.get_logger(__name__)


@dataclass(frozen=True)
class HCOps:
    """The mHC calls of a model, bound to one ``hc_implementation``: each takes the arguments of the functions of the
    same name in ``mhc_reference.py`` (``coeffs`` is ``mhc_coeffs``, ...)."""

    implementation: str  # the resolved one: "reference", "torch", "triton" or "auto" (Triton on CUDA, else torch)
    coeffs: Callable
    coeffs_pre: Callable
    post_res: Callable
    head: Callable


REFERENCE_OPS = HCOps("reference", mhc_coeffs, mhc_coeffs_pre, mhc_post_res, mhc_head)


@functools.cache
def resolve_hc_ops(implementation: str) -> HCOps:
    """The ops of ``hc_implementation`` (see ``MHCConfig``), resolved once per value and process.

    ``"torch"``, ``"triton"`` and ``"auto"`` are the plugin's ``hf_mhc.kernels`` with that backend (``"auto"``: Triton
    for CUDA tensors, torch otherwise). Where ``hf_mhc.kernels`` does not import (a checkpoint loaded as remote code
    on a machine without the plugin, or without Triton), ``"auto"`` warns once and runs the reference formula, and
    ``"torch"`` / ``"triton"`` raise.
    """
    if implementation == "reference":
        return REFERENCE_OPS
    try:
        import hf_mhc.kernels as kernels
    except ImportError as error:
        if implementation != "auto":
            raise ImportError(f"hc_implementation={implementation!r} needs hf_mhc.kernels, which failed to import "
                              f"({error}); install hf-mhc with its kernels, or use hc_implementation='reference'.") \
                from error
        logger.warning_once(f"hf_mhc.kernels failed to import ({error}): the mHC maps run the plain reference formula "
                            "(hc_implementation='reference'), which is slower and saves more for backward.")
        return REFERENCE_OPS
    backend = None if implementation == "auto" else implementation
    return HCOps(implementation, functools.partial(kernels.mhc_coeffs, backend=backend),
                 functools.partial(kernels.mhc_coeffs_pre, backend=backend),
                 functools.partial(kernels.mhc_post_res, backend=backend),
                 functools.partial(kernels.mhc_head, backend=backend))


@dataclass(frozen=True)
class BackboneClasses:
    """The transformers classes (and functions) of one backbone family that an mHC model is built from."""

    base_model: type[PreTrainedModel]  # e.g. LlamaModel: its _init_weights initialises the backbone modules
    decoder_layer: type[nn.Module]  # e.g. LlamaDecoderLayer, named by base_model._no_split_modules
    rotary: type[nn.Module]  # e.g. LlamaRotaryEmbedding, the one rotary class of the family's modeling file
    router: OutputRecorder | None = None  # MoE: the router whose outputs base_model records as router_logits
    load_balancing_loss: Callable | None = None  # MoE: the family's load_balancing_loss_func, if it has one


HC_MODULE_NAMES: tuple[str, ...] = ("attn_hc", "ffn_hc", "hc_head")  # the float32 mHC modules, by attribute name


@functools.cache
def backbone_classes(model_type: str) -> BackboneClasses:
    """Base model, decoder-layer and rotary classes of a supported family, from transformers' own registry."""
    check_backbone_type(model_type)
    base_model = getattr(transformers, MODEL_MAPPING_NAMES[model_type])
    module = sys.modules[base_model.__module__]
    layers = [getattr(module, name, None) for name in base_model._no_split_modules or ()]
    rotaries = [cls for name, cls in vars(module).items() if isinstance(cls, type) and issubclass(cls, nn.Module)
                and name.endswith("RotaryEmbedding") and cls.__module__ == module.__name__]
    if len(layers) != 1 or layers[0] is None:
        check_backbone_type(model_type, misfit=f"{base_model.__name__}._no_split_modules names no single decoder layer")
    if len(rotaries) != 1:
        check_backbone_type(model_type, misfit=f"{module.__name__} has {len(rotaries)} rotary embedding classes, not 1")
    router = (base_model._can_record_outputs or {}).get("router_logits")
    if router is not None and not isinstance(router, OutputRecorder):
        router = OutputRecorder(target_class=router, index=0)
    return BackboneClasses(base_model=base_model, decoder_layer=layers[0], rotary=rotaries[0], router=router,
                           load_balancing_loss=getattr(module, "load_balancing_loss_func", None))


def attention_layer_types(backbone_config) -> list[str]:
    """Per-layer attention kind (``"full_attention"`` or ``"sliding_attention"``) as the backbone defines it."""
    layer_types = getattr(backbone_config, "layer_types", None)
    if layer_types is not None:
        return list(layer_types)
    kind = "sliding_attention" if getattr(backbone_config, "sliding_window", None) is not None else "full_attention"
    return [kind] * backbone_config.num_hidden_layers


def attention_masks(backbone_config, kinds: Iterable[str], inputs_embeds: torch.Tensor,
                    attention_mask: torch.Tensor | None, cache: Cache | None,
                    position_ids: torch.Tensor,
                    cache_layers: dict[str, int] | None = None) -> dict[str, torch.Tensor | None]:
    """The backbone's causal (and sliding-window) masks, one per attention kind the layers use. ``cache_layers``
    names, per kind, the cache layer whose length sizes the mask (default: the cache's first layer of that kind)."""
    mask_kwargs = {"config": backbone_config, "inputs_embeds": inputs_embeds, "attention_mask": attention_mask,
                   "cache": cache, "position_ids": position_ids}
    build = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
    cache_layers = cache_layers or {}
    return {kind: build[kind](**mask_kwargs, layer_idx=cache_layers.get(kind)) for kind in kinds}


def first_layer_of_each_kind(layers: Iterable[nn.Module]) -> dict[str, int]:
    """The index of the first layer of each attention kind that runs here: a pipeline stage's cache holds only its
    own layers (the others are ``PipelineIdentityLayer``s), so those size its masks and count the tokens seen."""
    first: dict[str, int] = {}
    for index, layer in enumerate(layers):
        if not isinstance(layer, PipelineIdentityLayer):
            first.setdefault(layer.attention_type, index)
    return first


def rotary_takes_layer_type(rotary: nn.Module) -> bool:
    """Whether the backbone's rotary module computes one embedding per attention kind (Gemma 3: ``forward(x,
    position_ids, layer_type)``, its own frequencies for sliding and full layers)."""
    return "layer_type" in inspect.signature(rotary.forward).parameters


def rotary_embeddings(rotary: nn.Module, per_layer_type: bool, kinds: Iterable[str], hidden_states: torch.Tensor,
                      position_ids: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``(cos, sin)`` per attention kind, as the backbone's own forward computes them."""
    if per_layer_type:
        return {kind: rotary(hidden_states, position_ids, kind) for kind in kinds}
    shared = rotary(hidden_states, position_ids)
    return dict.fromkeys(kinds, shared)


@contextmanager
def recording_router_logits(layers: nn.Module, router: OutputRecorder | None, enabled: bool):
    """Collect the router logits ``[B*T, experts]`` of every MoE layer in ``layers`` while the block runs, from the
    router outputs the backbone itself records (its ``_can_record_outputs["router_logits"]``). Yields the list the
    logits are appended to, in layer order (``None`` when not ``enabled`` or the family has no router)."""
    if not enabled or router is None:
        yield None
        return
    collected: list[torch.Tensor] = []

    def record(module, args, output):
        collected.append(output[router.index] if isinstance(output, tuple) else output)

    hooks = [module.register_forward_hook(record) for module in layers.modules()
             if isinstance(module, router.target_class)]
    try:
        yield collected
    finally:
        for hook in hooks:
            hook.remove()


def expand_to_streams(embeddings: torch.Tensor, hc_mult: int) -> torch.Tensor:
    """The embedding output ``[B, T, C]`` copied into ``hc_mult`` streams ``[B, T, n, C]``."""
    return embeddings.unsqueeze(-2).expand(-1, -1, hc_mult, -1).contiguous()


def scale_embeddings(backbone_config, embeddings: torch.Tensor, from_tokens: bool) -> torch.Tensor:
    """``[B, T, C]`` embeddings scaled as the family's wiring says (Gemma's ``sqrt(C)`` on token embeddings,
    rounded to their dtype; Granite's ``embedding_multiplier``)."""
    wiring = backbone_wiring(backbone_config.model_type)
    if wiring.embedding_scale_sqrt_hidden and from_tokens:
        embeddings = embeddings * torch.tensor(backbone_config.hidden_size**0.5).to(embeddings.dtype)
    if wiring.embedding_multiplier is not None:
        embeddings = embeddings * getattr(backbone_config, wiring.embedding_multiplier)
    return embeddings


def scale_logits(backbone_config, logits: torch.Tensor) -> torch.Tensor:
    """``[..., vocab]`` logits divided by Granite's ``logits_scaling``, soft-capped as Gemma's, per the wiring."""
    wiring = backbone_wiring(backbone_config.model_type)
    if wiring.logits_scaling is not None:
        logits = logits / getattr(backbone_config, wiring.logits_scaling)
    cap = getattr(backbone_config, wiring.final_logit_softcapping) if wiring.final_logit_softcapping else None
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


class MHCHyperConnection(nn.Module):
    """The entry of one sublayer site: ``streams [B, T, n, C]`` -> the collapsed sublayer input ``[B, T, C]`` and the
    token-dependent maps ``post [B, T, n]``, ``comb [B, T, n, n]`` (``None`` for the identity residual map; ``maps``
    gives ``pre`` too, and the comb applied).

    Parameters (float32): ``fn [m, n*C]``, ``base [m]``, ``scale [k]`` with ``m = (n+2)*n`` and ``k = 3`` for mHC
    (``config.hc_residual_map``: ``m = 2n, k = 2`` for the identity map, ``m = 2n + n!`` for permutations).
    ``sublayer_index`` counts the HC sites from the embedding (attention of layer l is ``2l``, its FFN ``2l + 1``);
    the initialisation uses it.
    """

    def __init__(self, config: MHCConfig, sublayer_index: int):
        super().__init__()
        n, hidden = config.hc_mult, config.backbone_config.hidden_size
        rows = sum(map_sizes(n, config.hc_residual_map))
        self.sublayer_index = sublayer_index
        self.hc_mult = n
        self.config = config  # the settings below are read from it at each call, so a change to it takes effect
        self.ops = resolve_hc_ops(config.hc_implementation)
        self.fn = nn.Parameter(torch.empty(rows, n * hidden, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty(rows, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(scale_size(config.hc_residual_map), dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``streams [B, T, n, C]`` -> the sublayer input ``[B, T, C]`` (``pre`` collapse), ``post [B, T, n]`` and
        ``comb [B, T, n, n]`` (float32; ``None`` for the identity map), in one op. None of them is a view: this module
        is an FSDP2 unit of its own, and FSDP2's pre-backward hook on a view output can be lost to an in-place op."""
        return self.ops.coeffs_pre(streams, self.fn, self.base, self.scale, **self._map_settings())

    def maps(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The site's maps alone: ``pre [B, T, n]``, ``post [B, T, n]``, ``comb [B, T, n, n]`` (float32), ``comb``
        being the one applied (the identity for ``hc_residual_map="identity"``)."""
        return self.ops.coeffs(streams, self.fn, self.base, self.scale, **self._map_settings())

    hc_sinkhorn_iters = property(lambda self: self.config.hc_sinkhorn_iters)
    hc_eps = property(lambda self: self.config.hc_eps)
    norm_eps = property(lambda self: self.config.backbone_config.rms_norm_eps)

    def _map_settings(self) -> dict:
        return dict(sinkhorn_iters=self.hc_sinkhorn_iters, eps=self.hc_eps, norm_eps=self.norm_eps,
                    residual_map=self.config.hc_residual_map, post_magnitude=self.config.hc_post_magnitude)


class MHCHyperHead(nn.Module):
    """Final read-out of the streams: ``[B, T, n, C] -> [B, T, C]``. Parameters ``hc_fn [n, n*C]``, ``hc_base [n]``,
    ``hc_scale [1]`` (float32), the same for every residual map."""

    def __init__(self, config: MHCConfig):
        super().__init__()
        n, hidden = config.hc_mult, config.backbone_config.hidden_size
        self.config = config  # hc_eps and norm_eps are read from it at each call
        self.ops = resolve_hc_ops(config.hc_implementation)
        self.hc_fn = nn.Parameter(torch.empty(n, n * hidden, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.empty(n, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))

    hc_eps = MHCHyperConnection.hc_eps
    norm_eps = MHCHyperConnection.norm_eps

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """``streams [B, T, n, C]`` -> ``[B, T, C]`` (streams' dtype), not a view (see MHCHyperConnection)."""
        return self.ops.head(streams, self.hc_fn, self.hc_base, self.hc_scale, eps=self.hc_eps,
                             norm_eps=self.norm_eps)


HC_MODULE_CLASSES: tuple[type[nn.Module], ...] = (MHCHyperConnection, MHCHyperHead)


def hc_mixed_precision():
    """The FSDP2 ``MixedPrecisionPolicy`` of the HC units (``DistributedConfig(fsdp_size=...)``, ``apply_fsdp2`` and
    Accelerate's FSDP2 path): gather and compute in the parameters' own dtype (float32), reduce gradients in float32,
    leave the streams they receive and the maps they return uncast."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32, output_dtype=None,
                                cast_forward_inputs=False)


def hc_modules(model: nn.Module) -> list[nn.Module]:
    """The HC modules of ``model`` (``attn_hc``, ``ffn_hc``, ``hc_head``), in module order."""
    return [module for module in model.modules() if isinstance(module, HC_MODULE_CLASSES)]


def shard_hc_units(modules: Iterable[nn.Module], **fully_shard_options) -> None:
    """``fully_shard`` each of ``modules`` as an FSDP2 unit of its own with :func:`hc_mixed_precision` (mesh,
    resharding and offload as ``fully_shard_options`` say): the one way every FSDP2 path here shards the HC modules."""
    from torch.distributed.fsdp import fully_shard

    for module in modules:
        fully_shard(module, mp_policy=hc_mixed_precision(), **fully_shard_options)


class MHCDecoderLayer(GradientCheckpointingLayer):
    """The backbone family's decoder layer with its two residual adds replaced by mHC.

    The layer's modules are those of the family's own decoder layer built for ``layer_idx`` (``self_attn``, ``mlp``
    and the norms the wiring entry names), under their own names. ``streams [B, T, n, C]`` in, ``streams [B, T, n,
    C]`` out (plus the attention weights when the attention implementation returns them).
    """

    def __init__(self, config: MHCConfig, layer_idx: int):
        super().__init__()
        backbone = config.backbone_config
        wiring = backbone_wiring(backbone.model_type)
        source = backbone_classes(backbone.model_type).decoder_layer(backbone, layer_idx)
        self.layer_idx = layer_idx
        self.attention_type = attention_layer_types(backbone)[layer_idx]
        adopted = {"self_attn", "mlp", *wiring.attention_before, *wiring.attention_after, *wiring.mlp_before,
                   *wiring.mlp_after}
        children = dict(source.named_children())
        missing = sorted(adopted - set(children))
        left_over = [name for name in children if name not in adopted]  # e.g. a norm or dropout mHC would drop
        if missing or left_over:
            what = f"lacks {missing}" if missing else f"has {left_over}, which the wiring entry does not place"
            check_backbone_type(backbone.model_type, misfit=f"{type(source).__name__} {what}")
        for name, child in children.items():  # in the backbone's own order
            if name in adopted:
                self.add_module(name, child)
        self.attention_before, self.attention_after = wiring.attention_before, wiring.attention_after
        self.mlp_before, self.mlp_after = wiring.mlp_before, wiring.mlp_after
        multiplier = wiring.residual_multiplier
        self.residual_multiplier = None if multiplier is None else getattr(backbone, multiplier)
        self.config = config
        self.layer_hc_recompute: bool | None = None  # set on one layer: that layer's own choice
        self.attn_hc = MHCHyperConnection(config, sublayer_index=2 * layer_idx)
        self.ffn_hc = MHCHyperConnection(config, sublayer_index=2 * layer_idx + 1)

    @property
    def hc_recompute(self) -> bool:
        """Selective recomputation in this layer: ``config.hc_recompute``, unless set on the layer itself."""
        return self.config.hc_recompute if self.layer_hc_recompute is None else self.layer_hc_recompute

    @hc_recompute.setter
    def hc_recompute(self, value: bool) -> None:
        self.layer_hc_recompute = value

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        attention_kwargs = dict(attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                                use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
        if self.hc_recompute and torch.is_grad_enabled():
            return self._forward_recomputing_mhc(hidden_states, attention_kwargs)
        attn_input, attn_post, attn_comb = self._enter_attention(hidden_states)
        attn_output, attn_weights = self._attention(attn_input, attention_kwargs)
        hidden_states = self.attn_hc.ops.post_res(hidden_states, attn_output, attn_post, attn_comb)
        mlp_input, mlp_post, mlp_comb = self._enter_mlp(hidden_states)
        return self.ffn_hc.ops.post_res(hidden_states, self._mlp(mlp_input), mlp_post, mlp_comb), attn_weights

    def _run_modules(self, names: tuple[str, ...], hidden_states: torch.Tensor) -> torch.Tensor:
        for name in names:
            hidden_states = getattr(self, name)(hidden_states)
        return hidden_states

    def _sublayer_output(self, names: tuple[str, ...], output: torch.Tensor) -> torch.Tensor:
        """What the backbone adds to its residual: the modules after the sublayer, then the residual multiplier."""
        output = self._run_modules(names, output)
        return output if self.residual_multiplier is None else output * self.residual_multiplier

    def _attention(self, attn_input: torch.Tensor, attention_kwargs: dict):
        attn_output, attn_weights = self.self_attn(hidden_states=attn_input, **attention_kwargs)
        return self._sublayer_output(self.attention_after, attn_output), attn_weights

    def _mlp(self, mlp_input: torch.Tensor) -> torch.Tensor:
        return self._sublayer_output(self.mlp_after, self.mlp(mlp_input))

    def _enter_attention(self, streams: torch.Tensor):
        """The attention site's input ``[B, T, C]`` (after the wiring's modules before it), ``post``, ``comb``."""
        collapsed, post, comb = self.attn_hc(streams)
        return self._run_modules(self.attention_before, collapsed), post, comb

    def _enter_mlp(self, streams: torch.Tensor):
        collapsed, post, comb = self.ffn_hc(streams)
        return self._run_modules(self.mlp_before, collapsed), post, comb

    def _between(self, streams, attn_output, attn_post, attn_comb):
        """The streams between the two sublayers and the MLP site's entry, from the layer's input."""
        return self._enter_mlp(self.attn_hc.ops.post_res(streams, attn_output, attn_post, attn_comb))

    def _exit(self, streams, attn_output, attn_post, attn_comb, mlp_output, mlp_post, mlp_comb):
        middle = self.attn_hc.ops.post_res(streams, attn_output, attn_post, attn_comb)
        return self.ffn_hc.ops.post_res(middle, mlp_output, mlp_post, mlp_comb)

    def _forward_recomputing_mhc(self, streams: torch.Tensor, attention_kwargs: dict):
        """Selective recomputation: three checkpointed mHC regions around the two sublayers, so that autograd keeps
        the layer's input streams, the sublayer outputs and ``post`` / ``comb``, and recomputes everything else of
        mHC (coefficients, collapsed inputs, the middle streams) in backward."""
        attn_input, attn_post, attn_comb = checkpoint(self._enter_attention, streams, use_reentrant=False)
        attn_output, attn_weights = self._attention(attn_input, attention_kwargs)
        mlp_input, mlp_post, mlp_comb = checkpoint(self._between, streams, attn_output, attn_post, attn_comb,
                                                   use_reentrant=False)
        mlp_output = self._mlp(mlp_input)
        out = checkpoint(self._exit, streams, attn_output, attn_post, attn_comb, mlp_output, mlp_post, mlp_comb,
                         use_reentrant=False)
        return out, attn_weights


def run_decoder_layers(
    layers: Iterable[MHCDecoderLayer],
    streams: torch.Tensor,
    masks: dict[str, torch.Tensor | None],
    position_embeddings: dict[str, tuple[torch.Tensor, torch.Tensor]],
    position_ids: torch.Tensor,
    cache: Cache | None = None,
    use_cache: bool = False,
    output_hidden_states: bool = False,
    output_attentions: bool = False,
    **kwargs,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None, tuple[torch.Tensor | None, ...] | None]:
    """The one layer loop (:class:`MHCModel` and the pipeline stages of ``hf_mhc.distributed``): ``streams [B, T, n,
    C]`` through ``layers``, each with the mask and rotary embedding of its attention kind. Returns the streams, the
    streams entering each layer and leaving the last (when ``output_hidden_states``) and the attention weights (when
    ``output_attentions``). Layers that transformers' pipeline parallelism gave to another stage
    (``PipelineIdentityLayer``) are skipped."""
    all_hidden_states = () if output_hidden_states else None
    all_attentions = () if output_attentions else None
    for layer in layers:
        if isinstance(layer, PipelineIdentityLayer):
            continue
        if output_hidden_states:
            all_hidden_states += (streams,)
        streams, attn_weights = layer(
            streams,
            attention_mask=masks[layer.attention_type],
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings[layer.attention_type],
            **kwargs,
        )
        if output_attentions:
            all_attentions += (attn_weights,)
    if output_hidden_states:
        all_hidden_states += (streams,)
    return streams, all_hidden_states, all_attentions


def function_preserving_hc_tensors(config: MHCConfig) -> dict[str, torch.Tensor]:
    """Every HC tensor of a function-preserving :class:`MHCForCausalLM`, keyed by state-dict name (float32).

    The ``fn`` / ``hc_fn`` zeros are expanded views of one scalar: no memory, whatever the model size.
    """
    n, hidden = config.hc_mult, config.backbone_config.hidden_size
    rows, scales = sum(map_sizes(n, config.hc_residual_map)), scale_size(config.hc_residual_map)
    dynamic_scale = config.hc_init_dynamic_scale
    zero = torch.zeros((), dtype=torch.float32)
    tensors = {}
    for layer in range(config.backbone_config.num_hidden_layers):
        for offset, site in enumerate(("attn_hc", "ffn_hc")):
            prefix = f"model.layers.{layer}.{site}"
            tensors[f"{prefix}.fn"] = zero.expand(rows, n * hidden)
            tensors[f"{prefix}.base"] = function_preserving_hc_base(config, 2 * layer + offset)
            tensors[f"{prefix}.scale"] = torch.full((scales,), dynamic_scale)
    tensors["model.hc_head.hc_fn"] = zero.expand(n, n * hidden)
    tensors["model.hc_head.hc_base"] = function_preserving_head_base(config)
    tensors["model.hc_head.hc_scale"] = torch.full((1,), dynamic_scale)
    return tensors


def backbone_init_weights(backbone_config, module: nn.Module) -> None:
    """Initialise ``module`` with the backbone family's own ``_init_weights``. It runs on a bare instance of the
    family's base model that carries only ``backbone_config`` (no modules, no weights): the method reads nothing
    else, and as a method of the family's class it may call its ``super()``."""
    base_model = backbone_classes(backbone_config.model_type).base_model
    bare = base_model.__new__(base_model)
    bare.config = backbone_config
    base_model._init_weights(bare, module)


def use_backbone_weight_conversions(backbone_model_type: str) -> None:
    """Make transformers' weight conversions of the backbone family those of mHC models (``model_type="mhc"``).

    transformers keeps MoE experts fused in memory (``mlp.experts.gate_up_proj``) and converts the published layout
    (one tensor per expert, Mixtral's ``block_sparse_moe.experts.0.w1``) at load and back at save, choosing the
    conversions by ``model_type``. mHC keeps every backbone tensor name, so the backbone's own conversions apply as
    they are. They are set for the family of the model being built or saved, right before transformers reads them.
    """
    register_checkpoint_conversion_mapping(
        MHCConfig.model_type, get_checkpoint_conversion_mapping(backbone_model_type) or [], overwrite=True
    )


class MHCPipelineStage(PipelineStage):
    """transformers' pipeline stage, knowing that ``hc_head`` (run before the final norm) is the last stage's."""

    def find_rank_for_key(self, key: str, num_layers: int, base_model_prefix: str) -> int | None:
        if key.startswith(f"{base_model_prefix}.hc_head."):
            return self.pp_size - 1
        return super().find_rank_for_key(key, num_layers, base_model_prefix)


def shard_hyper_connections(model: PreTrainedModel, distributed_config, mesh_manager) -> None:
    """FSDP2 units of their own for the HC modules under ``DistributedConfig(fsdp_size=...)``, before transformers
    shards the rest: gathered and computed in float32 and their gradients reduced in float32, also with
    ``fsdp_mixed_precision=True`` (which gathers every unit of transformers' own in bf16). They shard on the mesh and
    with the CPU offload transformers would use for them."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    names = ("dp_replicate", "fsdp") if distributed_config.dp_replicate_size > 1 else "fsdp"
    options = {"offload_policy": CPUOffloadPolicy()} if distributed_config.fsdp_cpu_offload else {}
    shard_hc_units(hc_modules(model), mesh=mesh_manager.get_mesh(names), reshard_after_forward=True, **options)


def pipeline_streams(model: PreTrainedModel, pp_mesh) -> None:
    """Fit transformers' naive pipeline split (``apply_pipeline_parallelism``: the layers of other stages, and the
    embedding, norm and ``lm_head`` where unused, replaced by ``PipelineIdentityLayer``) to mHC: ``hc_head`` is the
    last stage's too, so a non-last stage's base model returns the streams ``[B, T, n, C]``, and ``forward`` sends and
    receives those (:func:`pipeline_streams_forward`)."""
    model._pp_stage = MHCPipelineStage(pp_mesh)
    if not model._pp_stage.pp_is_last_stage:
        model.base_model.hc_head = PipelineIdentityLayer()
    original_forward = model.forward
    signature = inspect.signature(original_forward)

    @functools.wraps(original_forward)
    def forward(*args, **kwargs):
        return pipeline_streams_forward(model, original_forward, signature, *args, **kwargs)

    model.forward = forward


def pipeline_streams_forward(model: PreTrainedModel, original_forward: Callable, signature: inspect.Signature,
                             *args, **kwargs) -> CausalLMOutputWithPast:
    """transformers' ``pipeline_parallel_naive_forward`` with the streams as the hidden state: a non-first stage
    receives ``[B, T, n, C]`` from the previous one and feeds it as ``inputs_embeds``, a non-last stage sends its base
    model's streams on, and the logits ``[B, T, vocab]`` of the last stage are broadcast to every stage. Returns the
    logits and this stage's cache (holding its own layers)."""
    stage = model._pp_stage
    device, dtype = model.device, model.dtype
    forward_kwargs = _bind_forward_kwargs(signature, args, kwargs)
    forward_kwargs.update(forward_kwargs.pop("kwargs", None) or {})
    if not stage.pp_is_first_stage:
        tokens = forward_kwargs.pop("input_ids", None)
        batch, length = (tokens if tokens is not None else forward_kwargs["inputs_embeds"]).shape[:2]
        shape = (batch, length, model.config.hc_mult, model.config.backbone_config.hidden_size)
        forward_kwargs["inputs_embeds"] = stage.communicate("recv_forward", device=device, dtype=dtype, shape=shape)
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


AUTO_MAP = {
    "AutoConfig": "configuration_mhc.MHCConfig",
    "AutoModel": "modeling_mhc.MHCModel",
    "AutoModelForCausalLM": "modeling_mhc.MHCForCausalLM",
    "AutoModelForSequenceClassification": "modeling_mhc.MHCForSequenceClassification",
}


class MHCPreTrainedModel(PreTrainedModel):
    config_class = MHCConfig
    config: MHCConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    # The HC modules are listed too: FSDP auto-wrapping then gives these float32 modules units of their own.
    _no_split_modules = ["MHCDecoderLayer", "MHCHyperConnection", "MHCHyperHead"]
    _skip_keys_device_placement = ["cache"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True  # forward and backward trace with fullgraph=True, also with a static cache
    _keep_in_fp32_modules_strict = list(HC_MODULE_NAMES)

    def __init__(self, config: MHCConfig, *inputs, **kwargs):
        super().__init__(config, *inputs, **kwargs)
        use_backbone_weight_conversions(config.backbone_config.model_type)  # from_pretrained loads right after this
        # The backbone's float32 modules stay float32 too (DeepSeek-V3's router), with the HC modules.
        base_model = backbone_classes(config.backbone_config.model_type).base_model
        self._keep_in_fp32_modules = set(base_model._keep_in_fp32_modules or ())
        self._keep_in_fp32_modules_strict = set(HC_MODULE_NAMES) | set(base_model._keep_in_fp32_modules_strict or ())
        self._sync_backbone_attn_implementation()

    @classmethod
    def maybe_distribute_model(cls, model, distributed_config, mesh_manager):
        """transformers' engine (``from_pretrained(..., distributed_config=DistributedConfig(...))``) with the plans
        the config forwards from the backbone; with ``pp_size > 1`` the stages exchange the streams
        (:func:`pipeline_streams`) instead of a ``[B, T, C]`` hidden state."""
        pipelined = mesh_manager is not None and distributed_config.pp_size > 1
        if mesh_manager is not None and distributed_config.dp_size > 1:
            shard_hyper_connections(model, distributed_config, mesh_manager)
        if pipelined:
            model._pp_forward_wrapped = True  # the forward that transformers would wrap sends [B, T, C]
        model = super().maybe_distribute_model(model, distributed_config, mesh_manager)
        if pipelined:
            pipeline_streams(model, mesh_manager.get_mesh("pp"))
        return model

    def _resolve_parallel_plans(self, distributed_config):
        """transformers' plans, less the FSDP units of the HC modules, which :func:`shard_hyper_connections` made."""
        tp_plan, ep_plan, fsdp_plan = super()._resolve_parallel_plans(distributed_config)
        hc_units = {name for name, module in self.named_modules() if isinstance(module, HC_MODULE_CLASSES)}
        return tp_plan, ep_plan, {name: style for name, style in fsdp_plan.items() if name not in hc_units}

    def _sync_backbone_attn_implementation(self) -> None:
        # The backbone's attention and MoE experts modules read their own (nested) config; it follows the mHC
        # config's choices.
        backbone = self.config.backbone_config
        backbone._attn_implementation_internal = self.config._attn_implementation
        backbone._experts_implementation_internal = getattr(self.config, "_experts_implementation_internal", None)

    def set_hc_implementation(self, hc_implementation: str) -> None:
        """Run the mHC maps of this model through ``hc_implementation`` (``"auto"``, ``"reference"``, ``"torch"`` or
        ``"triton"``, see :class:`MHCConfig`) from now on; ``config.hc_implementation`` follows."""
        self.config.hc_implementation = hc_implementation  # checked like a constructor value
        ops = resolve_hc_ops(hc_implementation)
        for module in self.modules():
            if isinstance(module, (MHCHyperConnection, MHCHyperHead)):
                module.ops = ops

    def set_attn_implementation(self, attn_implementation, *args, **kwargs):
        super().set_attn_implementation(attn_implementation, *args, **kwargs)
        self._sync_backbone_attn_implementation()

    def _grouped_mm_can_dispatch(self) -> bool:
        """The MoE experts are the backbone family's modules: grouped_mm where the family supports it."""
        base_model = backbone_classes(self.config.backbone_config.model_type).base_model
        if not base_model._can_set_experts_implementation():
            raise ValueError(f"{base_model.__name__} does not support setting experts implementation.")
        return True

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Save as an ordinary folder whose ``auto_map`` names every mHC class, for ``trust_remote_code`` loading.

        A model whose class torch replaced with a wrapper class (FSDP2's ``fully_shard`` turns ``MHCForCausalLM`` into
        ``FSDPMHCForCausalLM``) saves as the class it wraps: the same ``auto_map`` and remote-code files
        (``configuration_mhc.py``, ``modeling_mhc.py``, ``mhc_reference.py``) as the unwrapped model, not the
        wrapper's name and torch's source files."""
        self.config.auto_map = dict(AUTO_MAP)
        use_backbone_weight_conversions(self.config.backbone_config.model_type)  # MoE experts in the published layout
        runtime_class = type(self)
        if not runtime_class.__module__.startswith("torch."):
            return super().save_pretrained(save_directory, *args, **kwargs)
        # transformers names type(self) in auto_map and copies the files of type(self)'s module. The wrapper keeps
        # its state and hooks on the instance, so the model saves the same while it is, briefly, of the mHC class.
        self.__class__ = next(cls for cls in runtime_class.__mro__ if not cls.__module__.startswith("torch."))
        try:
            return super().save_pretrained(save_directory, *args, **kwargs)
        finally:
            self.__class__ = runtime_class

    def _init_weights(self, module: nn.Module) -> None:
        """Backbone modules as the backbone initialises them (its ``_init_weights``: Gemma's zero-centred norms, MoE
        experts and routers, per-kind rotary frequencies), the HC modules as ``hc_init`` says."""
        config = self.config
        backbone_init_weights(config.backbone_config, module)
        std = getattr(config.backbone_config, "initializer_range", 0.02)
        if isinstance(module, MHCHyperConnection):
            if config.hc_init == "function_preserving":
                init.zeros_(module.fn)
                init.copy_(module.base, function_preserving_hc_base(config, module.sublayer_index))
                init.constant_(module.scale, config.hc_init_dynamic_scale)
            else:
                init.normal_(module.fn, mean=0.0, std=std)
                init.zeros_(module.base)
                init.ones_(module.scale)
        elif isinstance(module, MHCHyperHead):
            if config.hc_init == "function_preserving":
                init.zeros_(module.hc_fn)
                init.copy_(module.hc_base, function_preserving_head_base(config))
                init.constant_(module.hc_scale, config.hc_init_dynamic_scale)
            else:
                init.normal_(module.hc_fn, mean=0.0, std=std)
                init.zeros_(module.hc_base)
                init.ones_(module.hc_scale)


class MHCModel(MHCPreTrainedModel):
    """Embedding, mHC decoder layers, head read-out and final norm. Returns ``last_hidden_state [B, T, C]``;
    ``hidden_states`` (when asked) holds the streams ``[B, T, n, C]`` entering each layer and leaving the last."""

    def __init__(self, config: MHCConfig):
        super().__init__(config)
        backbone = config.backbone_config
        classes = backbone_classes(backbone.model_type)
        self.padding_idx = backbone.pad_token_id
        self.vocab_size = backbone.vocab_size
        self.embed_tokens = nn.Embedding(backbone.vocab_size, backbone.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([MHCDecoderLayer(config, i) for i in range(backbone.num_hidden_layers)])
        self.hc_head = MHCHyperHead(config)
        norm_like = getattr(self.layers[0], backbone_wiring(backbone.model_type).final_norm_like)
        self.norm = type(norm_like)(backbone.hidden_size, eps=backbone.rms_norm_eps)
        self.rotary_emb = classes.rotary(config=backbone)
        self.rotary_per_layer_type = rotary_takes_layer_type(self.rotary_emb)
        self.router = classes.router
        self.attention_kinds = tuple(sorted({layer.attention_type for layer in self.layers}))
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | dict | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        output_router_logits: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast | MoeModelOutputWithPast:
        r"""``inputs_embeds`` is either embeddings ``[B, T, C]`` (scaled and copied into the streams as token
        embeddings are) or the streams ``[B, T, n, C]`` entering the first layer, used as they are: what a pipeline
        stage receives from the one before it.

        An MoE backbone returns ``MoeModelOutputWithPast``, whose ``router_logits`` (when
        ``output_router_logits``, by default the backbone config's) hold one ``[B*T, experts]`` tensor per MoE
        layer."""
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        backbone = self.config.backbone_config
        use_cache = use_cache if use_cache is not None else getattr(backbone, "use_cache", True)
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        if output_attentions is None:
            output_attentions = self.config.output_attentions
        if self.gradient_checkpointing and self.training:
            use_cache = False
        if inputs_embeds is not None and inputs_embeds.ndim == 4:
            streams_shape = (self.config.hc_mult, backbone.hidden_size)
            if tuple(inputs_embeds.shape[2:]) != streams_shape:
                raise ValueError(f"4-D inputs_embeds are the streams [B, T, n, C] with (n, C) = {streams_shape}; got "
                                 f"shape {tuple(inputs_embeds.shape)}. Pass [B, T, C] embeddings or such streams.")
            streams, inputs_embeds = inputs_embeds, inputs_embeds[:, :, 0]  # one stream: shape, dtype, device
        else:
            from_tokens = inputs_embeds is None
            if from_tokens:
                inputs_embeds = self.embed_tokens(input_ids)
            inputs_embeds = scale_embeddings(backbone, inputs_embeds, from_tokens)
            streams = expand_to_streams(inputs_embeds, self.config.hc_mult)
        if use_cache and cache is None:
            cache = DynamicCache(config=backbone)
        cache_layers = first_layer_of_each_kind(self.layers)
        if position_ids is None:
            first_cached = min(cache_layers.values()) if cache_layers else 0  # min(default=) does not trace
            past_seen_tokens = cache.get_seq_length(first_cached) if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        if isinstance(attention_mask, dict):
            masks = attention_mask
        else:
            masks = attention_masks(backbone, cache_layers, inputs_embeds, attention_mask, cache, position_ids,
                                    cache_layers)
        position_embeddings = rotary_embeddings(self.rotary_emb, self.rotary_per_layer_type, self.attention_kinds,
                                                inputs_embeds, position_ids)
        if output_router_logits is None:
            output_router_logits = getattr(backbone, "output_router_logits", False)
        with recording_router_logits(self.layers, self.router, output_router_logits) as router_logits:
            streams, all_hidden_states, all_attentions = run_decoder_layers(
                self.layers,
                streams,
                masks,
                position_embeddings,
                position_ids,
                cache=cache,
                use_cache=use_cache,
                output_hidden_states=output_hidden_states,
                output_attentions=output_attentions,
                **kwargs,
            )
        outputs = dict(
            last_hidden_state=self.norm(self.hc_head(streams)),
            cache=cache if use_cache else None,
            hidden_states=all_hidden_states,
            attentions=all_attentions,
        )
        if self.router is None:
            return BaseModelOutputWithPast(**outputs)
        return MoeModelOutputWithPast(**outputs, router_logits=None if router_logits is None else tuple(router_logits))


class MHCForCausalLM(MHCPreTrainedModel, GenerationMixin):
    """mHC causal language model: :class:`MHCModel` plus the backbone's ``lm_head`` (tied when the backbone ties),
    its logits scaled or soft-capped as the backbone's wiring entry says."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    _fsdp_plan = {"lm_head": "keep_full_weight"}

    def __init__(self, config: MHCConfig):
        super().__init__(config)
        backbone = config.backbone_config
        self.model = MHCModel(config)
        self.vocab_size = backbone.vocab_size
        self.lm_head = nn.Linear(backbone.hidden_size, backbone.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed_tokens = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        output_router_logits: bool | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast | MoeCausalLMOutputWithPast:
        r"""``labels [B, T]`` (shifted inside, ``-100`` ignored) give ``loss``; ``logits [B, T, vocab]``.

        An MoE backbone returns ``MoeCausalLMOutputWithPast``. With ``output_router_logits`` (by default the backbone
        config's) and a family that defines a load-balancing loss (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), it is the
        family's own ``load_balancing_loss_func`` of the router logits: ``aux_loss``, added to ``loss`` times the
        backbone's ``router_aux_loss_coef``, as the backbone's ``*ForCausalLM`` does."""
        backbone = self.config.backbone_config
        if output_router_logits is None:
            output_router_logits = getattr(backbone, "output_router_logits", False)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **({"output_router_logits": output_router_logits} if self.model.router is not None else {}),
            **kwargs,
        )
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = scale_logits(backbone, self.lm_head(hidden_states))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.vocab_size, **kwargs)
        fields = dict(loss=loss, logits=logits, cache=outputs.cache, hidden_states=outputs.hidden_states,
                      attentions=outputs.attentions)
        if self.model.router is None:
            return CausalLMOutputWithPast(**fields)
        aux_loss = None
        load_balancing_loss = backbone_classes(backbone.model_type).load_balancing_loss
        if output_router_logits and load_balancing_loss is not None:
            router = next(m for m in self.model.modules() if isinstance(m, self.model.router.target_class))
            aux_loss = load_balancing_loss(outputs.router_logits, router.num_experts, router.top_k, attention_mask)
            if labels is not None:
                fields["loss"] = loss + backbone.router_aux_loss_coef * aux_loss.to(loss.device)
        return MoeCausalLMOutputWithPast(**fields, aux_loss=aux_loss, router_logits=outputs.router_logits)


class MHCForSequenceClassification(GenericForSequenceClassification, MHCPreTrainedModel):
    """Sequence classification on the last non-padding token (as transformers' ``*ForSequenceClassification``)."""

    def __init__(self, config: MHCConfig):
        MHCPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = MHCModel(config)
        self.score = nn.Linear(config.backbone_config.hidden_size, self.num_labels, bias=False)
        self.post_init()


MHCModel.register_for_auto_class("AutoModel")
MHCForCausalLM.register_for_auto_class("AutoModelForCausalLM")
MHCForSequenceClassification.register_for_auto_class("AutoModelForSequenceClassification")

__all__ = [
    "MHCDecoderLayer",
    "MHCForCausalLM",
    "MHCForSequenceClassification",
    "MHCHyperConnection",
    "MHCHyperHead",
    "MHCModel",
    "MHCPreTrainedModel",
]
