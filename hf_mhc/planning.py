"""Memory planning from a config alone (never weights): KV cache, parameters per device, mHC stream traffic,
activations held for backward, pipeline-boundary bytes.

:func:`plan_memory` returns a :class:`MemoryPlan` (every size in bytes) of ``batch`` sequences of ``tokens`` tokens in
``dtype`` on a ``tp`` x ``pp`` x ``fsdp`` layout, and :func:`format_plan` prints it (``hf-mhc plan``). Each figure is
that of transformers' own objects: the KV cache is what ``DynamicCache`` stores for the config's layer types (mHC
leaves it unchanged: attention reads the collapsed stream); parameters are placed as transformers' TP plan
(:data:`TP_STYLE_PLACEMENTS`), the pipeline split (:func:`hf_mhc.distributed.pipeline_layer_split`) and FSDP2 place
them, on the device holding the most; the mHC traffic is the HBM bytes per token and layer of the mHC paper's
Table 2, unfused and fused, against the layer's weight reads; the activations are counted on fake tensors by
:mod:`hf_mhc.activation_count`; the ``n·C`` streams of a microbatch cross each pipeline stage boundary.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from transformers import AutoModelForCausalLM, PreTrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs
from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES
from transformers.distributed.tensor_parallel import TensorParallelLayer, get_kv_heads_per_rank

from .activation_count import ACTIVATION_CASES, activations_held
from .common import DTYPES
from .compat import require
from .configuration_mhc import MHCConfig, check_attention_heads, check_backbone_type, load_pretrained_config
from .conversion.upcycle import is_hc_parameter, mhc_config_for
from .distributed import pipeline_layer_split

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
    parameter_plan = require("transformers.distributed.parallel_utils:_get_parameter_plan")
    for name, shape in shapes.items():
        placement = _tp_placement(parameter_plan(name, model.tp_plan), name, len(shape))
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
    :class:`MHCConfig`). ``tp``, ``pp``, ``fsdp``: the layout, as transformers' ``DistributedConfig`` applies it:
    ``tp`` ranks slice each parameter as the model's TP plan says (:func:`tp_shard_shapes`), the ``pp`` stages take
    :func:`~hf_mhc.distributed.pipeline_layer_split`'s layers (the embeddings on the first, the final norm, mHC head
    and LM head on the last, tied embeddings on both), ``fsdp`` ranks split each TP shard along dimension 0
    (:func:`fsdp_shard_numel`); ``microbatches``: the equal parts of ``batch`` a pipeline step runs. Raises
    ``ValueError`` on bad input, a layout the model cannot take, and a workload whose tensors exceed torch's sizes.
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
    residual_map = residual_map or MHCConfig.hc_residual_map
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
    stage_of_layer = [stage for stage, stage_layers in enumerate(pipeline_layer_split(layers, pp))
                      for _ in stage_layers]
    per_stage = [0] * pp
    longest_rows: list[tuple[int, str]] = [(0, "")] * pp  # the longest dimension 0 of each stage's TP shards
    backbone_bytes = hc_bytes = 0
    shared = {id(p) for n, p in model.named_parameters(remove_duplicate=False) if n.endswith("lm_head.weight")}
    for name, parameter in model.named_parameters():
        bytes_per_value = 4 if is_hc_parameter(name) else element
        size = parameter.numel() * bytes_per_value
        if is_hc_parameter(name):
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
        size = parameter.numel() * (4 if is_hc_parameter(name) else element)
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
