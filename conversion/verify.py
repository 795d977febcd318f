"""Check a converted checkpoint against its source: logits on fixed prompts, and greedy decoding.

What is compared, whatever dtype the conversion writes:

- the converted checkpoint as written, and the source's tensors as the conversion wrote them: each source tensor that
  ``--dtype`` cast is rounded to that dtype exactly as the converter rounds it (``tensor.to(dtype)``), every other
  one (float8 weights and their scales, tensors kept as stored) is taken as stored. When the conversion changed no
  tensor's dtype, that is the source folder itself;
- both computed in float32 (float64 for a float64 checkpoint): ``from_pretrained(..., dtype=torch.float32)`` upcasts
  stored half-precision weights exactly, and the HC tensors are float32. So the two models hold the same numbers and
  differ only in how the mHC model combines them. Computing in the stored half precision would not tell a conversion
  error from rounding: the mHC streams round differently from the residual stream, and in an MoE model that alone
  flips expert choices, which moves the logits by a sizeable fraction of their scale.

The models are loaded one after the other (never both in memory), on CUDA when available. A conversion passes when

1. ``max |logits_mHC - logits_source| <= RELATIVE_TOLERANCE * max(1, max |logits_source|)`` over all prompt
   positions, with the logits finite. The function-preserving initialisation is exact up to rounding, and the mHC
   model adds the same terms in another order, so the logits differ by a few float32 ulps of their scale (growing
   about as the square root of depth x width); a wrong HC tensor, or a missing or swapped backbone tensor, moves them
   by far more;
2. greedy decoding of :data:`GREEDY_TOKENS` tokens from every prompt gives the same tokens: a difference of
   ``RELATIVE_TOLERANCE`` of the logit scale flips a greedy choice only at a near-exact tie.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
)

from .source import SourceCheckpoint, SourceTensor, TensorReader

# rtol of ``max |Δ logits| <= rtol * max(1, max |logits_source|)`` (see the module docstring).
RELATIVE_TOLERANCE = 1e-4
GREEDY_TOKENS = 32
PROMPT_TEXTS: tuple[str, ...] = (
    "Once upon a time, there was a little girl who",
    "The capital of France is",
    "def fibonacci(n):\n    return",
)
FIXED_PROMPT_LENGTHS: tuple[int, ...] = (8, 16, 24)


@dataclass(frozen=True)
class VerificationResult:
    """Outcome of :func:`verify_conversion`.

    ``dtype`` is the converted checkpoint's, ``compute_dtype`` the one both models ran in, ``rounded_tensors`` the
    number of source tensors rounded to the converted dtypes for the comparison (0: the source as stored).
    ``passed`` when the logits are finite, the largest difference is within ``tolerance`` and greedy decoding
    agrees on every prompt.
    """

    dtype: str
    compute_dtype: str
    rounded_tensors: int
    prompts: int
    prompt_source: str
    max_abs_logit_diff: float
    logit_scale: float
    greedy_tokens: int
    greedy_agrees: bool

    @property
    def tolerance(self) -> float:
        """:func:`logit_tolerance` of the source's logit scale."""
        return logit_tolerance(self.logit_scale)

    @property
    def logits_agree(self) -> bool:
        return math.isfinite(self.max_abs_logit_diff) and self.max_abs_logit_diff <= self.tolerance

    @property
    def passed(self) -> bool:
        return self.logits_agree and self.greedy_agrees

    def summary(self) -> str:
        """One line: what was compared, the difference against its threshold, and the greedy-decoding agreement."""
        if self.rounded_tensors:
            source = f"the source with {self.rounded_tensors} tensors rounded to {self.dtype} as converted"
        else:
            source = "the source as stored"
        scale = f", logit scale {self.logit_scale:.3g}" if math.isfinite(self.logit_scale) else ""
        return (
            f"{self.dtype} weights against {source}, both computed in {self.compute_dtype}, {self.prompts} prompts "
            f"({self.prompt_source}): max |logit difference| {self.max_abs_logit_diff:.3g} (threshold "
            f"{self.tolerance:.3g}{scale}); greedy decoding of {self.greedy_tokens} tokens "
            f"{'agrees' if self.greedy_agrees else 'DIFFERS'}"
        )


def logit_tolerance(logit_scale: float) -> float:
    """Largest acceptable ``max |Δ logits|`` for logits reaching ``logit_scale``:
    ``RELATIVE_TOLERANCE * max(1, logit_scale)`` (a non-finite scale counts as 1)."""
    return RELATIVE_TOLERANCE * max(logit_scale if math.isfinite(logit_scale) else 1.0, 1.0)


def compute_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """The dtype both models run in for a checkpoint stored in ``dtype``: float32, or float64 for float64."""
    return torch.promote_types(dtype, torch.float32)


def verification_prompts(source_folder: Path, vocab_size: int) -> tuple[list[torch.Tensor], str]:
    """Fixed prompts as 1-D token-id tensors: :data:`PROMPT_TEXTS` through the source's tokenizer when it loads,
    otherwise seeded random ids in ``[0, vocab_size)`` of lengths :data:`FIXED_PROMPT_LENGTHS`."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(source_folder)
        prompts = [torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long) for text in PROMPT_TEXTS]
        if all(0 < len(ids) and int(ids.max()) < vocab_size for ids in prompts):
            return prompts, "tokenizer"
    except Exception:  # no tokenizer files, or one this environment cannot load: fall back to fixed ids
        pass
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab_size, (length,), generator=generator) for length in FIXED_PROMPT_LENGTHS]
    return prompts, "token ids"


def _read_whole(reader: TensorReader, tensor: SourceTensor) -> torch.Tensor:
    blocks = list(reader.chunks(tensor, max(1, math.prod(tensor.shape) * tensor.dtype.itemsize)))
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks)


def load_source_as_converted(
    source: SourceCheckpoint, rounded: Mapping[str, torch.dtype], compute_dtype: torch.dtype
) -> PreTrainedModel:
    """The source model in ``compute_dtype``, each tensor named in ``rounded`` first rounded to its dtype there (as
    the converter casts it: ``tensor.to(dtype)``), the others as stored."""
    if not rounded:
        return AutoModelForCausalLM.from_pretrained(source.folder, dtype=compute_dtype)
    with source.reader() as reader:
        state_dict = {
            name: _read_whole(reader, tensor).to(rounded.get(name, tensor.dtype))
            for name, tensor in source.tensors.items()
        }
    config = AutoConfig.from_pretrained(source.folder)
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # the Auto class needs a folder, and there is none
    return model_class.from_pretrained(None, config=config, state_dict=state_dict, dtype=compute_dtype)


def _run_prompts(
    model: PreTrainedModel, device: str, prompts: list[torch.Tensor]
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Logits ``[T, vocab]`` per prompt (CPU), and ``[P, GREEDY_TOKENS]`` greedily decoded ids.

    Logits come from each prompt alone; greedy decoding runs on the left-padded batch of all prompts at once.
    """
    model = model.to(device).eval()
    longest = max(len(ids) for ids in prompts)
    batch = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for row, ids in enumerate(prompts):
        batch[row, longest - len(ids) :] = ids
        mask[row, longest - len(ids) :] = 1
    # The same settings for both models, replacing each one's own: ``generate`` would otherwise merge in the defaults
    # the model derived from its config.json (a source without generation_config.json takes its eos_token_id, and
    # min_new_tokens then masks that token for the source but not for the mHC model, whose config has none).
    model.generation_config = GenerationConfig(
        do_sample=False, max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS, pad_token_id=0
    )
    with torch.no_grad():
        logits = [model(ids[None].to(device)).logits[0].cpu() for ids in prompts]
        output = model.generate(batch.to(device), attention_mask=mask.to(device))
    return logits, output[:, longest:].cpu()


def verify_conversion(
    source: SourceCheckpoint,
    converted_folder: str | Path,
    dtype: torch.dtype,
    written_dtypes: Mapping[str, torch.dtype],
    vocab_size: int,
    device: str | None = None,
) -> VerificationResult:
    """Compare the converted checkpoint with its source on fixed prompts, as the module docstring says.

    Args:
        source: the inspected source checkpoint.
        converted_folder: the converted checkpoint, stored in ``dtype`` (its config's).
        written_dtypes: the dtype the conversion wrote each source tensor in, by name; a source tensor whose dtype
            differs there is rounded to it for the comparison.
        vocab_size: the backbone's, for the fallback prompts.
        device: where both models run; CUDA when available by default.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    compute_dtype = compute_dtype_for(dtype)
    rounded = {
        name: written
        for name, written in written_dtypes.items()
        if name in source.tensors and written != source.tensors[name].dtype
    }
    prompts, prompt_source = verification_prompts(source.folder, vocab_size)
    source_model = load_source_as_converted(source, rounded, compute_dtype)
    source_logits, source_tokens = _run_prompts(source_model, device, prompts)
    del source_model
    converted_model = AutoModelForCausalLM.from_pretrained(converted_folder, dtype=compute_dtype)
    converted_logits, converted_tokens = _run_prompts(converted_model, device, prompts)
    del converted_model
    gc.collect()
    max_diff = max(float((got - want).abs().max()) for got, want in zip(converted_logits, source_logits, strict=True))
    if not all(torch.isfinite(logits).all() for logits in source_logits + converted_logits):
        max_diff = math.inf
    return VerificationResult(
        dtype=str(dtype).removeprefix("torch."),
        compute_dtype=str(compute_dtype).removeprefix("torch."),
        rounded_tensors=len(rounded),
        prompts=len(prompts),
        prompt_source=prompt_source,
        max_abs_logit_diff=max_diff,
        logit_scale=max(float(logits.abs().max()) for logits in source_logits),
        greedy_tokens=GREEDY_TOKENS,
        greedy_agrees=torch.equal(converted_tokens, source_tokens),
    )


__all__ = ["RELATIVE_TOLERANCE", "VerificationResult", "logit_tolerance", "verify_conversion"]
