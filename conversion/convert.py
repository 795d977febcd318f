"""Stream a residual checkpoint into an mHC checkpoint folder: exact, verified, and all-or-nothing.

The backbone tensors are copied under their unchanged names, chunk by chunk (at most ``CHUNK_BYTES`` of tensor data
in memory), and the function-preserving HC tensors are added in float32; config, remote code, the source's tokenizer,
chat-template, generation-config and license files and a model card go beside them. Files are read only from inside
SRC: a symbolic link in SRC that leads outside it is refused, except links of a Hugging Face cache snapshot into that
repo's ``blobs/`` (:func:`~.source.check_inside_source`). OUT is written all-or-nothing, one conversion at a time, and
never replaces what a user has (:mod:`.output_safety`).
"""

from __future__ import annotations

import copy
import fnmatch
import json
import logging
import math
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedConfig
from transformers.core_model_loading import revert_weight_conversion
from transformers.dynamic_module_utils import custom_object_save

from hf_mhc.common import DTYPES
from hf_mhc.configuration_mhc import MHCConfig, check_backbone_type, check_hc_options, load_pretrained_config
from hf_mhc.model_card import CARD_FILE, kept_card_message, may_write_card, model_card
from hf_mhc.modeling_mhc import AUTO_MAP, MHCForCausalLM, function_preserving_hc_tensors

from .errors import ConversionError, VerificationError
from .output_safety import (
    ExistingOutput,
    check_not_protected,
    check_output,
    locked_output,
    move_into_place,
    output_path,
    staging_folder,
)
from .safetensors_stream import SafetensorsStreamWriter, TensorSpec, aligned_order, parse_size
from .source import (
    COPIED_FILE_PATTERNS,
    COPIED_FOLDERS,
    SourceCheckpoint,
    SourceTensor,
    TensorReader,
    check_inside_source,
    resolve_source,
)
from .upcycle import is_hc_parameter, mhc_config_for
from .verify import VerificationResult, verify_conversion

DEFAULT_MAX_SHARD_SIZE = "5GB"
CHUNK_BYTES = 64 * 2**20
# Fine-grained FP8 checkpoints (DeepSeek-V3): float8 weights, each with its block scales under this suffix.
FLOAT8_DTYPES: frozenset[torch.dtype] = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})
FP8_SCALE_SUFFIX = "_scale_inv"
# Source tensors that transformers itself ignores when loading (old checkpoints saved the rotary buffer).
IGNORED_SOURCE_TENSOR = re.compile(r"(^|\.)rotary_emb\.inv_freq$")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ConversionReport:
    """What :func:`convert_checkpoint` wrote: the folder, the weight files, and the verification outcome."""

    source: str
    output: Path
    family: str
    hc_mult: int
    dtype: str
    tensors: int
    weight_files: tuple[str, ...]
    copied_files: tuple[str, ...]
    total_size: int
    verification: VerificationResult | None
    quantization: dict | None = None  # the source's FP8 quantization_config, carried over


@dataclass(frozen=True)
class PlannedTensor:
    """One output tensor: a source tensor to copy (cast to ``spec.dtype``) or an HC tensor ``value`` (float32)."""

    spec: TensorSpec
    source: SourceTensor | None = None
    value: torch.Tensor | None = None


def convert_checkpoint(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    hc_mult: int = MHCConfig.hc_mult,
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
    verify: bool = True,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    allow_pickle: bool = False,
    progress: bool = True,
    **hc_options,
) -> ConversionReport:
    """Convert a causal-LM checkpoint of a supported family (``SUPPORTED_BACKBONES``) into an mHC checkpoint ``out``.

    Args:
        src: a checkpoint folder, or a Hub model id (downloaded, or taken from the cache when offline).
        out: the folder to create. It must not exist or be empty, unless ``overwrite``: then a folder that holds a
            checkpoint (``config.json`` and weight files) is replaced, only after the new one is complete and
            verified. Never the working directory, the home folder, SRC, a folder containing one of them, or a
            folder inside SRC.
        hc_mult: number of residual streams.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` to cast the floating backbone tensors; ``None`` keeps
            them as stored. HC tensors are always float32. In a fine-grained FP8 checkpoint (DeepSeek-V3's
            ``quantization_config``, see :func:`fp8_quantization_config`) the float8 weights and their
            ``weight_scale_inv`` are never cast: they are copied byte for byte, and a warning says so.
        verify: compare the result's logits and greedy decoding with the source's, rounded to the written dtypes,
            both computed in float32 (see :mod:`.verify`); raises :class:`VerificationError` and writes nothing when
            the logits differ by more than ``RELATIVE_TOLERANCE`` of their scale or greedy decoding differs.
        max_shard_size: largest weight file, e.g. ``"5GB"`` or ``"500MB"``; one ``model.safetensors`` when all fits.
        allow_pickle: read pickled ``pytorch_model*.bin`` weights (with ``torch.load(weights_only=True)``).
        progress: show a progress bar per written shard.
        **hc_options: other :class:`MHCConfig` fields (``hc_sinkhorn_iters``, ``hc_eps``, ``hc_init_*``).

    Returns:
        A :class:`ConversionReport`. Raises :class:`ConversionError` on bad input, before ``out`` is touched, and
        when another conversion to ``out`` runs or ``out`` appeared or changed while converting.
    """
    try:
        check_hc_options(hc_options, "convert_checkpoint")
    except ValueError as error:
        raise ConversionError(str(error)) from None
    out = output_path(out)
    max_shard_bytes = parse_size(max_shard_size)
    target_dtype = _parse_dtype(dtype)
    local_src = Path(src).expanduser() if os.fspath(src).strip() and Path(src).expanduser().is_dir() else None
    check_output(out, overwrite, local_src)  # fail fast, before a download or a new folder; again under the lock
    with locked_output(out, overwrite) as existing:
        return _convert_locked(
            src, out, existing, hc_mult, target_dtype, verify, max_shard_bytes, allow_pickle, progress, hc_options
        )


def _convert_locked(
    src: str | os.PathLike,
    out: Path,
    existing: ExistingOutput | None,
    hc_mult: int,
    target_dtype: torch.dtype | None,
    verify: bool,
    max_shard_bytes: int,
    allow_pickle: bool,
    progress: bool,
    hc_options: dict,
) -> ConversionReport:
    """The conversion proper, with OUT's lock held and ``existing`` the OUT found then (see
    :func:`~.output_safety.check_output`)."""
    source = resolve_source(src, allow_pickle=allow_pickle)
    check_not_protected(out, source.folder)
    backbone_config = load_backbone_config(source.folder)
    backbone_config._name_or_path = str(src)
    try:
        config = mhc_config_for(backbone_config, hc_mult=hc_mult, **hc_options)
    except (ValueError, TypeError) as error:
        raise ConversionError(str(error)) from None
    checkpoint = SourceCheckpoint.inspect(source.folder, allow_pickle=allow_pickle)
    quantization = fp8_quantization_config(backbone_config, checkpoint)
    plan = plan_tensors(config, checkpoint, target_dtype, quantization)
    model_dtype = next(p.spec.dtype for p in plan if p.spec.name == "model.embed_tokens.weight")
    shards = pack_shards(plan, max_shard_bytes)

    with staging_folder(out) as staging:
        with checkpoint.reader() as reader:
            weight_files = write_weights(staging, shards, reader, progress=progress)
        write_config_and_code(config, staging, model_dtype, quantization)
        copied_files = copy_auxiliary_files(source.folder, staging)
        verification = None
        if verify:
            written_dtypes = {planned.source.name: planned.spec.dtype for planned in plan if planned.source is not None}
            verification = verify_conversion(
                checkpoint, staging, model_dtype, written_dtypes, vocab_size=config.backbone_config.vocab_size
            )
            if not verification.passed:
                raise VerificationError(verification_failure(verification))
        report = ConversionReport(
            source=str(src),
            output=out,
            family=config.backbone_config.model_type,
            hc_mult=config.hc_mult,
            dtype=str(model_dtype).removeprefix("torch."),
            tensors=len(plan),
            weight_files=weight_files,
            copied_files=tuple(copied_files),
            total_size=sum(p.spec.nbytes for p in plan),
            verification=verification,
            quantization=quantization,
        )
        write_card(staging, out, existing, report, config)
        move_into_place(staging, out, existing)
    return report


def verification_failure(verification: VerificationResult) -> str:
    """The error message of a failed verification: what differs, and what to do about it."""
    if not math.isfinite(verification.logit_scale) and verification.dtype == "float16":
        hint = "non-finite logits: float16 holds weights up to 65504 only, larger ones become inf; try --dtype bfloat16"
    elif not math.isfinite(verification.logit_scale):
        hint = "the source's own logits are not finite: check that it runs with transformers alone"
    else:
        hint = (
            "both models hold the same weights, so rounding alone stays far below this threshold and keeps greedy "
            "decoding identical: this is a conversion bug, please report it with the source checkpoint's config.json"
        )
    return f"the converted model does not reproduce the source: {verification.summary()}; nothing was written ({hint})."


def _parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype in DTYPES.values()):
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    raise ConversionError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)} (or none to keep it).")


def load_backbone_config(folder: Path) -> PreTrainedConfig:
    """The source's config, checked to be a causal LM of a supported family."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ConversionError(
            f"{folder} has no config.json, so it is not a transformers checkpoint; pass the folder that holds "
            "config.json and the weights."
        )
    check_inside_source(config_path, folder)
    try:
        raw = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConversionError(f"{config_path} is not valid JSON ({error}).") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type == MHCConfig.model_type:
        raise ConversionError(f"{folder} is already an mHC checkpoint; convert the residual model it came from.")
    try:
        check_backbone_type(model_type)
    except ValueError as error:
        raise ConversionError(f"{folder}: {error}") from None
    architectures = raw.get("architectures") or []
    if architectures and not any(str(name).endswith("ForCausalLM") for name in architectures):
        raise ConversionError(
            f"{folder} is a {', '.join(map(str, architectures))} checkpoint, not a causal language model; "
            "hf-mhc convert needs a *ForCausalLM checkpoint (e.g. LlamaForCausalLM)."
        )
    try:
        return load_pretrained_config(folder)
    except (OSError, ValueError) as error:
        raise ConversionError(str(error)) from None


def fp8_quantization_config(backbone_config: PreTrainedConfig, checkpoint: SourceCheckpoint) -> dict | None:
    """The source's fine-grained FP8 ``quantization_config`` (as in DeepSeek-V3's config.json), or ``None``.

    Such a checkpoint stores a Linear weight ``W [out, in]`` as float8_e4m3fn ``Q`` beside float32
    ``weight_scale_inv S [ceil(out / b0), ceil(in / b1)]`` with ``weight_block_size = [b0, b1]``: ``W ≈ Q · S`` block
    by block. Raises :class:`ConversionError` for another quantization method, and for float8 tensors without an
    FP8 ``quantization_config`` (nothing would tell transformers how to read them).
    """
    quantization = getattr(backbone_config, "quantization_config", None)
    if quantization is not None and not isinstance(quantization, dict):
        quantization = quantization.to_dict()
    float8 = [tensor.name for tensor in checkpoint.tensors.values() if tensor.dtype in FLOAT8_DTYPES]
    if quantization is None:
        if float8:
            raise ConversionError(
                f"{checkpoint.folder} holds float8 tensors ({float8[0]}, ...) but its config.json has no "
                "quantization_config saying how to read them; add the fine-grained FP8 one it was published with."
            )
        return None
    method, activations = quantization.get("quant_method"), quantization.get("activation_scheme", "dynamic")
    if method != "fp8" or activations != "dynamic":
        what = f"{method}" if method != "fp8" else f"fp8 with {activations} activation scales"
        raise ConversionError(
            f"{checkpoint.folder} is quantized ({what}); hf-mhc convert copies only fine-grained FP8 checkpoints with "
            "dynamic activations (DeepSeek-V3's) and unquantized ones: convert the unquantized model."
        )
    block = quantization.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConversionError(
            f"{checkpoint.folder}: quantization_config.weight_block_size is {block!r}; hf-mhc convert needs the "
            "block-wise FP8 layout, two positive integers such as [128, 128]."
        )
    return copy.deepcopy(quantization)


def _scale_companions(
    copied: dict[str, SourceTensor], expected: dict[str, tuple[int, ...]], quantization: dict
) -> dict[str, SourceTensor]:
    """The ``*.weight_scale_inv`` tensors of an FP8 checkpoint that belong to a weight the model expects, checked:
    that weight is float8 and the scales have its block-grid shape; each expected float8 weight has its scales.
    Scales of names the model does not expect are left to :func:`plan_tensors`' layout check."""
    block_rows, block_cols = quantization["weight_block_size"]
    scales = {
        name: tensor
        for name, tensor in copied.items()
        if name.endswith(f".weight{FP8_SCALE_SUFFIX}") and name.removesuffix(FP8_SCALE_SUFFIX) in expected
    }
    for name, scale in scales.items():
        weight = copied.get(name.removesuffix(FP8_SCALE_SUFFIX))
        if weight is None or weight.dtype not in FLOAT8_DTYPES:
            raise ConversionError(
                f"{name} in {scale.file} scales no float8 weight ({name.removesuffix(FP8_SCALE_SUFFIX)} is "
                f"{'missing' if weight is None else weight.dtype}); the checkpoint is not the FP8 layout transformers "
                "reads, a float8 weight with its weight_scale_inv beside it."
            )
        *leading, rows, cols = weight.shape
        grid = (*leading, -(-rows // block_rows), -(-cols // block_cols))
        if scale.shape != grid or not scale.dtype.is_floating_point:
            raise ConversionError(
                f"{name} has shape {list(scale.shape)} ({scale.dtype}), but {weight.name} {list(weight.shape)} with "
                f"weight_block_size {[block_rows, block_cols]} needs floating scales of shape {list(grid)}."
            )
    unscaled = [
        name
        for name, tensor in copied.items()
        if name in expected and tensor.dtype in FLOAT8_DTYPES and name + FP8_SCALE_SUFFIX not in copied
    ]
    if unscaled:
        raise ConversionError(
            f"{unscaled[0]} is float8 but has no {unscaled[0]}{FP8_SCALE_SUFFIX} beside it; the checkpoint is "
            "incomplete: re-download it."
        )
    return scales


def plan_tensors(
    config: MHCConfig, checkpoint: SourceCheckpoint, dtype: torch.dtype | None, quantization: dict | None = None
) -> list[PlannedTensor]:
    """Every output tensor, backbone ones in source order then the HC ones; checks the source's names and shapes.

    The expected layout is that of :class:`MHCForCausalLM` (built on the meta device, no memory): the backbone
    names and shapes must match the source exactly. With tied embeddings there is no ``lm_head.weight`` in the
    output (transformers re-ties it on load), as ``save_pretrained`` writes it. With an FP8 ``quantization``
    (:func:`fp8_quantization_config`) each float8 weight comes with its ``weight_scale_inv``; both are copied as
    stored whatever ``dtype`` says.
    """
    try:
        with torch.device("meta"):
            model = MHCForCausalLM(copy.deepcopy(config))
    except Exception as error:  # values the config accepted but the modules cannot be built from
        raise ConversionError(
            f"the config.json of {checkpoint.folder} describes a model transformers cannot build "
            f"({type(error).__name__}: {error})."
        ) from None
    family = config.backbone_config.model_type
    tied = config.tie_word_embeddings
    copied = {
        name: tensor
        for name, tensor in checkpoint.tensors.items()
        if not IGNORED_SOURCE_TENSOR.search(name) and not (tied and name == "lm_head.weight")
    }
    # Either layout of the backbone tensors: as the model holds them in memory, or as transformers saves (and
    # publishes) them, e.g. one tensor per MoE expert. The mHC model loads both, so they are copied as they are.
    in_memory = model.state_dict()
    layouts = [{name: tuple(tensor.shape) for name, tensor in layout.items() if not is_hc_parameter(name)}
               for layout in (revert_weight_conversion(model, dict(in_memory)), in_memory)]
    for layout in layouts:
        if tied:
            layout.pop("lm_head.weight", None)
    weights = {name for name in copied if not name.endswith(f".weight{FP8_SCALE_SUFFIX}")}
    expected = next((layout for layout in layouts if set(layout) == weights), layouts[0])
    scales = _scale_companions(copied, expected, quantization) if quantization is not None else {}
    missing = [name for name in expected if name not in copied]
    unexpected = [name for name in copied if name not in expected and name not in scales]
    if missing or unexpected:
        raise ConversionError(
            f"the weights in {checkpoint.folder} do not match a {family} causal LM with this config: "
            f"missing {missing[:3]}{' ...' if len(missing) > 3 else ''}, "
            f"unexpected {unexpected[:3]}{' ...' if len(unexpected) > 3 else ''}. "
            "Is it a base model without lm_head, or are config.json and the weights from different models?"
        )
    mismatched = [name for name, tensor in copied.items() if name not in scales and tensor.shape != expected[name]]
    if mismatched:
        name = mismatched[0]
        raise ConversionError(
            f"{name} has shape {list(copied[name].shape)} in {copied[name].file} but config.json implies "
            f"{list(expected[name])}; the config and the weights do not belong together."
        )
    kept = {name for name, tensor in copied.items() if tensor.dtype in FLOAT8_DTYPES} | set(scales)
    if kept and dtype is not None:
        logger.warning(
            "--dtype %s casts the %d unquantized tensors only; the %d float8 weights and their weight%s stay as "
            "stored (transformers dequantizes them on load).",
            str(dtype).removeprefix("torch."),
            len(copied) - len(kept),
            len(kept) - len(scales),
            FP8_SCALE_SUFFIX,
        )
    plan = []
    for name, tensor in copied.items():
        cast = dtype is not None and tensor.dtype.is_floating_point and name not in kept
        out_dtype = dtype if cast else tensor.dtype
        plan.append(PlannedTensor(TensorSpec(name, out_dtype, tensor.shape), source=tensor))
    for name, value in function_preserving_hc_tensors(config).items():
        plan.append(PlannedTensor(TensorSpec(name, torch.float32, tuple(value.shape)), value=value.float()))
    return plan


def pack_shards(plan: list[PlannedTensor], max_shard_bytes: int) -> list[list[PlannedTensor]]:
    """Consecutive groups of ``plan`` of at most ``max_shard_bytes`` each (a larger tensor gets a shard of its own)."""
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for planned in plan:
        if shards[-1] and size + planned.spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(planned)
        size += planned.spec.nbytes
    return shards


def write_weights(
    folder: Path, shards: list[list[PlannedTensor]], reader: TensorReader, *, progress: bool = True
) -> tuple[str, ...]:
    """Write ``shards`` as safetensors files in ``folder`` (plus the index when there are several).

    File names follow transformers: ``model.safetensors``, or ``model-00001-of-00003.safetensors`` ... with
    ``model.safetensors.index.json`` (``metadata.total_size``, ``metadata.total_parameters``, ``weight_map``).
    """
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map = {}
    for file_name, shard in zip(names, shards, strict=True):
        by_name = {planned.spec.name: planned for planned in shard}
        specs = aligned_order(planned.spec for planned in shard)
        with (
            tqdm(
                total=sum(s.nbytes for s in specs), unit="B", unit_scale=True, desc=file_name, disable=not progress
            ) as bar,
            SafetensorsStreamWriter(folder / file_name, specs, metadata={"format": "pt"}) as writer,
        ):
            for spec in specs:
                writer.write_tensor(spec.name, _output_chunks(by_name[spec.name], reader), on_bytes=bar.update)
                weight_map[spec.name] = file_name
    if len(shards) == 1:
        return tuple(names)
    plan = [planned for shard in shards for planned in shard]
    index = {
        "metadata": {
            "total_parameters": sum(math.prod(p.spec.shape) for p in plan),
            "total_size": sum(p.spec.nbytes for p in plan),
        },
        "weight_map": weight_map,
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return (*names, "model.safetensors.index.json")


def _output_chunks(planned: PlannedTensor, reader: TensorReader) -> Iterator[torch.Tensor]:
    if planned.value is not None:
        yield planned.value
        return
    for chunk in reader.chunks(planned.source, CHUNK_BYTES):
        yield chunk.to(planned.spec.dtype)


def write_config_and_code(
    config: MHCConfig, folder: Path, model_dtype: torch.dtype, quantization: dict | None = None
) -> None:
    """``config.json`` and the flat remote-code files, exactly as ``MHCForCausalLM.save_pretrained`` writes them.

    A source ``quantization`` (FP8) moves to the top level of the mHC config, where ``from_pretrained`` reads it.
    """
    config = copy.deepcopy(config)
    if quantization is not None:
        config.quantization_config = quantization
        if hasattr(config.backbone_config, "quantization_config"):
            del config.backbone_config.quantization_config
    config.backbone_config.dtype = model_dtype
    config.dtype = str(model_dtype).removeprefix("torch.")
    config.architectures = [MHCForCausalLM.__name__]
    config.auto_map = dict(AUTO_MAP)
    # The model's half of save_pretrained's remote-code step: modeling_mhc.py and its relative imports, flat.
    custom_object_save(MHCForCausalLM, folder)
    config.save_pretrained(folder)  # config.json, and configuration_mhc.py for AutoConfig


def copy_auxiliary_files(source_folder: Path, folder: Path) -> list[str]:
    """Copy the tokenizer, chat-template, generation-config and license files of the source into ``folder``.

    Their content is copied (links are followed) only from inside the source (see
    :func:`~.source.check_inside_source`); a symbolic link leading elsewhere raises :class:`ConversionError`.
    """
    copied = []
    for entry in sorted(source_folder.iterdir()):
        if entry.is_file() and any(fnmatch.fnmatch(entry.name, pattern) for pattern in COPIED_FILE_PATTERNS):
            check_inside_source(entry, source_folder)
            shutil.copyfile(entry, folder / entry.name)
            copied.append(entry.name)
        elif entry.is_dir() and entry.name in COPIED_FOLDERS:
            _check_tree_inside_source(entry, source_folder)
            shutil.copytree(entry, folder / entry.name)
            copied.append(entry.name)
    return copied


def _check_tree_inside_source(tree: Path, source_folder: Path) -> None:
    """Check every entry under ``tree`` (links followed) with :func:`~.source.check_inside_source`."""
    check_inside_source(tree, source_folder)
    for root, dirs, files in os.walk(tree, followlinks=True):
        here = Path(root)
        above = [folder for folder in here.parents if folder == tree or tree in folder.parents]
        if any(os.path.samefile(folder, here) for folder in above):
            raise ConversionError(f"{here} links back to a folder above it; remove the link loop from SRC.")
        for name in (*dirs, *files):
            check_inside_source(Path(root) / name, source_folder)


def card_weights(report: ConversionReport) -> str:
    """The model card's line on the weights of a converted checkpoint: their dtypes, and FP8 ones as copied."""
    weights = report.dtype
    if report.quantization is not None:
        weights = (
            f"Linear weights in fine-grained FP8, float8 with block scales `weight_scale_inv`, weight_block_size "
            f"{report.quantization['weight_block_size']}, byte for byte as in the source; the others {report.dtype}. "
            "transformers dequantizes them on load without a GPU of compute capability 8.9 or more"
        )
    return f"backbone tensors copied under their original names ({weights}); HC tensors float32."


def write_card(staging: Path, out: Path, existing: ExistingOutput | None, report: ConversionReport,
               config: MHCConfig) -> None:
    """hf-mhc's model card into ``staging``; or, when the OUT being replaced holds a ``README.md`` that hf-mhc did
    not write (:func:`~hf_mhc.model_card.may_write_card`), that one, copied as it is, and a warning saying so."""
    if existing is not None and not existing.empty and not may_write_card(out):
        shutil.copy2(out / CARD_FILE, staging / CARD_FILE, follow_symlinks=False)
        logger.warning(kept_card_message(out))
        return
    if report.verification is None:
        verified = "not verified (converted with `--no-verify`)."
    else:
        verified = f"passed: {report.verification.summary()}."
    card = model_card(config, out.name, made_by="`hf-mhc convert`", weights=card_weights(report),
                      verification=verified)
    (staging / CARD_FILE).write_text(card, encoding="utf-8")


__all__ = ["ConversionReport", "convert_checkpoint", "DEFAULT_MAX_SHARD_SIZE"]
