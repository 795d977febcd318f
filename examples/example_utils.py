"""What the example scripts share: the default assets, the options they have in common, their text data, model
loading, checkpoint folders and clearing an earlier output.

The scripts import it as a sibling module: ``python examples/X.py``, ``torchrun`` and ``accelerate launch`` put
``examples/`` first on ``sys.path``, and each script adds it too for when it is imported by path (as the tests do).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from itertools import islice
from pathlib import Path

from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError, safe_open
from transformers import AutoModelForCausalLM

from hf_mhc.cli import DEFAULT_HC_MULT
from hf_mhc.cli import SHARED_OPTIONS as CLI_OPTIONS
from hf_mhc.common import first_line
from hf_mhc.configuration_mhc import load_pretrained_config

ASSETS = Path(__file__).resolve().parents[2] / "shared" / "assets"
STORIES260K = ASSETS / "stories260K"
JANEAUSTEN = ASSETS / "janeausten"
REAL_MODEL_SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "real_model.py"

MAX_SEED = 2**32 - 1  # numpy's seeding (transformers.set_seed) takes no more


def built_real_model() -> Path | None:
    """The folder of SmolLM2-135M-Instruct that ``make real-model`` built (``tools/real_model.py``), or ``None``
    when it is not built."""
    spec = importlib.util.spec_from_file_location("real_model", REAL_MODEL_SCRIPT)
    real_model = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(real_model)
    try:
        return real_model.real_model_folder()
    except real_model.RealModelError:
        return None


# --- options -----------------------------------------------------------------------------------------------------


def integer(value: str) -> int:
    """``int(value)``; anything else is an argparse error."""
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {value!r}") from None


def number(value: str) -> float:
    """``float(value)``; anything else is an argparse error."""
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None


def seed(value: str) -> int:
    """The argparse type of ``--seed``: an integer from 0 to :data:`MAX_SEED`."""
    parsed = integer(value)
    if not 0 <= parsed <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to {MAX_SEED} (2**32 - 1), got {parsed}")
    return parsed


def block_size(value: str) -> int:
    """The argparse type of ``--block-size``: an integer >= 2. Each token of a block learns to predict the next one,
    so a block of one token trains on nothing."""
    parsed = integer(value)
    if parsed < 2:
        raise argparse.ArgumentTypeError(f"must be >= 2 (each token is trained to predict the next one in its block), "
                                         f"got {parsed}")
    return parsed


def non_negative_integer(value: str) -> int:
    """The argparse type of ``--warmup-steps``: an integer >= 0."""
    parsed = integer(value)
    if parsed < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {parsed}")
    return parsed


def non_negative_number(value: str) -> float:
    """The argparse type of ``--weight-decay``: a finite number >= 0."""
    parsed = number(value)
    if not (math.isfinite(parsed) and parsed >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {value}")
    return parsed


def learning_rate(value: str) -> float:
    """The argparse type of the examples' ``--lr``: a finite number > 0."""
    parsed = number(value)
    if not (math.isfinite(parsed) and parsed > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {value}")
    return parsed


# The options several examples take, defined once. "default" is the value when a script gives none; a script gives its
# own only where the option means the same but its scale differs (--steps, --block-size); help may name it as {default}.
EXAMPLE_OPTIONS: dict[str, dict] = {
    "--seed": dict(type=seed, default=0, help="seed of the random number generators and the data order (default 0)"),
    "--hc-mult": dict(**CLI_OPTIONS["--hc-mult"], default=None,
                      help=f"residual streams n of the upcycled model (default {DEFAULT_HC_MULT})"),
    "--steps": dict(type=int, help="optimizer steps (default {default})"),
    "--block-size": dict(type=block_size, help="tokens per training sequence, at least 2 (default {default})"),
    "--warmup-steps": dict(type=non_negative_integer, default=None, help="linear warm-up steps (default steps // 10)"),
    "--weight-decay": dict(type=non_negative_number, default=0.0, help="AdamW weight decay (default 0)"),
    "--resume": dict(nargs="?", const="last", default=None, metavar="CHECKPOINT",
                     help="continue from the newest complete checkpoint in --output-dir, or from CHECKPOINT"),
}


def add_example_option(group: argparse._ActionsContainer, flag: str, *, shown_default: str | None = None,
                       **script_default) -> None:
    """Add the :data:`EXAMPLE_OPTIONS` definition of ``flag`` to ``group`` (a parser or an argument group);
    ``default=`` gives the script's own default where the definition has none, ``shown_default`` what its help says
    of a default the script decides later (``default=None``)."""
    if set(script_default) - {"default"} or script_default.keys() & EXAMPLE_OPTIONS[flag].keys():
        raise ValueError(f"{flag} has one definition: only a default it lacks may be given, not {script_default}")
    options = {**EXAMPLE_OPTIONS[flag], **script_default}
    options["help"] = options["help"].format(default=shown_default or options.get("default"))
    group.add_argument(flag, **options)


def hc_mult_or_default(hc_mult: int | None) -> int:
    """The streams of an upcycled model: --hc-mult, else :data:`hf_mhc.cli.DEFAULT_HC_MULT`."""
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
    """hf-mhc's ``load_pretrained_config(name)`` (the config loader of its CLI); what it rejects ends in one
    ``parser.error`` line."""
    try:
        return load_pretrained_config(name)
    except (OSError, ValueError) as error:
        parser.error(f"cannot load {option} {name}: {first_line(error)}")


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


# --- checkpoints -------------------------------------------------------------------------------------------------

CHECKPOINT_PREFIX = "checkpoint-"  # transformers' PREFIX_CHECKPOINT_DIR, and pipeline_finetune.py's
STATE_FILE = "trainer_state.json"  # written last: a checkpoint is complete once it holds it in full
PARTIAL_SUFFIX = ".partial-"  # .checkpoint-STEP.partial-XXXX: a save in progress (or killed) before its rename
# incomplete-checkpoint-STEP.XXXX: an incomplete checkpoint-STEP that a resumed run set aside (set_aside_incomplete).
# Not checkpoint-*: Trainer's --save-total-limit rotation counts every checkpoint-* folder and deletes the oldest.
SET_ASIDE_PREFIX = "incomplete-"


def checkpoint_step(path: Path) -> int | None:
    """The STEP of a ``checkpoint-STEP`` folder, else None."""
    step = path.name.removeprefix(CHECKPOINT_PREFIX)
    if path.name.startswith(CHECKPOINT_PREFIX) and step.isdigit() and path.is_dir() and not path.is_symlink():
        return int(step)
    return None


def checkpoint_folders(folder: Path) -> list[Path]:
    """The ``checkpoint-STEP`` folders in ``folder``, newest (highest STEP) first."""
    found = [entry for entry in folder.iterdir() if checkpoint_step(entry) is not None] if folder.is_dir() else []
    return sorted(found, key=checkpoint_step, reverse=True)


def file_error(path: Path) -> str | None:
    """Why the checkpoint file ``path`` cannot be read, as ``"NAME is ..."``; None when it can. JSON is parsed,
    safetensors headers are checked against the file size, torch files (zip archives) must have their directory,
    which a file cut short has lost."""
    if not path.exists():
        return f"{path.name} is missing"
    try:
        if path.suffix == ".json":
            json.loads(path.read_text(encoding="utf-8"))
        elif path.suffix == ".safetensors":
            with safe_open(path, framework="pt"):
                pass
        elif path.suffix in (".pt", ".pth", ".bin"):
            zipfile.ZipFile(path).close()
    except json.JSONDecodeError as error:
        return f"{path.name} is not valid JSON (line {error.lineno}: {error.msg})"
    except UnicodeDecodeError:
        return f"{path.name} is not UTF-8 text"
    except SafetensorError as error:
        return f"{path.name} is damaged or cut short ({first_line(error)})"
    except zipfile.BadZipFile:
        return f"{path.name} is damaged or cut short (not a complete torch archive)"
    except OSError as error:
        return f"{path.name} cannot be read ({first_line(error)})"
    return None


def incomplete_reason(checkpoint: Path) -> str | None:
    """Why ``checkpoint`` is not a complete save: its :data:`STATE_FILE` (written last) is missing or cut short."""
    return file_error(checkpoint / STATE_FILE)


def checkpoint_to_resume(parser: argparse.ArgumentParser, resume: str, out: Path) -> tuple[Path, dict, str]:
    """The checkpoint ``--resume`` names: CHECKPOINT (``resume``), which must be complete, or for ``"last"`` the
    newest complete ``checkpoint-STEP`` in ``out``. Returns it, its parsed :data:`STATE_FILE` and a note (``"; ..."``,
    empty when there is nothing to say) naming what was left alone: newer incomplete checkpoints and interrupted
    saves. Nothing is deleted."""
    if resume != "last":
        checkpoint = Path(resume).expanduser()
        if not checkpoint.is_dir():
            parser.error(f"--resume {resume}: no such checkpoint folder")
        reason = incomplete_reason(checkpoint)
        if reason is not None:
            parser.error(f"--resume {resume}: incomplete checkpoint ({reason}), not one to continue from")
        return checkpoint, json.loads((checkpoint / STATE_FILE).read_text(encoding="utf-8")), ""
    skipped = []
    for checkpoint in checkpoint_folders(out):
        reason = incomplete_reason(checkpoint)
        if reason is None:
            interrupted = sorted(entry.name for entry in out.glob(f".{CHECKPOINT_PREFIX}*{PARTIAL_SUFFIX}*")
                                 if entry.is_dir())
            left = [*skipped, *(f"{name} (an interrupted save)" for name in interrupted)]
            note = f"; skipped: {', '.join(left)}" if left else ""
            return checkpoint, json.loads((checkpoint / STATE_FILE).read_text(encoding="utf-8")), note
        skipped.append(f"{checkpoint.name} (incomplete: {reason})")
    if skipped:
        parser.error(f"--resume: no complete checkpoint in --output-dir {out}: {', '.join(skipped)}")
    parser.error(f"--resume: no checkpoint-* in --output-dir {out} to continue from")


def incomplete_in_the_way(parser: argparse.ArgumentParser, checkpoint: Path, step: int, folders: Iterable[Path]
                          ) -> list[tuple[Path, str]]:
    """Of ``folders`` (what a run resumed from ``checkpoint``, at ``step``, would save into), the incomplete
    ``checkpoint-STEP`` folders with why each is incomplete (:func:`incomplete_reason`): a killed save's, which
    :func:`set_aside_incomplete` moves out of the way. Anything else there (a complete checkpoint, a file, a link)
    ends in one ``parser.error`` line: nothing complete is replaced or moved."""
    incomplete = []
    for folder in folders:
        reason = incomplete_reason(folder) if checkpoint_step(folder) is not None else None
        if reason is None:
            parser.error(f"--resume {checkpoint} continues at step {step} and would save {folder.name} again, which "
                         "--output-dir already holds: move it away first (nothing is replaced)")
        incomplete.append((folder, reason))
    return incomplete


def set_aside_incomplete(incomplete: Iterable[tuple[Path, str]]) -> list[str]:
    """Rename each incomplete checkpoint of :func:`incomplete_in_the_way` to a new ``incomplete-checkpoint-STEP.XXXX``
    beside it (a name no other folder has: it takes the place of an empty folder made for it); nothing is deleted.
    Returns a line for each, saying so. Raises ``OSError`` when a rename fails."""
    lines = []
    for folder, reason in incomplete:
        aside = Path(tempfile.mkdtemp(prefix=f"{SET_ASIDE_PREFIX}{folder.name}.", dir=folder.parent))
        try:
            folder.rename(aside)  # onto the empty folder just made (POSIX rename replaces an empty directory)
        except OSError:
            aside.rmdir()
            raise
        lines.append(f"--resume: set aside the incomplete {folder.name} ({reason}) as {aside.name}, so that this run "
                     f"can save {folder.name} again; nothing of it is deleted")
    return lines


def first_file_error(paths: Iterable[Path]) -> str | None:
    """:func:`file_error` of the first of ``paths`` that cannot be read, else None."""
    return next((error for error in map(file_error, paths) if error is not None), None)


def damaged_file(folder: Path) -> str | None:
    """:func:`file_error` of the first JSON, safetensors or torch file directly in ``folder`` that cannot be read."""
    suffixes = (".json", ".safetensors", ".pt", ".pth", ".bin")
    return first_file_error(path for path in sorted(folder.iterdir()) if path.is_file() and path.suffix in suffixes)


@contextmanager
def atomic_folder(folder: Path) -> Iterator[Path]:
    """Write a new ``folder`` all at once: the block writes into a hidden folder beside it (``.NAME.partial-*``),
    renamed to ``folder`` when the block completes, so that an interrupted save never leaves a ``folder`` that looks
    complete. Raises ``FileExistsError`` when ``folder`` exists. A block that raises takes its hidden folder with it;
    a killed process leaves it, and :func:`checkpoint_to_resume` names it."""
    if folder.exists():
        raise FileExistsError(f"{folder} exists")
    folder.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(prefix=f".{folder.name}{PARTIAL_SUFFIX}", dir=folder.parent))
    umask = os.umask(0)
    os.umask(umask)
    temporary.chmod(0o777 & ~umask)  # as a folder made by mkdir, not mkdtemp's private 0o700
    try:
        yield temporary
        temporary.rename(folder)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def clear_earlier_output(folder: Path, is_output_file: Callable[[Path], bool],
                         cleared_subfolder: Callable[[Path], bool]) -> tuple[list[str], list[str]]:
    """Delete what an earlier run wrote to ``folder``: the files ``is_output_file`` accepts, there and in the
    subfolders ``cleared_subfolder`` accepts (given their path relative to ``folder``: ``merged``,
    ``checkpoint-50``, ``additional_chat_templates/more``); a subfolder emptied so goes too. Every other file and
    subfolder stays. Returns the deleted and the kept names, relative to ``folder`` (a deleted subfolder as
    ``name/``)."""
    removed: list[str] = []
    kept: list[str] = []

    def clear(directory: Path, relative: Path) -> bool:
        everything = True
        for entry in sorted(directory.iterdir()):
            name = str(relative / entry.name)
            if entry.is_dir() and not entry.is_symlink():
                if not cleared_subfolder(relative / entry.name):
                    kept.append(name + "/")
                    everything = False
                    continue
                before = len(removed)
                if clear(entry, relative / entry.name):
                    entry.rmdir()
                    removed[before:] = [name + "/"]
                else:
                    everything = False
            elif is_output_file(entry):
                entry.unlink()
                removed.append(name)
            else:
                kept.append(name)
                everything = False
        return everything

    clear(folder, Path())
    return removed, kept
