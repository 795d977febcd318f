"""mHC models on residual backbones: any family with a wiring entry (``BACKBONE_WIRINGS``).

The decoder layers are the backbone family's own: each mHC layer builds the family's decoder layer (found through
transformers' registry) and adopts its attention, MLP or MoE block and norms under their own names
(``model.layers.0.self_attn.q_proj.weight``). Only the residual wiring is new: the hidden state is ``n = hc_mult``
streams ``[B, T, n, C]``; around each sublayer ``attn_hc`` / ``ffn_hc`` collapse them into the sublayer's input and
merge its output back, and ``model.hc_head`` reads them out. The formulas are in ``mhc_reference.py``; names and
numerics follow transformers' DeepSeek-V4.

This file, ``configuration_mhc.py``, ``mhc_reference.py`` and ``distributed.py`` are copied flat into saved
checkpoints, so a machine without ``hf_mhc`` loads them with ``trust_remote_code=True``.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
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
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from . import mhc_reference
from .configuration_mhc import HC_MODULE_NAMES, MHCConfig, backbone_wiring, check_backbone_type
from .distributed import distribute_with_transformers
from .mhc_reference import function_preserving_hc_base, function_preserving_head_base, map_sizes, scale_size

try:  # the plugin's kernels and their dispatch table (absent where a checkpoint is loaded as remote code alone)
    from hf_mhc.kernels.dispatch import mhc_ops as kernel_ops
except ImportError as error:
    kernel_ops, KERNELS_IMPORT_ERROR = None, error
try:  # the plugin's model card (remote code alone saves none)
    from hf_mhc import model_card
except ImportError:
    model_card = None

logger = logging.get_logger(__name__)



def hc_ops(implementation: str, streams: torch.Tensor, *weights: torch.Tensor):
    """The ops that run one call of the mHC maps (an object with ``mhc_reference``'s functions): the plugin's dispatch
    table ``hf_mhc.kernels.dispatch.MHC_OPS``, keyed by ``implementation``, the device and whether a gradient is
    wanted. Without the plugin's kernels (a checkpoint loaded as remote code on a machine without hf-mhc),
    ``"auto"`` warns once and runs ``mhc_reference``; ``"torch"`` / ``"triton"`` raise ``ImportError``."""
    if kernel_ops is not None:
        return kernel_ops(implementation, streams, *weights)
    if implementation not in ("auto", "reference"):
        raise ImportError(f"hc_implementation={implementation!r} needs hf_mhc.kernels, which failed to import "
                          f"({KERNELS_IMPORT_ERROR}); install hf-mhc, or use hc_implementation='reference'.")
    if implementation == "auto":
        logger.warning_once(f"hf_mhc.kernels failed to import ({KERNELS_IMPORT_ERROR}): the mHC maps run the plain "
                            "reference formula (hc_implementation='reference'), which is slower and saves more for "
                            "backward.")
    return mhc_reference


@dataclass(frozen=True)
class BackboneClasses:
    """The transformers classes (and functions) of one backbone family that an mHC model is built from."""

    base_model: type[PreTrainedModel]  # e.g. LlamaModel: its _init_weights initialises the backbone modules
    decoder_layer: type[nn.Module]  # e.g. LlamaDecoderLayer, named by base_model._no_split_modules
    rotary: type[nn.Module]  # e.g. LlamaRotaryEmbedding, the one rotary class of the family's modeling file
    router: type[nn.Module] | None = None  # MoE: the router whose first output the family records as router_logits
    load_balancing_loss: Callable | None = None  # MoE: the family's load_balancing_loss_func, if it has one


@functools.cache
def backbone_classes(model_type: str) -> BackboneClasses:
    """Base model, decoder-layer, rotary and router classes of a supported family, from transformers' registry."""
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
    if isinstance(router, OutputRecorder):
        if router.index != 0:
            check_backbone_type(model_type, misfit="its router_logits are not its router's first output")
        router = router.target_class
    return BackboneClasses(base_model=base_model, decoder_layer=layers[0], rotary=rotaries[0], router=router,
                           load_balancing_loss=getattr(module, "load_balancing_loss_func", None))


def attention_layer_types(backbone_config) -> list[str]:
    """Per-layer attention kind (``"full_attention"`` or ``"sliding_attention"``) as the backbone defines it."""
    layer_types = getattr(backbone_config, "layer_types", None)
    if layer_types is not None:
        return list(layer_types)
    kind = "sliding_attention" if getattr(backbone_config, "sliding_window", None) is not None else "full_attention"
    return [kind] * backbone_config.num_hidden_layers


class MHCHyperConnection(nn.Module):
    """One sublayer site: collapses the streams into the sublayer's input and makes the maps that merge its output.

    Parameters (float32): ``fn [m, n*C]``, ``base [m]``, ``scale [k]``; ``m = (n+2)*n`` and ``k = 3`` for mHC
    (``2n`` and 2 for ``hc_residual_map="identity"``, ``2n + n!`` and 3 for ``"permutations"``). ``sublayer_index``
    counts the sites from the embedding (attention of layer ``l`` is ``2l``, its MLP ``2l + 1``); the
    function-preserving initialisation depends on it.
    """

    def __init__(self, config: MHCConfig, sublayer_index: int):
        super().__init__()
        n, hidden = config.hc_mult, config.backbone_config.hidden_size
        rows = sum(map_sizes(n, config.hc_residual_map))
        self.sublayer_index = sublayer_index
        self.hc_mult = n
        self.config = config  # the settings below are read from it at each call, so a change to it takes effect
        self.fn = nn.Parameter(torch.empty(rows, n * hidden, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty(rows, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(scale_size(config.hc_residual_map), dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``streams [B, T, n, C]`` -> the collapsed sublayer input ``Σ_i pre[i]·X[i]`` ``[B, T, C]`` (streams'
        dtype), ``post [B, T, n]`` and ``comb [B, T, n, n]`` (float32; ``None`` for the identity map), in one op.
        No output tensor is a view: this module is an FSDP2 unit of its own, and FSDP2's pre-backward hook on a view
        output can be lost to an in-place op."""
        config = vars(self.config)
        ops = hc_ops(config["hc_implementation"], streams, self.fn, self.base, self.scale)
        return ops.mhc_coeffs_pre(streams, self.fn, self.base, self.scale, **self._map_settings(config))

    def merge(self, streams: torch.Tensor, output: torch.Tensor, post: torch.Tensor,
              comb: torch.Tensor | None) -> torch.Tensor:
        """The sublayer's ``output [B, T, C]`` merged back: ``X'[i] = post[i]·y + Σ_j comb[j, i]·X[j]``, streams'
        dtype (``comb`` ``None``: ``X'[i] = post[i]·y + X[i]``). Reads no parameter of the site."""
        weights = (output, post) if comb is None else (output, post, comb)
        ops = hc_ops(vars(self.config)["hc_implementation"], streams, *weights)
        return ops.mhc_post_res(streams, output, post, comb)

    def maps(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The site's maps alone: ``pre [B, T, n]``, ``post [B, T, n]``, ``comb [B, T, n, n]`` (float32), ``comb``
        being the one applied (the identity for ``hc_residual_map="identity"``)."""
        config = vars(self.config)
        ops = hc_ops(config["hc_implementation"], streams, self.fn, self.base, self.scale)
        return ops.mhc_coeffs(streams, self.fn, self.base, self.scale, **self._map_settings(config))

    hc_sinkhorn_iters = property(lambda self: self.config.hc_sinkhorn_iters)
    hc_eps = property(lambda self: self.config.hc_eps)
    norm_eps = property(lambda self: self.config.backbone_config.rms_norm_eps)

    @staticmethod
    def _map_settings(config: dict) -> dict:
        """The keywords of the map ops, from the config's fields ``vars(config)``: one lookup per call, where reading
        each setting as an attribute goes through ``PreTrainedConfig.__getattribute__`` (Python) once per setting."""
        return dict(sinkhorn_iters=config["hc_sinkhorn_iters"], eps=config["hc_eps"],
                    norm_eps=vars(config["backbone_config"])["rms_norm_eps"], residual_map=config["hc_residual_map"],
                    post_magnitude=config["hc_post_magnitude"])


class MHCHyperHead(nn.Module):
    """Final read-out of the streams ``[B, T, n, C] -> [B, T, C]``. Parameters (float32) ``hc_fn [n, n*C]``,
    ``hc_base [n]``, ``hc_scale [1]``, the same for every residual map."""

    def __init__(self, config: MHCConfig):
        super().__init__()
        n, hidden = config.hc_mult, config.backbone_config.hidden_size
        self.config = config  # hc_eps and norm_eps are read from it at each call
        self.hc_fn = nn.Parameter(torch.empty(n, n * hidden, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.empty(n, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))

    hc_eps = MHCHyperConnection.hc_eps
    norm_eps = MHCHyperConnection.norm_eps

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """``streams [B, T, n, C]`` -> ``Σ_i pre_h[i]·X[i]`` ``[B, T, C]`` (streams' dtype), not a view."""
        config = vars(self.config)
        ops = hc_ops(config["hc_implementation"], streams, self.hc_fn, self.hc_base, self.hc_scale)
        return ops.mhc_head(streams, self.hc_fn, self.hc_base, self.hc_scale, eps=config["hc_eps"],
                            norm_eps=vars(config["backbone_config"])["rms_norm_eps"])


class MHCDecoderLayer(GradientCheckpointingLayer):
    """The backbone family's decoder layer with its two residual adds replaced by mHC.

    Its modules are those of the family's own decoder layer built for ``layer_idx`` (``self_attn``, ``mlp`` and the
    norms its wiring entry names), under their own names. ``streams [B, T, n, C]`` in and out.
    """

    def __init__(self, config: MHCConfig, layer_idx: int):
        super().__init__()
        backbone = config.backbone_config
        wiring = backbone_wiring(backbone.model_type)
        classes = backbone_classes(backbone.model_type)
        source = classes.decoder_layer(backbone, layer_idx)
        adopted = {"self_attn", "mlp", *wiring.attention_before, *wiring.attention_after, *wiring.mlp_before,
                   *wiring.mlp_after}
        children = dict(source.named_children())
        missing = sorted(adopted - set(children))
        left_over = [name for name in children if name not in adopted]  # e.g. a norm or dropout mHC would drop
        if missing or left_over:
            what = f"lacks {missing}" if missing else f"has {left_over}, which the wiring entry does not place"
            check_backbone_type(backbone.model_type, misfit=f"{type(source).__name__} {what}")
        routers = [name for name, module in source.named_modules()
                   if classes.router is not None and isinstance(module, classes.router)]
        if any(name != "mlp.gate" for name in routers):  # where MHCPreTrainedModel records the router logits
            check_backbone_type(backbone.model_type, misfit=f"its router sits at {routers[0]}, not at mlp.gate")
        for name, child in children.items():  # in the backbone's own order
            if name in adopted:
                self.add_module(name, child)
        self.layer_idx = layer_idx
        self.attention_type = attention_layer_types(backbone)[layer_idx]
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
    ) -> torch.Tensor:
        """``hidden_states``: the streams ``[B, T, n, C]`` entering the layer; returns the streams leaving it.

        Around each sublayer: collapse the streams into its input (``attn_hc`` / ``ffn_hc``: ``Σ_i pre[i]·X[i]``,
        through the backbone's norms before it), run it (with the backbone's modules after it and its residual
        multiplier), merge its output ``y`` back: ``X'[i] = post[i]·y + Σ_j comb[j, i]·X[j]``. With ``hc_recompute``
        in training, :meth:`forward_recomputing` runs the same steps instead.
        """
        if self.hc_recompute and torch.is_grad_enabled():
            return self.forward_recomputing(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                            cache=cache, use_cache=use_cache,
                                            position_embeddings=position_embeddings, **kwargs)
        streams = hidden_states
        attn_input, attn_post, attn_comb = self.collapse(self.attn_hc, self.attention_before, streams)
        attn_output, _ = self.self_attn(hidden_states=attn_input, attention_mask=attention_mask,
                                        position_ids=position_ids, cache=cache, use_cache=use_cache,
                                        position_embeddings=position_embeddings, **kwargs)
        attn_output = self.sublayer_output(attn_output, self.attention_after)
        streams = self.attn_hc.merge(streams, attn_output, attn_post, attn_comb)

        mlp_input, mlp_post, mlp_comb = self.collapse(self.ffn_hc, self.mlp_before, streams)
        mlp_output = self.sublayer_output(self.mlp(mlp_input), self.mlp_after)
        return self.ffn_hc.merge(streams, mlp_output, mlp_post, mlp_comb)

    def collapse(self, site: MHCHyperConnection, norms: tuple[str, ...], streams: torch.Tensor, *attention):
        """``site``'s sublayer input (through the backbone's ``norms`` before it), ``post`` and ``comb``, from
        ``streams``; with ``attention`` (its output, post and comb), from the streams with the attention merged in."""
        if attention:
            streams = self.attn_hc.merge(streams, *attention)
        sublayer_input, post, comb = site(streams)
        for name in norms:
            sublayer_input = getattr(self, name)(sublayer_input)
        return sublayer_input, post, comb

    def sublayer_output(self, output: torch.Tensor, after: tuple[str, ...]) -> torch.Tensor:
        """A sublayer's output through the backbone's modules ``after`` it, times its residual multiplier."""
        for name in after:
            output = getattr(self, name)(output)
        return output if self.residual_multiplier is None else output * self.residual_multiplier

    def forward_recomputing(self, streams: torch.Tensor, **attention_kwargs) -> torch.Tensor:
        """:meth:`forward` under ``hc_recompute`` (selective recomputation, mHC paper §4.3.2): the mHC steps run in
        checkpointed regions. The layer keeps for backward its input streams, the two sublayer outputs and ``post`` /
        ``comb``; backward recomputes the coefficients, the collapsed inputs and the streams between the two
        sublayers, which the two regions after attention remake from the layer's input (merging the attention
        again) rather than keep."""
        region = functools.partial(checkpoint, use_reentrant=False)
        attn_input, attn_post, attn_comb = region(self.collapse, self.attn_hc, self.attention_before, streams)
        attn_output, _ = self.self_attn(hidden_states=attn_input, **attention_kwargs)
        attention = (self.sublayer_output(attn_output, self.attention_after), attn_post, attn_comb)

        mlp_input, mlp_post, mlp_comb = region(self.collapse, self.ffn_hc, self.mlp_before, streams, *attention)
        mlp_output = self.sublayer_output(self.mlp(mlp_input), self.mlp_after)
        return region(self._merge_both, streams, mlp_output, mlp_post, mlp_comb, *attention)

    def _merge_both(self, streams: torch.Tensor, mlp_output, mlp_post, mlp_comb, *attention) -> torch.Tensor:
        """The attention, then the MLP's output, merged into the layer's input ``streams``."""
        return self.ffn_hc.merge(self.attn_hc.merge(streams, *attention), mlp_output, mlp_post, mlp_comb)


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
    # Whatever the backbone family: the streams entering each layer and leaving the last, the attention weights, and
    # the logits of the MoE routers, which every supported MoE family keeps at `mlp.gate` (checked per layer).
    _can_record_outputs = {
        "hidden_states": MHCDecoderLayer,
        "attentions": OutputRecorder(None, index=1, class_name="self_attn"),
        "router_logits": OutputRecorder(None, index=0, class_name="mlp.gate"),
    }

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
        """transformers' engine (``from_pretrained(..., distributed_config=DistributedConfig(...))``) with the mHC
        adapters of :mod:`distributed`: float32 FSDP2 units for the HC modules, the streams between pipeline stages."""
        return distribute_with_transformers(super().maybe_distribute_model, model, distributed_config, mesh_manager)

    def _sync_backbone_attn_implementation(self) -> None:
        # The backbone's attention and MoE experts modules read their own (nested) config; it follows the mHC
        # config's choices.
        backbone = self.config.backbone_config
        backbone._attn_implementation_internal = self.config._attn_implementation
        backbone._experts_implementation_internal = getattr(self.config, "_experts_implementation_internal", None)

    def set_hc_implementation(self, hc_implementation: str) -> None:
        """Run the mHC maps of this model through ``hc_implementation`` (``"auto"``, ``"reference"``, ``"torch"`` or
        ``"triton"``, see :class:`MHCConfig`) from now on; ``config.hc_implementation`` follows."""
        self.config.hc_implementation = hc_implementation  # checked like a constructor value; read at each call

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

        The remote-code files are ``configuration_mhc.py``, ``modeling_mhc.py`` and the files it imports,
        ``mhc_reference.py`` and ``distributed.py``. A model whose class a torch wrapper replaced (FSDP2's
        ``fully_shard`` turns ``MHCForCausalLM`` into ``FSDPMHCForCausalLM``) saves as the class it wraps: the same
        ``auto_map`` and files as the unwrapped model. An upcycled model (``config.upcycled_from`` set) also gets
        hf-mhc's model card, ``README.md``, unless the folder holds one that hf-mhc did not write
        (:mod:`hf_mhc.model_card`)."""
        self.config.auto_map = dict(AUTO_MAP)
        use_backbone_weight_conversions(self.config.backbone_config.model_type)  # MoE experts in the published layout
        runtime_class = type(self)
        # transformers names type(self) in auto_map and copies the files of type(self)'s module. The wrapper keeps
        # its state and hooks on the instance, so the model saves the same while it is, briefly, of the mHC class.
        self.__class__ = next(cls for cls in runtime_class.__mro__ if not cls.__module__.startswith("torch."))
        try:
            saved = super().save_pretrained(save_directory, *args, **kwargs)
            is_main_process = kwargs.get("is_main_process", args[0] if args else True)
            if self.config.upcycled_from is not None and model_card is not None and is_main_process:
                self._write_model_card(Path(save_directory))
        finally:
            self.__class__ = runtime_class
        return saved

    def _write_model_card(self, folder: Path) -> None:
        """hf-mhc's model card in ``folder``, or one line saying why the ``README.md`` there is left as it is."""
        if not model_card.may_write_card(folder):
            logger.warning(model_card.kept_card_message(folder))
            return
        # The Auto class that loads the saved class (or the mHC class it derives from); a causal LM's by default.
        auto_classes = {target.rpartition(".")[2]: name for name, target in AUTO_MAP.items()}
        auto_class = next((auto_classes[cls.__name__] for cls in type(self).__mro__ if cls.__name__ in auto_classes),
                          "AutoModelForCausalLM")
        dtype = str(self.dtype).removeprefix("torch.")
        quantization = getattr(self.config, "quantization_config", None)
        method = quantization.get("quant_method") if isinstance(quantization, dict) else getattr(
            quantization, "quant_method", None)
        quantized = f", Linear weights quantized ({getattr(method, 'value', method)})" if quantization else ""
        card = model_card.model_card(
            self.config, folder.name, made_by="`save_pretrained`", auto_class=auto_class,
            weights=f"backbone tensors in {dtype}{quantized}; HC tensors float32.",
            verification="not verified: upcycled in memory (`hf_mhc.upcycle`) or trained since; `hf-mhc convert` "
            "compares the logits and greedy decoding of a conversion with its source.",
        )
        (folder / model_card.CARD_FILE).write_text(card, encoding="utf-8")

    def _init_weights(self, module: nn.Module) -> None:
        """Backbone modules as the backbone initialises them (its ``_init_weights``: Gemma's zero-centred norms, MoE
        experts and routers, per-kind rotary frequencies), the HC modules as ``hc_init`` says."""
        config = self.config
        backbone_init_weights(config.backbone_config, module)
        std = getattr(config.backbone_config, "initializer_range", 0.02)
        if isinstance(module, MHCHyperConnection):
            fn, base, scale = module.fn, module.base, module.scale
            preserving_base = functools.partial(function_preserving_hc_base, config, module.sublayer_index)
        elif isinstance(module, MHCHyperHead):
            fn, base, scale = module.hc_fn, module.hc_base, module.hc_scale
            preserving_base = functools.partial(function_preserving_head_base, config)
        else:
            return
        if config.hc_init == "function_preserving":  # the dynamic part off (fn = 0), its scale non-zero for a gradient
            init.zeros_(fn)
            init.copy_(base, preserving_base())
            init.constant_(scale, config.hc_init_dynamic_scale)
        else:  # DeepSeek-V4's
            init.normal_(fn, mean=0.0, std=std)
            init.zeros_(base)
            init.ones_(scale)


class MHCModel(MHCPreTrainedModel):
    """Embedding, mHC decoder layers, head read-out and final norm: ``last_hidden_state [B, T, C]``.
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
        self.wiring = backbone_wiring(backbone.model_type)
        self.norm = type(getattr(self.layers[0], self.wiring.final_norm_like))(backbone.hidden_size,
                                                                                 eps=backbone.rms_norm_eps)
        self.rotary_emb = classes.rotary(config=backbone)
        # Gemma 3's rotary embedding takes the layer type: its own frequencies for sliding and full layers.
        self.rotary_per_layer_type = "layer_type" in inspect.signature(self.rotary_emb.forward).parameters
        self.layer_types = attention_layer_types(backbone)
        self.router = classes.router
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    @merge_with_config_defaults
    @capture_outputs(tie_last_hidden_states=False)
    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | dict | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast | MoeModelOutputWithPast:
        r"""``inputs_embeds`` is either embeddings ``[B, T, C]`` (scaled and copied into the streams as token
        embeddings are) or the streams ``[B, T, n, C]`` entering the first layer, used as they are.
        ``attention_mask`` may be a dict of masks by attention kind, as ``generate`` builds them.

        An MoE backbone returns ``MoeModelOutputWithPast``, whose ``router_logits`` (when ``output_router_logits``,
        by default the backbone config's) hold one ``[B*T, experts]`` tensor per MoE layer."""
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        backbone, wiring, n = self.config.backbone_config, self.wiring, self.config.hc_mult
        if inputs_embeds is not None and inputs_embeds.ndim == 4:
            if tuple(inputs_embeds.shape[2:]) != (n, backbone.hidden_size):
                raise ValueError(f"4-D inputs_embeds are the streams [B, T, n, C] with (n, C) = "
                                 f"{(n, backbone.hidden_size)}; got shape {tuple(inputs_embeds.shape)}. Pass [B, T, C] "
                                 "embeddings or such streams.")
            streams = inputs_embeds
        else:
            if inputs_embeds is None:
                inputs_embeds = self.embed_tokens(input_ids)
                if wiring.embedding_scale_sqrt_hidden:  # Gemma: sqrt(C), rounded to the embeddings' dtype
                    inputs_embeds = inputs_embeds * torch.tensor(backbone.hidden_size**0.5).to(inputs_embeds.dtype)
            if wiring.embedding_multiplier is not None:  # Granite
                inputs_embeds = inputs_embeds * getattr(backbone, wiring.embedding_multiplier)
            streams = inputs_embeds.unsqueeze(-2).expand(-1, -1, n, -1).contiguous()  # the embedding in every stream
        hidden = streams[:, :, 0]  # [B, T, C]: the shape, dtype and device the masks and rotary embedding read

        if use_cache and cache is None:
            cache = DynamicCache(config=backbone)
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(hidden.shape[1], device=hidden.device) + past_seen_tokens).unsqueeze(0)
        kinds = sorted(set(self.layer_types))
        if not isinstance(attention_mask, dict):
            mask_kwargs = dict(config=backbone, inputs_embeds=hidden, attention_mask=attention_mask, cache=cache,
                               position_ids=position_ids)
            build = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
            attention_mask = {kind: build[kind](**mask_kwargs) for kind in kinds}
        if self.rotary_per_layer_type:
            position_embeddings = {kind: self.rotary_emb(hidden, position_ids, kind) for kind in kinds}
        else:
            position_embeddings = dict.fromkeys(kinds, self.rotary_emb(hidden, position_ids))

        for layer, kind in zip(self.layers, self.layer_types, strict=True):
            streams = layer(
                streams,
                attention_mask=attention_mask[kind],
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                position_embeddings=position_embeddings[kind],
                **kwargs,
            )

        output_class = BaseModelOutputWithPast if self.router is None else MoeModelOutputWithPast
        return output_class(last_hidden_state=self.norm(self.hc_head(streams)), cache=cache if use_cache else None)


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
        backbone, wiring = self.config.backbone_config, self.model.wiring
        moe = self.model.router is not None
        if moe and output_router_logits is None:
            output_router_logits = getattr(backbone, "output_router_logits", False)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **({"output_router_logits": output_router_logits} if moe else {}),
            **kwargs,
        )
        logits = self.lm_head(slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep))
        if wiring.logits_scaling is not None:  # Granite
            logits = logits / getattr(backbone, wiring.logits_scaling)
        cap = getattr(backbone, wiring.final_logit_softcapping) if wiring.final_logit_softcapping else None
        if cap is not None:  # Gemma
            logits = torch.tanh(logits / cap) * cap

        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.vocab_size, **kwargs)
        fields = dict(loss=loss, logits=logits, cache=outputs.cache, hidden_states=outputs.hidden_states,
                      attentions=outputs.attentions)
        if not moe:
            return CausalLMOutputWithPast(**fields)
        aux_loss = None
        load_balancing_loss = backbone_classes(backbone.model_type).load_balancing_loss
        if output_router_logits and load_balancing_loss is not None:
            router = next(module for module in self.model.modules() if isinstance(module, self.model.router))
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
