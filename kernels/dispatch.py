"""The mHC dispatch table: which ops run a call, looked up per call from ``(implementation, device, gradient)``.

``MHC_OPS`` maps ``(hc_implementation, device kind, gradient wanted)`` to the name of an op set; ``mhc_ops`` looks a
call up and returns that op set, an object with the functions of ``hf_mhc.mhc_reference`` of the same names and
signatures (``mhc_coeffs``, ``mhc_coeffs_pre``, ``mhc_pre``, ``mhc_post_res``, ``mhc_head``, ``sinkhorn``):

- ``"reference"``: ``hf_mhc.mhc_reference`` itself, the plain formula (autograd through it);
- ``"torch"``: the memory-light torch kernels (``torch_backend``), on any device;
- ``"cpu_decode"``: the torch kernels, with a site's entry, merge and the head as one C++ call each for at most
  ``cpu_decode.MAX_TOKENS`` tokens (``cpu_decode``): CPU calls that want no gradient;
- ``"triton"``: the fused Triton kernels (``triton_backend``), for CUDA tensors, and for CPU tensors when Triton
  runs its interpreter (``TRITON_INTERPRET=1``).

The device kind is ``"cuda"``, ``"cpu"`` or ``"other"``; a gradient is wanted when grad mode is on and a tensor of the
call requires grad. ``"auto"`` is Triton on CUDA and torch elsewhere. The torch, C++ and reference sets import without
Triton; the Triton set is imported with this module where CUDA is available, and otherwise on the first call that
needs it (the interpreter).
"""

from __future__ import annotations

import contextlib

import torch

from hf_mhc import mhc_reference
from hf_mhc.configuration_mhc import HC_IMPLEMENTATIONS

from .common import interpreting
from .cpu_decode import CPU_DECODE_OPS
from .torch_backend import TORCH_OPS

DEVICE_KINDS = ("cuda", "cpu", "other")

MHC_OPS: dict[tuple[str, str, bool], str] = {
    # (hc_implementation, device kind, gradient wanted): op set
    ("auto", "cuda", True): "triton",       ("auto", "cuda", False): "triton",
    ("auto", "cpu", True): "torch",         ("auto", "cpu", False): "cpu_decode",
    ("auto", "other", True): "torch",       ("auto", "other", False): "torch",
    ("torch", "cuda", True): "torch",       ("torch", "cuda", False): "torch",
    ("torch", "cpu", True): "torch",        ("torch", "cpu", False): "cpu_decode",
    ("torch", "other", True): "torch",      ("torch", "other", False): "torch",
    ("triton", "cuda", True): "triton",     ("triton", "cuda", False): "triton",
    ("triton", "cpu", True): "triton",      ("triton", "cpu", False): "triton",  # under TRITON_INTERPRET=1 only
    ("reference", "cuda", True): "reference", ("reference", "cuda", False): "reference",
    ("reference", "cpu", True): "reference",  ("reference", "cpu", False): "reference",
    ("reference", "other", True): "reference", ("reference", "other", False): "reference",
}
OP_SETS: dict[str, object] = {  # the loaded op sets; "triton" joins on first use
    "reference": mhc_reference,
    "torch": TORCH_OPS,
    "cpu_decode": CPU_DECODE_OPS,
}


def load_op_set(name: str):
    """The op set ``name`` (a value of ``MHC_OPS``); the Triton set is imported on first use."""
    op_set = OP_SETS.get(name)
    if op_set is None and name == "triton":
        from .triton_backend import TRITON_OPS  # imports Triton

        op_set = OP_SETS["triton"] = TRITON_OPS
    return op_set


def mhc_ops(implementation: str, streams: torch.Tensor, *weights: torch.Tensor):
    """The op set that runs a call of ``implementation`` on ``streams`` (and the op's tensor ``weights``).

    ``ValueError`` in one line for an unknown implementation, and for ``"triton"`` on tensors Triton cannot run on
    (CPU tensors without ``TRITON_INTERPRET=1``, other devices)."""
    grad = torch.is_grad_enabled() and (streams.requires_grad or any(w.requires_grad for w in weights))
    kind = streams.device.type
    name = MHC_OPS.get((implementation, kind if kind in DEVICE_KINDS else "other", grad))
    if name is not None and name != "triton":
        return OP_SETS[name]
    if name is None and implementation not in HC_IMPLEMENTATIONS:
        raise ValueError(f"Unknown hc_implementation {implementation!r}; available: {', '.join(HC_IMPLEMENTATIONS)}.")
    if name is None or (name == "triton" and kind == "cpu" and not interpreting()):
        raise ValueError(
            f"hc_implementation='triton' runs on CUDA tensors, not {streams.device.type} tensors; set "
            "TRITON_INTERPRET=1 before importing triton to run the kernels on CPU tensors, or use 'torch' or 'auto' "
            "(backend='torch' or None in hf_mhc.kernels)."
        )
    return load_op_set(name)


if torch.cuda.is_available():  # loaded now, so that a traced call (torch.compile) finds it loaded
    with contextlib.suppress(ImportError):  # without Triton installed, a call that needs it raises ImportError then
        load_op_set("triton")
