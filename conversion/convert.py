"""Stream a residual checkpoint into an mHC checkpoint folder: exact, verified, and all-or-nothing.

The backbone tensors are copied under their unchanged names, chunk by chunk (at most ``CHUNK_BYTES`` of tensor data
in memory), and the function-preserving HC tensors are added in float32. Everything is written to a hidden staging
folder beside ``out`` that is renamed into place only once the checkpoint is complete and verified; on any error or
interruption the staging folder is removed and ``out`` is left as it was.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import math
import os
import re
import secrets
import shutil
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoConfig, PreTrainedConfig
from transformers.dynamic_module_utils import custom_object_save

from hf_mhc.configuration_mhc import SUPPORTED_BACKBONES, MHCConfig
from hf_mhc.modeling_mhc import AUTO_MAP, MHCForCausalLM, function_preserving_hc_tensors

from .errors import ConversionError, VerificationError
from .safetensors_stream import SafetensorsStreamWriter, TensorSpec, aligned_order, parse_size
from .source import SourceCheckpoint, SourceTensor, TensorReader, resolve_source
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
# Source tensors that transformers itself ignores when loading (old checkpoints saved the rotary buffer).
IGNORED_SOURCE_TENSOR = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
STAGING_MARKER = ".hf-mhc-partial."


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
    """Convert a Llama / Mistral / Qwen2 / Qwen3 causal-LM checkpoint into an mHC checkpoint folder ``out``.

    Args:
        src: a checkpoint folder, or a Hub model id (downloaded, or taken from the cache when offline).
        out: the folder to create. It must not exist or be empty, unless ``overwrite`` (then the old folder is
            replaced only after the new one is complete and verified).
        hc_mult: number of residual streams.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"`` to cast the floating backbone tensors; ``None`` keeps
            them as stored. HC tensors are always float32.
        verify: load source and result and compare their logits and greedy decoding (see :mod:`.verify`);
            raises :class:`VerificationError` and writes nothing when the difference exceeds the dtype's tolerance.
        max_shard_size: largest weight file, e.g. ``"5GB"`` or ``"500MB"``; one ``model.safetensors`` when all fits.
        allow_pickle: read pickled ``pytorch_model*.bin`` weights (with ``torch.load(weights_only=True)``).
        progress: show a progress bar per written shard.
        **hc_options: other :class:`MHCConfig` fields (``hc_sinkhorn_iters``, ``hc_eps``, ``hc_init_*``).

    Returns:
        A :class:`ConversionReport`. Raises :class:`ConversionError` on bad input, before ``out`` is touched.
    """
    out = Path(os.path.abspath(Path(out).expanduser()))  # normalised: "." and "a/.." name real folders
    max_shard_bytes = parse_size(max_shard_size)
    target_dtype = _parse_dtype(dtype)
    _check_output(out, overwrite)
    source = resolve_source(src, allow_pickle=allow_pickle)
    if out.resolve() == source.folder.resolve() or out.resolve() in source.folder.resolve().parents:
        raise ConversionError(f"OUT {out} is SRC or contains it; write the converted checkpoint to another folder.")
    backbone_config = load_backbone_config(source.folder)
    backbone_config._name_or_path = str(src)
    try:
        config = mhc_config_for(backbone_config, hc_mult=hc_mult, **hc_options)
    except (ValueError, TypeError) as error:
        raise ConversionError(str(error)) from None
    checkpoint = SourceCheckpoint.inspect(source.folder, allow_pickle=allow_pickle)
    plan = plan_tensors(config, checkpoint, target_dtype)
    model_dtype = next(p.spec.dtype for p in plan if p.spec.name == "model.embed_tokens.weight")
    shards = pack_shards(plan, max_shard_bytes)

    _remove_stale_staging(out)
    created_parents = _missing_ancestors(out)
    staging = out.parent / f".{out.name}{STAGING_MARKER}{os.getpid()}@{socket.gethostname()}.{secrets.token_hex(6)}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()  # beside OUT (same file system, so the final rename is atomic), with the umask's permissions
        with checkpoint.reader() as reader:
            weight_files = write_weights(staging, shards, reader, progress=progress)
        write_config_and_code(config, staging, model_dtype)
        copied_files = copy_auxiliary_files(source.folder, staging)
        verification = None
        if verify:
            verification = verify_conversion(
                source.folder, staging, model_dtype, vocab_size=config.backbone_config.vocab_size
            )
            if not verification.passed:
                hint = ""
                if math.isinf(verification.max_abs_logit_diff):
                    hint = " (non-finite logits: float16 overflows for many models; try --dtype bfloat16)"
                raise VerificationError(
                    f"the converted model does not reproduce the source: {verification.summary()}{hint}; "
                    "nothing was written. Please report this with the source checkpoint's config."
                )
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
        )
        (staging / "README.md").write_text(model_card(report, config, source.hub_id), encoding="utf-8")
        _move_into_place(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for folder in created_parents:
            try:
                folder.rmdir()
            except OSError:
                break
        raise
    return report


def _parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype in DTYPES.values()):
        return dtype
    if isinstance(dtype, str) and dtype.removeprefix("torch.") in DTYPES:
        return DTYPES[dtype.removeprefix("torch.")]
    raise ConversionError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)} (or none to keep it).")


def _check_output(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ConversionError(f"OUT {out} exists and is a file; choose a folder path.")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConversionError(
            f"OUT {out} exists and is not empty; choose a new folder or pass --overwrite "
            "(the old folder is then replaced only once the new checkpoint is complete)."
        )


def load_backbone_config(folder: Path) -> PreTrainedConfig:
    """The source's config, checked to be a causal LM of a supported family."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ConversionError(
            f"{folder} has no config.json, so it is not a transformers checkpoint; pass the folder that holds "
            "config.json and the weights."
        )
    try:
        raw = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConversionError(f"{config_path} is not valid JSON ({error}).") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if model_type == MHCConfig.model_type:
        raise ConversionError(f"{folder} is already an mHC checkpoint; convert the residual model it came from.")
    if model_type not in SUPPORTED_BACKBONES:
        raise ConversionError(
            f"{folder} is a {model_type!r} model; hf-mhc convert supports these architectures: "
            f"{', '.join(SUPPORTED_BACKBONES)}."
        )
    architectures = raw.get("architectures") or []
    if architectures and not any(str(name).endswith("ForCausalLM") for name in architectures):
        raise ConversionError(
            f"{folder} is a {', '.join(map(str, architectures))} checkpoint, not a causal language model; "
            "hf-mhc convert needs a *ForCausalLM checkpoint (e.g. LlamaForCausalLM)."
        )
    try:
        return AutoConfig.from_pretrained(folder)
    except (OSError, ValueError, TypeError, KeyError) as error:
        raise ConversionError(f"{config_path} cannot be loaded as a {model_type} config ({error}).") from None


def plan_tensors(config: MHCConfig, checkpoint: SourceCheckpoint, dtype: torch.dtype | None) -> list[PlannedTensor]:
    """Every output tensor, backbone ones in source order then the HC ones; checks the source's names and shapes.

    The expected layout is that of :class:`MHCForCausalLM` (built on the meta device, no memory): the backbone
    names and shapes must match the source exactly. With tied embeddings there is no ``lm_head.weight`` in the
    output (transformers re-ties it on load), as ``save_pretrained`` writes it.
    """
    with torch.device("meta"):
        expected = {
            name: tuple(tensor.shape)
            for name, tensor in MHCForCausalLM(copy.deepcopy(config)).state_dict().items()
            if not is_hc_parameter(name)
        }
    family = config.backbone_config.model_type
    tied = config.tie_word_embeddings
    if tied:
        expected.pop("lm_head.weight", None)
    copied = {
        name: tensor
        for name, tensor in checkpoint.tensors.items()
        if not IGNORED_SOURCE_TENSOR.search(name) and not (tied and name == "lm_head.weight")
    }
    missing = [name for name in expected if name not in copied]
    unexpected = [name for name in copied if name not in expected]
    if missing or unexpected:
        raise ConversionError(
            f"the weights in {checkpoint.folder} do not match a {family} causal LM with this config: "
            f"missing {missing[:3]}{' ...' if len(missing) > 3 else ''}, "
            f"unexpected {unexpected[:3]}{' ...' if len(unexpected) > 3 else ''}. "
            "Is it a base model without lm_head, or are config.json and the weights from different models?"
        )
    mismatched = [name for name, tensor in copied.items() if tensor.shape != expected[name]]
    if mismatched:
        name = mismatched[0]
        raise ConversionError(
            f"{name} has shape {list(copied[name].shape)} in {copied[name].file} but config.json implies "
            f"{list(expected[name])}; the config and the weights do not belong together."
        )
    plan = []
    for name, tensor in copied.items():
        out_dtype = dtype if dtype is not None and tensor.dtype.is_floating_point else tensor.dtype
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
            tqdm(total=sum(s.nbytes for s in specs), unit="B", unit_scale=True, desc=file_name, disable=not progress)
            as bar,
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


def write_config_and_code(config: MHCConfig, folder: Path, model_dtype: torch.dtype) -> None:
    """``config.json`` and the flat remote-code files, exactly as ``MHCForCausalLM.save_pretrained`` writes them."""
    config = copy.deepcopy(config)
    config.backbone_config.dtype = model_dtype
    config.dtype = str(model_dtype).removeprefix("torch.")
    config.architectures = [MHCForCausalLM.__name__]
    config.auto_map = dict(AUTO_MAP)
    # The model's half of save_pretrained's remote-code step: modeling_mhc.py and its relative imports, flat.
    custom_object_save(MHCForCausalLM, folder)
    config.save_pretrained(folder)  # config.json, and configuration_mhc.py for AutoConfig


def copy_auxiliary_files(source_folder: Path, folder: Path) -> list[str]:
    """Copy the tokenizer, chat-template and generation-config files of the source (following links)."""
    copied = []
    for entry in sorted(source_folder.iterdir()):
        if entry.is_file() and any(fnmatch.fnmatch(entry.name, pattern) for pattern in COPIED_FILE_PATTERNS):
            shutil.copyfile(entry, folder / entry.name)
            copied.append(entry.name)
        elif entry.is_dir() and entry.name in COPIED_FOLDERS:
            shutil.copytree(entry, folder / entry.name)
            copied.append(entry.name)
    return copied


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
            f"- **Streams:** hc_mult = {config.hc_mult}, {config.hc_sinkhorn_iters} Sinkhorn iterations, "
            f"hc_eps = {config.hc_eps:g}",
            "- **Initialisation:** function-preserving. Every stream starts as a copy of the embedding; "
            f"pre = 1/n; post biases in pairs ±k·{config.hc_init_post_delta:g} with mean(post) = 1; "
            f"comb bias = {config.hc_init_comb_diag:g}·I; the head averages the streams; the token-dependent part "
            f"is off (fn = 0, scale = {config.hc_init_dynamic_scale:g}). Until it is trained the model computes the "
            "source's function.",
            f"- **Weights:** backbone tensors copied under their original names ({report.dtype}); HC tensors float32.",
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
        if not entry.name.startswith(prefix) or not entry.is_dir():
            continue
        owner = entry.name[len(prefix) :].rsplit(".", 1)[0]
        pid, _, host = owner.partition("@")
        if host != socket.gethostname() or not pid.isdigit() or _process_alive(int(pid)):
            continue
        shutil.rmtree(entry, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _move_into_place(staging: Path, out: Path) -> None:
    """Rename the finished ``staging`` folder to ``out``; an existing ``out`` is set aside first, removed after."""
    if not out.exists():
        os.rename(staging, out)
        return
    if not any(out.iterdir()):
        out.rmdir()
        os.rename(staging, out)
        return
    replaced = out.parent / f".{out.name}.hf-mhc-replaced.{secrets.token_hex(6)}"
    os.rename(out, replaced)
    try:
        os.rename(staging, out)
    except BaseException:
        os.rename(replaced, out)
        raise
    shutil.rmtree(replaced, ignore_errors=True)


__all__ = ["ConversionReport", "convert_checkpoint", "DEFAULT_MAX_SHARD_SIZE"]
