"""The thread-local op cache and the per-call training reserve rule. LSTM throughout: the
cache does not depend on the mode, and float64 LSTM is the quick tier's float64 kernel set
(conftest.QUICK_KERNELS)."""
import gc
import threading

import numpy as np
import pytest

import fusedrnn

from conftest import make_case, rel_err
from reference import finite_difference, loss_reference


@pytest.fixture
def limits():
    yield fusedrnn.set_cache_limits
    fusedrnn.set_cache_limits(max_entries=32, max_bytes=1 << 30)


def test_hits_and_misses_by_key():
    case, kw, _ = make_case("lstm")
    fusedrnn.RNN(**case, **kw)
    fusedrnn.RNN(**case, **kw)
    info = fusedrnn.cache_info()
    assert (info.misses, info.hits, info.entries) == (1, 1, 1)
    fusedrnn.RNN(**dict(case, data=case["data"][:2]), **kw)              # another T
    fusedrnn.RNN(**{k: None if v is None else v.astype(np.float32) for k, v in case.items()},
                 **kw)                                                    # another dtype
    assert fusedrnn.cache_info().entries == 3
    fusedrnn.clear_cache()
    assert fusedrnn.cache_info().entries == 0


def test_lru_bound_on_entries(limits):
    limits(max_entries=2)
    for T in (1, 2, 3, 1):
        case, kw, _ = make_case("lstm", T=T)
        fusedrnn.RNN(**case, **kw)
    info = fusedrnn.cache_info()
    assert info.entries == 2 and info.evictions == 2 and info.misses == 4


def test_bound_on_bytes_keeps_the_newest(limits):
    limits(max_bytes=1)
    for T in (5, 6):
        case, kw, _ = make_case("lstm", T=T)
        expected = fusedrnn.RNN(**case, **kw)
    info = fusedrnn.cache_info()
    assert info.entries == 1 and info.evictions == 1
    assert np.array_equal(fusedrnn.RNN(**case, **kw), expected)


def test_two_training_forwards_before_backward_both_correct():
    kw_case = [make_case("lstm", L=2, D=2, seed=s) for s in (1, 2)]
    handles = [fusedrnn.RNN(**c, **kw, state_outputs=True, train=True)[-1]
               for c, kw, _ in kw_case]
    for handle, (case, kw, heads) in zip(reversed(handles), reversed(kw_case)):
        grads = fusedrnn.rnn_backward(handle, **heads)
        ref = finite_difference(lambda: loss_reference(**case, heads=list(heads.values()), **kw),  # noqa: B023  (called in this iteration)
                                case["parameters"])
        assert rel_err(grads.parameters, ref) <= 1e-7


def test_reserve_is_recycled_after_backward_only():
    case, kw, heads = make_case("lstm")
    _, h1 = fusedrnn.RNN(**case, **kw, train=True)
    _, h2 = fusedrnn.RNN(**case, **kw, train=True)
    assert h1._reserve is not h2._reserve
    reserve = h1._reserve
    fusedrnn.rnn_backward(h1, heads["dout"])
    assert h1.released
    _, h3 = fusedrnn.RNN(**case, **kw, train=True)
    assert h3._reserve is reserve            # the released one is reused ...
    _, h4 = fusedrnn.RNN(**case, **kw, train=True)
    assert h4._reserve is not h2._reserve    # ... never one still held


def test_backward_twice_needs_retain():
    case, kw, heads = make_case("lstm")
    _, handle = fusedrnn.RNN(**case, **kw, train=True)
    first = fusedrnn.rnn_backward(handle, heads["dout"], retain=True)
    second = fusedrnn.rnn_backward(handle, heads["dout"])
    assert np.array_equal(first.parameters, second.parameters)
    with pytest.raises(RuntimeError, match="already released"):
        fusedrnn.rnn_backward(handle, heads["dout"])


def test_handle_survives_eviction_and_clear(limits):
    case, kw, heads = make_case("lstm")
    _, handle = fusedrnn.RNN(**case, **kw, train=True)
    expected = fusedrnn.rnn_backward(handle, heads["dout"], retain=True)
    fusedrnn.clear_cache()
    limits(max_entries=1)
    for T in (2, 3):
        fusedrnn.RNN(**dict(case, data=case["data"][:T]), **kw)
    got = fusedrnn.rnn_backward(handle, heads["dout"])
    assert np.array_equal(got.parameters, expected.parameters)


def test_each_thread_has_its_own_cache():
    case, kw, _ = make_case("lstm")
    expected = fusedrnn.RNN(**case, **kw)
    seen = {}

    def worker():
        seen["before"] = fusedrnn.cache_info().entries
        seen["out"] = fusedrnn.RNN(**case, **kw)
        seen["after"] = fusedrnn.cache_info().entries

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert (seen["before"], seen["after"]) == (0, 1)
    assert np.array_equal(seen["out"], expected)
    assert fusedrnn.cache_info().entries == 1


def test_backward_in_another_thread_runs_on_the_forwards_op():
    """As torch's autograd runs a CUDA backward on its device thread: that thread builds
    no op of its own (no second scratch, no settings of its own), and the reserve goes
    back to the forward's op for its thread's next training call."""
    case, kw, heads = make_case("lstm", L=2)
    _, handle = fusedrnn.RNN(**case, **kw, train=True)
    expected = fusedrnn.rnn_backward(handle, heads["dout"], retain=True)
    reserve, result = handle._reserve, {}

    def worker():
        result["g"] = fusedrnn.rnn_backward(handle, heads["dout"])
        result["info"] = fusedrnn.cache_info()
    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert np.array_equal(result["g"].parameters, expected.parameters)
    assert (result["info"].entries, result["info"].misses) == (0, 0)
    _, again = fusedrnn.RNN(**case, **kw, train=True)
    assert again._reserve is reserve


def test_an_op_runs_one_call_at_a_time_across_threads():
    """Two handles of one op carried to two threads, their backwards at once (as two
    threads' autograd might): each result is the one it has alone (the op's lock: both
    use its backward scratch)."""
    case, kw, heads = make_case("lstm", T=40, N=8, I=16, H=48, L=2, D=2, seed=2)
    handles = [fusedrnn.RNN(**case, **kw, train=True)[1] for _ in range(2)]
    want = fusedrnn.rnn_backward(handles[0], heads["dout"], retain=True)
    bad = []

    def backwards(handle):
        for _ in range(40):
            g = fusedrnn.rnn_backward(handle, heads["dout"], retain=True)
            bad.append(not np.array_equal(g.parameters, want.parameters))
    threads = [threading.Thread(target=backwards, args=(h,)) for h in handles]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(bad) == 80 and not any(bad)


def test_a_handle_released_inside_its_ops_call_does_not_deadlock():
    """The garbage collector can run the torch integration's finalizer (a handle's
    release) in the middle of the same op's call, on the thread that holds its lock."""
    case, kw, _ = make_case("lstm")
    _, handle = fusedrnn.RNN(**case, **kw, train=True)

    def inside_a_call():
        with handle._op().lock:
            handle.release()
    thread = threading.Thread(target=inside_a_call, daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive() and handle.released


def test_a_release_never_waits_for_another_threads_call():
    """While another thread's call holds the op, a release (the garbage collector's, say)
    returns at once and leaves the reserve to be freed; a backward waiting for the op then
    finds the handle released and says so."""
    case, kw, heads = make_case("lstm")
    _, handle = fusedrnn.RNN(**case, **kw, train=True)
    op, busy, done, outcome = handle._op(), threading.Event(), threading.Event(), []

    def another_call():
        with op.lock:
            busy.set()
            done.wait(10)
    holder = threading.Thread(target=another_call)
    holder.start()
    busy.wait(10)

    def backward():
        try:
            fusedrnn.rnn_backward(handle, heads["dout"])
        except RuntimeError as e:
            outcome.append(str(e))
    waiting = threading.Thread(target=backward)
    waiting.start()
    pooled = len(op._reserve_pool)
    handle.release()          # returns: the op is busy
    handle.release()          # and again: nothing left to give
    assert handle.released and len(op._reserve_pool) == pooled
    done.set()
    holder.join()
    waiting.join(10)
    assert outcome and "already released" in outcome[0]


def test_a_handle_does_not_keep_a_dropped_op_alive():
    case, kw, heads = make_case("lstm")
    _, handle = fusedrnn.RNN(**case, **kw, train=True)
    expected = fusedrnn.rnn_backward(handle, heads["dout"], retain=True)
    fusedrnn.clear_cache()
    gc.collect()
    assert handle._op() is None
    got = fusedrnn.rnn_backward(handle, heads["dout"])   # on this thread's new op
    assert np.array_equal(got.parameters, expected.parameters)


def test_limits_are_validated(limits):
    with pytest.raises(ValueError, match="max_entries"):
        limits(max_entries=0)
    with pytest.raises(ValueError, match="max_bytes"):
        limits(max_entries=4, max_bytes=-5)
    assert fusedrnn.cache_info().max_entries == 32       # a bad call changes nothing
    limits(max_entries=np.int64(4))
    assert fusedrnn.cache_info().max_entries == 4


def test_release_after_clear_does_not_rebuild_the_op():
    case, kw, _ = make_case("lstm")
    _, handle = fusedrnn.RNN(**case, **kw, train=True)
    fusedrnn.clear_cache()
    handle.release()
    info = fusedrnn.cache_info()
    assert handle.released and (info.misses, info.entries) == (0, 0)


def test_byte_limit_holds_when_the_kept_op_is_the_oldest(limits):
    """Trimming skips the op in use and evicts the next least recent one."""
    big, bkw, heads = make_case("lstm", T=6, N=4, L=2, D=2)
    small, skw, _ = make_case("lstm", T=3)
    _, handle = fusedrnn.RNN(**big, **bkw, train=True)   # the big op, then the small one
    fusedrnn.RNN(**small, **skw)
    limits(max_bytes=fusedrnn.cache_info().nbytes)
    handle.release()                                      # the big op grows by its reserve
    info = fusedrnn.cache_info()
    assert info.entries == 1 and info.evictions >= 1
