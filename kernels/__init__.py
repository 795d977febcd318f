"""mHC ops (imported as ``hf_mhc.kernels``): see :mod:`hf_mhc.kernels.functional`."""

from .functional import BACKENDS, mhc_coeffs, mhc_head, mhc_post_res, mhc_pre, resolve_backend, sinkhorn

__all__ = ["BACKENDS", "mhc_coeffs", "mhc_head", "mhc_post_res", "mhc_pre", "resolve_backend", "sinkhorn"]
