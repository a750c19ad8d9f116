"""Property tests: random valid configurations against the independent float64 reference.

The parametrised tests elsewhere pin a handful of shapes; here hypothesis draws the whole
configuration (mode, T, N, I, H, layers, directions, dtype, states, state_outputs, and for
LSTM projection and clipping, plus ragged lengths) so that combinations nobody wrote down
(a projected bidirectional 3-layer LSTM with N=1 and ragged lengths, H=1, T=1, ...) get
checked too. Inputs are seeded numpy draws from a hypothesis-drawn seed: never zeros, so a
kernel that ignores an input or a state cannot hide behind 0 * anything.

`derandomize=True` makes the drawn examples a function of the test alone, so CI sees the
same ones every run; the example counts keep the file well under 40 s on 2 cores.

The autouse fixture in conftest clears the op cache per test function, not per example,
so later examples may hit ops cached by earlier ones. That is fine (and realistic): every
op still runs on NaN-poisoned buffers, and a cached op reused with different options
(lengths, clipping) is exactly what a user's program does.
"""
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import fusedrnn

from conftest import CELLS, MODES, QUICK_KERNELS, rel_err, tolerance
from reference import param_count, rnn_reference

# The autouse poisoning fixture is function-scoped; hypothesis warns that it is not reset
# between examples. We rely on it only to patch the backend's allocator (the same for
# every example) and to clear the cache around the test, so the warning does not apply.
SETTINGS = dict(deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


@dataclass
class Config:
    mode: str
    T: int
    N: int
    I: int
    H: int
    L: int
    D: int
    dtype: type
    states: bool
    state_outputs: bool
    P: int | None            # LSTM projection size, or None
    clip: tuple | None       # (lo, hi, clip_nan) for LSTM, or None
    lengths: tuple | None    # per-sample lengths (use_sequence_length=True), or None
    lengths_dtype: type
    seed: int

    @property
    def R(self):
        return self.P or self.H


@st.composite
def configs(draw, modes=MODES, float64_modes=MODES, dtypes=(np.float32, np.float64)):
    """A Config; float64 is drawn for float64_modes only (float32 for the others)."""
    mode = draw(st.sampled_from(modes))
    T, N = draw(st.integers(1, 6)), draw(st.integers(1, 4))
    I, H = draw(st.integers(1, 5)), draw(st.integers(1, 6))
    P = clip = lengths = None
    if CELLS[mode].projection and H >= 2 and draw(st.booleans()):
        P = draw(st.integers(1, H - 1))
    if CELLS[mode].state_clip:
        if draw(st.booleans()):
            # Bounds around 0 so they bite (c is O(0.1..1) with these inputs) but not
            # everywhere; lo == hi (a constant c) is valid and allowed. Multiples of 1/8,
            # exact in float32: a bound like 1e-92 is 0 in float32, and comparing that
            # op's 0 with the reference's 1e-92 measures the bound's rounding, not the op.
            lo = draw(st.integers(-12, 2)) / 8
            clip = (lo, lo + draw(st.integers(0, 12)) / 8, draw(st.booleans()))
    if draw(st.booleans()):
        lengths = tuple(draw(st.lists(st.integers(1, T), min_size=N, max_size=N)))
    return Config(mode=mode, T=T, N=N, I=I, H=H, L=draw(st.integers(1, 3)),
                  D=draw(st.sampled_from([1, 2])),
                  dtype=draw(st.sampled_from(dtypes)) if mode in float64_modes
                  else np.float32,
                  states=draw(st.booleans()), state_outputs=draw(st.booleans()),
                  P=P, clip=clip, lengths=lengths,
                  lengths_dtype=draw(st.sampled_from([np.int32, np.int64])),
                  seed=draw(st.integers(0, 2**32 - 1)))


def inputs(cfg):
    """(arrays for RNN, keyword arguments for RNN, keyword arguments for rnn_reference)."""
    rng = np.random.default_rng(cfg.seed)
    LD, scale = cfg.L * cfg.D, 1.0 / np.sqrt(cfg.H)
    n_params = param_count(cfg.mode, cfg.I, cfg.H, cfg.L, cfg.D, cfg.P)
    arrays = dict(
        data=rng.standard_normal((cfg.T, cfg.N, cfg.I)).astype(cfg.dtype),
        parameters=rng.uniform(-scale, scale, n_params).astype(cfg.dtype),
        state=(0.5 * rng.standard_normal((LD, cfg.N, cfg.R))).astype(cfg.dtype)
        if cfg.states else None,
        state_cell=(0.5 * rng.standard_normal((LD, cfg.N, cfg.H))).astype(cfg.dtype)
        if cfg.states and CELLS[cfg.mode].has_cell_state else None,
    )
    shared = dict(mode=cfg.mode, state_size=cfg.H, num_layers=cfg.L,
                  bidirectional=cfg.D == 2, projection_size=cfg.P)
    op_kw, ref_kw = dict(shared), dict(shared)
    if cfg.clip is not None:
        lo, hi, nan = cfg.clip
        op_kw.update(lstm_state_clip_min=lo, lstm_state_clip_max=hi, lstm_state_clip_nan=nan)
        ref_kw.update(clip_min=lo, clip_max=hi, clip_nan=nan)
    if cfg.lengths is not None:
        lens = np.array(cfg.lengths, dtype=cfg.lengths_dtype)
        op_kw.update(sequence_length=lens, use_sequence_length=True)
        ref_kw.update(sequence_length=lens)
    return arrays, op_kw, ref_kw


def as_tuple(result):
    return result if isinstance(result, tuple) else (result,)


def expected_outputs(cfg, ref):
    """The reference's (out, hy, cy) cut to what RNN returns for this state_outputs."""
    out, hy, cy = ref
    if not cfg.state_outputs:
        return (out,)
    return (out, hy) if cy is None else (out, hy, cy)


def check_inference(cfg):
    arrays, op_kw, ref_kw = inputs(cfg)
    got = as_tuple(fusedrnn.RNN(**arrays, **op_kw, state_outputs=cfg.state_outputs))
    want = expected_outputs(cfg, rnn_reference(**arrays, **ref_kw))
    assert len(got) == len(want)
    for name, ours, theirs in zip(("out", "hy", "cy"), got, want):
        assert ours.dtype == cfg.dtype, name
        assert ours.shape == theirs.shape, name   # (T, N, D*R), (L*D, N, R), (L*D, N, H)
        err = rel_err(ours, theirs)
        assert err <= tolerance(cfg.dtype), (name, err)
    if cfg.lengths is not None:
        # Past its length a sample's output is exactly 0 (the buffers start as NaN).
        for n, length in enumerate(cfg.lengths):
            assert not got[0][length:, n].any()


def heads_for(cfg, rng):
    """Random head gradients for every output this forward has (None for the others)."""
    LD = cfg.L * cfg.D
    dout = rng.standard_normal((cfg.T, cfg.N, cfg.D * cfg.R)).astype(cfg.dtype)
    dhy = (rng.standard_normal((LD, cfg.N, cfg.R)).astype(cfg.dtype)
           if cfg.state_outputs else None)
    dcy = (rng.standard_normal((LD, cfg.N, cfg.H)).astype(cfg.dtype)
           if cfg.state_outputs and CELLS[cfg.mode].has_cell_state else None)
    return dict(dout=dout, dhy=dhy, dcy=dcy)


def clip_margin(cfg, arrays, ref_kw):
    """Least distance of any pre-clip c to a clip bound (inf without clipping)."""
    if cfg.clip is None:
        return np.inf
    trace = []
    rnn_reference(**arrays, **ref_kw, trace=trace)
    c = np.concatenate(trace)
    lo, hi, _ = cfg.clip
    return float(np.min(np.minimum(np.abs(c - lo), np.abs(c - hi))))


def check_training(cfg):
    arrays, op_kw, ref_kw = inputs(cfg)
    inference = as_tuple(fusedrnn.RNN(**arrays, **op_kw, state_outputs=cfg.state_outputs))
    *training, handle = fusedrnn.RNN(**arrays, **op_kw, state_outputs=cfg.state_outputs,
                                     train=True)
    # Without dropout (p=0) a training forward is the same computation writing into a
    # reserve instead of scratch: identical bits, not merely close.
    assert isinstance(handle, fusedrnn.TrainingHandle)
    assert len(training) == len(inference)
    for ours, theirs in zip(training, inference):
        assert np.array_equal(ours, theirs)

    rng = np.random.default_rng(cfg.seed + 1)
    heads = heads_for(cfg, rng)
    grads = fusedrnn.rnn_backward(handle, **heads)
    assert handle.released
    for name in ("data", "parameters", "state", "state_cell"):
        given_array, grad = arrays[name], getattr(grads, name)
        if given_array is None:       # no gradient for an input that was not passed
            assert grad is None, name
            continue
        assert grad.shape == given_array.shape and grad.dtype == cfg.dtype, name
        assert np.all(np.isfinite(grad)), name   # poisoned (NaN) buffers fully written

    if cfg.dtype != np.float64:
        return
    # float64: the gradient's component along a random direction v must be the directional
    # derivative of the reference's loss, by central differences (2 reference runs instead
    # of one per element). Measured over 600 non-derandomized draws the error is at most
    # 1.2e-10 of `magnitude` (the sum of |g*v|), so 1e-8 leaves a 100x margin and still
    # catches one wrong bias element (0.1% off). The loss is piecewise smooth (relu,
    # clipping), so skip the rare draw whose pre-clip c sits within the step of a bound.
    assume(clip_margin(cfg, arrays, ref_kw) > 1e-4)
    names = [k for k, v in arrays.items() if v is not None]
    direction = {k: rng.standard_normal(arrays[k].shape) for k in names}
    eps = 1e-6

    def loss(sign):
        moved = {k: (v + sign * eps * direction[k] if k in direction else v)
                 for k, v in arrays.items()}
        outputs = rnn_reference(**moved, **ref_kw)
        return sum(float(np.sum(o * h)) for o, h in
                   zip(outputs, (heads["dout"], heads["dhy"], heads["dcy"])) if h is not None)

    fd = (loss(+1) - loss(-1)) / (2 * eps)
    terms = [getattr(grads, k) * direction[k] for k in names]
    analytic = sum(float(np.sum(t)) for t in terms)
    magnitude = sum(float(np.sum(np.abs(t))) for t in terms) + 1.0
    assert abs(fd - analytic) <= 1e-8 * magnitude, (fd, analytic, magnitude)


# Each property runs over the full space and over LSTM alone: hypothesis draws a choice's
# first option ("no projection", "no clipping", a low mode index) more often than uniform,
# so the LSTM features (projection x clipping x lengths x layers x directions) get a
# strategy of their own to be covered well (roughly 1/3 of LSTM draws project, 1/3 clip).
# The quick tier draws float64 for the modes of its float64 kernels (conftest's
# QUICK_KERNELS; each mode's float64 kernels compile for seconds on a cold clone), the
# exhaustive tier's twins float64 for the other modes.
QUICK_FLOAT64 = QUICK_KERNELS["float64"]
OTHER_MODES = tuple(m for m in MODES if m not in QUICK_FLOAT64)


@settings(max_examples=400, **SETTINGS)
@given(cfg=configs(float64_modes=QUICK_FLOAT64))
def test_inference_matches_reference(cfg):
    check_inference(cfg)


@pytest.mark.exhaustive
@settings(max_examples=300, **SETTINGS)
@given(cfg=configs(modes=OTHER_MODES, dtypes=(np.float64,)))
def test_inference_matches_reference_float64_other_modes(cfg):
    check_inference(cfg)


@settings(max_examples=300, **SETTINGS)
@given(cfg=configs(modes=("lstm",)))
def test_lstm_features_inference_matches_reference(cfg):
    check_inference(cfg)


@settings(max_examples=200, **SETTINGS)
@given(cfg=configs(float64_modes=QUICK_FLOAT64))
def test_training_forward_equals_inference_and_gradients_are_sane(cfg):
    check_training(cfg)


@pytest.mark.exhaustive
@settings(max_examples=150, **SETTINGS)
@given(cfg=configs(modes=OTHER_MODES, dtypes=(np.float64,)))
def test_training_float64_other_modes(cfg):
    check_training(cfg)


@settings(max_examples=150, **SETTINGS)
@given(cfg=configs(modes=("lstm",)))
def test_lstm_features_training(cfg):
    check_training(cfg)
