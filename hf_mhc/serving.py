"""``hf-mhc serve``: transformers' own OpenAI-compatible server (``transformers serve``) on mHC models.

transformers' server builds a checkpoint's model class as ``getattr(transformers, config.architectures[0])`` (in
``transformers.cli.serving.model_manager``), which finds transformers' own classes only, not a plugin's or a remote
code's. :func:`register_with_transformers_serve` sets the mHC model classes on the ``transformers`` module, and
``import hf_mhc`` calls it: transformers 5.24 loads the model in the server's process, 5.25 in a process it spawns,
which imports the ``hf-mhc`` command (its main script) and so ``hf_mhc`` again. :func:`serve` then runs transformers'
own ``serve`` command with the arguments unchanged, so every option of ``transformers serve``
(``--continuous-batching``, ``--cb-*``, ``--host``, ``--port``, ``--device``, ``--dtype``, ``--quantization``, ...)
means what it means there. :func:`serve` adds one check to the server transformers builds
(:func:`reject_bad_generation_requests`): a ``max_tokens`` that is not a positive integer, and a prompt that does not
fit the model's context, get HTTP 400 instead of a server error, an empty answer or an answer past the context.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from . import modeling_mhc
from .compat import SERVE_REJECTS_FULL_CONTEXT, require, serve_max_model_len, text_modality

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
        modules.append(require("transformers.cli.serving.model_manager:transformers"))
    for module in modules:
        for model_class in SERVED_CLASSES:
            if getattr(module, model_class.__name__, None) is None:
                setattr(module, model_class.__name__, model_class)


# The generation routes checked, each with its new-token count fields, the one its handler uses first, first.
MAX_TOKENS_FIELDS = {
    "/v1/completions": ("max_tokens",),
    "/v1/chat/completions": ("max_completion_tokens", "max_tokens"),
}


def max_tokens_error(body: dict, fields: Sequence[str]) -> str | None:
    """The message of a 400 for the first of ``fields`` that ``body`` gives (not ``None``) and that is not a positive
    integer; ``None`` when all of them are."""
    for field in fields:
        value = body.get(field)
        if value is not None and (type(value) is not int or value < 1):
            return f"`{field}` must be a positive integer; got {json.dumps(value)}."
    return None


def context_error(prompt_tokens: int, max_new_tokens: int | None, context: int,
                  field: str = "max_tokens") -> str | None:
    """The message of a 400 for a prompt of ``prompt_tokens`` that leaves no room in a ``context`` of positions, or
    that with ``max_new_tokens`` (the request's ``field``, when it gives it) exceeds it; ``None`` when it fits."""
    if prompt_tokens >= context:
        return f"The prompt has {prompt_tokens} tokens; the model's context is {context} tokens."
    if max_new_tokens is not None and prompt_tokens + max_new_tokens > context:
        return (f"The prompt's {prompt_tokens} tokens and {field}={max_new_tokens} exceed the model's context of "
                f"{context} tokens.")
    return None


@functools.cache
def served_text_model(model_id: str) -> tuple[Any, Any] | None:
    """``(config, tokenizer)`` of the text model ``model_id`` (a folder or a Hub id, read as the server reads it), or
    ``None`` for a model these checks do not judge: one whose config or tokenizer does not load this way (a
    ``repo@revision`` or GGUF id, a processor-only model) or that is not a text model. Loaded once per id."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(model_id)
        tokenizer = AutoTokenizer.from_pretrained(model_id)
    except (OSError, ValueError, KeyError):
        return None
    if getattr(config, "vision_config", None) is not None or getattr(config, "audio_config", None) is not None:
        return None
    return config, tokenizer


def reject_bad_generation_requests(app, model_manager, chat_handler, completion_handler) -> None:
    """Add to ``app`` (built by transformers' ``build_server``, not started yet) a middleware that answers a ``POST``
    to ``/v1/completions`` or ``/v1/chat/completions`` with HTTP 400 ``{"detail": message}`` (transformers' own 400s'
    shape) when a field of :data:`MAX_TOKENS_FIELDS` is given and is not a positive integer, or when the prompt's
    tokens (a chat's through the chat template, as its handler applies it; text models only) fill the served model's
    context (``max_position_embeddings``, or transformers' ``--max-model-len`` where it has one) or, with the
    new-token count the request gives, exceed it.

    The checks read the request body, the served model's own config and tokenizer (:func:`served_text_model`) and the
    server's chat template arguments, never a handler's private method. A prompt that fills the context is left to
    transformers where it rejects it itself (:data:`hf_mhc.compat.SERVE_REJECTS_FULL_CONTEXT`), so its answer is
    transformers'. Every request these checks do not reject reaches transformers' routes unchanged: a body that is
    not a JSON object (or nests past Python's recursion limit), a model other than the pinned one, a prompt that is
    not a string, a model not judged. The middleware sits inside transformers' request-id one, so a 400 carries the
    ``x-request-id`` header as transformers' own do.
    """
    from fastapi.responses import JSONResponse
    from starlette.middleware import Middleware
    from starlette.middleware.base import BaseHTTPMiddleware

    handlers = {"/v1/completions": completion_handler, "/v1/chat/completions": chat_handler}

    def prompt_tokens(path: str, body: dict, tokenizer) -> int | None:
        """The request's prompt tokens as its handler builds them; ``None`` when its prompt is not for these checks."""
        if path == "/v1/completions":
            prompt = body.get("prompt", "")
            return len(tokenizer(prompt)["input_ids"]) if isinstance(prompt, str) else None
        if not isinstance(body.get("messages"), list):
            return None
        handler = handlers[path]
        messages = handler.get_processor_inputs_from_messages(body["messages"], text_modality())
        template_kwargs = {**handler.chat_template_kwargs, **(body.get("chat_template_kwargs") or {})}
        inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=body.get("tools"),
                                               tokenize=True, return_dict=True, **template_kwargs)
        return len(inputs["input_ids"])

    def bad_request_message(path: str, body: dict) -> str | None:
        message = max_tokens_error(body, MAX_TOKENS_FIELDS[path])
        if message is not None:
            return message
        requested, pinned = body.get("model"), model_manager.force_model
        if pinned is not None and requested not in (None, pinned):
            return None  # transformers answers: the server is pinned to another model
        model = served_text_model(pinned if pinned is not None else requested) if (pinned or requested) else None
        if model is None:
            return None
        config, tokenizer = model
        limits = [getattr(config.get_text_config(decoder=True), "max_position_embeddings", None),
                  serve_max_model_len(chat_handler)]
        limits = [limit for limit in limits if limit is not None]
        tokens = prompt_tokens(path, body, tokenizer) if limits else None
        if tokens is None:
            return None
        context = min(limits)
        if tokens >= context and SERVE_REJECTS_FULL_CONTEXT:
            return None  # transformers answers 400 itself, with its own message
        given = [field for field in MAX_TOKENS_FIELDS[path] if body.get(field) is not None]
        if not given:
            return context_error(tokens, None, context)
        return context_error(tokens, body[given[0]], context, given[0])

    async def dispatch(request, call_next: Callable[[Any], Any]):
        if request.method != "POST" or request.url.path not in handlers:
            return await call_next(request)
        try:
            body = json.loads(await request.body())  # Starlette keeps the body for the route
        except (ValueError, RecursionError):  # not JSON, or nested too deep to parse: transformers answers
            return await call_next(request)
        if not isinstance(body, dict):
            return await call_next(request)
        message = await asyncio.to_thread(bad_request_message, request.url.path, body)
        if message is None:
            return await call_next(request)
        return JSONResponse({"detail": message}, status_code=400)

    app.user_middleware.append(Middleware(BaseHTTPMiddleware, dispatch=dispatch))


def serve(arguments: Sequence[str]) -> int:
    """Run ``transformers serve ARGUMENTS`` (:func:`register_with_transformers_serve` done by ``import hf_mhc``), its
    app checked by :func:`reject_bad_generation_requests`; return its exit status. ``ImportError`` when transformers'
    serving dependencies are missing."""
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        raise ImportError(f"serving needs fastapi, uvicorn, pydantic and openai: {SERVE_REQUIREMENTS}")
    import click

    app = require("transformers.cli.transformers:app")
    build_server = require("transformers.cli.serving.server:build_server")
    server = sys.modules["transformers.cli.serving.server"]

    def build_checked_server(model_manager, chat_handler, completion_handler, *args, **kwargs):
        checked = build_server(model_manager, chat_handler, completion_handler, *args, **kwargs)
        reject_bad_generation_requests(checked, model_manager, chat_handler, completion_handler)
        return checked

    register_with_transformers_serve()  # again, in case a transformers import replaced the module since
    server.build_server = build_checked_server  # transformers' serve command imports it when it runs
    try:
        return app.main(["serve", *arguments], prog_name="hf-mhc", standalone_mode=False) or 0
    except click.exceptions.Abort:
        return 130
    except click.exceptions.ClickException as error:
        error.show()
        return error.exit_code
    finally:
        server.build_server = build_server


__all__ = [
    "MAX_TOKENS_FIELDS",
    "SERVED_CLASSES",
    "context_error",
    "max_tokens_error",
    "register_with_transformers_serve",
    "reject_bad_generation_requests",
    "serve",
]
