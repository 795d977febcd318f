"""``hf-mhc serve``: transformers' own OpenAI-compatible server (``transformers serve``) on mHC models.

transformers' server builds a checkpoint's model class as ``getattr(transformers, config.architectures[0])`` (in
``transformers.cli.serving.model_manager``), which finds transformers' own classes only, not a plugin's or a remote
code's. :func:`register_with_transformers_serve` sets the mHC model classes on the ``transformers`` module, and
``import hf_mhc`` calls it: transformers 5.24 loads the model in the server's process, 5.25 in a process it spawns,
which imports the ``hf-mhc`` command (its main script) and so ``hf_mhc`` again. :func:`serve` then runs transformers'
own ``serve`` command with the arguments unchanged, so every option of ``transformers serve``
(``--continuous-batching``, ``--cb-*``, ``--host``, ``--port``, ``--device``, ``--dtype``, ``--quantization``, ...)
means what it means there.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

from . import modeling_mhc

# The classes a served mHC checkpoint's config can name in ``architectures``.
SERVED_CLASSES = (modeling_mhc.MHCForCausalLM,)
SERVE_REQUIREMENTS = "pip install 'hf-mhc[serving]'"


def register_with_transformers_serve() -> None:
    """Set :data:`SERVED_CLASSES` on the ``transformers`` module of this process, where ``transformers serve`` looks
    a checkpoint's class up. A name transformers already resolves is left alone.

    The first import of ``transformers.processing_utils`` puts a new ``transformers`` module object in
    ``sys.modules`` (it re-executes ``transformers/__init__.py``), which would drop an attribute set on the earlier
    one: it is imported first, so that the object set here is the one every later ``import transformers`` gets.
    """
    importlib.import_module("transformers.processing_utils")
    modules = [sys.modules["transformers"]]
    if "transformers.cli.serving.model_manager" in sys.modules:  # imported earlier: the object its lookup reads
        modules.append(sys.modules["transformers.cli.serving.model_manager"].transformers)
    for module in modules:
        for model_class in SERVED_CLASSES:
            if getattr(module, model_class.__name__, None) is None:
                setattr(module, model_class.__name__, model_class)


def serve(arguments: Sequence[str]) -> int:
    """Run ``transformers serve ARGUMENTS`` (:func:`register_with_transformers_serve` done by ``import hf_mhc``);
    return its exit status. ``ImportError`` when transformers' serving dependencies are missing."""
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        raise ImportError(f"serving needs fastapi, uvicorn, pydantic and openai: {SERVE_REQUIREMENTS}")
    import click
    from transformers.cli.transformers import app

    register_with_transformers_serve()  # again, in case a transformers import replaced the module since
    try:
        return app.main(["serve", *arguments], prog_name="hf-mhc", standalone_mode=False) or 0
    except click.exceptions.Abort:
        return 130
    except click.exceptions.ClickException as error:
        error.show()
        return error.exit_code


__all__ = ["SERVED_CLASSES", "register_with_transformers_serve", "serve"]
