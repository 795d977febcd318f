"""Stream a residual checkpoint into an mHC checkpoint folder: exact, verified, and all-or-nothing.

The backbone tensors are copied under their unchanged names, chunk by chunk (at most ``CHUNK_BYTES`` of tensor data
in memory), and the function-preserving HC tensors are added in float32. Everything is written to a hidden staging
folder beside ``out`` that is renamed into place only once the checkpoint is complete and verified; on any error or
interruption the staging folder is removed and ``out`` is left as it was.

Nothing a user has is lost:

- One conversion per OUT at a time: ``.OUT.hf-mhc-lock`` beside OUT is created exclusively and holds ``pid@host``;
  a second conversion to the same OUT fails at once. A lock left by a killed process on this host is taken over.
- The final move replaces only what was checked at the start, under the lock: nothing (OUT missing, or an empty
  folder), or, with ``overwrite``, the same folder (same device and inode) that then looked like a checkpoint. An OUT
  that appears or changes meanwhile is left as it is and the conversion fails.
- ``overwrite`` replaces only a folder holding ``config.json`` and weight files, and OUT may never be, contain or lie
  inside SRC, nor be or contain the working directory or the home folder (symbolic links resolved).
- With ``overwrite`` the old OUT is renamed to ``.OUT.hf-mhc-replaced.*``, the new one renamed to OUT, and only then
  the old one deleted. If the process is killed between the two renames, the next conversion to OUT renames the old
  checkpoint back (when OUT is missing) or says where it is; it never deletes it.
- Files are read only from inside SRC: a symbolic link in SRC (weights, config, tokenizer, license, chat templates)
  that leads outside it is refused, except links of a Hugging Face cache snapshot into that repo's ``blobs/``.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import logging
import math
import os
import re
import secrets
import shutil
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedConfig
from transformers.core_model_loading import revert_weight_conversion
from transformers.dynamic_module_utils import custom_object_save

from hf_mhc.configuration_mhc import MHCConfig, check_backbone_type, check_hc_options, load_pretrained_config
from hf_mhc.modeling_mhc import AUTO_MAP, MHCForCausalLM, function_preserving_hc_tensors

from .errors import ConversionError, VerificationError
from .safetensors_stream import SafetensorsStreamWriter, TensorSpec, aligned_order, parse_size
from .source import SourceCheckpoint, SourceTensor, TensorReader, check_inside_source, resolve_source
from .upcycle import is_hc_parameter, mhc_config_for
from .verify import VerificationResult, verify_conversion

DEFAULT_MAX_SHARD_SIZE = "5GB"
CHUNK_BYTES = 64 * 2**20
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Files copied from the source beside the weights: tokenizer, chat template, generation defaults, license terms.
COPIED_FILE_PATTERNS: tuple[str, ...] = (
    "LICENSE*",
    "NOTICE*",
    "USE_POLICY*",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "*.model",
    "*.tiktoken",
    "chat_template.json",
    "chat_template.jinja",
    "generation_config.json",
)
COPIED_FOLDERS: tuple[str, ...] = ("additional_chat_templates",)
# Fine-grained FP8 checkpoints (DeepSeek-V3): float8 weights, each with its block scales under this suffix.
FLOAT8_DTYPES: frozenset[torch.dtype] = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})
FP8_SCALE_SUFFIX = "_scale_inv"
# Source tensors that transformers itself ignores when loading (old checkpoints saved the rotary buffer).
IGNORED_SOURCE_TENSOR = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
STAGING_MARKER = ".hf-mhc-partial."
REPLACED_MARKER = ".hf-mhc-replaced."
LOCK_SUFFIX = ".hf-mhc-lock"
# Files in a folder that mark it as a checkpoint --overwrite may replace (besides config.json).
WEIGHT_FILE_PATTERNS: tuple[str, ...] = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")
# What a checkpoint folder holds (the files a conversion writes, and those of an ordinary transformers checkpoint):
# --overwrite replaces only a folder with nothing else in it.
CHECKPOINT_FILE_PATTERNS: tuple[str, ...] = (
    "config.json", "README.md", "*.py", *WEIGHT_FILE_PATTERNS, *COPIED_FILE_PATTERNS,
)

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
    hc_mult: int = 4,
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
    out = _output_path(out)
    max_shard_bytes = parse_size(max_shard_size)
    target_dtype = _parse_dtype(dtype)
    local_src = Path(src).expanduser() if os.fspath(src).strip() and Path(src).expanduser().is_dir() else None
    _check_output(out, overwrite, local_src)  # fail fast, before a download or a new folder; again under the lock
    created_parents = _missing_ancestors(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with _OutputLock(out):
            _remove_stale_staging(out)
            _recover_replaced(out)
            existing = _check_output(out, overwrite)
            report = _convert_locked(
                src, out, existing, hc_mult, target_dtype, verify, max_shard_bytes, allow_pickle, progress, hc_options
            )
    except BaseException:
        for folder in created_parents:
            try:
                folder.rmdir()
            except OSError:
                break
        raise
    return report


def _convert_locked(
    src: str | os.PathLike,
    out: Path,
    existing: _Existing | None,
    hc_mult: int,
    target_dtype: torch.dtype | None,
    verify: bool,
    max_shard_bytes: int,
    allow_pickle: bool,
    progress: bool,
    hc_options: dict,
) -> ConversionReport:
    """The conversion proper, with OUT's lock held and ``existing`` the OUT found then (see :func:`_check_output`)."""
    source = resolve_source(src, allow_pickle=allow_pickle)
    _check_not_protected(out, source.folder)
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

    staging = out.parent / f".{out.name}{STAGING_MARKER}{os.getpid()}@{socket.gethostname()}.{secrets.token_hex(6)}"
    try:
        staging.mkdir()  # beside OUT (same file system, so the final rename is atomic), with the umask's permissions
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
        (staging / "README.md").write_text(model_card(report, config, source.hub_id), encoding="utf-8")
        _move_into_place(staging, out, existing)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
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


def _output_path(out: str | os.PathLike) -> Path:
    """``out`` as an absolute path ("." and "a/.." name real folders); an empty OUT is refused."""
    text = os.fspath(out)
    if not text.strip():
        raise ConversionError("OUT is empty; name the folder to create, e.g. ./my-model-mhc.")
    return Path(os.path.abspath(Path(text).expanduser()))


class _Existing(NamedTuple):
    """An OUT folder found at the start: its identity (device, inode), and whether it was empty."""

    identity: tuple[int, int]
    empty: bool


def _identity(path: Path) -> tuple[int, int]:
    stat = os.lstat(path)
    return stat.st_dev, stat.st_ino


def foreign_entries(folder: Path) -> list[str]:
    """The entries of ``folder`` that are no part of a checkpoint (:data:`CHECKPOINT_FILE_PATTERNS`,
    :data:`COPIED_FOLDERS`): a ``.git`` folder, notes, training checkpoints, ..."""
    return sorted(
        entry.name + ("/" if entry.is_dir() else "")
        for entry in folder.iterdir()
        if not (entry.is_dir() and not entry.is_symlink() and entry.name in COPIED_FOLDERS)
        and not (entry.is_file() and any(fnmatch.fnmatch(entry.name, pattern) for pattern in CHECKPOINT_FILE_PATTERNS))
    )


def looks_like_checkpoint(folder: Path) -> bool:
    """Whether ``folder`` holds a ``config.json`` and weight files (``*.safetensors``, ``*.bin`` or an index)."""
    names = [entry.name for entry in folder.iterdir() if entry.is_file()]
    return "config.json" in names and any(
        fnmatch.fnmatch(name, pattern) for name in names for pattern in WEIGHT_FILE_PATTERNS
    )


def _check_output(out: Path, overwrite: bool, src: Path | None = None) -> _Existing | None:
    """Check that ``out`` may be written (and is not ``src``, a local SRC folder, or around it): ``None`` when it
    does not exist, else the folder the final move replaces."""
    if out.is_symlink():
        raise ConversionError(f"OUT {out} is a symbolic link; name the folder itself.")
    if out.exists() and not out.is_dir():
        raise ConversionError(f"OUT {out} exists and is a file; choose a folder path.")
    _check_not_protected(out, src)
    if not out.exists():
        ancestor = out.parent
        while not ancestor.exists():
            ancestor = ancestor.parent
        if not ancestor.is_dir():
            raise ConversionError(f"OUT {out} cannot be created: {ancestor} is a file.")
        return None
    empty = not any(out.iterdir())
    if not empty and not overwrite:
        raise ConversionError(
            f"OUT {out} exists and is not empty; choose a new folder or pass --overwrite "
            "(the old folder is then replaced only once the new checkpoint is complete)."
        )
    if not empty and not looks_like_checkpoint(out):
        raise ConversionError(
            f"OUT {out} is not empty and does not look like a checkpoint (a config.json and *.safetensors, *.bin or "
            "index files); --overwrite replaces only a checkpoint folder: choose a new folder, or empty it yourself."
        )
    foreign = [] if empty else foreign_entries(out)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ConversionError(
            f"OUT {out} holds more than a checkpoint ({shown}); --overwrite would delete them with the folder: move "
            "them away or choose a new folder."
        )
    return _Existing(_identity(out), empty)


def _check_not_protected(out: Path, src: Path | None) -> None:
    """Refuse an OUT that is, or contains, the working directory, the home folder or SRC, or that lies inside SRC."""
    real_out = Path(os.path.realpath(out))
    guarded = {"the working directory": Path.cwd()}
    try:
        guarded["your home folder"] = Path.home()
    except (KeyError, RuntimeError):  # no home folder known
        pass
    if src is not None:
        guarded["SRC"] = src
    for what, folder in guarded.items():
        real = Path(os.path.realpath(folder))
        if real_out == real or real_out in real.parents:
            raise ConversionError(
                f"OUT {out} is {what} or contains it; write the converted checkpoint to a new folder."
            )
    if src is not None and Path(os.path.realpath(src)) in real_out.parents:
        raise ConversionError(f"OUT {out} is inside SRC {src}; write the converted checkpoint to another folder.")


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


def model_card(report: ConversionReport, config: MHCConfig, hub_id: str | None) -> str:
    """The ``README.md`` of a converted checkpoint: source, hc_mult, initialisation and verification."""
    backbone = config.backbone_config
    header = ["---", "library_name: transformers", "tags:", "- mhc", "- hyper-connections", "- hf-mhc"]
    if hub_id is not None:
        header.append(f"base_model: {hub_id}")
    header.append("---")
    if report.verification is None:
        verified = "not run (converted with `--no-verify`)."
    else:
        verified = f"passed: {report.verification.summary()}."
    architecture = (backbone.architectures or [f"{backbone.model_type} causal LM"])[0]
    residual = {"sinkhorn": f"comb bias = {config.hc_init_comb_diag:g}·I", "unconstrained": "comb = I",
                "identity": "streams carried by the identity",
                "permutations": "permutation weights peaked on the identity"}[config.hc_residual_map]
    weights = report.dtype
    if report.quantization is not None:
        weights = (
            f"Linear weights in fine-grained FP8, float8 with block scales `weight_scale_inv`, weight_block_size "
            f"{report.quantization['weight_block_size']}, byte for byte as in the source; the others {report.dtype}. "
            "transformers dequantizes them on load without a GPU of compute capability 8.9 or more"
        )
    return "\n".join(
        [
            *header,
            "",
            f"# {report.output.name}",
            "",
            f"`{report.source}` ({architecture}, {backbone.num_hidden_layers} layers, hidden size "
            f"{backbone.hidden_size}) converted by `hf-mhc convert` into a Manifold-Constrained Hyper-Connections "
            f"(mHC, arXiv 2512.24880) model with **hc_mult = {config.hc_mult}** residual streams.",
            "",
            f"- **Source:** `{report.source}`",
            f"- **Streams:** hc_mult = {config.hc_mult}, residual map `{config.hc_residual_map}`, "
            f"{config.hc_sinkhorn_iters} Sinkhorn iterations, hc_eps = {config.hc_eps:g}",
            "- **Initialisation:** function-preserving. Every stream starts as a copy of the embedding; "
            f"pre = 1/n; post biases in pairs ±k·{config.hc_init_post_delta:g} with mean(post) = 1; "
            f"{residual}; the head averages the streams; the token-dependent part "
            f"is off (fn = 0, scale = {config.hc_init_dynamic_scale:g}). Until it is trained the model computes the "
            "source's function.",
            f"- **Weights:** backbone tensors copied under their original names ({weights}); HC tensors float32.",
            f"- **Verification:** {verified}",
            "",
            "## Usage",
            "",
            "```python",
            "import hf_mhc  # registers the mHC classes; without it, pass trust_remote_code=True",
            "from transformers import AutoModelForCausalLM",
            "",
            f'model = AutoModelForCausalLM.from_pretrained("{report.output.name}")',
            "```",
            "",
        ]
    )


def _missing_ancestors(out: Path) -> list[Path]:
    """Ancestors of ``out`` that do not exist yet, deepest first (removed again if the conversion fails)."""
    missing = []
    folder = out.absolute().parent
    while not folder.exists():
        missing.append(folder)
        folder = folder.parent
    return missing


def _remove_stale_staging(out: Path) -> None:
    """Delete staging folders for ``out`` left by conversions on this host whose process no longer exists."""
    if not out.parent.is_dir():
        return
    prefix = f".{out.name}{STAGING_MARKER}"
    for entry in out.parent.iterdir():
        if not entry.name.startswith(prefix) or not entry.is_dir() or entry.is_symlink():
            continue
        owner = entry.name[len(prefix) :].rsplit(".", 1)[0]
        if _owner_is_dead(owner):
            shutil.rmtree(entry, ignore_errors=True)


def _owner_is_dead(owner: str) -> bool:
    """Whether ``owner`` (``pid@host``) names a process of this host that no longer exists."""
    pid, _, host = owner.partition("@")
    return host == socket.gethostname() and pid.isdigit() and not _process_alive(int(pid))


def _process_alive(pid: int) -> bool:
    if os.name == "nt":  # os.kill(pid, 0) would send CTRL_C_EVENT there: never take a Windows process for dead
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _OutputLock:
    """``.OUT.hf-mhc-lock`` beside OUT: created with ``O_EXCL``, holding ``pid@host token``; one conversion per OUT.

    A lock whose process is dead (same host) is moved aside atomically and taken over; if what was moved aside turns
    out to be a newer lock (another conversion took over first), it is linked back and this conversion fails.
    """

    def __init__(self, out: Path):
        self.out = out
        self.path = out.parent / f".{out.name}{LOCK_SUFFIX}"
        self.owner = f"{os.getpid()}@{socket.gethostname()} {secrets.token_hex(6)}"

    def __enter__(self) -> _OutputLock:
        for _ in range(5):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = _read_text(self.path)
                if holder is not None and not _owner_is_dead(holder.split(" ")[0]):
                    raise self._busy(holder) from None
                if holder is not None:
                    self._take_over(holder)
                continue
            except OSError as error:
                raise ConversionError(
                    f"cannot write in {self.path.parent}, the folder of OUT ({error.strerror or error})."
                ) from None
            with os.fdopen(fd, "w", encoding="utf-8") as file:
                file.write(self.owner)
            return self
        raise self._busy(_read_text(self.path) or "")

    def _take_over(self, holder: str) -> None:
        aside = self.path.with_name(f"{self.path.name}.stale.{secrets.token_hex(6)}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return
        try:
            if _read_text(aside) != holder:
                os.link(aside, self.path)  # a newer lock: put it back (never over a third one), and give way
                raise self._busy(_read_text(aside) or "")
        finally:
            aside.unlink(missing_ok=True)

    def _busy(self, holder: str) -> ConversionError:
        who = holder.split(" ")[0] or "starting"
        return ConversionError(
            f"another hf-mhc convert ({who}) is writing OUT {self.out}; wait for it to finish, or delete "
            f"{self.path} if no conversion is running there."
        )

    def __exit__(self, exc_type, exc, traceback) -> None:
        if _read_text(self.path) == self.owner:
            self.path.unlink(missing_ok=True)


def _read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError):
        return ""


def _recover_replaced(out: Path) -> None:
    """Old checkpoints of ``out`` that a killed ``--overwrite`` left in ``.OUT.hf-mhc-replaced.*`` (lock held).

    One, with OUT missing (or an empty folder): renamed back to OUT. Otherwise each is kept and its path logged.
    Never deleted.
    """
    prefix = f".{out.name}{REPLACED_MARKER}"
    aside = sorted(
        entry
        for entry in out.parent.iterdir()
        if entry.name.startswith(prefix) and entry.is_dir() and not entry.is_symlink()
    )
    if len(aside) == 1 and (not os.path.lexists(out) or (out.is_dir() and not out.is_symlink() and _rmdir(out))):
        os.rename(aside[0], out)
        logger.warning(
            "restored %s from %s, where an interrupted --overwrite had set the old checkpoint aside", out, aside[0].name
        )
        return
    for folder in aside:
        logger.warning(
            "%s holds an earlier checkpoint of %s that an interrupted --overwrite set aside; it is kept: move it back "
            "or delete it yourself",
            folder,
            out,
        )


def _rmdir(folder: Path) -> bool:
    """Remove ``folder`` if it is empty; whether it was."""
    try:
        folder.rmdir()
    except OSError:
        return False
    return True


def _move_into_place(staging: Path, out: Path, existing: _Existing | None) -> None:
    """Rename the finished ``staging`` folder to ``out``, replacing only ``existing`` (see :func:`_check_output`).

    Without a checkpoint to replace, a single rename, which fails on a non-empty folder or a file: an OUT that
    appeared meanwhile is left as it is. A checkpoint is set aside first, checked to be the folder found at the start,
    and deleted only once the new one is in place.
    """
    if existing is not None and existing.empty:
        if os.path.lexists(out) and (_identity(out) != existing.identity or not _rmdir(out)):
            raise _appeared(out)
        existing = None
    if existing is None:
        try:
            os.rename(staging, out)
        except OSError:
            if os.path.lexists(out):
                raise _appeared(out) from None
            raise
        return
    replaced = out.parent / f".{out.name}{REPLACED_MARKER}{secrets.token_hex(6)}"
    try:
        os.rename(out, replaced)
    except FileNotFoundError:  # the old checkpoint was removed meanwhile: nothing to replace
        _move_into_place(staging, out, None)
        return
    try:
        checked = _identity(replaced) == existing.identity
        if checked:
            os.rename(staging, out)
    except BaseException:  # an error or Ctrl-C between the two renames: the old checkpoint goes back
        _put_back(replaced, out)
        raise
    if not checked:  # what was set aside is not the folder checked at the start
        _put_back(replaced, out)
        raise _appeared(out)
    shutil.rmtree(replaced, ignore_errors=True)


def _put_back(replaced: Path, out: Path) -> None:
    """Rename ``replaced`` back to ``out``; if that fails (OUT taken meanwhile), say where it is."""
    try:
        os.rename(replaced, out)
    except OSError:
        logger.warning("%s could not be renamed back to %s; it is kept where it is", replaced, out)


def _appeared(out: Path) -> ConversionError:
    return ConversionError(
        f"OUT {out} appeared or changed while converting (another program wrote it); it was left as it is and the "
        "converted checkpoint was not kept: remove OUT or choose another folder, then convert again."
    )


__all__ = ["ConversionReport", "convert_checkpoint", "DEFAULT_MAX_SHARD_SIZE"]
