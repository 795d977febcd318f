"""The ops of ``hf_mhc.kernels`` (``kernels/functional.py`` and the op files behind it) on both backends: every op,
every residual map, n = 1..8, float32 / bfloat16 / float16 / float64 streams against the float64 oracle
(``reference_check``); their properties, memory and custom-op registration; their handling of empty and invalid input.

The Triton backend runs on CPU tensors through the interpreter (``TRITON_INTERPRET=1``, set in conftest), so shapes
stay at tens of tokens; on a GPU machine ``HF_MHC_TEST_DEVICE=cuda`` runs the same tests on CUDA tensors with the
compiled kernels. Output buffers are poisoned with NaN first: a kernel that leaves an element unwritten fails.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.utils._device
from conftest import TEST_DEVICE
from reference_check import check_against_reference, leaf, random_head_params, random_site_params

import hf_mhc.kernels as kernels
from hf_mhc import mhc_reference
from hf_mhc.kernels import (
    common,
    mhc_coeffs,
    mhc_coeffs_pre,
    mhc_head,
    mhc_post_res,
    mhc_pre,
    sinkhorn,
)
from hf_mhc.kernels.common import map_token_chunks
from hf_mhc.kernels.dispatch import MHC_OPS, load_op_set, mhc_ops
from hf_mhc.profiling import saved_bytes_for_backward

BACKENDS = ["torch", "triton"]
VARIANTS = ["unconstrained", "identity", "permutations"]  # the residual maps beside mHC's "sinkhorn"
STREAM_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
NORM_EPS = 1e-6
HC_EPS = 1e-6
ITERS = 20
MAGNITUDE = 2.5  # the identity map's post magnitude: not 2, so that a hard-coded 2 fails
SHAPES = [(1, 5, 1, 8), (2, 3, 2, 16), (1, 7, 3, 12), (2, 4, 4, 20), (1, 5, 6, 10), (1, 3, 8, 24)]


pytestmark = pytest.mark.usefixtures("on_test_device")


@pytest.fixture(autouse=True)
def nan_poisoned_buffers(monkeypatch):
    """Every floating-point ``torch.empty`` / ``torch.empty_like`` during a test starts out as NaN."""
    # torch's device contexts (`set_default_device`, `with torch.device("meta")`) know the factory functions by
    # identity, from a set cached on first use. Filled while the stand-ins are in place, it would hold them and ignore
    # the real torch.empty for the rest of the process: later tests then build "meta" models on the CPU.
    torch.utils._device._device_constructors()
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def poison(tensor):
        return tensor.fill_(math.nan) if tensor.is_floating_point() else tensor

    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: poison(real_empty(*args, **kwargs)))
    monkeypatch.setattr(torch, "empty_like", lambda *args, **kwargs: poison(real_empty_like(*args, **kwargs)))


# --- helpers ------------------------------------------------------------------------------------------------------


def streams_for(residual_map: str) -> list[int]:
    return [1, 2, 3, 4] if residual_map == "permutations" else [1, 2, 3, 4, 8]


def sinkhorn_iters(n: int) -> int:
    """20 where the interpreter's cost allows: it replays Sinkhorn O(iters²) times in backward."""
    return ITERS if n in (3, 4) else 4


def settings(residual_map: str = "sinkhorn", iters: int = ITERS) -> dict:
    return dict(sinkhorn_iters=iters, eps=HC_EPS, norm_eps=NORM_EPS, residual_map=residual_map,
                post_magnitude=MAGNITUDE if residual_map == "identity" else 2.0)


def check_op(op: str, backend: str, inputs: list, **op_settings) -> tuple:
    """``hf_mhc.kernels.<op>`` on ``backend`` against ``mhc_reference.<op>`` in float64, forward and backward."""
    return check_against_reference(functools.partial(getattr(kernels, op), backend=backend, **op_settings),
                                   functools.partial(getattr(mhc_reference, op), **op_settings), inputs)


def shape_id(shape) -> str:
    return "x".join(map(str, shape))


# --- every op against the float64 oracle ------------------------------------------------------------------------


COEFFS_CASES = [
    *(pytest.param("sinkhorn", shape, dtype, id=f"sinkhorn-{shape_id(shape)}-{dtype}")
      for shape in SHAPES for dtype in STREAM_DTYPES),
    *(pytest.param(residual_map, (2, 3, n, 8), torch.float32, id=f"{residual_map}-n{n}")
      for residual_map in VARIANTS for n in streams_for(residual_map)),
]


@pytest.mark.parametrize(("residual_map", "shape", "dtype"), COEFFS_CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_mhc_coeffs_matches_the_oracle(backend, residual_map, shape, dtype):
    b, t, n, c = shape
    x = leaf(torch.randn(shape).to(dtype))
    params = [leaf(p) for p in random_site_params(n, c, residual_map)]
    pre, post, comb = check_op("mhc_coeffs", backend, [x, *params], **settings(residual_map, sinkhorn_iters(n)))
    assert pre.dtype == post.dtype == comb.dtype == torch.float32
    assert pre.shape == post.shape == (b, t, n) and comb.shape == (b, t, n, n)
    if residual_map == "identity":  # the comb applied is the identity, built, not computed: bit-exact
        torch.testing.assert_close(comb, torch.eye(n).expand(b, t, n, n), atol=0, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mhc_coeffs_pre_grad_through_the_collapse_alone(backend):
    """``post`` and ``comb`` unused: autograd hands the op None for them, and only the collapse path is left."""
    x = leaf(torch.randn(2, 5, 3, 12))
    params = [leaf(p) for p in random_site_params(3, 12)]
    check_against_reference(lambda *inputs: mhc_coeffs_pre(*inputs, backend=backend, **settings())[0],
                            lambda *inputs, compute_dtype: mhc_reference.mhc_coeffs_pre(
                                *inputs, compute_dtype=compute_dtype, **settings())[0],
                            [x, *params])


def site(x, fn, base, scale, weight, *, backend, **site_settings):
    """One site: ``mhc_coeffs_pre``, a linear sublayer ``y @ weight`` (in float32, rounded to the streams' dtype), then
    ``mhc_post_res``."""
    y, post, comb = mhc_coeffs_pre(x, fn, base, scale, backend=backend, **site_settings)
    return mhc_post_res(x, (y.float() @ weight).to(x.dtype), post, comb, backend=backend)


def site_reference(x, fn, base, scale, weight, *, compute_dtype, **site_settings):
    y, post, comb = mhc_reference.mhc_coeffs_pre(x, fn, base, scale, compute_dtype=compute_dtype, **site_settings)
    return mhc_reference.mhc_post_res(x, y @ weight, post, comb, compute_dtype=compute_dtype)


def check_site(backend: str, residual_map: str, shape, dtype, iters: int) -> torch.Tensor:
    b, t, n, c = shape
    x = leaf(torch.randn(shape).to(dtype))
    params = [leaf(p) for p in random_site_params(n, c, residual_map)]
    weight = leaf(torch.randn(c, c) / c**0.5)
    site_settings = settings(residual_map, iters)
    (out,) = check_against_reference(functools.partial(site, backend=backend, **site_settings),
                                     functools.partial(site_reference, **site_settings), [x, *params, weight])
    assert out.dtype == dtype
    return out


SITE_CASES = [
    *(pytest.param(residual_map, (2, 3, n, 8), torch.float32, id=f"{residual_map}-n{n}")
      for residual_map in VARIANTS for n in streams_for(residual_map)),
    *(pytest.param(residual_map, (1, 5, 3, 16), dtype, id=f"{residual_map}-{dtype}")
      for residual_map in VARIANTS for dtype in (torch.bfloat16, torch.float16)),
]


@pytest.mark.parametrize(("residual_map", "shape", "dtype"), SITE_CASES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_site_of_each_residual_map_matches_the_oracle(backend, residual_map, shape, dtype):
    """The identity map's ``mhc_coeffs_pre`` returns ``comb=None``, and its merge carries the streams unmixed."""
    x = torch.randn(shape).to(dtype)
    _, _, comb = mhc_coeffs_pre(x, *random_site_params(shape[-2], shape[-1], residual_map), backend=backend,
                                **settings(residual_map))
    assert (comb is None) == (residual_map == "identity")
    check_site(backend, residual_map, shape, dtype, iters=4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_site_on_token_chunks_matches_the_oracle(monkeypatch, dtype):
    """A whole site with 16-bit streams on the torch kernels, forced down to a few tokens per chunk."""
    monkeypatch.setattr(common, "CPU_CHUNK_BYTES", 3 * 4 * 3 * 4 * 12)
    check_site("torch", "sinkhorn", (2, 7, 4, 12), dtype, iters=ITERS)


@pytest.mark.parametrize("dtype", STREAM_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("op", ["mhc_coeffs_pre", "mhc_pre", "mhc_post_res", "mhc_head"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_stream_op_matches_the_oracle(backend, op, shape, dtype):
    """The ops with a stream-sized result in the streams' dtype (``mhc_coeffs_pre``: coefficients and collapse in one
    op, one backward node whose stream gradient carries both paths; ``mhc_post_res`` with a comb that is not
    symmetric, so that the transpose matters)."""
    b, t, n, c = shape
    inputs = op_inputs(op, leaf(torch.randn(shape).to(dtype)))
    outputs = check_op(op, backend, inputs, **op_settings(op, iters=sinkhorn_iters(n)))
    assert outputs[0].dtype == dtype and outputs[0].shape == (shape if op == "mhc_post_res" else (b, t, c))
    if op == "mhc_coeffs_pre":
        _, post, comb = outputs
        assert post.dtype == comb.dtype == torch.float32 and comb.shape == (b, t, n, n)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("iters", [1, 3, 20])
@pytest.mark.parametrize("backend", BACKENDS)
def test_sinkhorn_matches_the_oracle(backend, n, iters):
    (comb,) = check_op("sinkhorn", backend, [leaf(torch.randn(3, 4, n, n) * 3)], iters=iters, eps=HC_EPS)
    assert comb.dtype == torch.float32


@pytest.mark.parametrize("op", ["mhc_coeffs", "mhc_coeffs_pre", "mhc_pre", "mhc_post_res", "mhc_head"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_streams_match_the_oracle(backend, op):
    """float64 streams: the maps are computed in float32, stream-sized results returned in float64."""
    inputs = op_inputs(op, leaf(torch.randn(2, 3, 3, 8, dtype=torch.float64)))
    outputs = check_op(op, backend, inputs, **op_settings(op))
    assert outputs[0].dtype == (torch.float32 if op == "mhc_coeffs" else torch.float64)


# --- properties ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_mhc_post_res_applies_comb_transposed(backend):
    x = torch.tensor([[[[1.0], [10.0]]]])  # [1, 1, n=2, C=1]
    comb = torch.tensor([[[[0.0, 1.0], [0.0, 0.0]]]])  # comb[0, 1] = 1: stream 0 flows into stream 1
    out = mhc_post_res(x, torch.zeros(1, 1, 1), torch.zeros(1, 1, 2), comb, backend=backend)
    assert out.flatten().tolist() == [0.0, 1.0]


@pytest.mark.parametrize("magnitude", [1.0, 30.0, 1e4])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("backend", BACKENDS)
def test_sinkhorn_properties(backend, n, magnitude):
    logits = (torch.randn(64, n, n) * magnitude).requires_grad_(True)
    with torch.no_grad():
        logits[0] = magnitude  # constant matrix
        logits[1] = -magnitude
        logits[2] = torch.eye(n) * magnitude  # peaked on the diagonal
    comb = sinkhorn(logits, ITERS, HC_EPS, backend=backend)
    assert torch.isfinite(comb).all()
    assert (comb >= 0).all()
    # The last normalisation is over columns: they sum to 1 up to eps and float32 rounding, at any logit size.
    torch.testing.assert_close(comb.sum(-2), torch.ones(64, n), atol=1e-5, rtol=0)
    (grad,) = torch.autograd.grad(comb, logits, torch.randn_like(comb))
    assert torch.isfinite(grad).all()


def test_sinkhorn_rows_converge_with_iterations():
    logits = torch.randn(256, 4, 4) * 4
    row_error = [(sinkhorn(logits, iters, HC_EPS).sum(-1) - 1).abs().max().item() for iters in (1, 5, 50)]
    assert row_error[0] > row_error[1] > row_error[2]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("magnitude", [1.0, 30.0, 1e4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_permutations_comb_is_exactly_doubly_stochastic(backend, magnitude, n):
    """Rows and columns sum to 1 to float32 rounding at any logit size (Sinkhorn's rows are only approximately 1),
    entries in [0, 1]; a large bias on the first weight gives the identity (the documented order starts with it)."""
    x = torch.randn(1, 6, n, 8)
    fn, base, scale = random_site_params(n, 8, "permutations")
    _, _, comb = mhc_coeffs(x, fn * magnitude, base * magnitude, scale, backend=backend, **settings("permutations"))
    assert torch.isfinite(comb).all() and (comb >= 0).all() and (comb <= 1 + 1e-6).all()
    ones = torch.ones(1, 6, n)
    # A convex combination of permutation matrices: exact up to float32 rounding of a sum of at most 24 weights.
    torch.testing.assert_close(comb.sum(-1), ones, atol=2e-6, rtol=0)
    torch.testing.assert_close(comb.sum(-2), ones, atol=2e-6, rtol=0)
    peaked = base.clone()
    peaked[2 * n :] = 0.0
    peaked[2 * n] = 100.0
    _, _, comb = mhc_coeffs(x, fn * 0, peaked, scale, backend=backend, **settings("permutations"))
    # The other weights are e^-100 of the first: the identity up to float32 rounding.
    torch.testing.assert_close(comb, torch.eye(n).expand(1, 6, n, n), atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unconstrained_comb_is_not_projected(backend):
    """Hyper-Connections' comb is its static part plus a bounded dynamic part: negative entries and row / column
    sums away from 1 pass through."""
    n = 3
    x = torch.randn(1, 4, n, 8)
    fn, _, scale = random_site_params(n, 8, "unconstrained")
    base = torch.cat([torch.zeros(2 * n), -2.0 * torch.ones(n * n)])
    _, _, comb = mhc_coeffs(x, fn, base, scale, backend=backend, **settings("unconstrained"))
    assert (comb < 0).all()
    assert ((comb.sum(-1) - 1).abs() > 1).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_coefficients_stay_float32_under_autocast(backend):
    x = torch.randn(1, 6, 4, 16)
    fn, base, scale = random_site_params(4, 16)
    expected = mhc_coeffs(x, fn, base, scale, sinkhorn_iters=5, eps=HC_EPS, norm_eps=NORM_EPS, backend=backend)
    with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16):
        got = mhc_coeffs(x, fn, base, scale, sinkhorn_iters=5, eps=HC_EPS, norm_eps=NORM_EPS, backend=backend)
        merged = mhc_post_res(x, torch.randn(1, 6, 16), *got[1:], backend=backend)
    for ours, ref in zip(got, expected, strict=True):  # bit-exact: autocast leaves the same code on the same tensors
        torch.testing.assert_close(ours, ref, atol=0, rtol=0)
    assert merged.dtype == torch.float32


def test_map_token_chunks_writes_every_chunk_like_one_call(monkeypatch):
    """The torch kernels' chunking of 16-bit streams: results equal one call on all tokens, in the requested dtypes,
    in the inputs' leading shape, and not as views (autograd accumulates into them in place)."""
    monkeypatch.setattr(common, "CPU_CHUNK_BYTES", 2 * 4 * 3 * 5)  # 2 tokens per chunk, 14 tokens: 7 chunks
    x, w = torch.randn(2, 7, 3, 5).to(torch.bfloat16), torch.rand(2, 7, 3)

    def collapse_and_norms(x, w):
        return torch.matmul(w.unsqueeze(-2), x.float()).squeeze(-2), x.float().square().sum(-1) * w

    expected = collapse_and_norms(x, w)
    got = map_token_chunks(collapse_and_norms, (x, w), (torch.bfloat16, torch.float32), 4 * 3 * 5)
    assert [t.shape for t in got] == [(2, 7, 5), (2, 7, 3)]
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32
    assert all(t._base is None for t in got)
    # torch's per-dtype tolerances: a chunk runs the same code on fewer tokens, which BLAS may block otherwise
    torch.testing.assert_close(got[0], expected[0].to(torch.bfloat16))
    torch.testing.assert_close(got[1], expected[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_op_outputs_are_not_views(backend, dtype):
    """An FSDP2 unit (each HC module is one) must not return a view: an in-place op on it drops the unit's
    pre-backward hook and skips the all-gather, and torch warns. Every result of the public ops is a tensor of its
    own, on both backends."""
    x = leaf(torch.randn(1, 6, 4, 16).to(dtype))
    fn, base, scale = (leaf(t) for t in random_site_params(4, 16))
    site_settings = dict(sinkhorn_iters=ITERS, eps=HC_EPS, norm_eps=NORM_EPS, backend=backend)
    pre, post, comb = mhc_coeffs(x, fn, base, scale, **site_settings)
    results = {
        "mhc_coeffs": (pre, post, comb),
        "mhc_coeffs_pre": mhc_coeffs_pre(x, fn, base, scale, **site_settings),
        "mhc_pre": (mhc_pre(x, pre, backend=backend),),
        "mhc_post_res": (mhc_post_res(x, torch.randn_like(x[..., 0, :]), post, comb, backend=backend),),
        "mhc_head": (mhc_head(x, fn[:4], base[:4], scale[:1], eps=HC_EPS, norm_eps=NORM_EPS, backend=backend),),
        "sinkhorn": (sinkhorn(torch.randn(6, 4, 4, requires_grad=True), ITERS, HC_EPS, backend=backend),),
    }
    views = [f"{op}[{index}]" for op, outputs in results.items() for index, out in enumerate(outputs)
             if out._base is not None]
    assert not views, f"views: {views}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_stream_gradients_are_not_views(backend, dtype):
    """Autograd adds the stream gradients of a site's two nodes in place only into a tensor that is not a view;
    otherwise every site pays one more stream-sized allocation and pass."""
    x = torch.randn(1, 6, 4, 16).to(dtype)
    fn, base, scale = random_site_params(4, 16)
    y, post, comb, pre, mix, rstd = load_op_set(backend).coeffs_pre_op(x, fn, base, scale, ITERS, HC_EPS, NORM_EPS,
                                                                       "sinkhorn", 2.0)
    merge_backward = getattr(torch.ops.hf_mhc, f"mhc_post_res_bwd_{backend}")
    entry_backward = getattr(torch.ops.hf_mhc, f"mhc_coeffs_pre_bwd_{backend}")
    from_merge = merge_backward(x, y, post, comb, torch.randn_like(x), False)[0]
    from_entry = entry_backward(x, fn, base, scale, pre, mix, rstd, torch.randn_like(y), torch.rand_like(post),
                                torch.rand_like(comb), ITERS, HC_EPS, "sinkhorn", 2.0)[0]
    assert from_merge._base is None and from_entry._base is None


# --- memory -------------------------------------------------------------------------------------------------------


SAVED_BYTES_CASES = [
    *(pytest.param("sinkhorn", n, dtype, fused_entry,
                   id=f"sinkhorn-n{n}-{dtype}-{'mhc_coeffs_pre' if fused_entry else 'mhc_coeffs+mhc_pre'}")
      for n in (1, 4, 8) for dtype in (torch.float32, torch.bfloat16) for fused_entry in (True, False)),
    *(pytest.param(residual_map, n, torch.bfloat16, True, id=f"{residual_map}-n{n}")
      for residual_map in VARIANTS for n in (1, 4)),
]


@pytest.mark.parametrize(("residual_map", "n", "dtype", "fused_entry"), SAVED_BYTES_CASES)
def test_one_site_saves_the_streams_the_output_and_its_coefficients(residual_map, n, dtype, fused_entry):
    """Memory-light backward: per token, a site keeps the streams, the sublayer output and its float32 coefficients
    (``mix``, ``rstd``, ``pre``, ``post``, ``comb``: 196 bytes for mHC at n = 4), at most the issue's 512 bytes for
    n <= 4, whether its entry is one op or two."""
    tokens, hidden = 24, 64
    x = torch.randn(1, tokens, n, hidden, dtype=dtype, requires_grad=True)
    fn, base, scale = (p.requires_grad_(True) for p in random_site_params(n, hidden, residual_map))
    site_settings = settings(residual_map)

    def one_site():
        if fused_entry:
            y, post, comb = mhc_coeffs_pre(x, fn, base, scale, **site_settings)
        else:
            pre, post, comb = mhc_coeffs(x, fn, base, scale, **site_settings)
            y = mhc_pre(x, pre)
        return mhc_post_res(x, y, post, comb)  # identity sublayer

    saved = saved_bytes_for_backward(one_site, exclude=(fn, base, scale))
    coefficient_bytes = saved / tokens - (n + 1) * hidden * x.element_size()
    comb_floats = 0 if residual_map == "identity" else n * n
    assert coefficient_bytes == 4 * (sum(mhc_reference.map_sizes(n, residual_map)) + 1 + 2 * n + comb_floats)
    assert n > 4 or coefficient_bytes <= 512


# --- custom-op registration ---------------------------------------------------------------------------------------


def custom_op_call(op: str, residual_map: str, backend: str) -> tuple:
    """``(custom op, args)`` of ``op``'s forward with small inputs that require grad, on ``backend``."""
    n, hidden = 3, 8
    streams = torch.randn(2, 3, n, hidden, requires_grad=True)
    weights = torch.rand(2, 3, n, requires_grad=True)
    site_params = [p.requires_grad_(True) for p in random_site_params(n, hidden, residual_map)]
    head_params = [p.requires_grad_(True) for p in random_head_params(n, hidden)]
    magnitude = MAGNITUDE if residual_map == "identity" else 2.0
    identity = residual_map == "identity"
    ops = load_op_set(backend)
    if op == "sinkhorn":
        return ops.sinkhorn_op, (torch.randn(2, 3, n, n, requires_grad=True), 5, HC_EPS)
    if op in ("mhc_coeffs", "mhc_coeffs_pre"):
        custom_op = ops.coeffs_op if op == "mhc_coeffs" else ops.coeffs_pre_op
        return custom_op, (streams, *site_params, 5, HC_EPS, NORM_EPS, residual_map, magnitude)
    if op == "mhc_head":
        return ops.head_op, (streams, *head_params, HC_EPS, NORM_EPS)
    if op == "mhc_pre":
        return ops.pre_op, (streams, weights)
    comb = torch.zeros(0) if identity else torch.rand(2, 3, n, n, requires_grad=True)
    return ops.post_res_op, (streams, torch.randn(2, 3, hidden, requires_grad=True), weights, comb, identity)


CUSTOM_OP_CASES = [
    *(pytest.param(op, "sinkhorn", backend, id=f"{op}-{backend}")
      for op in ("sinkhorn", "mhc_coeffs", "mhc_coeffs_pre", "mhc_head", "mhc_pre", "mhc_post_res")
      for backend in BACKENDS),
    # each other residual map's shapes (the registration does not depend on the backend)
    *(pytest.param(op, residual_map, "torch", id=f"{op}-{residual_map}")
      for op in ("mhc_coeffs", "mhc_coeffs_pre") for residual_map in VARIANTS),
    pytest.param("mhc_post_res", "identity", "torch", id="mhc_post_res-identity"),  # the identity merge's empty comb
]


@pytest.mark.parametrize(("op", "residual_map", "backend"), CUSTOM_OP_CASES)
def test_custom_ops_are_well_formed(op, residual_map, backend):
    """``torch.library.opcheck``: schemas, fake (meta) results, autograd registrations and AOT dispatch of every op's
    forward (and through it its backward op) on both backends, and with each residual map's shapes."""
    torch.library.opcheck(*custom_op_call(op, residual_map, backend))


@pytest.mark.parametrize("op", ["coeffs_pre", "post_res", "head"])
def test_cpu_decode_custom_ops_are_well_formed(op):
    """The CPU decode fast path's custom ops (what ``torch.compile`` traces): schemas and fake results."""
    if TEST_DEVICE != "cpu":
        pytest.skip("the CPU decode kernels run on CPU tensors")
    n, hidden = 3, 8
    streams = torch.randn(2, 3, n, hidden)
    args = {
        "coeffs_pre": (streams, *random_site_params(n, hidden), 5, HC_EPS, NORM_EPS, 0, 2.0),
        "post_res": (streams, torch.randn(2, 3, hidden), torch.rand(2, 3, n), torch.rand(2, 3, n, n), False),
        "head": (streams, *random_head_params(n, hidden), HC_EPS, NORM_EPS),
    }[op]
    custom_op = getattr(torch.ops.hf_mhc, f"cpu_decode_{op}")
    torch.library.opcheck(custom_op, args, test_utils=("test_schema", "test_faketensor"))


# --- backends, empty and invalid input ------------------------------------------------------------------------------


def test_backend_selection(monkeypatch):
    x = torch.randn(1, 2, 2, 4)
    with pytest.raises(ValueError, match="available backends: torch, triton"):
        mhc_pre(x, torch.rand(1, 2, 2), backend="cuda-magic")
    with pytest.raises(ValueError, match="Unknown hc_implementation 'cuda-magic'; available: auto, reference"):
        mhc_ops("cuda-magic", x)
    on_cuda = x.is_cuda
    assert mhc_ops("auto", x).name == ("triton" if on_cuda else "cpu_decode")
    assert mhc_ops("auto", x.requires_grad_()).name == ("triton" if on_cuda else "torch")
    with torch.no_grad():
        assert mhc_ops("torch", x).name == ("torch" if on_cuda else "cpu_decode")
    assert mhc_ops("triton", x).name == "triton"  # on CPU tensors, allowed because conftest sets TRITON_INTERPRET=1
    assert mhc_ops("reference", x) is mhc_reference
    x = x.detach().cpu()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="hc_implementation='triton' runs on CUDA tensors, not cpu tensors"):
        mhc_pre(x, torch.rand(1, 2, 2, device="cpu"), backend="triton")


def test_the_dispatch_table_covers_every_implementation_device_and_grad():
    """Every (hc_implementation, device kind, gradient) has its op set, and "auto" is Triton on CUDA, torch elsewhere
    (the C++ decode kernels on CPU without gradient)."""
    from hf_mhc.configuration_mhc import HC_IMPLEMENTATIONS
    from hf_mhc.kernels.dispatch import DEVICE_KINDS

    keys = {(implementation, device, grad) for implementation in HC_IMPLEMENTATIONS for device in DEVICE_KINDS
            for grad in (False, True)}
    assert set(MHC_OPS) == keys - {("triton", "other", False), ("triton", "other", True)}
    assert set(MHC_OPS.values()) == {"reference", "torch", "cpu_decode", "triton"}
    assert {device: MHC_OPS["auto", device, True] for device in DEVICE_KINDS} == {
        "cuda": "triton", "cpu": "torch", "other": "torch"}
    assert MHC_OPS["auto", "cpu", False] == MHC_OPS["torch", "cpu", False] == "cpu_decode"


def test_shape_errors_are_clear():
    x = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match=r"needs fn \[15, 12\]"):
        mhc_coeffs(x, torch.zeros(15, 11), torch.zeros(15), torch.ones(3), sinkhorn_iters=2, eps=1e-6, norm_eps=1e-6)
    with pytest.raises(ValueError, match="integer sinkhorn_iters >= 1"):
        mhc_coeffs(x, torch.zeros(15, 12), torch.zeros(15), torch.ones(3), sinkhorn_iters=0, eps=1e-6, norm_eps=1e-6)
    with pytest.raises(ValueError, match="needs pre of shape"):
        mhc_pre(x, torch.rand(1, 2, 4))
    with pytest.raises(ValueError, match="needs y of shape"):
        mhc_post_res(x, torch.randn(1, 2, 5), torch.rand(1, 2, 3), torch.rand(1, 2, 3, 3))
    with pytest.raises(ValueError, match="square"):
        sinkhorn(torch.randn(2, 3), 5, 1e-6)


def test_permutations_of_more_than_four_streams_are_refused():
    fn, base, scale = random_site_params(4, 8, "permutations")
    raises_one_line(lambda: mhc_coeffs(torch.randn(1, 2, 5, 8), fn, base, scale, **settings("permutations")),
                    r"residual_map='permutations' supports n <= 4: it mixes all n! permutation matrices, a cost that "
                    r"grows as n! \(24 at n=4, 120 at n=5\); got n=5\.")


def test_parameter_shapes_of_another_map_are_refused():
    fn, base, scale = random_site_params(3, 8, "sinkhorn")
    with pytest.raises(ValueError, match=r"residual_map='identity' needs fn \[6, 24\], base \[6\], scale \[2\]"):
        mhc_coeffs_pre(torch.randn(1, 2, 3, 8), fn, base, scale, **settings("identity"))
    with pytest.raises(ValueError, match="available maps: sinkhorn, unconstrained, identity, permutations"):
        mhc_coeffs_pre(torch.randn(1, 2, 3, 8), fn, base, scale, **settings("hc"))


OPS = ["sinkhorn", "mhc_coeffs", "mhc_coeffs_pre", "mhc_pre", "mhc_post_res", "mhc_head"]


def op_inputs(op: str, streams: torch.Tensor, *, param_device=None, **tensors) -> list:
    """The tensor arguments of ``op`` on ``streams [B, T, n, C]`` (``sinkhorn``: logits ``[B, T, n, n]`` of the
    streams' dtype instead): the streams, then float32 leaves, on ``param_device`` if given; ``tensors`` replaces
    ``logits``, ``pre`` or ``y``."""
    b, t, n, c = streams.shape
    where = {} if param_device is None else dict(device=param_device)
    if op == "sinkhorn":
        return [tensors["logits"] if "logits" in tensors else leaf(torch.randn(b, t, n, n).to(streams.dtype))]
    if op in ("mhc_coeffs", "mhc_coeffs_pre"):
        return [streams, *(leaf(p.to(**where)) for p in random_site_params(n, c))]
    if op == "mhc_pre":
        return [streams, tensors["pre"] if "pre" in tensors else leaf(torch.rand(b, t, n).to(**where))]
    if op == "mhc_post_res":
        y_dtype = streams.dtype if streams.is_floating_point() else torch.float32
        y = tensors["y"] if "y" in tensors else leaf(torch.randn(b, t, c).to(y_dtype))
        return [streams, y, leaf((torch.rand(b, t, n) * 2).to(**where)), leaf(torch.rand(b, t, n, n))]
    return [streams, *(leaf(p.to(**where)) for p in random_head_params(n, c))]


def op_settings(op: str, *, eps=HC_EPS, norm_eps=NORM_EPS, iters=3) -> dict:
    """The keyword settings of ``op``: Sinkhorn's iterations and the epsilons it takes."""
    return {
        "sinkhorn": dict(iters=iters, eps=eps),
        "mhc_coeffs": dict(sinkhorn_iters=iters, eps=eps, norm_eps=norm_eps),
        "mhc_coeffs_pre": dict(sinkhorn_iters=iters, eps=eps, norm_eps=norm_eps),
        "mhc_head": dict(eps=eps, norm_eps=norm_eps),
    }.get(op, {})


def op_call(op, streams, backend=None, *, eps=HC_EPS, norm_eps=NORM_EPS, iters=3, param_device=None, **tensors):
    """``(run, inputs)``: ``op`` of ``hf_mhc.kernels`` on ``op_inputs(op, streams, ...)``."""
    inputs = op_inputs(op, streams, param_device=param_device, **tensors)
    run = functools.partial(getattr(kernels, op), backend=backend,
                            **op_settings(op, eps=eps, norm_eps=norm_eps, iters=iters))
    return (lambda: run(*inputs)), inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_no_tokens_give_empty_outputs_and_gradients(backend, op, dtype):
    """Zero tokens (an empty batch, or a sequence of length 0) run through every op and its backward: the outputs and
    token-shaped gradients are empty, of the right shapes and dtypes, and the parameters' gradients are zeros."""
    n, c = 3, 8
    streams = leaf(torch.randn(2, 0, n, c).to(dtype))
    run, inputs = op_call(op, streams, backend)
    outs = run()
    outs = outs if isinstance(outs, tuple) else (outs,)
    expected = {
        "sinkhorn": [((2, 0, n, n), torch.float32)],
        "mhc_coeffs": [((2, 0, n), torch.float32), ((2, 0, n), torch.float32), ((2, 0, n, n), torch.float32)],
        "mhc_coeffs_pre": [((2, 0, c), dtype), ((2, 0, n), torch.float32), ((2, 0, n, n), torch.float32)],
        "mhc_pre": [((2, 0, c), dtype)],
        "mhc_post_res": [((2, 0, n, c), dtype)],
        "mhc_head": [((2, 0, c), dtype)],
    }[op]
    assert [(tuple(o.shape), o.dtype) for o in outs] == expected
    torch.autograd.backward(list(outs), [torch.randn_like(o) for o in outs])
    for tensor in inputs:
        assert tensor.grad is not None and tensor.grad.shape == tensor.shape and tensor.grad.dtype == tensor.dtype
        if tensor.numel():  # a parameter: no token contributes to its gradient
            assert torch.equal(tensor.grad, torch.zeros_like(tensor))


def raises_one_line(run, match):
    with pytest.raises(ValueError, match=match) as error:
        run()
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.bool, torch.complex64], ids=str)
@pytest.mark.parametrize("op", OPS)
def test_non_float_streams_are_refused(op, dtype):
    """Integer, bool and complex streams would otherwise be cast (complex ones losing their imaginary part)."""
    streams = torch.ones(1, 2, 3, 8, dtype=dtype)
    tensors = {"logits": torch.ones(1, 2, 3, 3, dtype=dtype)} if op == "sinkhorn" else {}
    run, _ = op_call(op, streams, **tensors)
    name = "logits" if op == "sinkhorn" else "streams"
    raises_one_line(run, rf"{op} needs floating-point {name} \(float32, bfloat16, float16 or float64\), got {dtype}")


@pytest.mark.parametrize("op", ["mhc_pre", "mhc_post_res"])
def test_non_float_weights_are_refused(op):
    streams = torch.randn(1, 2, 3, 8)
    tensors = {"pre": torch.ones(1, 2, 3, dtype=torch.int64)} if op == "mhc_pre" else {
        "y": torch.ones(1, 2, 8, dtype=torch.int64)}
    raises_one_line(op_call(op, streams, **tensors)[0], "needs floating-point (pre|y) .*, got torch.int64")


BAD_SETTINGS = [
    (dict(eps=-1e-6), "needs eps as a finite number >= 0, got -1e-06"),
    (dict(eps=math.nan), "needs eps as a finite number >= 0, got nan"),
    (dict(eps=math.inf), "needs eps as a finite number >= 0, got inf"),
    (dict(norm_eps=-1.0), "needs norm_eps as a finite number >= 0, got -1.0"),
    (dict(norm_eps=math.nan), "needs norm_eps as a finite number >= 0, got nan"),
    (dict(iters=0), "needs an integer (sinkhorn_)?iters >= 1, got 0"),
    (dict(iters=-3), "needs an integer (sinkhorn_)?iters >= 1, got -3"),
    (dict(iters=2.5), "needs an integer (sinkhorn_)?iters >= 1, got 2.5"),
    (dict(iters=True), "needs an integer (sinkhorn_)?iters >= 1, got True"),
]
OP_SETTINGS = {"sinkhorn": {"eps", "iters"}, "mhc_coeffs": {"eps", "norm_eps", "iters"},
               "mhc_coeffs_pre": {"eps", "norm_eps", "iters"}, "mhc_head": {"eps", "norm_eps"}}


@pytest.mark.parametrize(
    ("op", "bad_settings", "message"),
    [pytest.param(op, bad, message, id=f"{op}-{'-'.join(f'{k}={v}' for k, v in bad.items())}")
     for op, names in OP_SETTINGS.items() for bad, message in BAD_SETTINGS if set(bad) <= names],
)
def test_invalid_eps_and_iterations_are_refused(op, bad_settings, message):
    raises_one_line(op_call(op, torch.randn(1, 2, 3, 8), **bad_settings)[0], message)


@pytest.mark.parametrize("op", OPS[1:])
def test_tensors_on_two_devices_are_refused_and_all_on_meta_run(op):
    """A parameter left on ``meta`` (or another device) is refused with where each tensor is; tensors all on
    ``meta`` (shape inference, deferred initialisation) still run and give meta outputs."""
    streams = torch.randn(1, 2, 3, 8)
    raises_one_line(op_call(op, streams, param_device="meta")[0],
                    rf"{op} needs all its tensors on one device: streams is on {streams.device}, \w+ on meta")
    with torch.device("meta"):
        outs = op_call(op, torch.randn(1, 2, 3, 8))[0]()
    outs = outs if isinstance(outs, tuple) else (outs,)
    assert all(o.is_meta for o in outs) and outs[0].shape[:2] == (1, 2)


def test_streams_without_a_token_axis_or_with_no_streams_are_refused():
    raises_one_line(lambda: mhc_pre(torch.randn(8, 3), torch.rand(8)), r"needs streams of shape \[\.\.\., T, n, C\]")
    raises_one_line(lambda: mhc_pre(torch.randn(2, 0, 8), torch.rand(2, 0)), r"n >= 1 and C >= 1, got \(2, 0, 8\)")
