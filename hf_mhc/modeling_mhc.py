"""mHC models on dense residual backbones (Llama, Mistral, Qwen2, Qwen3).

Decoder layers reuse the backbone family's own attention, MLP, RMSNorm and rotary modules, so every backbone
tensor keeps its name (``model.layers.0.self_attn.q_proj.weight``). Only the residual wiring is new: the hidden
state is ``hc_mult`` streams ``[B, T, n, C]``, mixed around each sublayer by ``attn_hc`` / ``ffn_hc`` and read
out by ``model.hc_head`` (the formulas are in ``mhc_reference.py``; names and numerics as transformers' DeepSeek-V4).

This file, ``configuration_mhc.py`` and ``mhc_reference.py`` are copied flat into saved checkpoints, so a
machine without ``hf_mhc`` can load them with ``trust_remote_code=True``.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_layers import GenericForSequenceClassification, GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel, slice_logits_to_keep
from transformers.utils import can_return_tuple
from transformers.utils.deprecation import deprecate_kwarg

from .configuration_mhc import MHCConfig, check_backbone_type

try:  # the plugin's dispatching ops (fused kernels where available)
    from hf_mhc.kernels import mhc_coeffs, mhc_coeffs_pre, mhc_head, mhc_post_res, sinkhorn
except ImportError:  # a checkpoint loaded as remote code on a machine without hf_mhc
    from .mhc_reference import mhc_coeffs, mhc_coeffs_pre, mhc_head, mhc_post_res, sinkhorn


@dataclass(frozen=True)
class BackboneModules:
    """The transformers classes an mHC decoder layer borrows from one backbone family."""

    attention: type[nn.Module]
    mlp: type[nn.Module]
    norm: type[nn.Module]
    rotary: type[nn.Module]


HC_MODULE_NAMES: tuple[str, ...] = ("attn_hc", "ffn_hc", "hc_head")  # the float32 mHC modules, by attribute name

_BACKBONE_CLASS_PREFIX = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}


def backbone_modules(model_type: str) -> BackboneModules:
    """Attention / MLP / RMSNorm / rotary classes of a supported backbone family."""
    check_backbone_type(model_type)
    prefix = _BACKBONE_CLASS_PREFIX[model_type]
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    return BackboneModules(
        attention=getattr(module, f"{prefix}Attention"),
        mlp=getattr(module, f"{prefix}MLP"),
        norm=getattr(module, f"{prefix}RMSNorm"),
        rotary=getattr(module, f"{prefix}RotaryEmbedding"),
    )


def attention_layer_types(backbone_config) -> list[str]:
    """Per-layer attention kind (``"full_attention"`` or ``"sliding_attention"``) as the backbone defines it."""
    layer_types = getattr(backbone_config, "layer_types", None)
    if layer_types is not None:
        return list(layer_types)
    kind = "sliding_attention" if getattr(backbone_config, "sliding_window", None) is not None else "full_attention"
    return [kind] * backbone_config.num_hidden_layers


def attention_masks(backbone_config, kinds: set[str], inputs_embeds: torch.Tensor, attention_mask: torch.Tensor | None,
                    cache: Cache | None, position_ids: torch.Tensor) -> dict[str, torch.Tensor | None]:
    """The backbone's causal (and sliding-window) masks, one per attention kind the layers use."""
    mask_kwargs = {"config": backbone_config, "inputs_embeds": inputs_embeds, "attention_mask": attention_mask,
                   "cache": cache, "position_ids": position_ids}
    build = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
    return {kind: build[kind](**mask_kwargs) for kind in kinds}


def expand_to_streams(embeddings: torch.Tensor, hc_mult: int) -> torch.Tensor:
    """The embedding output ``[B, T, C]`` copied into ``hc_mult`` streams ``[B, T, n, C]``."""
    return embeddings.unsqueeze(-2).expand(-1, -1, hc_mult, -1).contiguous()


class MHCHyperConnection(nn.Module):
    """The entry of one sublayer site: ``streams [B, T, n, C]`` -> the collapsed sublayer input ``[B, T, C]`` and the
    token-dependent maps ``post [B, T, n]``, ``comb [B, T, n, n]`` (``maps`` gives ``pre`` too).

    Parameters (float32): ``fn [(n+2)*n, n*C]``, ``base [(n+2)*n]``, ``scale [3]``. ``sublayer_index`` counts the
    HC sites from the embedding (attention of layer l is ``2l``, its FFN ``2l + 1``); the initialisation uses it.
    """

    def __init__(self, config: MHCConfig, sublayer_index: int):
        super().__init__()
        n, hidden = config.hc_mult, config.backbone_config.hidden_size
        self.sublayer_index = sublayer_index
        self.hc_mult = n
        self.hc_sinkhorn_iters = config.hc_sinkhorn_iters
        self.hc_eps = config.hc_eps
        self.norm_eps = config.backbone_config.rms_norm_eps
        self.fn = nn.Parameter(torch.empty((n + 2) * n, n * hidden, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty((n + 2) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``streams [B, T, n, C]`` -> the sublayer input ``[B, T, C]`` (``pre`` collapse), ``post [B, T, n]`` and
        ``comb [B, T, n, n]`` (float32), in one op. None of them is a view: this module is an FSDP2 unit of its own,
        and FSDP2's pre-backward hook on a view output can be lost to an in-place op."""
        return mhc_coeffs_pre(streams, self.fn, self.base, self.scale, **self._map_settings())

    def maps(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The site's maps alone: ``pre [B, T, n]``, ``post [B, T, n]``, ``comb [B, T, n, n]`` (float32)."""
        return mhc_coeffs(streams, self.fn, self.base, self.scale, **self._map_settings())

    def _map_settings(self) -> dict:
        return dict(sinkhorn_iters=self.hc_sinkhorn_iters, eps=self.hc_eps, norm_eps=self.norm_eps)


class MHCHyperHead(nn.Module):
    """Final read-out of the streams: ``[B, T, n, C] -> [B, T, C]``. Parameters ``hc_fn [n, n*C]``, ``hc_base [n]``,
    ``hc_scale [1]`` (float32)."""

    def __init__(self, config: MHCConfig):
        super().__init__()
        n, hidden = config.hc_mult, config.backbone_config.hidden_size
        self.hc_eps = config.hc_eps
        self.norm_eps = config.backbone_config.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.empty(n, n * hidden, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.empty(n, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """``streams [B, T, n, C]`` -> ``[B, T, C]`` (streams' dtype), not a view (see MHCHyperConnection)."""
        return mhc_head(streams, self.hc_fn, self.hc_base, self.hc_scale, eps=self.hc_eps, norm_eps=self.norm_eps)


class MHCDecoderLayer(GradientCheckpointingLayer):
    """A pre-norm decoder layer of the backbone family with its two residual adds replaced by mHC.

    ``streams [B, T, n, C]`` in, ``streams [B, T, n, C]`` out (plus the attention weights when the attention
    implementation returns them).
    """

    def __init__(self, config: MHCConfig, layer_idx: int):
        super().__init__()
        backbone = config.backbone_config
        parts = backbone_modules(backbone.model_type)
        self.layer_idx = layer_idx
        self.attention_type = attention_layer_types(backbone)[layer_idx]
        self.self_attn = parts.attention(config=backbone, layer_idx=layer_idx)
        self.mlp = parts.mlp(backbone)
        self.input_layernorm = parts.norm(backbone.hidden_size, eps=backbone.rms_norm_eps)
        self.post_attention_layernorm = parts.norm(backbone.hidden_size, eps=backbone.rms_norm_eps)
        self.hc_recompute = config.hc_recompute
        self.attn_hc = MHCHyperConnection(config, sublayer_index=2 * layer_idx)
        self.ffn_hc = MHCHyperConnection(config, sublayer_index=2 * layer_idx + 1)

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
        attn_output, attn_weights = self.self_attn(hidden_states=attn_input, **attention_kwargs)
        hidden_states = mhc_post_res(hidden_states, attn_output, attn_post, attn_comb)
        mlp_input, mlp_post, mlp_comb = self._enter_mlp(hidden_states)
        return mhc_post_res(hidden_states, self.mlp(mlp_input), mlp_post, mlp_comb), attn_weights

    def _enter_attention(self, streams: torch.Tensor):
        """The attention site's normalised input ``[B, T, C]``, ``post`` and ``comb``."""
        collapsed, post, comb = self.attn_hc(streams)
        return self.input_layernorm(collapsed), post, comb

    def _enter_mlp(self, streams: torch.Tensor):
        collapsed, post, comb = self.ffn_hc(streams)
        return self.post_attention_layernorm(collapsed), post, comb

    def _between(self, streams, attn_output, attn_post, attn_comb):
        """The streams between the two sublayers and the MLP site's entry, from the layer's input."""
        return self._enter_mlp(mhc_post_res(streams, attn_output, attn_post, attn_comb))

    def _exit(self, streams, attn_output, attn_post, attn_comb, mlp_output, mlp_post, mlp_comb):
        middle = mhc_post_res(streams, attn_output, attn_post, attn_comb)
        return mhc_post_res(middle, mlp_output, mlp_post, mlp_comb)

    def _forward_recomputing_mhc(self, streams: torch.Tensor, attention_kwargs: dict):
        """Selective recomputation: three checkpointed mHC regions around the two sublayers, so that autograd keeps
        the layer's input streams, the sublayer outputs and ``post`` / ``comb``, and recomputes everything else of
        mHC (coefficients, collapsed inputs, the middle streams) in backward."""
        attn_input, attn_post, attn_comb = checkpoint(self._enter_attention, streams, use_reentrant=False)
        attn_output, attn_weights = self.self_attn(hidden_states=attn_input, **attention_kwargs)
        mlp_input, mlp_post, mlp_comb = checkpoint(self._between, streams, attn_output, attn_post, attn_comb,
                                                   use_reentrant=False)
        mlp_output = self.mlp(mlp_input)
        out = checkpoint(self._exit, streams, attn_output, attn_post, attn_comb, mlp_output, mlp_post, mlp_comb,
                         use_reentrant=False)
        return out, attn_weights


def _logit(p: float) -> float:
    return math.log(p / (1.0 - p))


def function_preserving_hc_base(config: MHCConfig, sublayer_index: int) -> torch.Tensor:
    """``base [(n+2)*n]`` of the function-preserving initialisation, with ``fn = 0``.

    ``pre = 1/n`` exactly and ``comb_b = c·I``. A symmetric ``comb`` has equal row and column sums ``s``, which the
    ``hc_eps`` terms of Sinkhorn make ``1 - O(hc_eps)``, so each site scales the stream mean by ``s``. The ``post``
    values of site ``k`` are ``s^(k+1) · 2σ(±j·δ)`` in pairs (``j = 1, 2, ...``; ``s^(k+1)`` alone for odd n): their
    mean ``s^(k+1)`` scales the sublayer output like the residual, so the stream mean after site ``k`` is exactly
    ``s^(k+1)`` times the residual network's hidden state. Pre-norm sublayers and the final norm cancel that
    uniform scale, so the model reproduces its backbone to float32 rounding rather than to ``hc_eps · depth``.
    Distinct ``j·δ`` keep every stream different (identical streams would get identical gradients forever).
    """
    n, eps = config.hc_mult, config.hc_eps
    comb_b = config.hc_init_comb_diag * torch.eye(n, dtype=torch.float64)
    row_sum = sinkhorn(comb_b.float(), config.hc_sinkhorn_iters, eps).double().sum(-1).mean()
    post_mean = row_sum ** (sublayer_index + 1)
    half_post = torch.full((n,), 0.5, dtype=torch.float64)
    for pair in range(n // 2):
        half_post[2 * pair] = torch.sigmoid(torch.tensor((pair + 1) * config.hc_init_post_delta, dtype=torch.float64))
        half_post[2 * pair + 1] = 1.0 - half_post[2 * pair]
    post_b = torch.logit(post_mean * half_post)
    pre_b = torch.full((n,), _logit(1.0 / n - eps), dtype=torch.float64)
    return torch.cat([pre_b, post_b, comb_b.flatten()]).float()


def function_preserving_head_base(config: MHCConfig) -> torch.Tensor:
    """``hc_base [n]`` making the head average the streams: ``pre_h = 1/n`` exactly (with ``hc_fn = 0``)."""
    return torch.full((config.hc_mult,), _logit(1.0 / config.hc_mult - config.hc_eps), dtype=torch.float32)


def function_preserving_hc_tensors(config: MHCConfig) -> dict[str, torch.Tensor]:
    """Every HC tensor of a function-preserving :class:`MHCForCausalLM`, keyed by state-dict name (float32).

    The ``fn`` / ``hc_fn`` zeros are expanded views of one scalar: no memory, whatever the model size.
    """
    n, hidden = config.hc_mult, config.backbone_config.hidden_size
    dynamic_scale = config.hc_init_dynamic_scale
    zero = torch.zeros((), dtype=torch.float32)
    tensors = {}
    for layer in range(config.backbone_config.num_hidden_layers):
        for offset, site in enumerate(("attn_hc", "ffn_hc")):
            prefix = f"model.layers.{layer}.{site}"
            tensors[f"{prefix}.fn"] = zero.expand((n + 2) * n, n * hidden)
            tensors[f"{prefix}.base"] = function_preserving_hc_base(config, 2 * layer + offset)
            tensors[f"{prefix}.scale"] = torch.full((3,), dynamic_scale)
    tensors["model.hc_head.hc_fn"] = zero.expand(n, n * hidden)
    tensors["model.hc_head.hc_base"] = function_preserving_head_base(config)
    tensors["model.hc_head.hc_scale"] = torch.full((1,), dynamic_scale)
    return tensors


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
        self._sync_backbone_attn_implementation()

    def _sync_backbone_attn_implementation(self) -> None:
        # The backbone's attention modules read their own (nested) config; it follows the mHC config's choice.
        self.config.backbone_config._attn_implementation_internal = self.config._attn_implementation

    def set_attn_implementation(self, attn_implementation, *args, **kwargs):
        super().set_attn_implementation(attn_implementation, *args, **kwargs)
        self._sync_backbone_attn_implementation()

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Save as an ordinary folder whose ``auto_map`` names every mHC class, for ``trust_remote_code`` loading.

        A model whose class torch replaced with a wrapper class (FSDP2's ``fully_shard`` turns ``MHCForCausalLM`` into
        ``FSDPMHCForCausalLM``) saves as the class it wraps: the same ``auto_map`` and remote-code files
        (``configuration_mhc.py``, ``modeling_mhc.py``, ``mhc_reference.py``) as the unwrapped model, not the
        wrapper's name and torch's source files."""
        self.config.auto_map = dict(AUTO_MAP)
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
        super()._init_weights(module)
        config = self.config
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
        parts = backbone_modules(backbone.model_type)
        self.padding_idx = backbone.pad_token_id
        self.vocab_size = backbone.vocab_size
        self.embed_tokens = nn.Embedding(backbone.vocab_size, backbone.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList([MHCDecoderLayer(config, i) for i in range(backbone.num_hidden_layers)])
        self.hc_head = MHCHyperHead(config)
        self.norm = parts.norm(backbone.hidden_size, eps=backbone.rms_norm_eps)
        self.rotary_emb = parts.rotary(config=backbone)
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
        **kwargs,
    ) -> BaseModelOutputWithPast:
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
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=backbone)
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        if isinstance(attention_mask, dict):
            masks = attention_mask
        else:
            kinds = {layer.attention_type for layer in self.layers}
            masks = attention_masks(backbone, kinds, inputs_embeds, attention_mask, cache, position_ids)
        streams = expand_to_streams(inputs_embeds, self.config.hc_mult)
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids)
        all_hidden_states = () if output_hidden_states else None
        all_attentions = () if output_attentions else None
        for layer in self.layers:
            if output_hidden_states:
                all_hidden_states += (streams,)
            streams, attn_weights = layer(
                streams,
                attention_mask=masks[layer.attention_type],
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                position_embeddings=position_embeddings,
                **kwargs,
            )
            if output_attentions:
                all_attentions += (attn_weights,)
        if output_hidden_states:
            all_hidden_states += (streams,)

        return BaseModelOutputWithPast(
            last_hidden_state=self.norm(self.hc_head(streams)),
            cache=cache if use_cache else None,
            hidden_states=all_hidden_states,
            attentions=all_attentions,
        )


class MHCForCausalLM(MHCPreTrainedModel, GenerationMixin):
    """mHC causal language model: :class:`MHCModel` plus the backbone's ``lm_head`` (tied when the backbone ties)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}

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
        **kwargs,
    ) -> CausalLMOutputWithPast:
        r"""``labels [B, T]`` (shifted inside, ``-100`` ignored) give ``loss``; ``logits [B, T, vocab]``."""
        outputs: BaseModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


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
