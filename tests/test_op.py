"""fusedrnn.RNN forward and backward against the plain float64 reference in tests/."""
import numpy as np
import pytest

import fusedrnn

from conftest import CELLS, MODES, make_case, rel_err, tolerance
from reference import finite_difference, loss_reference, rnn_reference


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("D", [1, 2])
@pytest.mark.parametrize("L", [1, 2, 3])
@pytest.mark.parametrize("mode", MODES)
def test_forward_matches_reference(mode, L, D, dtype):
    case, kw, _ = make_case(mode, T=5, N=3, I=4, H=5, L=L, D=D, dtype=dtype, seed=L * 10 + D)
    out, hy, *cy = fusedrnn.RNN(**case, **kw, state_outputs=True)
    ref_out, ref_hy, ref_cy = rnn_reference(**case, **kw)
    assert out.dtype == hy.dtype == dtype
    assert rel_err(out, ref_out) <= tolerance(dtype)
    assert rel_err(hy, ref_hy) <= tolerance(dtype)
    if CELLS[mode].has_cell_state:
        assert rel_err(cy[0], ref_cy) <= tolerance(dtype)
    else:
        assert cy == []


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("D", [1, 2])
@pytest.mark.parametrize("L", [1, 2, 3])
@pytest.mark.parametrize("mode", MODES)
def test_backward_matches_finite_differences_of_reference(mode, L, D, dtype):
    """Gradients of every input, float64 central differences of the reference as truth."""
    case, kw, heads = make_case(mode, T=4, N=2, I=3, H=3, L=L, D=D, dtype=dtype, seed=7 + L + D)
    *outs, handle = fusedrnn.RNN(**case, **kw, state_outputs=True, train=True)
    grads = fusedrnn.rnn_backward(handle, **heads)
    # The reference runs in float64 on the (possibly float32) inputs, made float64 here.
    ref_case = {k: (None if v is None else v.astype(np.float64)) for k, v in case.items()}
    ref_heads = [None if heads[k] is None else heads[k].astype(np.float64)
                 for k in ("dout", "dhy", "dcy")]

    def loss():
        return loss_reference(**ref_case, heads=ref_heads, **kw)

    # FD error ~1e-9 absolute on O(1) gradients; float32 carries its own rounding.
    tol = 1e-7 if dtype == np.float64 else 1e-5
    for name in ("data", "parameters", "state", "state_cell"):
        got = getattr(grads, name)
        if ref_case[name] is None:
            assert got is None
            continue
        assert got.dtype == dtype and got.shape == case[name].shape
        assert rel_err(got, finite_difference(loss, ref_case[name])) <= tol, name


@pytest.mark.parametrize("mode", MODES)
def test_backward_is_deterministic(mode):
    """Repeat runs give bit-identical gradients (finite differences above are only good
    to ~1e-9; the tight 1e-10 gradient checks are test_golden.py and
    tests/torch/test_autograd.py)."""
    case, kw, heads = make_case(mode, L=2, D=2)
    *_, h1 = fusedrnn.RNN(**case, **kw, state_outputs=True, train=True)
    g1 = fusedrnn.rnn_backward(h1, **heads)
    *_, h2 = fusedrnn.RNN(**case, **kw, state_outputs=True, train=True)
    g2 = fusedrnn.rnn_backward(h2, **heads)
    for a, b in zip(g1, g2):  # deterministic: bit-identical on repeat
        assert (a is None and b is None) or np.array_equal(a, b)


@pytest.mark.parametrize("mode", MODES)
def test_missing_states_default_to_zero(mode):
    case, kw, _ = make_case(mode, L=2, D=2, states=False)
    out = fusedrnn.RNN(**case, **kw)
    zeros = np.zeros((4, 3, 6))
    ref_out, _, _ = rnn_reference(case["data"], case["parameters"], zeros,
                                  zeros if CELLS[mode].has_cell_state else None, **kw)
    assert rel_err(out, ref_out) <= 1e-10


@pytest.mark.parametrize("together", [False, True])
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("mode, L, D, projection", [
    ("rnn_relu", 1, 2, None), ("rnn_tanh", 2, 1, None), ("gru", 2, 2, None),
    ("lstm", 1, 2, None), ("lstm", 2, 1, 3)])
def test_a_backward_without_initial_states_skips_their_products(monkeypatch, mode, L, D,
                                                                projection, T, together):
    """Without initial states their gradients are None and not computed (dh_0 = dG @ W_h
    of each first step), and at T=1 dW_h = dG^T h_0 is zero, no product: every other
    gradient equals an explicit zero state's, bit for bit (float32, the backward's
    products together or apart: `together` patches both bounds)."""
    monkeypatch.setattr(fusedrnn.cpu.CpuBackend, "step_products",
                        staticmethod(lambda dtype, work: together))
    monkeypatch.setattr(fusedrnn.cpu.CpuBackend, "sequence_products",
                        staticmethod(lambda dtype, rows, work: together))
    work = []   # multiply-adds of each call's GEMMs (forward and backward)
    matmul, products = fusedrnn.cpu.CpuBackend.matmul, fusedrnn.cpu.CpuBackend.products

    def counted_matmul(a, b, out, transpose_a=False, **kw):
        work[-1] += a.size * b.shape[1]
        return matmul(a, b, out, transpose_a, **kw)

    def counted_products(jobs, dtype):
        work[-1] += sum(a.size * b.shape[1] for a, b, _, _ in jobs)
        return products(jobs, dtype)
    def counted_xp_matmul(a, b, **kw):   # (the step-by-step driver's own)
        work[-1] += a.size * b.shape[1]
        return np.matmul(a, b, **kw)
    monkeypatch.setattr(fusedrnn.cpu.CpuBackend, "matmul", staticmethod(counted_matmul))
    monkeypatch.setattr(fusedrnn.cpu.CpuBackend.xp, "matmul", counted_xp_matmul)
    monkeypatch.setattr(fusedrnn.cpu.CpuBackend, "products", staticmethod(counted_products))
    case, kw, heads = make_case(mode, T=T, N=7, I=5, H=20, L=L, D=D, dtype=np.float32,
                                states=False)
    kw["projection_size"] = projection
    R = projection or 20
    size = fusedrnn.param_size(input_size=5, **kw)
    case["parameters"] = np.random.default_rng(1).uniform(-0.2, 0.2, size).astype(np.float32)
    heads["dout"], heads["dhy"] = heads["dout"][..., :D * R], heads["dhy"][..., :R]
    zeros = np.zeros((L * D, 7, 20), np.float32)
    given = dict(state=zeros[..., :R], state_cell=zeros if CELLS[mode].has_cell_state else None)
    grads = []
    for states in (given, {}):
        work.append(0)
        *_, handle = fusedrnn.RNN(**dict(case, **states), **kw, state_outputs=True, train=True)
        grads.append(fusedrnn.rnn_backward(handle, **heads))
    explicit, none = grads
    # fewer products: each first step's dh_0 = dG @ W_h, at T=1 dW_h = dG^T h_0 too
    skipped = L * D * 7 * CELLS[mode].gates * 20 * R * (1 + (T == 1))
    assert work[0] - work[1] == skipped, (work, skipped)
    assert none.state is None and none.state_cell is None
    assert explicit.state is not None and np.abs(explicit.state).max() > 0
    np.testing.assert_array_equal(none.data, explicit.data)
    np.testing.assert_array_equal(none.parameters, explicit.parameters)


@pytest.mark.parametrize("mode", MODES)
def test_output_arity_like_mxnet(mode):
    case, kw, _ = make_case(mode)
    assert isinstance(fusedrnn.RNN(**case, **kw), np.ndarray)
    outs = fusedrnn.RNN(**case, **kw, state_outputs=True)
    assert len(outs) == (3 if CELLS[mode].has_cell_state else 2)
    *outs, handle = fusedrnn.RNN(**case, **kw, state_outputs=True, train=True)
    assert isinstance(handle, fusedrnn.TrainingHandle)
    out, handle = fusedrnn.RNN(**case, **kw, train=True)
    assert isinstance(handle, fusedrnn.TrainingHandle)


@pytest.mark.parametrize("mode", MODES)
def test_training_forward_equals_inference(mode):
    case, kw, _ = make_case(mode, L=3, D=2)
    inference = fusedrnn.RNN(**case, **kw, state_outputs=True)
    *training, handle = fusedrnn.RNN(**case, **kw, state_outputs=True, train=True)
    for a, b in zip(inference, training):
        assert np.array_equal(a, b)


def test_head_gradients_may_be_omitted():
    case, kw, heads = make_case("lstm", L=2)
    *_, handle = fusedrnn.RNN(**case, **kw, state_outputs=True, train=True)
    only_dhy = fusedrnn.rnn_backward(handle, dhy=heads["dhy"])
    ref = [finite_difference(lambda: loss_reference(**case, heads=[None, heads["dhy"], None],
                                                    **kw), case["state"])]
    assert rel_err(only_dhy.state, ref[0]) <= 1e-7
    out, handle = fusedrnn.RNN(**case, **kw, train=True)
    none = fusedrnn.rnn_backward(handle)
    assert all(np.count_nonzero(g) == 0 for g in none)


def test_strided_and_negative_stride_inputs_are_read_correctly():
    case, kw, _ = make_case("gru", L=2, D=2)
    expected = fusedrnn.RNN(**case, **kw)
    reversed_copy = np.ascontiguousarray(case["data"][::-1])[::-1]      # negative strides
    wide = np.zeros((4, 3, 10))
    wide[:, :, ::2] = case["data"][:, :, :5]                             # non-contiguous
    strided = dict(case, data=reversed_copy)
    assert np.array_equal(fusedrnn.RNN(**strided, **kw), expected)
    assert wide[:, :, ::2].flags.c_contiguous is False
    strided = dict(case, data=wide[:, :, ::2])
    assert np.array_equal(fusedrnn.RNN(**strided, **kw), expected)


@pytest.mark.parametrize("T, projection", [(4, None), (1, None), (4, 3), (1, 3)])
def test_read_only_inputs_give_the_results_of_writable_ones(T, projection):
    """Read-only arrays (a memory map, np.frombuffer): every input, on the fused loop, its
    T=1 form and the projected per-step path, training included. The per-step kernels'
    signatures once refused the read-only biases with a TypeError."""
    case, kw, heads = make_case("lstm", T=T, N=3, I=5, H=6, L=2, D=2, seed=11)
    if projection:
        rng = np.random.default_rng(12)
        case["parameters"] = rng.uniform(-0.4, 0.4, fusedrnn.param_size(
            input_size=5, projection_size=projection, **kw))
        case["state"] = case["state"][..., :projection].copy()
        heads["dout"] = heads["dout"][..., :2 * projection].copy()
    lengths = np.array([T, 1, max(1, T - 1)], np.int64)
    extra = dict(projection_size=projection, sequence_length=lengths,
                 use_sequence_length=True, state_outputs=True)
    expected = fusedrnn.RNN(**case, **kw, **extra, train=True)
    expected_grads = fusedrnn.rnn_backward(expected[-1], heads["dout"])
    fixed = {k: v.copy() for k, v in case.items() if v is not None}
    for array in (*fixed.values(), lengths):
        array.setflags(write=False)
    extra["sequence_length"] = lengths
    got = fusedrnn.RNN(**fixed, **kw, **extra, train=True)
    grads = fusedrnn.rnn_backward(got[-1], heads["dout"])
    for a, b in zip((*got[:-1], *grads), (*expected[:-1], *expected_grads)):
        assert (a is None and b is None) or np.array_equal(a, b)


@pytest.mark.parametrize("stored_as", ["bfloat16", "float16", "float32", 3])
def test_stored_as_is_refused_outside_cupy_float32_data(stored_as):
    """op.RNN's private _stored_as (torch's CUDA bfloat16 arriving as float32) applies to
    CuPy float32 data only; numpy data is refused, naming it, whatever it says."""
    case, kw, _ = make_case("gru", dtype=np.float32)
    with pytest.raises(ValueError, match="_stored_as: expected None, or 'bfloat16'"):
        fusedrnn.RNN(**case, **kw, _stored_as=stored_as)
    assert fusedrnn.RNN(**case, **kw, _stored_as=None).dtype == np.float32


# ---- a call like the thread's last one (op.py: the checks and the lookup skipped) ------

def _fresh(case, kw, **more):
    """The call on an empty cache: every check, the op looked up."""
    fusedrnn.clear_cache()
    return fusedrnn.RNN(**case, **kw, **more)


REPEATS = [  # (mode, T, N, L, D, dtype, states, keywords)
    ("lstm", 1, 1, 1, 1, np.float32, False, {}),
    ("gru", 1, 3, 2, 2, np.float64, True, dict(state_outputs=True)),
    ("lstm", 4, 2, 1, 2, np.float32, True, dict(state_outputs=True, lstm_state_clip_min=-0.2,
                                               lstm_state_clip_max=0.3)),
    ("rnn_tanh", 3, 2, 2, 1, np.float64, False, dict(p=0.5, train=True, seed=3)),
]


@pytest.mark.parametrize("mode, T, N, L, D, dtype, states, more", REPEATS)
def test_a_repeated_call_gives_what_a_checked_one_gives(mode, T, N, L, D, dtype, states, more):
    """Calls like the last one (new values, the same shapes, dtypes and arguments) skip
    the checks and the lookup: each gives exactly what the same call gives on an empty
    cache, training handles included, and counts as the cache's hit."""
    case, kw, heads = make_case(mode, T=T, N=N, I=3, H=4, L=L, D=D, dtype=dtype, states=states)
    fusedrnn.RNN(**case, **kw, **more)
    for seed in (1, 2):
        again, _, heads = make_case(mode, T=T, N=N, I=3, H=4, L=L, D=D, dtype=dtype,
                                    states=states, seed=seed)
        hits = fusedrnn.cache_info().hits
        got = fusedrnn.RNN(**again, **kw, **more)
        assert fusedrnn.cache_info().hits == hits + 1
        want = _fresh(again, kw, **more)
        got, want = (x if isinstance(x, tuple) else (x,) for x in (got, want))
        if more.get("train"):
            got = (*got[:-1], *fusedrnn.rnn_backward(got[-1], heads["dout"])[:2])
            want = (*want[:-1], *fusedrnn.rnn_backward(want[-1], heads["dout"])[:2])
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and np.array_equal(a, b)
        fusedrnn.RNN(**again, **kw, **more)   # (the last call again, for the next round)


def _error(call):
    with pytest.raises((TypeError, ValueError)) as raised:
        call()
    return type(raised.value), str(raised.value)


@pytest.mark.parametrize("change", ["num_layers=True", "bidirectional=1", "float64 parameters",
                                    "parameters as a list", "a state of another shape",
                                    "a state as a list", "use_sequence_length alone",
                                    "a state_cell for a GRU"])
def test_a_call_unlike_the_last_is_checked_as_a_first_call(change):
    """One argument apart from the last call's (a value of another type, an array of
    another dtype or shape, or not an array): the same error as on an empty cache."""
    mode = "gru" if change == "a state_cell for a GRU" else "lstm"
    case, kw, _ = make_case(mode, T=1, N=2, I=3, H=4, dtype=np.float32)
    fusedrnn.RNN(**case, **kw)
    fusedrnn.RNN(**case, **kw)   # (a repeat: the one to differ from)
    bad, more = dict(case), {}
    if change == "num_layers=True":
        kw = dict(kw, num_layers=True)
    elif change == "bidirectional=1":
        kw = dict(kw, bidirectional=1)
    elif change == "float64 parameters":
        bad["parameters"] = case["parameters"].astype(np.float64)
    elif change == "parameters as a list":
        bad["parameters"] = list(case["parameters"])
    elif change == "a state of another shape":
        bad["state"] = case["state"][:, :1].copy()
    elif change == "a state as a list":
        bad["state"] = case["state"].tolist()
    elif change == "use_sequence_length alone":
        more = dict(use_sequence_length=True)
    else:
        bad["state_cell"] = case["state"].copy()
    repeated = _error(lambda: fusedrnn.RNN(**bad, **kw, **more))
    assert repeated == _error(lambda: _fresh(bad, kw, **more))


@pytest.mark.parametrize("slot", ["parameters", "state"])
@pytest.mark.parametrize("then", ["a list", "too long", "float64"])
def test_after_an_array_subclass_the_next_call_is_checked(slot, then):
    """An ndarray subclass (a memory map's type here) passes the checks; a later call with
    anything else in its place is checked as a first call would be."""
    case, kw, _ = make_case("gru", T=1, N=2, I=3, H=4, dtype=np.float32)
    mapped = dict(case, **{slot: case[slot].view(np.memmap)})
    fusedrnn.RNN(**mapped, **kw)
    fusedrnn.RNN(**mapped, **kw)
    bad = case[slot]
    if then == "a list":
        bad = bad.tolist()
    elif then == "too long":
        bad = np.concatenate([bad, bad[:1] if slot == "state" else bad[:7]]).view(np.memmap)
    else:
        bad = bad.astype(np.float64).view(np.memmap)
    other = dict(case, **{slot: bad})
    assert _error(lambda: fusedrnn.RNN(**other, **kw)) == _error(lambda: _fresh(other, kw))


@pytest.mark.parametrize("name, value", [("state_size", [4, 4]), ("p", [0.1, 0.2])])
def test_an_array_where_a_number_goes_is_checked_after_a_repeat(name, value):
    """(An array's == answers with an array: the signature compares types first.)"""
    case, kw, _ = make_case("gru", T=1, N=2, I=3, H=4, dtype=np.float32)
    for _ in range(2):
        fusedrnn.RNN(**case, **kw)
    bad = dict(kw, **{name: np.array(value)})
    assert _error(lambda: fusedrnn.RNN(**case, **bad)) == _error(lambda: _fresh(case, bad))


def test_lengths_are_checked_at_every_call():
    """sequence_length's values are read at every call (no repeat is kept for them)."""
    case, kw, _ = make_case("gru", T=3, N=2, I=3, H=4, dtype=np.float32)
    for _ in range(2):
        fusedrnn.RNN(**case, **kw, sequence_length=np.array([3, 1]), use_sequence_length=True)
    with pytest.raises(ValueError, match="sequence_length"):
        fusedrnn.RNN(**case, **kw, sequence_length=np.array([3, 4]), use_sequence_length=True)


def test_a_strided_repeat_reads_its_data_as_the_checks_would():
    """The repeat takes the same contiguous copies the checks take."""
    case, kw, _ = make_case("lstm", T=1, N=3, I=4, H=4, dtype=np.float32)
    fusedrnn.RNN(**case, **kw)
    wide = np.repeat(case["data"], 2, axis=2)[:, :, ::2]   # (same values, strided)
    assert not wide.flags.c_contiguous
    assert np.array_equal(fusedrnn.RNN(**dict(case, data=wide), **kw), _fresh(case, kw))


def test_the_repeat_goes_with_its_op():
    """A cleared cache, or the repeat's op evicted: no repeat (nor its op kept alive)."""
    from fusedrnn.cache import thread_cache
    case, kw, _ = make_case("lstm", T=1, N=2, I=3, H=4, dtype=np.float32)
    fusedrnn.RNN(**case, **kw)
    assert thread_cache().last is not None
    fusedrnn.clear_cache()
    assert thread_cache().last is None
    fusedrnn.RNN(**case, **kw)
    first = thread_cache().last
    fusedrnn.RNN(**dict(case, data=case["data"][:, :1], state=None, state_cell=None), **kw)
    assert thread_cache().last.op is not first.op
    thread_cache().touch(first.key, first.op)   # (the last call's op now the oldest)
    try:
        fusedrnn.set_cache_limits(max_entries=1)
        assert fusedrnn.cache_info().entries == 1 and thread_cache().last is None
    finally:
        fusedrnn.set_cache_limits(max_entries=32)


def test_no_repeat_while_on_the_first_tier(monkeypatch):
    """A call on the first tier keeps no repeat: a later one may find the kernels ready."""
    from fusedrnn.cache import thread_cache
    from fusedrnn.cpu import FIRST_TIER, CpuBackend
    monkeypatch.setattr(CpuBackend, "for_call", lambda self, *args: FIRST_TIER)
    case, kw, _ = make_case("gru", T=2, N=2, I=3, H=4, dtype=np.float32)
    for _ in range(2):
        fusedrnn.RNN(**case, **kw)
        assert thread_cache().last is None
    assert fusedrnn.cache_info().backends == {"cpu-first-tier": 1}
