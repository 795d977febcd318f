"""Check a converted checkpoint against its source: logits on fixed prompts, and greedy decoding.

Both models are loaded in the same dtype, one after the other (never both in memory), on CUDA when available.

A conversion passes when both criteria hold:

1. ``max |logits_mHC - logits_source| <= rtol * max(1, max |logits_source|)`` over all prompt positions, with the
   logits finite. The threshold is relative to the logit scale because float32 rounding is: the function-preserving
   initialisation is exact up to rounding, and the mHC model adds the same terms in a different order, so its logits
   differ from the source's by a few float32 ulps of the logit scale. Measured (tiny random Llamas, CPU, 1 thread):
   ``max |Δ| / scale`` = 3e-7 at 2 layers x 64 wide, 7e-7 at 4-6 layers x 128 wide (logits ~500, so ``|Δ|`` = 3.7e-4),
   1.3e-6 at 8 x 1024, 1.5e-6 at 16 x 384; 3e-6 was reported for a 16 x 384 Llama with logits ~100 (|Δ| = 2.7e-4).
   The source model's own float32 error against float64 is the same size (0.5e-6 to 1.2e-6 on these models), so
   this is the rounding floor of a float32 forward, not a conversion error. It grows roughly with the square root of
   depth x width, so ``rtol = 1e-4`` (float32 and float64) leaves a margin of 30 at 16 x 384 and about 3 for an
   80-layer, 8192-wide model. A conversion error is far larger: one layer's post bias off by 0.01 moves the logits by
   6e-4 of their scale (4 x 128 Llama), a wrong HC initialisation or a missing or swapped tensor by a sizeable
   fraction of it. (A single tensor rounded to bfloat16 moves them by only 6e-6 to 3e-3 of the scale, so dtypes are
   not judged by the logits: every floating backbone tensor is written in the one ``--dtype``, or as stored.)
   In bfloat16 ``rtol = 0.1``, in float16 ``0.02``: half precision rounds the mHC streams differently from the
   residual model, so both drift from the float32 function by about the same amount. Measured on the real
   stories260K Llama (5 layers): mHC vs source 1.4% (bf16) and 0.19% (fp16) of the logit scale, the source itself
   vs float32 1.5% and 0.3%; the thresholds leave room for models of ~50 layers and more.
2. In float32 and float64, greedy decoding of :data:`GREEDY_TOKENS` tokens from every prompt gives the same tokens.
   A difference of 1e-4 of the logit scale flips a greedy choice only at a near-exact tie. In half precision greedy
   decoding is reported, not enforced: a near-tie can flip a token (stories260K in bfloat16 diverges at the 4th
   generated token of one prompt, and so does the source itself in bfloat16 against float32).
"""

from __future__ import annotations

import gc
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

# rtol of ``max |Δ logits| <= rtol * max(1, max |logits_source|)`` per dtype (see the module docstring).
RELATIVE_TOLERANCES: dict[torch.dtype, float] = {
    torch.float64: 1e-4,
    torch.float32: 1e-4,
    torch.bfloat16: 0.1,
    torch.float16: 0.02,
}
# Dtypes in which greedy decoding must agree (in half precision rounding flips near-ties).
GREEDY_ENFORCED: frozenset[torch.dtype] = frozenset({torch.float32, torch.float64})
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

    ``passed`` when the logits are finite, the largest difference is within ``tolerance`` (``rtol * max(1,
    logit_scale)``), and, where ``greedy_required`` (float32, float64), greedy decoding agrees on every prompt.
    """

    dtype: str
    prompts: int
    prompt_source: str
    max_abs_logit_diff: float
    tolerance: float
    greedy_tokens: int
    greedy_agrees: bool
    logit_scale: float = math.nan
    greedy_required: bool = False

    @property
    def logits_agree(self) -> bool:
        return math.isfinite(self.max_abs_logit_diff) and self.max_abs_logit_diff <= self.tolerance

    @property
    def passed(self) -> bool:
        return self.logits_agree and (self.greedy_agrees or not self.greedy_required)

    def summary(self) -> str:
        """One line: dtype, prompts, the difference against its threshold, and the greedy-decoding agreement."""
        greedy = "agrees" if self.greedy_agrees else "DIFFERS"
        if not self.greedy_agrees and not self.greedy_required:
            greedy += f" (in {self.dtype} rounding flips near-ties, as it does between the source and float32)"
        scale = f", logit scale {self.logit_scale:.3g}" if math.isfinite(self.logit_scale) else ""
        return (
            f"{self.dtype}, {self.prompts} prompts ({self.prompt_source}): max |logit difference| "
            f"{self.max_abs_logit_diff:.3g} (threshold {self.tolerance:.3g}{scale}); greedy decoding of "
            f"{self.greedy_tokens} tokens {greedy}"
        )


def logit_tolerance(dtype: torch.dtype, logit_scale: float) -> float:
    """Largest acceptable ``max |Δ logits|`` for models run in ``dtype`` whose logits reach ``logit_scale``:
    ``rtol * max(1, logit_scale)`` with the dtype's ``rtol`` from :data:`RELATIVE_TOLERANCES`."""
    if dtype not in RELATIVE_TOLERANCES:
        raise ValueError(f"no verification tolerance for {dtype}; use float32, bfloat16 or float16.")
    return RELATIVE_TOLERANCES[dtype] * max(logit_scale, 1.0)


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


def _run_prompts(
    folder: Path, dtype: torch.dtype, device: str, prompts: list[torch.Tensor]
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Logits ``[T, vocab]`` per prompt (float32, CPU), and ``[P, GREEDY_TOKENS]`` greedily decoded ids.

    Logits come from each prompt alone; greedy decoding runs on the left-padded batch of all prompts at once.
    """
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
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
        logits = [model(ids[None].to(device)).logits[0].float().cpu() for ids in prompts]
        output = model.generate(batch.to(device), attention_mask=mask.to(device))
    del model
    gc.collect()
    return logits, output[:, longest:].cpu()


def verify_conversion(
    source_folder: str | Path,
    converted_folder: str | Path,
    dtype: torch.dtype,
    vocab_size: int,
    device: str | None = None,
) -> VerificationResult:
    """Compare the converted checkpoint with its source, both loaded in ``dtype``, on fixed prompts.

    Returns the largest absolute logit difference over every prompt position, the source's logit scale
    (``max |logits_source|``), the tolerance (:func:`logit_tolerance`) and whether greedy decoding of
    :data:`GREEDY_TOKENS` tokens agrees on every prompt (required in float32 and float64).
    """
    source_folder, converted_folder = Path(source_folder), Path(converted_folder)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    prompts, prompt_source = verification_prompts(source_folder, vocab_size)
    source_logits, source_tokens = _run_prompts(source_folder, dtype, device, prompts)
    converted_logits, converted_tokens = _run_prompts(converted_folder, dtype, device, prompts)
    max_diff = max(float((got - want).abs().max()) for got, want in zip(converted_logits, source_logits, strict=True))
    if not all(torch.isfinite(logits).all() for logits in source_logits + converted_logits):
        max_diff = math.inf
    logit_scale = max(float(logits.abs().max()) for logits in source_logits)
    return VerificationResult(
        dtype=str(dtype).removeprefix("torch."),
        prompts=len(prompts),
        prompt_source=prompt_source,
        max_abs_logit_diff=max_diff,
        tolerance=logit_tolerance(dtype, logit_scale if math.isfinite(logit_scale) else 1.0),
        greedy_tokens=GREEDY_TOKENS,
        greedy_agrees=torch.equal(converted_tokens, source_tokens),
        logit_scale=logit_scale,
        greedy_required=dtype in GREEDY_ENFORCED,
    )


__all__ = ["GREEDY_ENFORCED", "RELATIVE_TOLERANCES", "VerificationResult", "logit_tolerance", "verify_conversion"]
