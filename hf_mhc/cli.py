"""The ``hf-mhc`` command line: ``convert`` (a residual checkpoint into an mHC one), ``inspect`` (stability report),
``plan`` (memory from a config), ``serve`` (transformers' OpenAI-compatible server on an mHC model).

Each subcommand is a :class:`Subcommand` in :data:`SUBCOMMANDS`: its help line and a ``setup`` function that adds
its arguments and a ``run`` handler returning the exit status. Only the chosen subcommand is set up, so ``convert``
does not pay for ``inspect``'s imports. Bad input ends with one ``hf-mhc <command>: error: ...`` line on stderr and
status 1 (2 for arguments argparse rejects), never with a traceback; an interrupted command (Ctrl-C, SIGTERM during a
conversion) with status 130. ``serve`` hands its arguments to transformers' own ``serve`` command unparsed
(:mod:`hf_mhc.serving`), which parses and reports them.

The path checks every entry point runs, the dtypes and the one-line error report are in :mod:`hf_mhc.common`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from . import __version__
from .common import (
    BAD_INPUT_ERRORS,
    DTYPES,
    first_line,
    folder_error,
    looks_like_local_path,
    output_path_error,
    print_error,
)
from .configuration_mhc import MHCConfig
from .conversion import ConversionError, ConversionReport, convert_checkpoint
from .conversion.convert import DEFAULT_MAX_SHARD_SIZE
from .mhc_reference import RESIDUAL_MAPS

EXIT_INTERRUPTED = 130
DEFAULT_HC_MULT = MHCConfig.hc_mult  # the streams of a converted or upcycled model when --hc-mult is not given
# The options several commands take (hf-mhc's subcommands and the examples), defined once; each command adds its own
# default and help with add_shared_option.
SHARED_OPTIONS: dict[str, dict] = {
    "--hc-mult": dict(type=int, metavar="N"),
    "--residual-map": dict(choices=list(RESIDUAL_MAPS)),
    "--dtype": dict(choices=list(DTYPES)),
}


@dataclass(frozen=True)
class Subcommand:
    """One ``hf-mhc`` subcommand: its help line, ``setup(parser)`` adding its arguments and ``run`` handler, and the
    description its ``--help`` shows (``None``: the help line, or what ``setup`` sets)."""

    help: str
    setup: Callable[[argparse.ArgumentParser], None]
    description: str | None = None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``hf-mhc`` parser. Every subcommand is listed; only ``command`` (all when ``None``) gets its arguments."""
    parser = argparse.ArgumentParser(
        prog="hf-mhc", description="Manifold-Constrained Hyper-Connections (mHC) for Hugging Face Transformers."
    )
    parser.add_argument("--version", action="version", version=f"hf-mhc {__version__}")
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, subcommand in SUBCOMMANDS.items():
        subparser = subcommands.add_parser(name, help=subcommand.help,
                                           description=subcommand.description or subcommand.help)
        if command is None or command == name:
            subcommand.setup(subparser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``hf-mhc`` with ``argv`` (default: ``sys.argv[1:]``) and return the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        return _run_serve(argv[1:])
    command = next((arg for arg in argv if not arg.startswith("-")), "")  # the first positional argument
    args = build_parser(command).parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print(f"hf-mhc {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BAD_INPUT_ERRORS as error:
        return print_error(args.command, first_line(error))


def add_shared_option(parser: argparse._ActionsContainer, flag: str, **command_options) -> None:
    """Add ``flag`` as :data:`SHARED_OPTIONS` defines it to ``parser`` (a parser or an argument group), with this
    command's ``default`` and ``help``; ``ValueError`` for anything else, which would redefine the option."""
    if set(command_options) - {"default", "help"}:
        raise ValueError(f"{flag} has one definition: only its default and help may be given, not {command_options}")
    parser.add_argument(flag, **SHARED_OPTIONS[flag], **command_options)


def _setup_convert(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", metavar="SRC", help="checkpoint folder or Hugging Face Hub model id")
    parser.add_argument("out", metavar="OUT", help="folder to create (must not exist or be empty)")
    add_shared_option(parser, "--hc-mult", default=DEFAULT_HC_MULT,
                      help=f"number of residual streams (default {DEFAULT_HC_MULT})")
    add_shared_option(
        parser, "--residual-map", default=MHCConfig.hc_residual_map,
        help="how the streams are mixed: sinkhorn (mHC, default), unconstrained (Hyper-Connections), identity "
             "(unmixed, HY-V4), permutations (mHC-lite, hc-mult <= 4)",
    )
    add_shared_option(parser, "--dtype", help="cast the backbone weights (HC weights stay float32); default: keep")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an OUT that holds a checkpoint (config.json and weights) once the new one is complete",
    )
    parser.add_argument(
        "--no-verify", dest="verify", action="store_false", help="skip comparing logits and greedy decoding"
    )
    parser.add_argument(
        "--max-shard-size",
        default=DEFAULT_MAX_SHARD_SIZE,
        metavar="SIZE",
        help=f"largest weight file, e.g. 500MB or 2GiB (default {DEFAULT_MAX_SHARD_SIZE})",
    )
    parser.add_argument(
        "--allow-pickle",
        action="store_true",
        help="read pickled pytorch_model*.bin weights (with torch.load(weights_only=True))",
    )
    parser.set_defaults(run=_run_convert)


def _setup_inspect(parser: argparse.ArgumentParser) -> None:
    from .diagnostics.cli import INSPECT_DESCRIPTION, add_inspect_arguments, run_inspect  # loads models: only here

    parser.description = INSPECT_DESCRIPTION
    add_inspect_arguments(parser).set_defaults(run=run_inspect)


def _setup_plan(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="CONFIG", help="folder holding config.json, or Hugging Face Hub model id")
    parser.add_argument("--tokens", type=int, default=8192, metavar="N", help="tokens per sequence (default 8192)")
    parser.add_argument("--batch", type=int, default=1, metavar="B", help="sequences (default 1)")
    add_shared_option(parser, "--dtype", default="bfloat16",
                      help="backbone weights, KV cache and streams (default bfloat16; HC weights stay float32)")
    add_shared_option(parser, "--hc-mult",
                      help="plan the mHC model with N streams (default: the config's own; a residual config as is)")
    add_shared_option(parser, "--residual-map",
                      help="hc_residual_map of the planned mHC model (default: the config's own, else sinkhorn)")
    parser.add_argument("--tp", type=int, default=1, metavar="K", help="tensor-parallel degree (default 1)")
    parser.add_argument("--pp", type=int, default=1, metavar="K", help="pipeline stages (default 1)")
    parser.add_argument("--fsdp", type=int, default=1, metavar="K", help="FSDP shards per stage (default 1)")
    parser.add_argument("--microbatches", type=int, default=1, metavar="M", help="pipeline microbatches (default 1)")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers to PATH as JSON")
    parser.set_defaults(run=_run_plan)


def _setup_serve(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("arguments", nargs=argparse.REMAINDER, metavar="MODEL [OPTIONS]",
                        help="a folder or Hub id, and transformers serve's options (hf-mhc serve --help lists them)")


SUBCOMMANDS: dict[str, Subcommand] = {
    "convert": Subcommand(
        "convert a residual causal-LM checkpoint into an mHC checkpoint", _setup_convert,
        "Stream a residual causal-LM checkpoint (a folder or a Hub model id) into a new mHC checkpoint folder: "
        "backbone tensors copied unchanged, function-preserving HC tensors added, then verified against the "
        "source. OUT is written only once complete; on any error SRC and OUT are left as they were.",
    ),
    "inspect": Subcommand("stability diagnostics of an mHC checkpoint", _setup_inspect),
    "plan": Subcommand(
        "plan KV cache, parameter, activation and mHC stream memory from a config", _setup_plan,
        "Plan the memory of a model from its config alone (a folder or Hugging Face Hub model id; no weights are "
        "read): KV cache, parameters per device, mHC stream traffic, activations held for backward (residual, mHC, "
        "hc_recompute, gradient checkpointing), pipeline-boundary bytes.",
    ),
    "serve": Subcommand(
        "serve an mHC model with transformers' OpenAI-compatible server (transformers serve's options)", _setup_serve,
        "Run transformers' own OpenAI-compatible server (`transformers serve`) on an mHC folder or Hub id, every "
        "option of transformers serve passed through unchanged.",
    ),
}


def _run_serve(arguments: list[str]) -> int:
    from .serving import serve  # imports transformers' server: only here

    try:
        return serve(arguments)
    except BAD_INPUT_ERRORS as error:
        return print_error("serve", first_line(error))


def _run_plan(args: argparse.Namespace) -> int:
    from .planning import format_plan, plan_memory

    error = folder_error(args.config) or (output_path_error(args.json, folder=False) if args.json else None)
    local = looks_like_local_path(args.config)
    if error is None and local and not (Path(args.config).expanduser() / "config.json").is_file():
        error = f"no config.json in {args.config}"
    if error:
        return print_error("plan", error)
    plan = plan_memory(args.config, tokens=args.tokens, batch=args.batch, dtype=args.dtype, hc_mult=args.hc_mult,
                       residual_map=args.residual_map, tp=args.tp, pp=args.pp, fsdp=args.fsdp,
                       microbatches=args.microbatches)
    print(format_plan(plan))
    if args.json:
        path = Path(args.json).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(plan.to_dict(), indent=2) + "\n")
    return 0


def _run_convert(args: argparse.Namespace) -> int:
    try:
        with _sigterm_raises_keyboard_interrupt(), _conversion_warnings_on_stderr():
            report = convert_checkpoint(
                args.src,
                args.out,
                hc_mult=args.hc_mult,
                hc_residual_map=args.residual_map,
                dtype=args.dtype,
                overwrite=args.overwrite,
                verify=args.verify,
                max_shard_size=args.max_shard_size,
                allow_pickle=args.allow_pickle,
            )
    except (ConversionError, OSError) as error:
        return print_error("convert", str(error))
    except KeyboardInterrupt:
        print("hf-mhc convert: interrupted; OUT was not written (an existing OUT is unchanged).", file=sys.stderr)
        return EXIT_INTERRUPTED
    _print_report(report)
    return 0


@contextlib.contextmanager
def _conversion_warnings_on_stderr() -> Iterator[None]:
    """Within the block, the converter's warnings (e.g. an old OUT restored) print as one line each on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("hf-mhc convert: warning: %(message)s"))
    conversion_logger = logging.getLogger("hf_mhc.conversion")
    conversion_logger.addHandler(handler)
    try:
        yield
    finally:
        conversion_logger.removeHandler(handler)


def _print_report(report: ConversionReport) -> None:
    print(
        f"Converted {report.source} -> {report.output}: {report.family}, hc_mult {report.hc_mult}, {report.dtype}, "
        f"{report.tensors} tensors, {report.total_size / 1e6:.1f} MB in {report.weight_files[0]}"
        + (f" and {len(report.weight_files) - 1} more files" if len(report.weight_files) > 1 else "")
    )
    print(f"Copied from SRC: {', '.join(report.copied_files) or 'nothing (no tokenizer or generation config found)'}")
    if report.verification is None:
        print("Verification: skipped (--no-verify)")
    else:
        print(f"Verification: {report.verification.summary()}")


@contextlib.contextmanager
def _sigterm_raises_keyboard_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM (e.g. ``kill``) unwinds like Ctrl-C, so the conversion cleans up after itself."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


__all__ = [
    "DEFAULT_HC_MULT",
    "SHARED_OPTIONS",
    "SUBCOMMANDS",
    "Subcommand",
    "add_shared_option",
    "build_parser",
    "main",
]
