"""Accelerate's FSDP2 path (``accelerate launch`` with ``fsdp_version: 2``, ``Trainer`` with an FSDP2 ``fsdp_config``)
keeps the mHC hyper-connection modules float32.

Accelerate shards a model in ``fsdp2_prepare_model`` with ONE ``MixedPrecisionPolicy`` for every unit; with
``mixed_precision: bf16`` it is ``param_dtype = reduce_dtype = output_dtype = bfloat16``. On the hyper-connection (HC)
modules (``attn_hc``, ``ffn_hc``: :class:`~hf_mhc.MHCHyperConnection`; ``hc_head``: :class:`~hf_mhc.MHCHyperHead`)
that policy all-gathers ``fn``, ``base``, ``scale`` (``hc_fn``, ``hc_base``, ``hc_scale``) in bf16, so the ``pre``,
``post`` and Sinkhorn ``comb`` maps come from bf16-rounded weights, and it reduces their gradients in bf16. Listing
the HC classes in ``_no_split_modules`` gives them units of their own, but under that same policy.

Accelerate (checked up to 1.15) takes one policy for the whole model and FSDP2 has no public way to change a unit's
policy after ``fully_shard``, so :func:`install` (called by ``import hf_mhc``) wraps two functions of Accelerate, and
changes what they do only for a model holding HC modules, only while Accelerate prepares it for FSDP2:

- ``accelerate.accelerator.fsdp2_prepare_model`` (what ``Accelerator.prepare`` calls) records the accelerator for
  the duration of the call;
- ``accelerate.utils.fsdp_utils.fsdp2_prepare_auto_wrap_policy``, which that function calls right before it shards
  its units (after its upcast to float32 master weights and, with ``cpu_ram_efficient_loading``, after its move to
  the ``meta`` device), first runs :func:`shard_hyper_connections`: every HC module becomes an FSDP2 unit with
  :func:`hc_mixed_precision`, on Accelerate's mesh with its resharding and offload settings. Accelerate then shards
  the rest with the user's policy and skips modules that already are FSDP units.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import re
from typing import TYPE_CHECKING

import torch
from torch import nn

from .distributed import hc_modules, shard_hc_units

if TYPE_CHECKING:
    from accelerate import Accelerator

logger = logging.getLogger(__name__)

__all__ = ["install", "shard_hyper_connections"]

_MARK = "_hf_mhc_keeps_hc_float32"  # set on the wrappers: install() is idempotent
# The accelerator whose fsdp2_prepare_model is running, if any.
_PREPARING: contextvars.ContextVar[Accelerator | None] = contextvars.ContextVar("hf_mhc_fsdp2_prepare", default=None)


def _ignored_parameters(plugin, model: nn.Module) -> set[nn.Parameter]:
    """The parameters of the plugin's ``ignored_modules`` (modules, or a regex on their names): FSDP leaves them be."""
    ignored = plugin.ignored_modules
    if ignored is None:
        return set()
    if isinstance(ignored, str):
        pattern = re.compile(ignored)
        ignored = [module for name, module in model.named_modules() if pattern.fullmatch(name)]
    return {parameter for module in ignored for parameter in module.parameters()}


def shard_hyper_connections(accelerator: Accelerator, model: nn.Module) -> int:
    """Make every HC module of ``model`` an FSDP2 unit with :func:`hc_mixed_precision`, as Accelerate would shard it
    otherwise (its mesh, ``reshard_after_forward``, ``cpu_offload``; modules wholly in ``ignored_modules`` are left
    be). HC parameters that are not float32 (a model cast with ``model.to(torch.bfloat16)``) are upcast first: mHC
    keeps them float32 in any model dtype. Returns the number of HC modules sharded."""
    from torch.distributed.fsdp import FSDPModule

    modules = [module for module in hc_modules(model) if not isinstance(module, FSDPModule)]
    if not modules:
        return 0
    plugin = accelerator.state.fsdp_plugin
    ignored = _ignored_parameters(plugin, model)
    modules = [module for module in modules if not set(module.parameters()) <= ignored]
    if not modules:
        return 0
    upcast = []
    for module in modules:
        for name, parameter in module.named_parameters():
            if parameter.dtype != torch.float32:
                parameter.data = parameter.data.float()
                upcast.append(name)
    if upcast:
        logger.info("Upcast %d HC parameters to float32 before sharding: %s", len(upcast), sorted(set(upcast)))
    mesh = accelerator.torch_device_mesh
    kwargs = {
        "mesh": mesh[tuple(accelerator.parallelism_config.fsdp_dim_names)] if mesh is not None else None,
        "reshard_after_forward": plugin.reshard_after_forward,
        "offload_policy": plugin.cpu_offload,
    }
    if ignored:
        kwargs["ignored_params"] = ignored
    shard_hc_units(modules, **kwargs)
    return len(modules)


def install() -> None:
    """Wrap Accelerate's ``fsdp2_prepare_model`` and ``fsdp2_prepare_auto_wrap_policy`` so that mHC models keep
    float32 HC units (see the module docstring). Called by ``import hf_mhc``; calling it again changes nothing."""
    import accelerate.accelerator
    import accelerate.utils.fsdp_utils as fsdp_utils

    prepare = getattr(accelerate.accelerator, "fsdp2_prepare_model", None)
    policy = getattr(fsdp_utils, "fsdp2_prepare_auto_wrap_policy", None)
    if prepare is None or policy is None:
        logger.warning("This Accelerate lacks fsdp2_prepare_model: under its FSDP2 the HC modules follow its policy.")
        return
    if getattr(prepare, _MARK, False):
        return

    @functools.wraps(prepare)
    def fsdp2_prepare_model(accelerator, model: nn.Module) -> nn.Module:
        token = _PREPARING.set(accelerator)
        try:
            return prepare(accelerator, model)
        finally:
            _PREPARING.reset(token)

    @functools.wraps(policy)
    def fsdp2_prepare_auto_wrap_policy(fsdp2_plugin, model: nn.Module):
        accelerator = _PREPARING.get()
        if accelerator is not None:  # inside fsdp2_prepare_model, right before it shards its own units
            shard_hyper_connections(accelerator, model)
        return policy(fsdp2_plugin, model)

    for wrapper in (fsdp2_prepare_model, fsdp2_prepare_auto_wrap_policy):
        setattr(wrapper, _MARK, True)
    accelerate.accelerator.fsdp2_prepare_model = fsdp2_prepare_model
    fsdp_utils.fsdp2_prepare_auto_wrap_policy = fsdp2_prepare_auto_wrap_policy
