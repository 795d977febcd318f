"""What the example scripts share: the default assets, the options they have in common, their text data and model
loading.

The scripts import it as a sibling module: ``python examples/X.py``, ``torchrun`` and ``accelerate launch`` put
``examples/`` first on ``sys.path``, and each script adds it too for when it is imported by path (as the tests do).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path

from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError
from transformers import AutoConfig, AutoModelForCausalLM

import hf_mhc
from hf_mhc.cli import first_line

ASSETS = Path(__file__).resolve().parents[2] / "shared" / "assets"
STORIES260K = ASSETS / "stories260K"
JANEAUSTEN = ASSETS / "janeausten"

DEFAULT_HC_MULT = hf_mhc.MHCConfig.hc_mult  # streams of an upcycled model when --hc-mult is not given
MAX_SEED = 2**32 - 1  # numpy's seeding (transformers.set_seed) takes no more


# --- options -----------------------------------------------------------------------------------------------------


def seed(value: str) -> int:
    """The argparse type of ``--seed``: an integer from 0 to :data:`MAX_SEED`."""
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None
    if not 0 <= number <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to {MAX_SEED} (2**32 - 1), got {number}")
    return number


# The options several examples take, defined once. "default" is the value when a script gives none; a script gives its
# own only where the option means the same but its scale differs (--steps, --block-size); help may name it as {default}.
SHARED_OPTIONS: dict[str, dict] = {
    "--seed": dict(type=seed, default=0, help="seed of the random number generators and the data order (default 0)"),
    "--hc-mult": dict(type=int, default=None, metavar="N",
                      help=f"residual streams n of the upcycled model (default {DEFAULT_HC_MULT})"),
    "--steps": dict(type=int, help="optimizer steps (default {default})"),
    "--block-size": dict(type=int, help="tokens per training sequence (default {default})"),
    "--warmup-steps": dict(type=int, default=None, help="linear warm-up steps (default steps // 10)"),
    "--weight-decay": dict(type=float, default=0.0, help="AdamW weight decay (default 0)"),
    "--resume": dict(nargs="?", const="last", default=None, metavar="CHECKPOINT",
                     help="continue from the last checkpoint in --output-dir, or from CHECKPOINT"),
}


def add_shared_option(group: argparse._ActionsContainer, flag: str, **script_default) -> None:
    """Add the :data:`SHARED_OPTIONS` definition of ``flag`` to ``group`` (a parser or an argument group);
    ``default=`` gives the script's own default where the definition has none."""
    if set(script_default) - {"default"} or script_default.keys() & SHARED_OPTIONS[flag].keys():
        raise ValueError(f"{flag} has one definition: only a default it lacks may be given, not {script_default}")
    options = {**SHARED_OPTIONS[flag], **script_default}
    options["help"] = options["help"].format(default=options.get("default"))
    group.add_argument(flag, **options)


def hc_mult_or_default(hc_mult: int | None) -> int:
    """The streams of an upcycled model: --hc-mult, else :data:`DEFAULT_HC_MULT`."""
    return DEFAULT_HC_MULT if hc_mult is None else hc_mult


def perplexity(loss: float) -> float:
    """``exp(loss)``; ``inf`` where a float cannot hold it (a loss above about 709)."""
    return math.exp(loss) if loss < math.log(sys.float_info.max) else math.inf


# --- text data ---------------------------------------------------------------------------------------------------


def paragraphs(texts: Iterable[str]) -> Iterator[str]:
    """The paragraphs (blocks between blank lines) of ``texts``, stripped, empty ones left out."""
    for text in texts:
        yield from (paragraph.strip() for paragraph in text.split("\n\n") if paragraph.strip())


def pydoc_paragraphs(half: int | None = None) -> Iterator[str]:
    """The paragraphs of Python's own help texts (about 450 kB of prose in every CPython); with ``half`` (0 or 1),
    of every other topic only, so that the two halves share no text."""
    from pydoc_data.topics import topics

    keys = sorted(topics) if half is None else sorted(topics)[half::2]
    return paragraphs(topics[key] for key in keys)


def token_blocks(texts: Iterable[str | None], tokenizer, block_size: int, max_blocks: int | None = None
                 ) -> list[list[int]]:
    """Tokenise every text (null and empty ones are skipped), append EOS to each, join them and cut the result into
    blocks of ``block_size`` token ids (the remainder is dropped). With ``max_blocks``, at most that many: ``texts``
    is read only as far as they need."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    texts = iter(text for text in texts if text)
    blocks: list[list[int]] = []
    joined: list[int] = []
    while max_blocks is None or len(blocks) < max_blocks:
        batch = list(islice(texts, 256))  # the tokenizer takes a batch at a time; [] would fail in it
        if not batch:
            break
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            joined += ids + eos
        usable = len(joined) // block_size * block_size
        blocks += [joined[start : start + block_size] for start in range(0, usable, block_size)]
        del joined[:usable]
    return blocks if max_blocks is None else blocks[:max_blocks]


def dataset_token_blocks(texts, tokenizer, text_column: str, block_size: int):
    """:func:`token_blocks` of a ``datasets.Dataset``'s ``text_column``, a thousand rows at a time: a dataset of
    ``input_ids`` and ``labels`` rows (the same ``block_size`` ids)."""

    def blocks_of(batch: dict) -> dict:
        blocks = token_blocks(batch[text_column], tokenizer, block_size)
        return {"input_ids": blocks, "labels": [list(block) for block in blocks]}

    return texts.map(blocks_of, batched=True, batch_size=1000, remove_columns=texts.column_names,
                     desc=f"blocks of {block_size} tokens")


def has_text(texts, text_column: str) -> bool:
    """Whether any row of the dataset ``texts`` holds a non-empty ``text_column`` (read until the first one)."""
    return any(text for batch in texts.select_columns(text_column).iter(batch_size=1000) for text in batch[text_column])


# --- models ------------------------------------------------------------------------------------------------------

LOAD_ERRORS = (OSError, ValueError, RuntimeError, StrictDataclassError, SafetensorError)


def innermost_message(error: BaseException) -> str:
    """The first line of the innermost cause of ``error`` (datasets and huggingface_hub wrap the original message)."""
    while (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__
    return first_line(error)


def load_error_message(error: BaseException) -> str:
    """One line for what transformers raised on loading: for a config its validation rejects, the validator's reason
    (the first line only names the validator)."""
    return innermost_message(error) if isinstance(error, StrictDataclassError) else first_line(error)


def load_config(parser: argparse.ArgumentParser, name: str, option: str = "--model"):
    """``AutoConfig.from_pretrained(name)``; what it rejects ends in one ``parser.error`` line."""
    try:
        return AutoConfig.from_pretrained(name)
    except LOAD_ERRORS as error:
        parser.error(f"cannot load {option} {name}: {load_error_message(error)}")


def load_causal_lm(parser: argparse.ArgumentParser, name: str, option: str = "--model", **kwargs):
    """``AutoModelForCausalLM.from_pretrained(name, **kwargs)``; a config that transformers rejects, weights that do
    not fit the config or do not load end in one ``parser.error`` line."""
    try:
        model, loading_info = AutoModelForCausalLM.from_pretrained(
            name, output_loading_info=True, ignore_mismatched_sizes=True, **kwargs
        )  # mismatched weights are refused below, with their names
    except LOAD_ERRORS as error:
        parser.error(f"cannot load {option} {name}: {load_error_message(error)}")
    mismatched = sorted(loading_info["mismatched_keys"])
    if mismatched:
        key, saved_shape, config_shape = mismatched[0]
        more = f"; {len(mismatched) - 1} more tensors differ" if len(mismatched) > 1 else ""
        parser.error(f"cannot load {option} {name}: its weights do not fit its config.json ({key} is "
                     f"{list(saved_shape)} in the weights, {list(config_shape)} by the config{more})")
    return model
