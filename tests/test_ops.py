"""The public ops of hf_mhc.kernels, both backends, against an independent float64 transcription of the mHC formulas
(RMSNorm, sigmoid maps, Sinkhorn-Knopp, collapse and merge); their handling of empty and invalid input.

The Triton backend runs on CPU tensors through the interpreter (``TRITON_INTERPRET=1``, set in conftest), so shapes
stay at tens of tokens; on a GPU machine ``HF_MHC_TEST_DEVICE=cuda`` runs the same tests on CUDA tensors with the
compiled kernels. Output buffers are poisoned with NaN first: a kernel that leaves an element unwritten fails.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.utils._device
from conftest import TEST_DEVICE

from hf_mhc.kernels import (
    common,
    mhc_coeffs,
    mhc_coeffs_pre,
    mhc_head,
    mhc_post_res,
    mhc_pre,
    resolve_backend,
    sinkhorn,
)
from hf_mhc.kernels.coeffs_pre_op import mhc_coeffs_pre_bwd_op, mhc_coeffs_pre_fwd_op
from hf_mhc.kernels.common import map_token_chunks
from hf_mhc.kernels.post_res_op import mhc_post_res_bwd_op
from hf_mhc.profiling import saved_bytes_for_backward

BACKENDS = ["torch", "triton"]

NORM_EPS = 1e-6
HC_EPS = 1e-6
ITERS = 20

# Tolerances per stream dtype for forward outputs / gradients against the float64 reference.
TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
}


# --- float64 reference, written from the formula, independent of hf_mhc.mhc_reference ---------------------------


def ref_sinkhorn(logits, iters, eps):
    m = torch.exp(logits - logits.amax(-1, keepdim=True))
    m = m / m.sum(-1, keepdim=True) + eps
    m = m / (m.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(-1, keepdim=True) + eps)
        m = m / (m.sum(-2, keepdim=True) + eps)
    return m


def ref_coeffs(x, fn, base, scale, iters=ITERS, eps=HC_EPS, norm_eps=NORM_EPS):
    *lead, n, c = x.shape
    flat = x.reshape(*lead, n * c)
    flat_n = flat / torch.sqrt((flat * flat).mean(-1, keepdim=True) + norm_eps)
    mix = torch.einsum("...k,jk->...j", flat_n, fn)
    pre = torch.sigmoid(scale[0] * mix[..., :n] + base[:n]) + eps
    post = 2 * torch.sigmoid(scale[1] * mix[..., n : 2 * n] + base[n : 2 * n])
    logits = scale[2] * mix[..., 2 * n :].reshape(*lead, n, n) + base[2 * n :].reshape(n, n)
    return pre, post, ref_sinkhorn(logits, iters, eps)


def ref_pre(x, pre):
    return torch.einsum("...i,...ic->...c", pre, x)


def ref_post_res(x, y, post, comb):
    return torch.einsum("...i,...c->...ic", post, y) + torch.einsum("...ji,...jc->...ic", comb, x)


def ref_head(x, hc_fn, hc_base, hc_scale, eps=HC_EPS, norm_eps=NORM_EPS):
    *lead, n, c = x.shape
    flat = x.reshape(*lead, n * c)
    flat_n = flat / torch.sqrt((flat * flat).mean(-1, keepdim=True) + norm_eps)
    pre_h = torch.sigmoid(hc_scale * torch.einsum("...k,jk->...j", flat_n, hc_fn) + hc_base) + eps
    return ref_pre(x, pre_h)


@pytest.fixture(autouse=True)
def on_test_device():
    """Every tensor a test creates lives on ``TEST_DEVICE``."""
    torch.set_default_device(TEST_DEVICE)
    yield
    torch.set_default_device("cpu")


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


# --- helpers --------------------------------------------------------------------------------------------------


def random_hc_params(n, c, dtype=torch.float32):
    fn = torch.randn((n + 2) * n, n * c, dtype=dtype) * 0.5
    base = torch.randn((n + 2) * n, dtype=dtype)
    scale = torch.rand(3, dtype=dtype) + 0.5
    return fn, base, scale


def leaf(t):
    return t.detach().clone().requires_grad_(True)


def as64(*tensors):
    return [leaf(t.detach().double()) for t in tensors]


def check_grads(ours_inputs, ours_out, ref_inputs, ref_out, tol):
    """Backprop the same random upstream gradients through both graphs and compare every input gradient."""
    outs = ours_out if isinstance(ours_out, tuple) else (ours_out,)
    refs = ref_out if isinstance(ref_out, tuple) else (ref_out,)
    upstream = [torch.randn(r.shape, dtype=torch.float64) for r in refs]
    torch.autograd.backward([o.float() for o in outs], [g.to(torch.float32) for g in upstream])
    torch.autograd.backward(list(refs), upstream)
    for mine, ref in zip(ours_inputs, ref_inputs, strict=True):
        assert mine.grad is not None and torch.isfinite(mine.grad).all()
        torch.testing.assert_close(mine.grad.double(), ref.grad, **tol)


SHAPES = [(1, 5, 1, 8), (2, 3, 2, 16), (1, 7, 3, 12), (2, 4, 4, 20), (1, 5, 6, 10), (1, 3, 8, 24)]


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("backend", BACKENDS)
def test_mhc_coeffs_forward_and_grad(backend, shape, dtype):
    b, t, n, c = shape
    iters = ITERS if n in (3, 4) else 4  # the interpreter replays Sinkhorn O(iters²) times in backward
    x = leaf(torch.randn(shape).to(dtype))
    fn, base, scale = (leaf(p) for p in random_hc_params(n, c))
    pre, post, comb = mhc_coeffs(x, fn, base, scale, sinkhorn_iters=iters, eps=HC_EPS, norm_eps=NORM_EPS,
                                 backend=backend)
    assert pre.dtype == post.dtype == comb.dtype == torch.float32
    assert pre.shape == (b, t, n) and post.shape == (b, t, n) and comb.shape == (b, t, n, n)
    x64, fn64, base64, scale64 = as64(x, fn, base, scale)
    refs = ref_coeffs(x64, fn64, base64, scale64, iters=iters)
    for mine, ref in zip((pre, post, comb), refs, strict=True):
        torch.testing.assert_close(mine.double(), ref, atol=1e-5, rtol=1e-5)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.05, rtol=0.05)
    check_grads([x, fn, base, scale], (pre, post, comb), [x64, fn64, base64, scale64], refs, tol)


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("backend", BACKENDS)
def test_mhc_coeffs_pre_forward_and_grad(backend, shape, dtype):
    """Coefficients and collapse in one op: one backward node whose stream gradient carries both paths."""
    b, t, n, c = shape
    iters = ITERS if n in (3, 4) else 4
    x = leaf(torch.randn(shape).to(dtype))
    fn, base, scale = (leaf(p) for p in random_hc_params(n, c))
    y, post, comb = mhc_coeffs_pre(x, fn, base, scale, sinkhorn_iters=iters, eps=HC_EPS, norm_eps=NORM_EPS,
                                   backend=backend)
    assert y.dtype == dtype and y.shape == (b, t, c)
    assert post.dtype == comb.dtype == torch.float32 and comb.shape == (b, t, n, n)
    x64, fn64, base64, scale64 = as64(x, fn, base, scale)
    pre64, post64, comb64 = ref_coeffs(x64, fn64, base64, scale64, iters=iters)
    refs = (ref_pre(x64, pre64), post64, comb64)
    torch.testing.assert_close(y.double(), refs[0], **TOLERANCES[dtype])
    for mine, ref in zip((post, comb), refs[1:], strict=True):
        torch.testing.assert_close(mine.double(), ref, atol=1e-5, rtol=1e-5)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.05, rtol=0.05)
    check_grads([x, fn, base, scale], (y, post, comb), [x64, fn64, base64, scale64], refs, tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mhc_coeffs_pre_grad_through_the_collapse_alone(backend):
    """``post`` and ``comb`` unused: autograd hands the op None for them, and only the collapse path is left."""
    x = leaf(torch.randn(2, 5, 3, 12))
    fn, base, scale = (leaf(p) for p in random_hc_params(3, 12))
    y, _, _ = mhc_coeffs_pre(x, fn, base, scale, sinkhorn_iters=ITERS, eps=HC_EPS, norm_eps=NORM_EPS,
                             backend=backend)
    x64, fn64, base64, scale64 = as64(x, fn, base, scale)
    ref = ref_pre(x64, ref_coeffs(x64, fn64, base64, scale64)[0])
    check_grads([x, fn, base, scale], y, [x64, fn64, base64, scale64], ref, dict(atol=1e-4, rtol=1e-4))


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
    fn, base, scale = (leaf(t) for t in random_hc_params(4, 16))
    settings = dict(sinkhorn_iters=ITERS, eps=HC_EPS, norm_eps=NORM_EPS, backend=backend)
    pre, post, comb = mhc_coeffs(x, fn, base, scale, **settings)
    results = {
        "mhc_coeffs": (pre, post, comb),
        "mhc_coeffs_pre": mhc_coeffs_pre(x, fn, base, scale, **settings),
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
    otherwise every site pays one more stream-sized allocation and pass (measured: +10 % on the site benchmark)."""
    x = torch.randn(1, 6, 4, 16).to(dtype)
    fn, base, scale = random_hc_params(4, 16)
    y, post, comb, pre, mix, rstd = mhc_coeffs_pre_fwd_op(x, fn, base, scale, ITERS, HC_EPS, NORM_EPS, backend,
                                                          "sinkhorn", 2.0)
    from_merge = mhc_post_res_bwd_op(x, y, post, comb, torch.randn_like(x), backend, False)[0]
    from_entry = mhc_coeffs_pre_bwd_op(x, fn, base, scale, pre, mix, rstd, torch.randn_like(y), torch.rand_like(post),
                                       torch.rand_like(comb), ITERS, HC_EPS, backend, "sinkhorn", 2.0)[0]
    assert from_merge._base is None and from_entry._base is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_site_on_token_chunks_matches_float64(monkeypatch, dtype):
    """A whole site (``mhc_coeffs_pre``, ``mhc_post_res``) with 16-bit streams on the torch kernels, forced down to a
    few tokens per chunk, against float64 autograd of the formula."""
    monkeypatch.setattr(common, "CPU_CHUNK_BYTES", 3 * 4 * 3 * 4 * 12)
    n, c = 4, 12
    x = leaf(torch.randn(2, 7, n, c).to(dtype))
    fn, base, scale = (leaf(p) for p in random_hc_params(n, c))
    y, post, comb = mhc_coeffs_pre(x, fn, base, scale, sinkhorn_iters=ITERS, eps=HC_EPS, norm_eps=NORM_EPS,
                                   backend="torch")
    out = mhc_post_res(x, y, post, comb, backend="torch")
    x64, fn64, base64, scale64 = as64(x, fn, base, scale)
    pre64, post64, comb64 = ref_coeffs(x64, fn64, base64, scale64)
    ref = ref_post_res(x64, ref_pre(x64, pre64), post64, comb64)
    torch.testing.assert_close(out.double(), ref, **TOLERANCES[dtype])
    check_grads([x, fn, base, scale], out, [x64, fn64, base64, scale64], ref, dict(atol=0.05, rtol=0.05))


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("backend", BACKENDS)
def test_mhc_pre_forward_and_grad(backend, shape, dtype):
    b, t, n, c = shape
    x = leaf(torch.randn(shape).to(dtype))
    pre = leaf(torch.rand(b, t, n))
    out = mhc_pre(x, pre, backend=backend)
    assert out.dtype == dtype and out.shape == (b, t, c)
    x64, pre64 = as64(x, pre)
    ref = ref_pre(x64, pre64)
    torch.testing.assert_close(out.double(), ref, **TOLERANCES[dtype])
    check_grads([x, pre], out, [x64, pre64], ref, TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("backend", BACKENDS)
def test_mhc_post_res_forward_and_grad(backend, shape, dtype):
    b, t, n, c = shape
    x = leaf(torch.randn(shape).to(dtype))
    y = leaf(torch.randn(b, t, c).to(dtype))
    post = leaf(torch.rand(b, t, n) * 2)
    comb = leaf(torch.rand(b, t, n, n))  # deliberately not symmetric: the transpose matters
    out = mhc_post_res(x, y, post, comb, backend=backend)
    assert out.dtype == dtype and out.shape == shape
    x64, y64, post64, comb64 = as64(x, y, post, comb)
    ref = ref_post_res(x64, y64, post64, comb64)
    torch.testing.assert_close(out.double(), ref, **TOLERANCES[dtype])
    check_grads([x, y, post, comb], out, [x64, y64, post64, comb64], ref, TOLERANCES[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
def test_mhc_post_res_applies_comb_transposed(backend):
    x = torch.tensor([[[[1.0], [10.0]]]])  # [1, 1, n=2, C=1]
    comb = torch.tensor([[[[0.0, 1.0], [0.0, 0.0]]]])  # comb[0, 1] = 1: stream 0 flows into stream 1
    out = mhc_post_res(x, torch.zeros(1, 1, 1), torch.zeros(1, 1, 2), comb, backend=backend)
    assert out.flatten().tolist() == [0.0, 1.0]


@pytest.mark.parametrize("dtype", list(TOLERANCES), ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("backend", BACKENDS)
def test_mhc_head_forward_and_grad(backend, shape, dtype):
    b, t, n, c = shape
    x = leaf(torch.randn(shape).to(dtype))
    hc_fn = leaf(torch.randn(n, n * c) * 0.5)
    hc_base = leaf(torch.randn(n))
    hc_scale = leaf(torch.rand(1) + 0.5)
    out = mhc_head(x, hc_fn, hc_base, hc_scale, eps=HC_EPS, norm_eps=NORM_EPS, backend=backend)
    assert out.dtype == dtype and out.shape == (b, t, c)
    ins64 = as64(x, hc_fn, hc_base, hc_scale)
    ref = ref_head(*ins64)
    torch.testing.assert_close(out.double(), ref, **TOLERANCES[dtype])
    tol = TOLERANCES[dtype] if dtype == torch.float32 else dict(atol=0.1, rtol=0.1)
    check_grads([x, hc_fn, hc_base, hc_scale], out, ins64, ref, tol)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("iters", [1, 3, 20])
@pytest.mark.parametrize("backend", BACKENDS)
def test_sinkhorn_matches_float64_autograd(backend, n, iters):
    logits = leaf(torch.randn(3, 4, n, n) * 3)
    comb = sinkhorn(logits, iters, HC_EPS, backend=backend)
    logits64 = leaf(logits.detach().double())
    ref = ref_sinkhorn(logits64, iters, HC_EPS)
    torch.testing.assert_close(comb.double(), ref, atol=1e-6, rtol=1e-5)
    check_grads([logits], comb, [logits64], ref, dict(atol=1e-5, rtol=1e-4))


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
    torch.testing.assert_close(comb.sum(-2), torch.ones(64, n), atol=1e-5, rtol=0)
    (grad,) = torch.autograd.grad(comb, logits, torch.randn_like(comb))
    assert torch.isfinite(grad).all()


def test_sinkhorn_rows_converge_with_iterations():
    logits = torch.randn(256, 4, 4) * 4
    row_error = [(sinkhorn(logits, iters, HC_EPS).sum(-1) - 1).abs().max().item() for iters in (1, 5, 50)]
    assert row_error[0] > row_error[1] > row_error[2]


def test_backend_selection(monkeypatch):
    x = torch.randn(1, 2, 2, 4)
    with pytest.raises(ValueError, match="available backends: torch, triton"):
        mhc_pre(x, torch.rand(1, 2, 2), backend="cuda-magic")
    assert resolve_backend(None, x) == ("triton" if x.is_cuda else "torch")
    assert resolve_backend("triton", x) == "triton"  # on CPU tensors, allowed because conftest sets TRITON_INTERPRET=1
    x = x.cpu()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="backend='triton' runs on CUDA tensors"):
        mhc_pre(x, torch.rand(1, 2, 2, device="cpu"), backend="triton")


@pytest.mark.parametrize("fused_entry", [True, False], ids=["mhc_coeffs_pre", "mhc_coeffs+mhc_pre"])
@pytest.mark.parametrize("n", [1, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_site_saves_at_most_the_streams_the_output_and_512_bytes_per_token(n, dtype, fused_entry):
    """Memory-light backward: per token, a site keeps the streams, the sublayer output and its float32 coefficients
    (``mix``, ``rstd``, ``pre``, ``post``, ``comb``: 196 bytes for n = 4, within the issue's 512)."""
    tokens, hidden = 24, 64
    x = torch.randn(1, tokens, n, hidden, dtype=dtype, requires_grad=True)
    fn, base, scale = (p.requires_grad_(True) for p in random_hc_params(n, hidden))

    def site():
        settings = dict(sinkhorn_iters=ITERS, eps=HC_EPS, norm_eps=NORM_EPS)
        if fused_entry:
            y, post, comb = mhc_coeffs_pre(x, fn, base, scale, **settings)
        else:
            pre, post, comb = mhc_coeffs(x, fn, base, scale, **settings)
            y = mhc_pre(x, pre)
        return mhc_post_res(x, y, post, comb)  # identity sublayer

    saved = saved_bytes_for_backward(site, exclude=(fn, base, scale))
    coefficient_bytes = 4 * ((n + 2) * n + 1 + n + n + n * n)
    assert saved / tokens <= (n + 1) * hidden * x.element_size() + coefficient_bytes


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


OPS = ["sinkhorn", "mhc_coeffs", "mhc_coeffs_pre", "mhc_pre", "mhc_post_res", "mhc_head"]


def op_call(op, streams, backend=None, *, eps=HC_EPS, norm_eps=NORM_EPS, iters=3, param_device=None, **tensors):
    """``(run, inputs)`` for ``op`` on ``streams [B, T, n, C]`` (``sinkhorn``: on logits ``[B, T, n, n]`` of the
    streams' dtype). The other tensors are float32 leaves, on ``param_device`` if given; ``tensors`` replaces any."""
    b, t, n, c = streams.shape
    where = dict(device=param_device) if param_device is not None else {}
    fn, base, scale = (leaf(p.to(**where)) for p in random_hc_params(n, c))
    settings = dict(eps=eps, norm_eps=norm_eps, backend=backend)
    if op == "sinkhorn":
        logits = tensors["logits"] if "logits" in tensors else leaf(torch.randn(b, t, n, n).to(streams.dtype))
        return (lambda: sinkhorn(logits, iters, eps, backend=backend)), [logits]
    if op in ("mhc_coeffs", "mhc_coeffs_pre"):
        function = mhc_coeffs if op == "mhc_coeffs" else mhc_coeffs_pre
        return (lambda: function(streams, fn, base, scale, sinkhorn_iters=iters, **settings)), [streams, fn, base,
                                                                                               scale]
    if op == "mhc_pre":
        pre = tensors["pre"] if "pre" in tensors else leaf(torch.rand(b, t, n).to(**where))
        return (lambda: mhc_pre(streams, pre, backend=backend)), [streams, pre]
    if op == "mhc_post_res":
        y_dtype = streams.dtype if streams.is_floating_point() else torch.float32
        y = tensors["y"] if "y" in tensors else leaf(torch.randn(b, t, c).to(y_dtype))
        post, comb = leaf(torch.rand(b, t, n).to(**where)), leaf(torch.rand(b, t, n, n))
        return (lambda: mhc_post_res(streams, y, post, comb, backend=backend)), [streams, y, post, comb]
    hc_fn, hc_base, hc_scale = leaf(fn[:n].to(**where)), leaf(base[:n]), leaf(scale[:1])
    return (lambda: mhc_head(streams, hc_fn, hc_base, hc_scale, **settings)), [streams, hc_fn, hc_base, hc_scale]


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
    torch.autograd.backward(list(outs), [torch.ones_like(o) for o in outs])
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
    """Integer, bool and complex streams were cast silently (complex ones losing their imaginary part)."""
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
    ("op", "settings", "message"),
    [pytest.param(op, settings, message, id=f"{op}-{'-'.join(f'{k}={v}' for k, v in settings.items())}")
     for op, names in OP_SETTINGS.items() for settings, message in BAD_SETTINGS if set(settings) <= names],
)
def test_invalid_eps_and_iterations_are_refused(op, settings, message):
    raises_one_line(op_call(op, torch.randn(1, 2, 3, 8), **settings)[0], message)


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


@pytest.mark.parametrize("backend", BACKENDS)
def test_coefficients_stay_float32_under_autocast(backend):
    x = torch.randn(1, 6, 4, 16)
    fn, base, scale = random_hc_params(4, 16)
    expected = mhc_coeffs(x, fn, base, scale, sinkhorn_iters=5, eps=HC_EPS, norm_eps=NORM_EPS, backend=backend)
    with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16):
        got = mhc_coeffs(x, fn, base, scale, sinkhorn_iters=5, eps=HC_EPS, norm_eps=NORM_EPS, backend=backend)
        merged = mhc_post_res(x, torch.randn(1, 6, 16), *got[1:], backend=backend)
    for ours, ref in zip(got, expected, strict=True):  # bit-exact: autocast leaves the same code on the same tensors
        torch.testing.assert_close(ours, ref, atol=0, rtol=0)
    assert merged.dtype == torch.float32
