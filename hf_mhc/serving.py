"""``hf-mhc serve``: transformers' own OpenAI-compatible server (``transformers serve``) on mHC models.

transformers' server builds a checkpoint's model class as ``getattr(transformers, config.architectures[0])`` (in
``transformers.cli.serving.model_manager``), which finds transformers' own classes only, not a plugin's or a remote
code's. :func:`serve` sets the mHC model classes on the module object that this lookup reads, the one the model
manager imported as ``transformers``: importing some of transformers' submodules (``transformers.processing_utils``)
puts a new module object in ``sys.modules["transformers"]``, so an attribute set on an earlier one is not seen. It then
runs transformers' own ``serve`` command with the arguments unchanged, so every option of ``transformers serve``
(``--continuous-batching``, ``--cb-*``, ``--host``, ``--port``, ``--device``, ``--dtype``, ``--quantization``, ...)
means what it means there.
"""

from __future__ import annotations

from collections.abc import Sequence

from . import modeling_mhc

# The classes a served mHC checkpoint's config can name in ``architectures``.
SERVED_CLASSES = (modeling_mhc.MHCForCausalLM,)
SERVE_REQUIREMENTS = "pip install 'hf-mhc[serving]'"


def register_with_transformers_serve() -> None:
    """Make :data:`SERVED_CLASSES` resolvable by ``transformers serve``'s model manager, in this process. A class
    transformers already resolves under that name is left alone."""
    from transformers.cli.serving import model_manager

    for model_class in SERVED_CLASSES:
        if getattr(model_manager.transformers, model_class.__name__, None) is None:
            setattr(model_manager.transformers, model_class.__name__, model_class)


def serve(arguments: Sequence[str]) -> int:
    """Run ``transformers serve ARGUMENTS`` with the mHC classes registered (:func:`register_with_transformers_serve`);
    return its exit status. ``ImportError`` when transformers' serving dependencies are missing."""
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        raise ImportError(f"serving needs fastapi, uvicorn, pydantic and openai: {SERVE_REQUIREMENTS}")
    import click
    from transformers.cli.transformers import app

    register_with_transformers_serve()
    try:
        return app.main(["serve", *arguments], prog_name="hf-mhc", standalone_mode=False) or 0
    except click.exceptions.Abort:
        return 130
    except click.exceptions.ClickException as error:
        error.show()
        return error.exit_code


__all__ = ["SERVED_CLASSES", "register_with_transformers_serve", "serve"]
