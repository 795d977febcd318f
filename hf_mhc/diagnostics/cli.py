"""``hf-mhc inspect``: the stability report of an mHC checkpoint (or of a PEFT adapter on one) as a table, JSON and
PNG plots. :func:`inspect_main` runs it alone; ``hf-mhc inspect`` (:mod:`hf_mhc.cli`) through
:func:`add_inspect_arguments` and :func:`run_inspect`."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..common import BAD_INPUT_ERRORS, first_line, folder_error, output_path_error, print_error
from ..configuration_mhc import load_pretrained_config
from .plots import plot_report
from .report import format_report, stability_report

INSPECT_PROG = "hf-mhc inspect"
INSPECT_DESCRIPTION = (
    "Stability diagnostics of an mHC checkpoint: gains of the residual mixing per layer and over depth, Sinkhorn "
    "deviations, stream collapse, pre/post ranges."
)
DEFAULT_INSPECT_TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
    "of a wife. However little known the feelings or views of such a man may be on his first entering a "
    "neighbourhood, this truth is so well fixed in the minds of the surrounding families."
)


def _load_for_inspection(checkpoint: str, device: torch.device, dtype: str) -> tuple[nn.Module, Any]:
    """The mHC model of ``checkpoint`` (a model folder / Hub id, or a PEFT adapter folder on an mHC base) and its
    tokenizer (``None`` when there is none)."""
    torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
    is_adapter = (Path(checkpoint) / "adapter_config.json").is_file()
    base = checkpoint
    if is_adapter:
        if (Path(checkpoint) / "config.json").is_file():
            # transformers would load the model and silently apply the adapter beside it.
            raise ValueError(
                f"{checkpoint} holds both a model (config.json) and a PEFT adapter (adapter_config.json): move one of "
                "them to its own folder"
            )
        from ..peft import adapter_base

        base = adapter_base(checkpoint)
    model_type = load_pretrained_config(base).model_type
    if model_type != "mhc":
        raise ValueError(f"{base} is a {model_type!r} model, not an mHC one: upcycle it first (hf_mhc.upcycle)")
    if is_adapter:
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(checkpoint, dtype=torch_dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch_dtype)
    tokenizer = None
    for source in dict.fromkeys((checkpoint, base)):
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
            break
        except (OSError, ValueError):
            continue
    return model.to(device).eval(), tokenizer


def add_inspect_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``hf-mhc inspect`` arguments to ``parser`` (e.g. a subcommand parser) and return it."""
    parser.add_argument("checkpoint", help="mHC model folder or Hub id, or a PEFT adapter folder on an mHC model")
    parser.add_argument("--text", default=None,
                        help="text to run the model on, cut to the model's context (default: a fixed English passage)")
    parser.add_argument("--plot", metavar="DIR", default=None, help="write overview.png and layer_{i}.png to DIR")
    parser.add_argument("--json", metavar="FILE", default=None, help="write the full report as JSON to FILE")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="torch device")
    parser.add_argument("--dtype", default="float32", choices=("auto", "float32", "bfloat16", "float16"),
                        help="dtype of the backbone weights (HC weights stay float32; default float32)")
    return parser


def inspect_main(argv: list[str] | None = None) -> int:
    """``hf-mhc inspect CHECKPOINT [--text TEXT] [--plot DIR] [--json FILE]``: print an mHC checkpoint's stability.

    Parses ``argv`` (default ``sys.argv[1:]``) and runs :func:`run_inspect`; returns the exit status.
    """
    parser = add_inspect_arguments(argparse.ArgumentParser(prog=INSPECT_PROG, description=INSPECT_DESCRIPTION))
    args = parser.parse_args(argv)
    try:
        return run_inspect(args)
    except BAD_INPUT_ERRORS as error:  # as hf-mhc's main: one line, no traceback
        return print_error("inspect", first_line(error))


def run_inspect(args: argparse.Namespace) -> int:
    """Run ``hf-mhc inspect`` on parsed arguments (see :func:`add_inspect_arguments`).

    Loads the checkpoint (an mHC model, or a PEFT adapter whose base is one), runs :func:`stability_report` on the
    text (tokenised with the checkpoint's tokenizer; without one, 64 random token ids with seed 0), cut to the model's
    ``max_position_embeddings`` when longer (its first tokens, as transformers truncates; one ``hf-mhc inspect:
    warning: ...`` line on stderr says so), prints the table of
    :func:`format_report` and optionally writes the report as JSON and PNG plots (:func:`plot_report`, needs
    matplotlib). The JSON is strict: a NaN or infinite value is ``null``, and ``non_finite_values`` maps where it was
    to what it was (``{"sites[0].forward_gain_max": "nan"}``); ``non_finite_parameters`` names the model's parameters
    holding NaN or inf. Returns the exit status: 0 on success, 1 when the checkpoint or input cannot be used or the
    report is not finite (one ``hf-mhc inspect: error: ...`` line on stderr; no plots then).
    """
    missing = folder_error(args.checkpoint)
    if missing is not None:
        return print_error("inspect", missing)
    if args.text is not None and not args.text.strip():
        return print_error("inspect", "--text is empty; give text to run the model on, or leave --text out for the "
                           "default passage")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return print_error("inspect", "--plot needs matplotlib: pip install matplotlib")
    for option, path, folder in (("--plot", args.plot, True), ("--json", args.json, False)):
        unusable = None if path is None else output_path_error(path, folder=folder)
        if unusable is not None:
            return print_error("inspect", f"{option} {path}: {unusable}")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        return print_error("inspect", f"--device {args.device!r} is not a torch device")
    if device.type == "cuda" and not torch.cuda.is_available():
        return print_error("inspect", "--device cuda: CUDA is not available on this machine")
    try:
        model, tokenizer = _load_for_inspection(args.checkpoint, device, args.dtype)
    except (OSError, ValueError) as exc:
        return print_error("inspect", f"cannot load {args.checkpoint}: {first_line(exc)}")

    text_config = model.config.get_text_config()
    context = getattr(text_config, "max_position_embeddings", None) or math.inf
    if tokenizer is not None:
        text = DEFAULT_INSPECT_TEXT if args.text is None else args.text
        # verbose=False: not transformers' own warning about a long sequence, but the one line below
        input_ids = tokenizer(text, return_tensors="pt", verbose=False)["input_ids"]
        if input_ids.numel() == 0:
            return print_error("inspect", "--text is empty after tokenisation.")
        if input_ids.shape[-1] > context:  # as transformers truncates: the first tokens, the rest cut
            what = "--text" if args.text is not None else "the default passage"
            print(f"hf-mhc inspect: warning: {what} is {input_ids.shape[-1]} tokens, more than the model's {context} "
                  f"positions (max_position_embeddings); measuring on its first {context} tokens", file=sys.stderr)
            input_ids = input_ids[:, :context]
    elif args.text is not None:
        return print_error("inspect", f"{args.checkpoint} has no tokenizer to encode --text.")
    else:
        count = min(64, context)
        print(f"{args.checkpoint} has no tokenizer: measuring on {count} random token ids (seed 0)")
        input_ids = torch.randint(0, text_config.vocab_size, (1, count), generator=torch.Generator().manual_seed(0))

    report = stability_report(model, input_ids)
    print(format_report(report))
    non_finite_parameters = [name for name, parameter in model.named_parameters()
                             if not torch.isfinite(parameter).all()]
    finite_report, non_finite_values = _json_ready(report)
    if args.json is not None:
        json_path = Path(args.json).expanduser()
        json_path.parent.mkdir(parents=True, exist_ok=True)
        finite_report |= {"non_finite_parameters": non_finite_parameters, "non_finite_values": non_finite_values}
        json_path.write_text(json.dumps(finite_report, indent=2, allow_nan=False), encoding="utf-8")
        print(f"report written to {args.json}")
    if non_finite_parameters or non_finite_values:
        what = (f"non-finite parameters: {_first_names(non_finite_parameters)}" if non_finite_parameters else
                f"non-finite report values: {_first_names(list(non_finite_values))}")
        written = ("null in --json (its non_finite_values lists them)" if args.json is not None
                   else "nan / inf in the table")
        no_plots = "; no plots written" if args.plot else ""
        return print_error("inspect", f"{what}; the report's non-finite values are {written}{no_plots}")
    if args.plot is not None:
        paths = plot_report(report, Path(args.plot).expanduser())
        print(f"{len(paths)} plots written to {args.plot}")
    return 0


def _json_ready(value: Any, path: str = "") -> tuple[Any, dict[str, str]]:
    """``value`` (a :func:`stability_report` or part of it) with every NaN / infinite float replaced by ``None``, and
    where those were: ``{"sites[0].forward_gain_max": "nan", ...}`` (strict JSON has no NaN or Infinity)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None, {path: repr(value)}
    found: dict[str, str] = {}
    if isinstance(value, dict):
        ready = {}
        for key, item in value.items():
            ready[key], where = _json_ready(item, f"{path}.{key}" if path else key)
            found |= where
        return ready, found
    if isinstance(value, list):
        ready = []
        for index, item in enumerate(value):
            item, where = _json_ready(item, f"{path}[{index}]")
            ready.append(item)
            found |= where
        return ready, found
    return value, found


def _first_names(names: list[str], shown: int = 3) -> str:
    """``a, b, c and 4 more``."""
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


__all__ = ["DEFAULT_INSPECT_TEXT", "INSPECT_DESCRIPTION", "INSPECT_PROG", "add_inspect_arguments", "inspect_main",
           "run_inspect"]
