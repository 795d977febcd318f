"""Memory planning from a config alone: KV cache, parameters per device, mHC stream traffic, pipeline boundaries.

:func:`plan_memory` reads a config (a residual backbone config, an :class:`MHCConfig`, or a folder / Hub id whose
``config.json`` is read; never weights) and returns a :class:`MemoryPlan` for a workload of ``batch`` sequences of
``tokens`` tokens in ``dtype``:

* **KV cache**, as transformers' ``DynamicCache`` stores it. Per token and layer, a standard attention layer holds a
  key and a value of ``num_key_value_heads × head_dim`` each (MHA, GQA and MQA alike); DeepSeek-V3's latent attention
  (MLA) holds the normalised latent ``[B, 1, T, kv_lora_rank]`` as its "key" and the rotary key
  ``[B, 1, T, qk_rope_head_dim]`` as its "value", i.e. ``kv_lora_rank + qk_rope_head_dim`` values. A sliding-window
  (or chunked) layer keeps the last ``sliding_window - 1`` tokens, plus an 8-byte int64 holding the window (those
  tokens are a view: its storage spans the whole prompt right after a prefill, ``sliding_window`` tokens while
  decoding). The layer types are transformers' own (``layer_types``, else ``sliding_window``). mHC leaves the cache
  unchanged: attention reads the collapsed ``[B, T, C]`` sublayer input, not the ``n`` streams.
* **Parameters**: the model built on the ``meta`` device (no memory, no weights), the backbone in ``dtype`` and the HC
  maps in float32, then split per device as transformers' ``DistributedConfig`` splits it, on the device holding the
  most: tensor parallelism (``tp``) follows the model's own TP plan (``model.tp_plan``), each style placing a
  parameter as transformers' does (:data:`TP_STYLE_PLACEMENTS`: colwise by output rows, rowwise by input columns with
  the bias whole, the embeddings and LM head by vocabulary rows, packed gate / up halves each apart; ``torch.chunk``'s
  slices, ``ceil(d / tp)`` on the first ranks); what the plan leaves whole (norms, router, ...) and the HC maps are
  on every rank. Pipeline parallelism (``pp``) gives each stage an even share of the layers (the first ``L mod pp``
  stages one more), the embeddings to the first stage and the final norm, mHC head and LM head to the last (tied
  embeddings on both); FSDP (``fsdp``) is FSDP2's split of each TP shard along dimension 0, ``ceil(rows / fsdp)`` rows
  on every rank (padded to the first rank's).
* **mHC traffic**, in HBM bytes per token per layer (two sites: attention and feed-forward), from the element counts
  of the mHC paper's Table 2 with streams in ``dtype``: unfused (transformers' DeepSeek-V4 path) a site reads
  ``(5n+1)·C`` and writes ``(3n+1)·C``; with hf-mhc's fused kernels it reads ``n·C`` and writes ``C`` for the
  coefficients + ``pre`` collapse, and reads ``(n+1)·C`` and writes ``n·C`` for ``post`` + ``comb`` + residual. The
  small ``n² + 2n`` coefficient terms are left out. Compared with the layer's weight bytes read per token: at decode
  one read shared by the ``batch`` tokens of a step (of a MoE layer's ``E`` routed experts at most ``top_k · batch``),
  at prefill ``1 / (batch · tokens)`` of the whole layer.
* **Activations**: the bytes autograd holds for backward after the training forward of the workload (one forward of
  ``batch`` unpadded, unpacked sequences of ``tokens`` tokens with labels; parameters excluded), for the residual
  model and its mHC upcycle, plain, with ``hc_recompute`` and with gradient checkpointing, by running the model's own
  transformers forward on fake tensors (``FakeTensorMode``: shapes and dtypes, no memory, no weights) and counting
  what its ops save (``saved_tensors_hooks``) and what its checkpoints keep (their inputs and a 5,056-byte copy of
  the CPU random state each): exactly what the same forward holds on real CPU tensors (tested for every family, and
  the count against torch's profiler). Per token per layer: the storages first held inside the decoder layers, over
  ``batch · tokens · layers``; the rest (embeddings, final norm, logits, loss) is reported apart. Kernels counted:
  the config's attention implementation (default SDPA) with torch's kernels, as on CPU (SDPA's fused kernel: ``q,
  k, v``, output, log-sum-exp; ``eager``: the ``T × T`` probabilities), except that an SDPA attention whose
  ``q``/``k`` and ``v`` head dims differ (MLA) is counted as CUDA's memory-efficient kernel, which keeps the same
  set, where the CPU would keep the ``T × T`` probabilities; float32 / float16 MoE experts as transformers'
  grouped-mm fallback (torch's grouped-mm kernel takes bfloat16). Gradient checkpointing holds each layer's inputs;
  its backward recomputes one layer at a time, adding up to the largest layer's bytes of the case without it.
* **Pipeline boundary**: the ``n·C`` streams (``C`` for a residual model) of every token of a microbatch, in
  ``dtype``, cross each stage boundary forward (and their gradient backward).
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from transformers import AutoModelForCausalLM, PreTrainedConfig, masking_utils
from transformers.cache_utils import get_layer_types_and_kwargs
from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES, _get_parameter_plan
from transformers.distributed.tensor_parallel import TensorParallelLayer, get_kv_heads_per_rank
from transformers.initialization import no_init_weights
from transformers.integrations import moe

from .configuration_mhc import MHCConfig, check_attention_heads, check_backbone_type, load_pretrained_config
from .conversion.convert import DTYPES  # the model dtypes hf-mhc's commands take
from .conversion.upcycle import mhc_config_for
from .modeling_mhc import HC_MODULE_NAMES
from .profiling import held_for_backward

SLIDING_LAYER_TYPES = ("sliding_attention", "chunked_attention")
WINDOW_TENSOR_BYTES = 8  # the int64 scalar a DynamicSlidingWindowLayer holds (its `_sliding_window_tensor`)
# How transformers' TP styles (transformers.distributed.tensor_parallel) place a parameter of `ndim` dimensions named
# `leaf`: the dimension each rank holds a slice of, and whether that dimension packs two halves (gate and up) split
# separately (`_StridedShard(split_factor=2)`); None: the parameter stays whole. The styles not named here and whose
# `shard_param` is TensorParallelLayer's own (a no-op: moe_tp_experts, replicated_with_grad_allreduce, ...) keep
# their parameters whole.
TP_STYLE_PLACEMENTS: dict[str, Callable[[str, int], tuple[int, bool] | None]] = {
    **dict.fromkeys(("colwise", "colwise_gather_output", "colwise_rep"), lambda leaf, ndim: (max(ndim - 2, 0), False)),
    **dict.fromkeys(("rowwise", "rowwise_split_input", "rowwise_rep"),
                    lambda leaf, ndim: None if leaf == "bias" else (ndim - 1, False)),
    "embedding_rowwise": lambda leaf, ndim: (0, False),
    "embedding_colwise": lambda leaf, ndim: (1, False),
    "packed_colwise": lambda leaf, ndim: (0, False) if ndim == 1 else (ndim - 2, True),
    "packed_rowwise": lambda leaf, ndim: None if ndim == 1 else (ndim - 1, True),
}
INT64_MAX = 2**63 - 1  # the largest size (and byte count) a torch tensor can have
# Held while _forward_as_in_training's substitutions are in place: plans in two threads take turns, so each
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


@dataclass
class MemoryPlan:
    """The numbers :func:`plan_memory` returns; every size is in bytes."""

    model_type: str
    hc_mult: int | None  # None: the residual model itself
    residual_map: str | None  # hc_residual_map of the mHC model (None for the residual model)
    hidden_size: int
    num_layers: int
    dtype: str
    tokens: int
    batch: int
    attention: str  # "MHA", "GQA", "MQA" or "MLA"
    layer_types: list[str]
    kv_cache_bytes_per_token: int  # per sequence, every layer, before any sliding-window bound
    kv_cache_bytes: int  # the workload: batch × tokens, windows applied, plus the window scalars
    kv_cache_layer_bytes_per_token: int  # one layer, one token, one sequence
    kv_cache_note: str
    parameter_bytes: int  # backbone + HC
    backbone_parameter_bytes: int
    hc_parameter_bytes: int
    tp: int
    pp: int
    fsdp: int
    parameter_bytes_per_stage: list[int]  # on the device of each pipeline stage holding the most, after TP and FSDP
    parameter_bytes_per_device: int  # the largest of them
    layer_weight_bytes: int  # the weights of one decoder layer, averaged over the layers
    layer_weight_bytes_read_per_token_decode: float  # of them, what one decode token reads (experts: at most k·B of E)
    mhc_traffic_unfused_bytes_per_token_layer: int
    mhc_traffic_fused_bytes_per_token_layer: int
    mhc_traffic_over_weights_decode: dict[str, float] = field(default_factory=dict)
    mhc_traffic_over_weights_prefill: dict[str, float] = field(default_factory=dict)
    microbatches: int = 1
    pipeline_boundary_bytes_per_microbatch: int = 0  # the streams of one microbatch (crossing none when pp = 1)
    # Activations, keyed by ACTIVATION_CASES' names (the mHC cases only in a plan of an mHC model).
    activation_bytes: dict[str, int] = field(default_factory=dict)  # held for backward, the whole workload
    activation_bytes_per_token_layer: dict[str, float] = field(default_factory=dict)  # the decoder layers' share
    activation_bytes_outside_layers: dict[str, int] = field(default_factory=dict)  # embeddings, norm, logits, loss
    activation_largest_layer_bytes: dict[str, int] = field(default_factory=dict)  # one layer, the workload

    def to_dict(self) -> dict:
        """The plan as a JSON-ready dict."""
        return asdict(self)


def load_config(config: PreTrainedConfig | str | os.PathLike) -> PreTrainedConfig:
    """``config`` itself, or the config of a folder / Hub id (``config.json`` only, never weights; one-line
    ``ValueError`` for a config transformers' validation rejects, see :func:`load_pretrained_config`)."""
    if isinstance(config, PreTrainedConfig):
        return config
    return load_pretrained_config(config)


def kv_cache_layer_bytes_per_token(backbone: PreTrainedConfig, dtype: torch.dtype) -> tuple[int, str]:
    """Bytes one attention layer caches per token and sequence, and the attention kind (MHA / GQA / MQA / MLA)."""
    element = torch.tensor([], dtype=dtype).element_size()
    if getattr(backbone, "kv_lora_rank", None):
        return (backbone.kv_lora_rank + backbone.qk_rope_head_dim) * element, "MLA"
    heads = backbone.num_attention_heads
    kv_heads = getattr(backbone, "num_key_value_heads", None) or heads
    head_dim = getattr(backbone, "head_dim", None) or backbone.hidden_size // heads
    kind = "MHA" if kv_heads == heads else "MQA" if kv_heads == 1 else "GQA"
    return 2 * kv_heads * head_dim * element, kind


def _cached_tokens(layer_type: str, kwargs: dict, tokens: int) -> tuple[int, int]:
    """``(tokens a DynamicCache layer keeps, its fixed bytes)`` after ``tokens`` tokens."""
    if layer_type == "full_attention":
        return tokens, 0
    if layer_type in SLIDING_LAYER_TYPES:
        return min(tokens, kwargs["sliding_window"] - 1), WINDOW_TENSOR_BYTES
    if layer_type == "dummy":  # a layer without attention, or one reusing another layer's cache
        return 0, 0
    raise ValueError(f"cannot plan a KV cache for layer type {layer_type!r}")


def _meta_model(config: PreTrainedConfig) -> torch.nn.Module:
    """The causal LM of ``config`` (a backbone config or an :class:`MHCConfig`) on the ``meta`` device."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _is_hc(name: str) -> bool:
    return any(part in HC_MODULE_NAMES for part in name.split(".")[:-1])


def _tp_placement(style: str | None, name: str, ndim: int) -> tuple[int, bool] | None:
    """``(dimension split, packed halves?)`` of parameter ``name`` under TP ``style`` (None: kept whole)."""
    if style is None:
        return None
    if style in TP_STYLE_PLACEMENTS:
        return TP_STYLE_PLACEMENTS[style](name.rpartition(".")[2], ndim)
    if type(ALL_PARALLEL_STYLES[style]).shard_param is TensorParallelLayer.shard_param:
        return None
    raise ValueError(f"cannot plan the tensor-parallel style {style!r} of {name}")


def _tp_shard_sizes(size: int, tp: int, packed: bool) -> tuple[int, int]:
    """The largest (rank 0's) and smallest (the last rank's) slice of a dimension of ``size`` split over ``tp`` ranks
    as DTensor's ``Shard`` splits it (``torch.chunk``: ``ceil(size / tp)`` each, the last ranks what is left), each of
    two packed halves apart when ``packed``."""
    halves = 2 if packed else 1
    part = size // halves
    chunk = -(-part // tp)
    return halves * chunk, halves * max(0, part - chunk * (tp - 1))


def tp_shard_shapes(model: torch.nn.Module, tp: int) -> dict[str, tuple[int, ...]]:
    """The shape of each parameter's largest TP shard (every parameter's on rank 0) when transformers applies
    ``model``'s own TP plan (``model.tp_plan``: the config's ``base_model_tp_plan`` and the class's ``_tp_plan``) over
    ``tp`` ranks. Raises ``ValueError`` for what the plan cannot split: no plan, query or key/value heads that the
    plan splits by head and ``tp`` does not divide, a split dimension leaving a rank without a slice."""
    shapes = {name: tuple(parameter.shape) for name, parameter in model.named_parameters()}
    if tp == 1:
        return shapes
    config = model.config.get_text_config()
    if not model.tp_plan:
        raise ValueError(f"tp {tp}: transformers has no tensor-parallel plan for {config.model_type}")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if get_kv_heads_per_rank(model.tp_plan, [heads, kv_heads], tp) is None:
        raise ValueError(f"tp {tp} does not divide the {heads} attention heads and {kv_heads} key/value heads, which "
                         f"the {config.model_type} TP plan splits by head (every rank holds the same whole heads)")
    for name, shape in shapes.items():
        placement = _tp_placement(_get_parameter_plan(name, model.tp_plan), name, len(shape))
        if placement is None:
            continue
        dim, packed = placement
        largest, smallest = _tp_shard_sizes(shape[dim], tp, packed)
        if smallest == 0:
            raise ValueError(f"tp {tp} leaves rank {tp - 1} without a slice of {name} (its dimension {dim} of "
                             f"{shape[dim]} splits into slices of "
                             + (f"{largest // 2} per packed half)" if packed else f"{largest})"))
        shapes[name] = shape[:dim] + (largest,) + shape[dim + 1:]
    return shapes


def fsdp_shard_numel(shape: tuple[int, ...], fsdp: int) -> int:
    """Elements each of ``fsdp`` ranks stores of a parameter of ``shape`` under FSDP2 (``fully_shard``, as
    transformers' and Accelerate's FSDP apply it): dimension 0 split as ``torch.chunk`` splits it, every rank's slice
    padded to the first one's ``ceil(rows / fsdp)`` rows."""
    rows = shape[0] if shape else 1
    return -(-rows // fsdp) * (math.prod(shape) // rows if rows else 0)


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    if "layers" in parts[:-1]:
        index = parts[parts.index("layers") + 1]
        if index.isdigit():
            return int(index)
    return None


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
        find_packed, can_use_grouped_mm = masking_utils.find_packed_sequence_indices, moe._can_use_grouped_mm
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


def plan_memory(
    config: PreTrainedConfig | str | os.PathLike,
    *,
    tokens: int = 8192,
    batch: int = 1,
    dtype: str = "bfloat16",
    hc_mult: int | None = None,
    residual_map: str | None = None,
    tp: int = 1,
    pp: int = 1,
    fsdp: int = 1,
    microbatches: int = 1,
) -> MemoryPlan:
    """The :class:`MemoryPlan` of ``config``'s model for ``batch`` sequences of ``tokens`` tokens in ``dtype``.

    ``hc_mult``: the streams of the mHC model planned; ``None`` keeps the config's own (an :class:`MHCConfig`'s
    ``hc_mult``, or the residual model itself for a backbone config). ``residual_map``: its ``hc_residual_map``
    (the HC parameter shapes differ: ``identity`` has no ``comb`` rows, ``permutations`` ``n!`` of them); ``None``
    keeps an :class:`MHCConfig`'s own, else ``"sinkhorn"``; it needs an mHC model (``hc_mult`` or an
    :class:`MHCConfig`). ``tp``, ``pp``, ``fsdp``: the layout, as transformers' ``DistributedConfig`` applies it (see
    the module docstring). Raises ``ValueError`` on bad input, a layout the model cannot take, and a workload whose
    tensors exceed torch's sizes.
    """
    for name, value in (("tokens", tokens), ("batch", batch), ("tp", tp), ("pp", pp), ("fsdp", fsdp),
                        ("microbatches", microbatches)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if value > INT64_MAX:
            raise ValueError(f"{name} {value} exceeds {INT64_MAX} (2^63 - 1), the largest size of a torch tensor")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if batch % microbatches:
        raise ValueError(f"batch {batch} does not split into {microbatches} equal microbatches")
    config = load_config(config)
    if isinstance(config, MHCConfig):
        backbone = config.backbone_config
        hc_mult = config.hc_mult if hc_mult is None else hc_mult
        residual_map = config.hc_residual_map if residual_map is None else residual_map
    else:
        backbone = config
        if residual_map is not None and hc_mult is None:
            raise ValueError(f"residual_map {residual_map!r} applies to an mHC model; give hc_mult (hf-mhc plan "
                             "--hc-mult N) to plan the residual config as one")
    check_backbone_type(backbone.model_type, backbone)
    check_attention_heads(backbone)
    residual_map = residual_map or "sinkhorn"
    # The planned mHC model (validates hc_mult and the map: permutations needs hc_mult <= 4), with the config's
    # attention and experts kernels, as `upcycle` and a loaded model run them.
    mhc_config = None if hc_mult is None else mhc_config_for(backbone, hc_mult=hc_mult, hc_residual_map=residual_map)
    if mhc_config is not None:
        mhc_config._attn_implementation = config._attn_implementation
        mhc_config._experts_implementation = getattr(config, "_experts_implementation", None)
    layers = backbone.num_hidden_layers
    if pp > layers:
        raise ValueError(f"pp {pp} exceeds the {layers} layers")
    torch_dtype = DTYPES[dtype]
    element = torch.tensor([], dtype=torch_dtype).element_size()

    # KV cache
    per_layer, attention = kv_cache_layer_bytes_per_token(backbone, torch_dtype)
    layer_types, layer_kwargs = get_layer_types_and_kwargs(backbone)
    cached = [_cached_tokens(kind, kwargs, tokens) for kind, kwargs in zip(layer_types, layer_kwargs, strict=True)]
    kv_layers = sum(kind != "dummy" for kind in layer_types)
    kv_bytes = sum(batch * kept * per_layer + fixed for kept, fixed in cached)
    note = (
        ("MLA: each layer caches the latent [B, 1, T, kv_lora_rank] and the rotary key [B, 1, T, qk_rope_head_dim]"
         if attention == "MLA" else f"{attention}: each layer caches a key and a value per KV head")
        + ("; sliding-window layers keep the last window - 1 tokens (a view: its storage spans the whole prompt"
           " right after a prefill, window tokens while decoding)" if any(
            kind in SLIDING_LAYER_TYPES for kind in layer_types) else "")
        + ("; mHC leaves the KV cache unchanged (attention reads the collapsed stream)" if hc_mult else "")
    )

    # Parameters
    model = _meta_model(backbone if mhc_config is None else mhc_config)
    tp_shapes = tp_shard_shapes(model, tp)
    stage_of_layer = []
    for stage in range(pp):
        stage_of_layer += [stage] * (layers // pp + (stage < layers % pp))
    per_stage = [0] * pp
    longest_rows: list[tuple[int, str]] = [(0, "")] * pp  # the longest dimension 0 of each stage's TP shards
    backbone_bytes = hc_bytes = 0
    shared = {id(p) for n, p in model.named_parameters(remove_duplicate=False) if n.endswith("lm_head.weight")}
    for name, parameter in model.named_parameters():
        bytes_per_value = 4 if _is_hc(name) else element
        size = parameter.numel() * bytes_per_value
        if _is_hc(name):
            hc_bytes += size
        else:
            backbone_bytes += size
        index = _layer_index(name)
        if index is not None:
            stages = {stage_of_layer[index]}
        elif "embed" in name:
            stages = {0} | ({pp - 1} if id(parameter) in shared else set())
        else:
            stages = {pp - 1}
        shape = tp_shapes[name]
        for stage in stages:
            per_stage[stage] += fsdp_shard_numel(shape, fsdp) * bytes_per_value
            longest_rows[stage] = max(longest_rows[stage], (shape[0] if shape else 1, name))
    for stage, (rows, name) in enumerate(longest_rows):
        if fsdp > rows:
            raise ValueError(f"fsdp {fsdp} exceeds the {rows} rows of {name}, the longest dimension 0 of pipeline "
                             f"stage {stage}'s parameters: FSDP2 splits every parameter along dimension 0, so the "
                             f"ranks beyond {rows} would hold only padding")
    layer_weights = decode_reads = 0
    top_k = getattr(backbone, "num_experts_per_tok", None) or 1
    for name, parameter in model.named_parameters():
        if _layer_index(name) is None:
            continue
        size = parameter.numel() * (4 if _is_hc(name) else element)
        layer_weights += size
        # A decode step of `batch` tokens reads at most top_k * batch of a layer's E routed experts.
        routed = "experts" in name.split(".")[:-1]
        decode_reads += size * min(1.0, top_k * batch / parameter.shape[0]) if routed else size
    layer_weights //= layers

    # mHC traffic per token per layer (two sites) and the pipeline boundary
    n, hidden = (hc_mult or 1), backbone.hidden_size
    unfused = 2 * ((5 * n + 1) + (3 * n + 1)) * hidden * element if hc_mult else 0
    fused = 2 * ((n + 1) + (n + 1) + n) * hidden * element if hc_mult else 0  # reads n + (n+1), writes 1 + n
    decode_weights = decode_reads / layers / batch
    prefill_weights = layer_weights / (batch * tokens)
    boundary = (batch // microbatches) * tokens * n * hidden * element

    # Activations
    held, per_token_layer, outside, largest = {}, {}, {}, {}
    models = [(False, backbone)] + ([] if mhc_config is None else [(True, mhc_config)])
    for is_mhc, model_config in models:
        cases = [case for case in ACTIVATION_CASES if case[1] == is_mhc]
        try:
            counts = activations_held(model_config, torch_dtype, batch=batch, tokens=tokens, cases=tuple(
                (recompute, checkpointing) for _, _, recompute, checkpointing in cases))
        except RuntimeError as error:  # torch's check of every size against int64, on fake tensors as on real ones
            if "overflow" not in str(error).lower():
                raise
            raise ValueError(f"batch {batch} x {tokens} tokens is too large to count the activations: a tensor of "
                             f"the forward would exceed {INT64_MAX} bytes, the most a torch tensor holds") from None
        for (name, _, _, checkpointing), by_layer in zip(cases, counts, strict=True):
            in_layers = [size for index, size in by_layer.items() if index is not None]
            held[name] = sum(by_layer.values())
            per_token_layer[name] = sum(in_layers) / (batch * tokens * layers)
            outside[name] = by_layer.get(None, 0)
            if not checkpointing:
                largest[name] = max(in_layers)

    return MemoryPlan(
        model_type=backbone.model_type, hc_mult=hc_mult, residual_map=residual_map if hc_mult else None,
        hidden_size=hidden, num_layers=layers, dtype=dtype,
        tokens=tokens, batch=batch, attention=attention, layer_types=list(layer_types),
        kv_cache_bytes_per_token=kv_layers * per_layer, kv_cache_bytes=kv_bytes,
        kv_cache_layer_bytes_per_token=per_layer, kv_cache_note=note,
        parameter_bytes=backbone_bytes + hc_bytes, backbone_parameter_bytes=backbone_bytes,
        hc_parameter_bytes=hc_bytes, tp=tp, pp=pp, fsdp=fsdp, parameter_bytes_per_stage=per_stage,
        parameter_bytes_per_device=max(per_stage), layer_weight_bytes=layer_weights,
        layer_weight_bytes_read_per_token_decode=decode_weights,
        mhc_traffic_unfused_bytes_per_token_layer=unfused, mhc_traffic_fused_bytes_per_token_layer=fused,
        mhc_traffic_over_weights_decode={"unfused": unfused / decode_weights, "fused": fused / decode_weights},
        mhc_traffic_over_weights_prefill={"unfused": unfused / prefill_weights, "fused": fused / prefill_weights},
        microbatches=microbatches, pipeline_boundary_bytes_per_microbatch=boundary,
        activation_bytes=held, activation_bytes_per_token_layer=per_token_layer,
        activation_bytes_outside_layers=outside, activation_largest_layer_bytes=largest,
    )


def format_bytes(size: float) -> str:
    """``size`` in binary units: ``4.00 GiB``, ``68.6 KiB``, ``512 B``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{size:.0f} B"


def format_plan(plan: MemoryPlan) -> str:
    """A readable table of ``plan``."""
    element = torch.tensor([], dtype=DTYPES[plan.dtype]).element_size()
    model = f"{plan.model_type}" + (f" as mHC, hc_mult {plan.hc_mult}, {plan.residual_map} residual map"
                                    if plan.hc_mult else " (residual)")
    rows = [
        ("model", f"{model}, {plan.num_layers} layers, C = {plan.hidden_size}, {plan.attention}, {plan.dtype}"),
        ("workload", f"batch {plan.batch} x {plan.tokens:,} tokens"),
        ("KV cache per token", f"{plan.kv_cache_bytes_per_token:,} B ({format_bytes(plan.kv_cache_bytes_per_token)})"
         f" = {plan.kv_cache_layer_bytes_per_token:,} B per layer"),
        ("KV cache, workload", f"{plan.kv_cache_bytes:,} B ({format_bytes(plan.kv_cache_bytes)})"),
        ("", plan.kv_cache_note),
        ("parameters", f"{format_bytes(plan.parameter_bytes)} = backbone {format_bytes(plan.backbone_parameter_bytes)}"
         f" + HC {format_bytes(plan.hc_parameter_bytes)} (float32)"),
        (f"per device (tp {plan.tp}, pp {plan.pp}, fsdp {plan.fsdp})",
         f"{format_bytes(plan.parameter_bytes_per_device)} max; per stage: "
         + ", ".join(format_bytes(size) for size in plan.parameter_bytes_per_stage)),
    ]
    if plan.hc_mult:
        decode, prefill = plan.mhc_traffic_over_weights_decode, plan.mhc_traffic_over_weights_prefill
        rows += [
            ("mHC traffic per token-layer", f"unfused {format_bytes(plan.mhc_traffic_unfused_bytes_per_token_layer)},"
             f" fused {format_bytes(plan.mhc_traffic_fused_bytes_per_token_layer)}"),
            ("  / layer weight reads", f"decode: unfused {100 * decode['unfused']:.3g} %, fused "
             f"{100 * decode['fused']:.3g} %;"
             f" prefill: unfused {prefill['unfused']:.3g}x, fused {prefill['fused']:.3g}x"),
        ]
    rows.append(("activations held for backward", "per token per layer (decoder layers) | workload total"))
    for name, per_token_layer in plan.activation_bytes_per_token_layer.items():
        rows.append((f"  {name}", f"{per_token_layer:,.0f} B ({per_token_layer / (plan.hidden_size * element):.1f} C)"
                     f" | {format_bytes(plan.activation_bytes[name])}"))
    if plan.activation_bytes:
        outside = {name.split(" + ")[0]: size for name, size in plan.activation_bytes_outside_layers.items()}
        largest = max(plan.activation_largest_layer_bytes.values())
        rows.append(("", "totals include what is held outside the layers (embeddings, final norm, logits, loss: "
                     + ", ".join(f"{format_bytes(size)} {name}" for name, size in outside.items())
                     + f"); with gradient checkpointing, backward adds one recomputed layer (at most"
                     f" {format_bytes(largest)}); C = hidden size x {element} B"))
    if plan.pp > 1:
        rows.append(("pipeline boundary", f"{format_bytes(plan.pipeline_boundary_bytes_per_microbatch)} per "
                     f"microbatch ({plan.microbatches} microbatches) at each stage boundary"))
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


__all__ = ["DTYPES", "MemoryPlan", "format_bytes", "format_plan", "fsdp_shard_numel", "kv_cache_layer_bytes_per_token",
           "load_config", "plan_memory", "tp_shard_shapes"]
