"""mHC ops (imported as ``hf_mhc.kernels``): see :mod:`hf_mhc.kernels.functional`."""

if __name__ == "hf_mhc.kernels":
    from .functional import (
        BACKENDS,
        mhc_coeffs,
        mhc_coeffs_pre,
        mhc_head,
        mhc_post_res,
        mhc_pre,
        resolve_backend,
        sinkhorn,
    )

    def __getattr__(name: str):
        """``apply_mhc_kernels`` lives in :mod:`hf_mhc.monkey_patch` (which imports this package): loaded on use."""
        if name == "apply_mhc_kernels":
            from hf_mhc.monkey_patch import apply_mhc_kernels

            return apply_mhc_kernels
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    __all__ = [
        "BACKENDS",
        "apply_mhc_kernels",
        "mhc_coeffs",
        "mhc_coeffs_pre",
        "mhc_head",
        "mhc_post_res",
        "mhc_pre",
        "resolve_backend",
        "sinkhorn",
    ]
else:
    # Imported as a top-level `kernels` because Python runs from the repository root (its folder is on sys.path).
    # transformers probes for Hugging Face's `kernels` package at import time: stay inert (no version, no imports)
    # so that the probe finds no usable package instead of importing hf_mhc while transformers is half-initialised.
    __all__ = []
