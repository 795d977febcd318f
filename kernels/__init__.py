"""mHC ops (imported as ``hf_mhc.kernels``): see :mod:`hf_mhc.kernels.functional`."""

if __name__ == "hf_mhc.kernels":
    from .functional import (
        BACKENDS,
        backend_implementation,
        mhc_coeffs,
        mhc_coeffs_pre,
        mhc_head,
        mhc_post_res,
        mhc_pre,
        sinkhorn,
    )

    __all__ = [
        "BACKENDS",
        "backend_implementation",
        "mhc_coeffs",
        "mhc_coeffs_pre",
        "mhc_head",
        "mhc_post_res",
        "mhc_pre",
        "backend_implementation",
        "sinkhorn",
    ]
else:
    # Imported as a top-level ``kernels`` because the repository root is on ``sys.path`` (Python run from the root:
    # the REPL, ``python -c``, a script saved there). This folder is hf-mhc's ops, never Hugging Face's ``kernels``
    # package, which transformers imports when it is installed: hand the import over to that package when it is on the
    # rest of ``sys.path``. Without it, stay an empty module without a version, which transformers' probe reads as no
    # usable ``kernels`` package, and whose every attribute says what it is.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.realpath(os.path.dirname(os.path.dirname(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        __name__, [entry for entry in sys.path if os.path.realpath(entry or os.curdir) != _root])
    if _spec is not None:
        _package = importlib.util.module_from_spec(_spec)
        sys.modules[__name__] = _package  # what the running ``import kernels`` returns
        _spec.loader.exec_module(_package)
    else:
        __all__ = []

        def __getattr__(name: str):
            raise AttributeError(f"`kernels` here is hf-mhc's kernels/ folder (the repository root is on sys.path), "
                                 f"not Hugging Face's `kernels` package, which is not installed; it has no {name!r}")
