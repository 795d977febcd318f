"""The native vLLM model of hf-mhc checkpoints (``MHCForCausalLM``), with vLLM's Transformers backend for the rest.

**Which implementation serves a checkpoint.** vLLM 0.32 resolves a model class from the config's ``architectures``
alone (``ModelRegistry.inspect_model_cls`` / ``resolve_model_cls``): a registered architecture always gets its
registered class, and only an unregistered one falls back to the Transformers backend (``_try_resolve_transformers``:
the ``auto_map`` remote code, ``is_backend_compatible``, ``TransformersForCausalLM``), which is how hf-mhc checkpoints
are served without the plugin. No public hook sees the config before that choice (a ``vllm.general_plugins`` entry
point runs before any config is read), so the choice is made here, when vLLM builds the model:
:class:`MHCForCausalLM` is the class registered for ``MHCForCausalLM`` (:mod:`hf_mhc.vllm_plugin`), and its
``__new__`` returns

- the native model, built from vLLM's layers, for the dense pre-norm families ``llama``, ``mistral``, ``qwen2`` and
  ``qwen3`` with the ``"sinkhorn"`` residual map (every layer of one attention kind, SiLU MLP): :func:`native_misfit`;
- otherwise an instance of vLLM's Transformers backend class for the config (``TransformersForCausalLM``, or the MoE
  one), built exactly as vLLM builds it for an unregistered architecture. With ``model_impl="vllm"`` such a
  checkpoint raises ``ValueError`` instead.

Either way one log line names the path (``hf-mhc: serving FOLDER with the native vLLM mHC model (llama, sinkhorn;
...)`` or ``... with vLLM's Transformers backend (REASON)``). vLLM's config-level view is that of this class: the
Transformers backend reached through it gets no pipeline parallelism, LoRA, speculative decoding or MLA attention
(those follow the resolved class's interfaces, and this one declares none); ``model_impl="transformers"`` bypasses
this class and gives the Transformers backend with all of them.

**The native model.** vLLM's own decoder layers of the backbone family (``LlamaDecoderLayer``,
``MistralDecoderLayer``, ``Qwen2DecoderLayer``, ``Qwen3DecoderLayer``: ``QKVParallelLinear`` /
``MergedColumnParallelLinear`` / ``RowParallelLinear``, ``get_rope``, q/k norms, vLLM's ``Attention`` with its paged
KV cache) give their sublayers and norms, adopted under their own names; ``VocabParallelEmbedding``, ``RMSNorm``,
``ParallelLMHead`` (tied where the backbone ties) and ``LogitsProcessor`` do the rest. The hidden state is the
streams ``[T, n, C]`` (``n = hc_mult``, model dtype): the embedding is copied into every stream (vLLM's
``hc_expand``); around each sublayer the site's maps collapse the streams into its input (``hc_pre``), the family's
norm and sublayer run, and the output is merged back (``hc_post``); ``hc_head`` reads the streams out before the final
norm, as in vLLM's DeepSeek-V4. The HC parameters are float32 whatever the model dtype and replicated on every
tensor-parallel rank (every rank holds the full streams: vLLM's row-parallel layers and embedding return full rows).
Checkpoint names are hf-mhc's (``model.layers.{i}.attn_hc.{fn,base,scale}``, ``model.hc_head.{hc_fn,hc_base,
hc_scale}``), q/k/v and gate/up stacked as vLLM's Llama loads them.

**The mHC maps: vLLM's ops, and where hf-mhc's run instead.** vLLM's ``MHCPreOp`` / ``MHCPostOp`` / ``HCHeadOp``
(``vllm/model_executor/layers/mhc.py``) implement hf-mhc's maps with the same parameter layout: ``fn`` rows
pre | post | comb, ``scale[3]``, the RMS norm of the flattened streams with the backbone's ``rms_norm_eps``,
``pre = σ(·) + eps``, ``post = 2σ(·)`` (``hc_post_mult_value=2``), ``comb`` softmax + eps, a column normalisation and
``iters - 1`` row and column rounds, each ``/(sum + eps)``, applied transposed (``out_j = post_j·y + Σ_i comb_ij·x_i``),
the head's ``σ(hc_scale·mix + hc_base) + eps``; one ``hc_eps`` serves as both ``hc_pre_eps`` and
``hc_sinkhorn_eps``. Only the argument order (``fn, scale, base``) and ``post``'s shape (``[T, n, 1]``) differ. The
torch references of ``MHCPreOp`` and ``MHCPostOp`` give hf-mhc's numbers to float32 rounding. But vLLM's mHC kernels
take 16-bit streams (TileLang and AITER bfloat16; the CPU kernels, only in vLLM's AVX-512-BF16 build, 16-bit), the
torch reference of ``MHCPreOp`` asserts bfloat16, and ``HCHeadOp`` has no torch implementation. So, per model:

================  ===========================  ===============================================  ====================
streams dtype     vLLM's mHC kernels present   collapse / merge                                 head read-out
================  ===========================  ===============================================  ====================
bfloat16          yes (and ``hc_mult == 4``)   ``MHCPreOp`` / ``MHCPostOp``                     ``HCHeadOp``
bfloat16          no                           their torch references (``forward_native``)      hf-mhc's ops
other             —                            hf-mhc's ops, in float32                         hf-mhc's ops
================  ===========================  ===============================================  ====================

hf-mhc's ops are those ``hf_mhc.MHCForCausalLM`` runs (``hf_mhc.modeling_mhc.hc_ops`` of the config's
``hc_implementation``: the C++ decode kernels or torch kernels on CPU, Triton on CUDA), in float32. ``hc_mult == 4``
is the only stream count vLLM's kernels serve in vLLM (DeepSeek-V4). ``MHCFusedPostPreOp`` is not used: on CPU it is
the two ops in sequence, and its fused kernels are bfloat16 GPU kernels.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PretrainedConfig
from vllm import ModelRegistry
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mhc import HAS_TILELANG_MHC, HCHeadOp, MHCPostOp, MHCPreOp, hc_expand
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.llama import LlamaDecoderLayer
from vllm.model_executor.models.mistral import MistralDecoderLayer
from vllm.model_executor.models.qwen2 import Qwen2DecoderLayer
from vllm.model_executor.models.qwen3 import Qwen3DecoderLayer
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper, make_layers, maybe_prefix
from vllm.platforms import current_platform
from vllm.sequence import IntermediateTensors

from .compat import require
from .mhc_reference import POST_MAGNITUDE
from .modeling_mhc import attention_layer_types, hc_ops

# A child of vLLM's logger: the line is printed with vLLM's own, at vLLM's level.
logger = init_logger(f"vllm.{__name__}")

# The families served natively: model_type -> its vLLM decoder layer for (vllm_config, backbone config, prefix).
FAMILY_LAYERS: dict[str, Callable[[VllmConfig, PretrainedConfig, str], nn.Module]] = {
    "llama": lambda vllm_config, config, prefix: LlamaDecoderLayer(vllm_config, prefix, config),
    "mistral": lambda vllm_config, config, prefix: MistralDecoderLayer(vllm_config, prefix, config),
    "qwen2": lambda vllm_config, config, prefix: Qwen2DecoderLayer(
        config, vllm_config.cache_config, vllm_config.quant_config, prefix),
    "qwen3": lambda vllm_config, config, prefix: Qwen3DecoderLayer(
        config, vllm_config.cache_config, vllm_config.quant_config, prefix),
}
NATIVE_RESIDUAL_MAP = "sinkhorn"
# The modules of a family's decoder layer that the mHC layer adopts, under their own names.
ADOPTED_MODULES = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
# hf-mhc's q/k/v and gate/up tensors -> vLLM's stacked parameters (as LlamaModel.hf_to_vllm_mapper).
STACKED_WEIGHTS = WeightsMapper(orig_to_new_stacked={
    ".q_proj": (".qkv_proj", "q"),
    ".k_proj": (".qkv_proj", "k"),
    ".v_proj": (".qkv_proj", "v"),
    ".gate_proj": (".gate_up_proj", 0),
    ".up_proj": (".gate_up_proj", 1),
})
VLLM_KERNEL_STREAMS = 4  # the stream count vLLM's mHC kernels run in vLLM (DeepSeek-V4)


def native_misfit(config: PretrainedConfig) -> str | None:
    """Why the native model cannot serve an mHC ``config`` (one phrase), or ``None`` when it can."""
    backbone = config.backbone_config
    if backbone.model_type not in FAMILY_LAYERS:
        return f"backbone family {backbone.model_type!r}; the native model serves {', '.join(FAMILY_LAYERS)}"
    if config.hc_residual_map != NATIVE_RESIDUAL_MAP:
        return f"residual map {config.hc_residual_map!r}; the native model runs {NATIVE_RESIDUAL_MAP!r}"
    if getattr(backbone, "hidden_act", "silu") != "silu":
        return f"activation {backbone.hidden_act!r}; vLLM's {backbone.model_type} MLP runs 'silu'"
    if len(set(attention_layer_types(backbone))) > 1:
        return "layers of both full and sliding-window attention"
    return None


def vllm_mhc_kernels_present() -> bool:
    """Whether vLLM's compiled mHC kernels run on this platform (for bfloat16 streams; see the module docstring)."""
    if current_platform.is_cpu():  # vLLM builds them into its AVX-512-BF16 library only
        return hasattr(torch.ops._C, "hc_pre_fused_cpu")
    if current_platform.is_cuda():
        return HAS_TILELANG_MHC
    return current_platform.is_rocm() or current_platform.is_xpu()  # ROCm's ops fall back within themselves


@dataclass(frozen=True)
class HCOps:
    """Which code runs a model's mHC maps (the module docstring's table) and the settings of the maps.

    ``vllm_ops``: collapse and merge by vLLM's ``MHCPreOp`` / ``MHCPostOp``; ``vllm_kernels``: through their kernels
    (and the head by ``HCHeadOp``) rather than their torch references. ``hf_implementation``: the
    ``hc_implementation`` of hf-mhc's ops, which run every step vLLM's do not.
    """

    vllm_ops: bool
    vllm_kernels: bool
    hf_implementation: str
    hc_mult: int
    sinkhorn_iters: int
    eps: float
    norm_eps: float

    @classmethod
    def choose(cls, config: PretrainedConfig, dtype: torch.dtype) -> HCOps:
        """The ops for an mHC ``config`` served with streams of ``dtype``."""
        vllm_ops = dtype == torch.bfloat16
        kernels = vllm_ops and config.hc_mult == VLLM_KERNEL_STREAMS and vllm_mhc_kernels_present()
        return cls(vllm_ops=vllm_ops, vllm_kernels=kernels,
                   hf_implementation=getattr(config, "hc_implementation", "auto"), hc_mult=config.hc_mult,
                   sinkhorn_iters=config.hc_sinkhorn_iters, eps=config.hc_eps,
                   norm_eps=config.backbone_config.rms_norm_eps)

    def describe(self) -> str:
        """The ops in a few words, for the log line."""
        if self.vllm_kernels:
            return "mHC maps: vLLM's mHC kernels"
        if self.vllm_ops:
            return "mHC maps: vLLM's mHC torch ops, hf-mhc's head read-out"
        return f"mHC maps: hf-mhc's float32 ops, hc_implementation={self.hf_implementation!r}"


class HyperConnection(nn.Module):
    """One sublayer site: float32 ``fn [(n+2)·n, n·C]`` (rows pre | post | comb), ``base [(n+2)·n]``, ``scale [3]``,
    replicated under tensor parallelism. ``post`` and ``comb`` pass from :meth:`collapse` to :meth:`merge` in the
    layout of the ops that made them."""

    def __init__(self, hidden_size: int, ops: HCOps):
        super().__init__()
        n, rows = ops.hc_mult, (ops.hc_mult + 2) * ops.hc_mult
        self.ops = ops
        self.fn = nn.Parameter(torch.empty(rows, n * hidden_size, dtype=torch.float32), requires_grad=False)
        self.base = nn.Parameter(torch.empty(rows, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32), requires_grad=False)
        if ops.vllm_ops:
            self.pre_op, self.post_op = MHCPreOp(), MHCPostOp()

    def collapse(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``streams [T, n, C]`` -> the sublayer input ``Σ_i pre_i·X_i`` ``[T, C]`` (streams' dtype), ``post`` and
        ``comb`` (float32: ``[T, n, 1]`` and ``[T, n, n]`` from vLLM's op, ``[T, n]`` and ``[T, n, n]`` from
        hf-mhc's)."""
        ops = self.ops
        if not ops.vllm_ops:
            hf_ops = hc_ops(ops.hf_implementation, streams, self.fn, self.base, self.scale)
            return hf_ops.mhc_coeffs_pre(streams, self.fn, self.base, self.scale, sinkhorn_iters=ops.sinkhorn_iters,
                                         eps=ops.eps, norm_eps=ops.norm_eps)
        pre_op = self.pre_op if ops.vllm_kernels else self.pre_op.forward_native
        post, comb, sublayer_input = pre_op(streams, self.fn, self.scale, self.base, ops.norm_eps, ops.eps, ops.eps,
                                            POST_MAGNITUDE, ops.sinkhorn_iters)
        return sublayer_input, post, comb

    def merge(self, streams: torch.Tensor, output: torch.Tensor, post: torch.Tensor,
              comb: torch.Tensor) -> torch.Tensor:
        """The sublayer's ``output [T, C]`` merged into ``streams [T, n, C]``: ``X'_i = post_i·y + Σ_j comb_ji·X_j``
        (streams' dtype)."""
        if not self.ops.vllm_ops:
            return hc_ops(self.ops.hf_implementation, streams, output, post, comb).mhc_post_res(
                streams, output, post, comb)
        post_op = self.post_op if self.ops.vllm_kernels else self.post_op.forward_native
        return post_op(output, streams, post, comb)


class HyperHead(nn.Module):
    """The read-out ``streams [T, n, C] -> Σ_i pre_i·X_i [T, C]``: float32 ``hc_fn [n, n·C]``, ``hc_base [n]``,
    ``hc_scale [1]``, replicated under tensor parallelism."""

    def __init__(self, hidden_size: int, ops: HCOps):
        super().__init__()
        n = ops.hc_mult
        self.ops = ops
        self.hc_fn = nn.Parameter(torch.empty(n, n * hidden_size, dtype=torch.float32), requires_grad=False)
        self.hc_base = nn.Parameter(torch.empty(n, dtype=torch.float32), requires_grad=False)
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32), requires_grad=False)
        if ops.vllm_kernels:
            self.head_op = HCHeadOp()

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        if ops.vllm_kernels:
            return self.head_op(streams, self.hc_fn, self.hc_scale, self.hc_base, ops.norm_eps, ops.eps)
        hf_ops = hc_ops(ops.hf_implementation, streams, self.hc_fn, self.hc_base, self.hc_scale)
        return hf_ops.mhc_head(streams, self.hc_fn, self.hc_base, self.hc_scale, eps=ops.eps, norm_eps=ops.norm_eps)


class MHCDecoderLayer(nn.Module):
    """The family's vLLM decoder layer with its two residual adds replaced by mHC: ``streams [T, n, C]`` in and out.

    Its modules are those of the family's layer built for ``prefix`` (:data:`ADOPTED_MODULES`, under their own
    names, so vLLM's attention keeps its KV-cache name ``{prefix}.self_attn.attn``), plus ``attn_hc`` and ``ffn_hc``.
    """

    def __init__(self, vllm_config: VllmConfig, config: PretrainedConfig, ops: HCOps, prefix: str):
        super().__init__()
        backbone = config.backbone_config
        family_layer = FAMILY_LAYERS[backbone.model_type](vllm_config, backbone, prefix)
        for name in ADOPTED_MODULES:
            self.add_module(name, getattr(family_layer, name))
        self.attn_hc = HyperConnection(backbone.hidden_size, ops)
        self.ffn_hc = HyperConnection(backbone.hidden_size, ops)

    def forward(self, positions: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """``positions [T]``, ``streams [T, n, C]``: collapse, the family's norm and sublayer, merge; twice."""
        sublayer_input, post, comb = self.attn_hc.collapse(streams)
        output = self.self_attn(positions=positions, hidden_states=self.input_layernorm(sublayer_input))
        streams = self.attn_hc.merge(streams, output, post, comb)
        sublayer_input, post, comb = self.ffn_hc.collapse(streams)
        output = self.mlp(self.post_attention_layernorm(sublayer_input))
        return self.ffn_hc.merge(streams, output, post, comb)


class MHCModel(nn.Module):
    """Embedding, mHC decoder layers, ``hc_head`` and the final norm: ``input_ids [T]`` -> ``hidden [T, C]``."""

    def __init__(self, vllm_config: VllmConfig, ops: HCOps, prefix: str):
        super().__init__()
        config = vllm_config.model_config.hf_config
        backbone = config.backbone_config
        self.hc_mult = config.hc_mult
        self.embed_tokens = VocabParallelEmbedding(backbone.vocab_size, backbone.hidden_size,
                                                   quant_config=vllm_config.quant_config,
                                                   prefix=f"{prefix}.embed_tokens")
        _, _, self.layers = make_layers(
            backbone.num_hidden_layers,
            lambda prefix: MHCDecoderLayer(vllm_config, config, ops, prefix),
            prefix=f"{prefix}.layers",
        )
        self.hc_head = HyperHead(backbone.hidden_size, ops)
        self.norm = RMSNorm(backbone.hidden_size, eps=backbone.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids [T]`` or ``inputs_embeds [T, C]``, ``positions [T]`` -> ``hidden [T, C]``."""
        embeddings = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        streams = hc_expand(embeddings, self.hc_mult)  # [T, n, C]: the embedding in every stream
        for layer in self.layers:
            streams = layer(positions, streams)
        return self.norm(self.hc_head(streams))


class MHCForCausalLM(nn.Module):
    """The class vLLM builds for an hf-mhc checkpoint (architecture ``MHCForCausalLM``).

    ``__new__`` builds vLLM's Transformers backend instead where :func:`native_misfit` names a reason (see the module
    docstring); otherwise this native model: :class:`MHCModel`, the backbone's ``lm_head`` (tied to the embedding
    where the backbone ties them) and vLLM's ``LogitsProcessor``.
    """

    def __new__(cls, *, vllm_config: VllmConfig, prefix: str = "") -> nn.Module:
        model_config = vllm_config.model_config
        misfit = native_misfit(model_config.hf_config)
        if misfit is None:
            return super().__new__(cls)
        if model_config.model_impl == "vllm":
            raise ValueError(f"hf-mhc: {model_config.model} has no native vLLM implementation ({misfit}); serve it "
                             "with model_impl='auto' or 'transformers'.")
        logger.info("hf-mhc: serving %s with vLLM's Transformers backend (%s)", model_config.model, misfit)
        backend_name = require("vllm.config.model:ModelConfig._get_transformers_backend_cls")(model_config)
        backend_class, _ = ModelRegistry.resolve_model_cls(backend_name, model_config)
        return backend_class(vllm_config=vllm_config, prefix=prefix)

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        model_config = vllm_config.model_config
        config = model_config.hf_config
        backbone = config.backbone_config
        ops = HCOps.choose(config, model_config.dtype)
        logger.info("hf-mhc: serving %s with the native vLLM mHC model (%s, %s; %s)", model_config.model,
                    backbone.model_type, config.hc_residual_map, ops.describe())
        self.config = config
        self.model = MHCModel(vllm_config, ops, maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(backbone.vocab_size, backbone.hidden_size, quant_config=vllm_config.quant_config,
                                      prefix=maybe_prefix(prefix, "lm_head"))
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(backbone.vocab_size, scale=getattr(backbone, "logit_scale", 1.0))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids [T]`` -> token embeddings ``[T, C]`` (before they are copied into the streams)."""
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden [T, C]`` after the final norm. No pipeline parallelism: ``intermediate_tensors`` is unused."""
        return self.model(input_ids, positions, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """hf-mhc's checkpoint names; q/k/v and gate/up into vLLM's stacked parameters, a tied ``lm_head`` once."""
        return AutoWeightsLoader(self).load_weights(weights, mapper=STACKED_WEIGHTS)
