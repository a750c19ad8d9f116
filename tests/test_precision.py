"""Half precision (float16, and bfloat16 as ml_dtypes' numpy dtype): every mode, layer
count, direction and feature against the float64 reference run on the same rounded
inputs, within a stated bound, and the bound shown to catch planted bugs.

The bound (`bound` below), from the error analysis of one output y (scale: max |y_ref|):
- y leaves the op rounded to the data's dtype: at most u * scale (u: unit roundoff,
  2^-8 bfloat16, 2^-11 float16; config.PRECISIONS).
- A kernel that holds states and layer inputs in the data's dtype between steps (as
  cuDNN does, and as fusedrnn's half kernels may) injects at most u |h| per step. The
  cells contract (|sigma'|, |tanh'| <= 1 and weights ~ U(+-1/sqrt(H)) give a per-step
  gain below 1), so injected errors decay instead of adding up: the total stays O(u),
  not O(u T). Emulated in the reference (`_emulate`, "rounded states"): 0.4-1.0 u at
  T = 5..300, H = 16..256, one and two layers.
- Products of length K (K = I, or H, or D*R) accumulated in float32: about
  sqrt(K) 2^-24 relative, random-signed; this is where H enters.
So bound = scale * (2 u + 16 sqrt(K) 2^-24), the same for every T. It is tight enough to
catch a wrong gate (order 1) and a product accumulated in the data's dtype instead of
float32 (6-13 u at K = 256, emulated the same way); tests below show both fail it.
Gradients are held to the same bound, against fusedrnn's float64 backward (itself checked
against central differences in test_op/test_features) on the same rounded inputs (with
dropout its float32 backward: `check` says why).

ReLU's kink. Products with half operands (the GPU's tensor cores round h_{t-1}; its half
GEMMs and the CPU's bfloat16 pairs round a layer's input) move a pre-activation by about
u |W| |h|. One that close to 0 takes the other side of relu than in the reference, and the
gradient through that unit changes by all of its dh: an O(1) error in that row, which no
bound in u covers (seen before this rule: CPU bfloat16 at T=9 N=20 I=6 H=40, L=2 D=2, 8-14
times the bound on ddata; GPU float16 95-209 u). rnn_relu cases are therefore drawn clear
of it (`clear_of_the_kink`): every pre-activation of the float64 reference at least
KINK_MARGIN from 0, half of the units active and half not. Then the bound above holds
(0.2-0.8 of it, both dtypes).
"""
from contextlib import contextmanager
from unittest import mock

import ml_dtypes
import numpy as np
import pytest
from test_features import dropout_masks, proj_case, ref_args

import fusedrnn
from fusedrnn.cpu import FIRST_TIER, CpuBackend, fused

import reference
from conftest import CELLS, MODES, make_case
from reference import rnn_reference

HALF = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
GRADS = ("data", "parameters", "state", "state_cell")


def u_of(dtype):
    return fusedrnn.config.PRECISIONS[np.dtype(dtype).name].unit_roundoff


def bound(dtype, scale, K):
    """The module docstring's bound on max |y - y_ref| for one output."""
    return scale * (2 * u_of(dtype) + 16 * np.sqrt(K) * 2.0 ** -24)


def rounded(case, dtype):
    """Every array of `case` in `dtype` (the op's inputs) and, as float64, the same
    rounded values (the reference's inputs)."""
    half = {k: None if v is None else np.asarray(v).astype(dtype) for k, v in case.items()}
    exact = {k: None if v is None else v.astype(np.float64) for k, v in half.items()}
    return half, exact


KINK_MARGIN = 0.25


def clear_of_the_kink(case, kw, **ref_kw):
    """`case`, or for relu (the module docstring's kink) the same case with its weights
    scaled by 1/4 and its biases b_x + b_h = +1 and -1 on alternate units (split between
    the two at random, so each is read), so that every pre-activation is dominated by its
    bias; checked on the float64 reference (ref_kw: its other arguments, lengths or
    dropout masks)."""
    if CELLS[kw["mode"]].nonlinearity != "relu":
        return case
    params = np.array(case["parameters"], np.float64)
    layout = fusedrnn.param_layout(mode=kw["mode"], input_size=case["data"].shape[2],
                                   state_size=kw["state_size"], num_layers=kw["num_layers"],
                                   bidirectional=kw.get("bidirectional", False))
    views, rng = layout.views(params), np.random.default_rng(1)
    for (layer, d, kind), block in views.items():
        if kind.startswith("W"):
            block *= 0.25
        elif kind == "b_x":
            split = rng.uniform(-0.5, 0.5, block.size)
            block[:] = np.where(np.arange(block.size) % 2, -1.0, 1.0) - split
            views[(layer, d, "b_h")][:] = split
    case = dict(case, parameters=params.astype(case["parameters"].dtype))
    closest = kink_clearance(case, kw, **ref_kw)
    assert closest >= KINK_MARGIN, f"a pre-activation {closest:.3g} from relu's kink"
    return case


def kink_clearance(case, kw, **ref_kw):
    """The smallest |pre-activation| of relu in the float64 reference (inf for cells
    without a kink); kw may hold the op's feature keywords, the reference needs none."""
    trace = []
    core = {k: kw[k] for k in ("mode", "state_size", "num_layers", "bidirectional") if k in kw}
    rnn_reference(**case, **core, **ref_kw, trace=trace)
    return min((np.abs(a).min() for a in trace), default=np.inf)


@pytest.fixture(autouse=True, params=["projected", "in-loop"])
def input_product(request, monkeypatch):
    """Both ways the CPU bfloat16 layer takes W_x x_t, at every case's size: the
    projection before the loop, and the product inside it (cpu/fused.py's
    FUSED_INPUT_ROWS decides by N; float16 runs its one path twice: ~40 s of CI)."""
    monkeypatch.setattr(fused, "FUSED_INPUT_ROWS", 1 if request.param == "in-loop" else 1 << 30)


def longest_product(kw, I):
    D = 2 if kw.get("bidirectional") else 1
    R = kw.get("projection_size") or kw["state_size"]
    return max(I, kw["state_size"], D * R)


def assert_within(actual, expected, dtype, K, what):
    assert actual.dtype == dtype, (what, actual.dtype)
    expected = np.asarray(expected, np.float64)
    err = np.max(np.abs(actual.astype(np.float64) - expected))
    limit = bound(dtype, np.max(np.abs(expected)), K)
    assert err <= limit, f"{what}: max error {err:.3g} > bound {limit:.3g} " \
                         f"({err / (np.max(np.abs(expected)) * u_of(dtype)):.2f} u)"


@contextmanager
def on_numpy(yes):
    """With yes, the float64 reference runs on the CPU's first tier (numpy, a second
    implementation that tests/cpu/test_warm.py holds to the fused kernels): no float64
    kernel of every mode to compile."""
    if not yes:
        yield
        return
    with mock.patch.object(CpuBackend, "for_call", lambda self, *args: FIRST_TIER):
        yield


def check(case, kw, dtype, heads=None, feats=None, masks=None, train_kw=None):
    """Forward (and, with heads, backward) of the op in `dtype` against float64."""
    feats = feats or {}
    case = clear_of_the_kink(case, kw, **ref_args(feats), dropout_masks=masks)
    half, exact = rounded(case, dtype)
    K = longest_product(kw, case["data"].shape[2])
    ref = rnn_reference(**exact, **kw, **ref_args(feats), dropout_masks=masks)
    result = fusedrnn.RNN(**half, **kw, **feats, state_outputs=True, **(train_kw or {}))
    names = ("out", "hy", "cy")
    for name, got, want in zip(names, result, ref):
        if want is not None:
            assert_within(got, want, dtype, K, name)
    if heads is None:
        return
    half_heads, exact_heads = rounded(heads, dtype)
    if not CELLS[kw["mode"]].has_cell_state:
        half_heads["dcy"] = exact_heads["dcy"] = None
    grads = fusedrnn.rnn_backward(result[-1], **half_heads)
    # With dropout the reference backward runs in float32, whose generator draws the
    # same masks as the half op's (float64's draws others); float32's own error (~1e-6)
    # is far below the bound.
    ref_dtype = np.float32 if (train_kw or {}).get("p") else np.float64
    ref_in = {k: None if v is None else v.astype(ref_dtype) for k, v in exact.items()}
    ref_heads = {k: None if v is None else v.astype(ref_dtype) for k, v in exact_heads.items()}
    with on_numpy(ref_dtype == np.float64):
        *_, handle = fusedrnn.RNN(**ref_in, **kw, **feats, state_outputs=True,
                                  **dict(train_kw or {}, train=True))
        want = fusedrnn.rnn_backward(handle, **ref_heads)
    for name in GRADS:
        if getattr(want, name) is not None:
            assert_within(getattr(grads, name), getattr(want, name), dtype, K, "d" + name)


@pytest.mark.parametrize("dtype", list(HALF))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("L,D", [(1, 1), (2, 2)])
def test_forward_and_backward_against_float64(dtype, mode, L, D):
    case, kw, heads = make_case(mode, T=7, N=3, I=5, H=20, L=L, D=D, seed=11)
    check(case, kw, HALF[dtype], heads, train_kw=dict(train=True))


@pytest.mark.parametrize("dtype", list(HALF))
@pytest.mark.parametrize("mode", MODES)
def test_longer_and_wider(dtype, mode):
    """T=60, H=96: the bound does not grow with T (module docstring)."""
    case, kw, _ = make_case(mode, T=60, N=4, I=40, H=96, seed=3)
    check(case, kw, HALF[dtype])


@pytest.mark.parametrize("dtype", list(HALF))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("T", [1, 2])
def test_single_steps(dtype, mode, T):
    """T=1 runs the single-step kernels."""
    case, kw, heads = make_case(mode, T=T, N=5, I=9, H=33, seed=T)
    check(case, kw, HALF[dtype], heads, train_kw=dict(train=True))


@pytest.mark.parametrize("dtype", list(HALF))
def test_features_together(dtype):
    """Lengths, projection, clipping and dropout in one call, forward and backward."""
    T, N, L, D, P, p, seed = 6, 4, 2, 2, 3, 0.3, 5
    case, kw, heads = proj_case(T=T, N=N, I=4, H=7, P=P, L=L, D=D, seed=9)
    feats = dict(sequence_length=np.array([6, 2, 4, 1]), use_sequence_length=True,
                 lstm_state_clip_min=-0.4, lstm_state_clip_max=0.5)
    # The masks are drawn in the compute dtype, float32 (config.PRECISIONS).
    masks = dropout_masks(seed, p, T, N, D, P, L, np.float32)
    check(case, kw, HALF[dtype], heads, feats=feats, masks=masks,
          train_kw=dict(train=True, p=p, seed=seed))


@pytest.mark.parametrize("dtype", list(HALF))
@pytest.mark.parametrize("mode", MODES)
def test_lengths(dtype, mode):
    case, kw, heads = make_case(mode, T=5, N=3, I=4, H=18, L=1, D=2, seed=4)
    feats = dict(sequence_length=np.array([5, 1, 3]), use_sequence_length=True)
    check(case, kw, HALF[dtype], heads, feats=feats, train_kw=dict(train=True))


def test_outputs_and_gradients_keep_the_dtype_and_a_second_backward_agrees():
    dtype = HALF["bfloat16"]
    case, kw, heads = make_case("lstm", T=4, N=2, I=3, H=16, seed=1)
    half, _ = rounded(case, dtype)
    out, hy, cy, handle = fusedrnn.RNN(**half, **kw, state_outputs=True, train=True)
    assert (out.dtype, hy.dtype, cy.dtype) == (dtype,) * 3
    dout = heads["dout"].astype(dtype)
    first = fusedrnn.rnn_backward(handle, dout, retain=True)
    second = fusedrnn.rnn_backward(handle, dout)
    for name in GRADS:
        assert getattr(first, name).dtype == dtype
        assert np.array_equal(getattr(first, name).view(np.uint16),
                              getattr(second, name).view(np.uint16))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_backward_gemms_run_on_pairs_where_the_backend_has_them(monkeypatch, dtype):
    """The bounds above cover the bfloat16 backward whose GEMMs take bfloat16 pairs
    (CpuBackend.pair_products, a CPU with AVX512-BF16); float16 keeps float32 GEMMs (one
    by one here: not sequence_products)."""
    from fusedrnn.cpu import BACKEND, CpuBackend
    monkeypatch.setattr(CpuBackend, "sequence_products", staticmethod(lambda *a: False))
    seen = []
    real = CpuBackend.matmul
    def matmul(a, b, out, *args, **kwargs):
        if out.dtype == np.float32:   # (not the float64 reference's backward)
            seen.append((kwargs.get("pairs") is not None, a.shape[0]))   # (rows summed or kept)
        return real(a, b, out, *args, **kwargs)
    monkeypatch.setattr(BACKEND, "matmul", matmul)
    T, N = 5, 3
    case, kw, heads = make_case("lstm", T=T, N=N, I=4, H=18, L=2, D=2, seed=6)
    check(case, kw, HALF[dtype], heads, train_kw=dict(train=True))
    # per layer: dX, and per direction two weight gradients, over all T*N rows
    over_all = [pairs for pairs, rows in seen if rows == T * N]
    assert len(over_all) == 2 * 5
    assert set(over_all) == {dtype == "bfloat16" and CpuBackend.pair_products(dtype)}
    # per layer and direction dh_0 = dG @ W_h of its first step's N rows, in float32
    assert [pairs for pairs, rows in seen if rows == N] == [False] * (2 * 2)
    assert len(seen) == 2 * 5 + 2 * 2


@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_the_weight_gradients_share_dg_pairs_only_where_dg_is_shared(monkeypatch, mode):
    """Cells whose gate gradients are not split (LSTM) interleave dG once for both weight
    gradients (matmul's a_paired); the gradients are bit for bit those of interleaving it
    twice. GRU's W_h gradient has its own dG and never reuses."""
    from fusedrnn.cache import thread_cache
    from fusedrnn.cpu import BACKEND, CpuBackend
    case, kw, heads = make_case(mode, T=9, N=4, I=6, H=20, L=1, D=2, seed=4)
    half = {k: v.astype(HALF["bfloat16"]) for k, v in case.items() if v is not None}
    head = heads["dout"].astype(HALF["bfloat16"])

    def grads():
        thread_cache().clear()
        *_, handle = fusedrnn.RNN(**half, **kw, train=True)
        return fusedrnn.rnn_backward(handle, head)
    shared = grads()
    flags, real = [], CpuBackend.matmul
    def matmul(a, b, out, transpose_a=False, pairs=None, a_paired=False, half="bfloat16"):
        flags.append(a_paired)
        return real(a, b, out, transpose_a, pairs, half=half)   # never reuses
    monkeypatch.setattr(BACKEND, "matmul", matmul)
    alone = grads()
    pairs = CpuBackend.pair_products("bfloat16")
    shares = pairs and not CELLS[mode].split_gate_grads
    assert flags.count(True) == (2 if shares else 0)   # a direction each
    for name in ("data", "parameters"):
        assert np.array_equal(getattr(shared, name).view(np.uint16),
                              getattr(alone, name).view(np.uint16)), name


def test_float16_and_bfloat16_of_one_shape_get_their_own_ops():
    """The op cache keys on the dtype's name: bfloat16's str ('<V2') is any 2-byte void's."""
    case, kw, _ = make_case("gru", T=3, N=2, I=4, H=16, seed=2)
    results = {}
    for name in ("bfloat16", "float16", "bfloat16"):
        half, exact = rounded(case, HALF[name])
        out = fusedrnn.RNN(**half, **kw)
        assert out.dtype == HALF[name]
        assert_within(out, rnn_reference(**exact, **kw)[0], HALF[name], 16, name)
        results.setdefault(name, []).append(out.view(np.uint16))
    assert np.array_equal(*results["bfloat16"])


@pytest.mark.parametrize("other", ["float32", "float16", "bfloat16"])
def test_mixed_dtypes_are_refused(other):
    data = np.zeros((2, 1, 3), HALF["float16"] if other != "float16" else HALF["bfloat16"])
    size = fusedrnn.param_size(mode="gru", input_size=3, state_size=4)
    params = np.zeros(size, np.dtype(ml_dtypes.bfloat16) if other == "bfloat16" else other)
    with pytest.raises(TypeError, match=f"parameters: expected dtype {data.dtype} "
                                        f"\\(data's dtype\\), got {other}"):
        fusedrnn.RNN(data, params, mode="gru", state_size=4, num_layers=1)


def test_other_two_byte_dtypes_are_refused():
    data = np.zeros((2, 1, 3), np.int16)
    with pytest.raises(TypeError, match="data: expected dtype float32, float64, float16 or "
                                        "bfloat16, got int16"):
        fusedrnn.RNN(data, np.zeros(60, np.int16), mode="gru", state_size=4, num_layers=1)


# ---- the bound catches planted bugs ------------------------------------------------------

class _Accumulating:
    """A matrix whose `@` sums its products in `dtype`, rounding after every addition:
    a kernel missing its float32 accumulation."""

    def __init__(self, w, dtype):
        self.w, self.dtype, self.shape = w, dtype, w.shape

    def __matmul__(self, v):
        total = np.zeros(self.w.shape[0])
        for k in range(self.w.shape[1]):
            total = (total + self.w[:, k] * v[k]).astype(self.dtype).astype(np.float64)
        return total


def _emulate(monkeypatch, variant, dtype):
    """The reference's cell made into a half kernel's: "rounded states" holds h and x in
    `dtype` between steps (allowed), "half sums" accumulates products in `dtype`, "wrong
    gate" swaps LSTM's input and forget gates (bugs)."""
    cell = reference.cell

    def patched(mode, x, h, c, wx, wh, bx, bh, clip=None, trace=None):
        if variant == "rounded states":
            x, h = (v.astype(dtype).astype(np.float64) for v in (x, h))
        elif variant == "half sums":
            wx, wh = _Accumulating(wx, dtype), _Accumulating(wh, dtype)
        elif variant == "wrong gate":
            H = wh.shape[0] // 4
            order = np.r_[H:2 * H, 0:H, 2 * H:4 * H]
            wx, wh, bx, bh = wx[order], wh[order], bx[order], bh[order]
        return cell(mode, x, h, c, wx, wh, bx, bh, clip, trace)

    monkeypatch.setattr(reference, "cell", patched)


@pytest.mark.parametrize("dtype", list(HALF))
@pytest.mark.parametrize("variant,caught", [("rounded states", False), ("half sums", True),
                                            ("wrong gate", True)])
def test_the_bound_admits_rounded_states_and_catches_planted_bugs(monkeypatch, dtype, variant,
                                                                  caught):
    dtype = HALF[dtype]
    case, kw, _ = make_case("lstm", T=4, N=2, I=256, H=256, seed=8)
    _, exact = rounded(case, dtype)
    expected = rnn_reference(**exact, **kw)[0]
    _emulate(monkeypatch, variant, dtype)
    emulated = rnn_reference(**exact, **kw)[0].astype(dtype)
    if caught:
        with pytest.raises(AssertionError, match="max error"):
            assert_within(emulated, expected, dtype, 256, variant)
    else:
        assert_within(emulated, expected, dtype, 256, variant)
    # and the op itself is within it at the same size
    half, _ = rounded(case, dtype)
    monkeypatch.undo()
    assert_within(fusedrnn.RNN(**half, **kw), expected, dtype, 256, "op")
