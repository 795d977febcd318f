"""Offloading parts of a model with Accelerate's ``device_map``: the routed experts of MoE layers, say, on the CPU or
on disk while everything else stays on the accelerator."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

__all__ = ["expert_modules", "offload_device_map"]


def expert_modules(model: nn.Module) -> list[str]:
    """Names of the routed-experts modules, one per MoE layer (``model.layers.{i}.mlp.experts``; DeepSeek-V3's
    always-active ``shared_experts`` are not among them)."""
    return [name for name, _ in model.named_modules() if name.rsplit(".", 1)[-1] == "experts"]


def offload_device_map(model: nn.Module, offloaded: Iterable[str], device: str | int = "cpu",
                       offload_to: str | int = "disk") -> dict[str, str | int]:
    """A ``device_map`` for ``from_pretrained`` with the modules ``offloaded`` on ``offload_to`` and everything else
    on ``device``. ``model`` gives the module tree: the model itself, or one built with ``init_empty_weights``.

    Accelerate places the whole subtree of each entry, so an ancestor of an offloaded module cannot be an entry itself
    (``{"": "cpu", "model.layers.1.mlp.experts": "disk"}`` fails in ``dispatch_model`` with ``gate_up_proj is on the
    meta device``): the map names the siblings along the path to each offloaded module instead.
    """
    offloaded = set(offloaded)
    device_map: dict[str, str | int] = {}

    def visit(prefix: str, module: nn.Module) -> None:
        for name, _ in module.named_parameters(recurse=False):
            device_map[prefix + name] = device
        for name, child in module.named_children():
            path = prefix + name
            if path in offloaded:
                device_map[path] = offload_to
            elif any(target.startswith(path + ".") for target in offloaded):
                visit(path + ".", child)
            else:
                device_map[path] = device

    visit("", model)
    return device_map
