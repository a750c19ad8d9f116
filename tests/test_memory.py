"""Memory bounds, measured: a long run stays bounded, training reserves are released.

The op cache is the one place fusedrnn keeps memory between calls (compiled kernels,
scratch buffers, a pool of recycled training reserves), and a TrainingHandle owns its
reserve until backward. These tests measure what that means for a process:

a. 10,000 calls of random small shapes (so the cache keeps missing and evicting) leave
   resident memory flat after a warm-up, the cache inside its limits after every call, and
   no training reserve alive but the few the cached ops pool;
b. backward (or release()) hands a reserve back to its op, which reuses it, and a handle
   dropped without backward frees its reserve;
c. many handles outstanding at once each own a distinct reserve and all give the same
   results as the same calls made one at a time.

Reserves are types.SimpleNamespace objects, which do not support weak references. Each
reserve is, however, carved out of ONE numpy allocation (fusedrnn.recurrence._carve: every
field is a view of a flat array), and numpy arrays do support them. So a weakref to that
owning array (`owner()` below) is alive exactly as long as the reserve's memory is: it
dies only when no view of the reserve is left anywhere (handle, op pool, outputs).
"""
import gc
import os
import random
import resource
import weakref

import numpy as np
import pytest

import fusedrnn
from fusedrnn.recurrence import RecurrentOp

from conftest import CELLS, MODES, make_case
from reference import param_count

DEFAULT_LIMITS = dict(max_entries=32, max_bytes=1 << 30)   # the documented defaults
PAGE = os.sysconf("SC_PAGE_SIZE")


@pytest.fixture
def limits():
    yield fusedrnn.set_cache_limits
    fusedrnn.set_cache_limits(**DEFAULT_LIMITS)


def rss_bytes():
    """Resident set size now (Linux: /proc/self/statm, field 2, in pages)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def owner(array):
    """The ndarray that owns `array`'s memory (views chain to it through .base)."""
    while isinstance(array.base, np.ndarray):
        array = array.base
    return array


def reserve_ref(handle):
    """A weakref to the memory of the handle's reserve (see the module docstring)."""
    return weakref.ref(owner(handle._reserve.hs))


# ---- a. a long random run ----------------------------------------------------------------
CALLS, WARMUP = 10_000, 500
# Measured growth after the warm-up is ~0.2 MiB. 50 MiB catches a gross leak (more than
# ~5 KB per call over the 9,500 calls: an op, or a call's arrays, kept each time) without
# tripping on allocator noise on another machine; a smaller leak of training reserves is
# caught exactly by counting live reserves at the end.
RSS_GROWTH_LIMIT = 50 << 20
RECURRING = 24  # shapes that come back (cache hits, reserve reuse), beside fresh ones


def random_call(rng):
    """Arguments for one RNN call of random small shape and features (seeded, not zeros).
    Half the calls reuse one of RECURRING shapes, so ops are hit again, grow backward
    scratch and pool reserves; the other half are fresh shapes that force misses and
    evictions (8 entries hold a third of the recurring shapes at most)."""
    shape_rng = (np.random.default_rng([7, int(rng.integers(RECURRING))])
                 if rng.random() < 0.5 else rng)
    mode = MODES[shape_rng.integers(len(MODES))]
    T, N, I, H = (int(shape_rng.integers(1, hi + 1)) for hi in (5, 4, 5, 6))
    L, D = int(shape_rng.integers(1, 3)), int(shape_rng.integers(1, 3))
    dtype = (np.float32, np.float64)[shape_rng.integers(2)]
    P = (int(shape_rng.integers(1, H))
         if CELLS[mode].projection and H >= 2 and shape_rng.random() < 0.3 else None)
    R = P or H
    kw = dict(mode=mode, state_size=H, num_layers=L, bidirectional=D == 2,
              projection_size=P, state_outputs=bool(rng.random() < 0.5))
    arrays = dict(data=rng.standard_normal((T, N, I)).astype(dtype),
                  parameters=rng.uniform(-0.5, 0.5, param_count(mode, I, H, L, D, P))
                  .astype(dtype))
    if rng.random() < 0.5:
        arrays["state"] = rng.standard_normal((L * D, N, R)).astype(dtype)
        if CELLS[mode].has_cell_state:
            arrays["state_cell"] = rng.standard_normal((L * D, N, H)).astype(dtype)
    if rng.random() < 0.3:
        kw.update(sequence_length=rng.integers(1, T + 1, N), use_sequence_length=True)
    return arrays, kw


def test_many_random_calls_keep_memory_bounded(limits):
    limits(max_entries=8)  # small, so 10,000 random shapes keep missing and evicting
    rng = np.random.default_rng(2024)
    reserves = []          # weakrefs to every training reserve handed out
    samples = {}           # RSS at a few points, for the failure message

    for i in range(CALLS):
        arrays, kw = random_call(rng)
        kind = rng.random()
        if kind < 0.80:                               # inference
            fusedrnn.RNN(**arrays, **kw)
        else:                                         # training forward ...
            *outs, handle = fusedrnn.RNN(**arrays, **kw, train=True)
            reserves.append(reserve_ref(handle))
            if kind < 0.95:                           # ... + backward
                fusedrnn.rnn_backward(handle, dout=np.ones_like(outs[0]))
                assert handle.released
            elif kind < 0.98:                         # ... released without backward
                handle.release()
            del handle                                # ... or simply dropped
        info = fusedrnn.cache_info()
        assert info.max_entries == 8 and info.entries <= 8, info
        assert info.nbytes <= info.max_bytes, info
        if i + 1 == WARMUP or (i + 1) % 2000 == 0:
            gc.collect()
            samples[i + 1] = rss_bytes()

    info = fusedrnn.cache_info()
    assert info.evictions > CALLS // 2, info  # the run did churn the cache
    growth = samples[CALLS] - samples[WARMUP]
    report = {k: f"{v / 2**20:.1f} MiB" for k, v in samples.items()}
    print(f"\nRSS after n calls: {report}; growth after warm-up {growth / 2**20:+.2f} MiB; "
          f"peak (ru_maxrss) {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.1f}"
          f" MiB; {len(reserves)} training forwards; {info}")
    assert growth < RSS_GROWTH_LIMIT, report

    # Sharper than RSS (a few KB per leaked reserve hides in allocator noise): every
    # reserve handed out is dead now but those pooled by the (at most 8) cached ops.
    gc.collect()
    alive = sum(ref() is not None for ref in reserves)
    assert alive <= info.entries * RecurrentOp.RESERVE_POOL, (alive, len(reserves))


def test_byte_limit_holds_after_hits(limits):
    """The run above keeps the default 1 GiB, which it cannot reach; here the limit binds.
    The cache may exceed max_bytes only with a single entry (the newest op is kept even
    when it alone is too big, tests/cache/test_cache.py), never with two or more."""
    big, big_kw, heads = make_case("lstm", T=6, N=4, I=5, H=6, L=2, D=2)
    small, small_kw, _ = make_case("gru", T=3)
    fusedrnn.RNN(**big, **big_kw)
    fusedrnn.RNN(**small, **small_kw)
    limits(max_bytes=fusedrnn.cache_info().nbytes)   # exactly what the two inference ops use
    for _ in range(3):                                 # a training loop on the big op: hits only
        *_, handle = fusedrnn.RNN(**big, **big_kw, train=True)
        fusedrnn.rnn_backward(handle, heads["dout"])
        info = fusedrnn.cache_info()
        assert info.entries == 1 or info.nbytes <= info.max_bytes, info


# ---- b. reserves are recycled or freed ----------------------------------------------------
def training_case():
    case, kw, heads = make_case("lstm", T=5, N=3, I=4, H=6, L=2, D=2, seed=7)
    return case, dict(kw, state_outputs=True), heads


def test_backward_recycles_reserve_into_the_op():
    case, kw, heads = training_case()
    *outs, handle = fusedrnn.RNN(**case, **kw, train=True)
    first = fusedrnn.rnn_backward(handle, **heads)   # builds the op's backward scratch too
    nbytes_pooled = fusedrnn.cache_info().nbytes      # op + scratch + one pooled reserve

    *outs, handle = fusedrnn.RNN(**case, **kw, train=True)
    reserve = handle._reserve
    size = reserve.nbytes
    # Taken from the pool: the handle owns it now, the cache no longer counts it.
    assert fusedrnn.cache_info().nbytes == nbytes_pooled - size
    grads = fusedrnn.rnn_backward(handle, **heads)
    assert handle.released and handle._reserve is None
    assert fusedrnn.cache_info().nbytes == nbytes_pooled   # handed back and counted again
    # The next training forward of the same shapes reuses it, not a new allocation ...
    *_, again = fusedrnn.RNN(**case, **kw, train=True)
    assert again._reserve is reserve
    del reserve
    # ... and a recycled reserve gives the same gradients as a fresh one did.
    for name in ("data", "parameters", "state", "state_cell"):
        assert np.array_equal(getattr(grads, name), getattr(first, name)), name
    again.release()


def test_release_without_backward_recycles_too():
    case, kw, _ = training_case()
    *_, handle = fusedrnn.RNN(**case, **kw, train=True)
    reserve = handle._reserve
    handle.release()
    assert handle.released
    with pytest.raises(RuntimeError, match="already released"):
        fusedrnn.rnn_backward(handle)
    *_, again = fusedrnn.RNN(**case, **kw, train=True)
    assert again._reserve is reserve
    del reserve
    again.release()


def test_dropped_handle_frees_its_reserve():
    case, kw, _ = training_case()
    *outs, handle = fusedrnn.RNN(**case, **kw, train=True)
    ref = reserve_ref(handle)
    nbytes = fusedrnn.cache_info().nbytes
    gc.collect()
    assert ref() is not None        # the control: alive while the handle is
    del handle, outs                # no backward, no release()
    gc.collect()
    assert ref() is None            # its memory is gone ...
    assert fusedrnn.cache_info().nbytes == nbytes   # ... and the op did not keep it


def test_pool_keeps_at_most_its_size_of_handed_back_reserves():
    """Handles backward'ed in a burst: the op keeps RESERVE_POOL of their reserves for the
    next forward and frees the rest (a training loop needs one; more would be a leak)."""
    case, kw, heads = training_case()
    handles = [fusedrnn.RNN(**case, **kw, train=True)[-1] for _ in range(6)]
    refs = [reserve_ref(h) for h in handles]
    for handle in handles:
        fusedrnn.rnn_backward(handle, **heads)
    del handles, handle
    gc.collect()
    alive = sum(ref() is not None for ref in refs)
    assert 1 <= alive <= RecurrentOp.RESERVE_POOL, alive


# ---- c. many outstanding handles -----------------------------------------------------------
HANDLES = 50
CONFIGS = {
    "lstm-proj-L2-bidir": dict(mode="lstm", L=2, D=2, P=3),
    "gru-L3-lengths": dict(mode="gru", L=3, D=1, lengths=True),
    "rnn_tanh-bidir-f32": dict(mode="rnn_tanh", L=2, D=2, dtype=np.float32),
}


def outstanding_case(seed, mode, L, D, P=None, lengths=False, dtype=np.float64):
    """Same shapes for every seed (one cached op), different values."""
    T, N, I, H = 5, 3, 4, 5
    R = P or H
    rng = np.random.default_rng(seed)
    case = dict(data=rng.standard_normal((T, N, I)).astype(dtype),
                parameters=rng.uniform(-0.4, 0.4, param_count(mode, I, H, L, D, P)).astype(dtype),
                state=rng.standard_normal((L * D, N, R)).astype(dtype),
                state_cell=rng.standard_normal((L * D, N, H)).astype(dtype)
                if CELLS[mode].has_cell_state else None)
    kw = dict(mode=mode, state_size=H, num_layers=L, bidirectional=D == 2, projection_size=P,
              state_outputs=True)
    if lengths:
        kw.update(sequence_length=rng.integers(1, T + 1, N), use_sequence_length=True)
    heads = dict(dout=rng.standard_normal((T, N, D * R)).astype(dtype),
                 dhy=rng.standard_normal((L * D, N, R)).astype(dtype),
                 dcy=(rng.standard_normal((L * D, N, H)).astype(dtype)
                      if CELLS[mode].has_cell_state else None))
    return case, kw, heads


@pytest.mark.parametrize("name", CONFIGS)
def test_many_outstanding_handles_each_own_their_reserve(name):
    cases = [outstanding_case(seed, **CONFIGS[name]) for seed in range(HANDLES)]

    # Serial: each forward's backward right away (one reserve, recycled 50 times).
    serial = []
    for case, kw, heads in cases:
        *outs, handle = fusedrnn.RNN(**case, **kw, train=True)
        serial.append((outs, fusedrnn.rnn_backward(handle, **heads)))
    fusedrnn.clear_cache()

    # Outstanding: all 50 forwards first, with inference calls of the same shapes between
    # them (those write the op's scratch, which must not be any handle's reserve).
    handles, forward_outs = [], []
    for case, kw, _ in cases:
        *outs, handle = fusedrnn.RNN(**case, **kw, train=True)
        handles.append(handle)
        forward_outs.append(outs)
        other, other_kw, _ = cases[len(handles) % HANDLES]
        fusedrnn.RNN(**other, **other_kw)
    owners = [owner(h._reserve.hs) for h in handles]
    assert len({id(o) for o in owners}) == HANDLES               # distinct allocations
    assert not any(np.shares_memory(a, b) for i, a in enumerate(owners) for b in owners[i + 1:])
    del owners

    order = list(range(HANDLES))
    random.Random(name).shuffle(order)   # backward in an order unrelated to the forwards
    for i in order:
        grads = fusedrnn.rnn_backward(handles[i], **cases[i][2])
        serial_outs, serial_grads = serial[i]
        for ours, theirs in zip(forward_outs[i], serial_outs):
            assert np.array_equal(ours, theirs), i
        for field in ("data", "parameters", "state", "state_cell"):
            ours, theirs = getattr(grads, field), getattr(serial_grads, field)
            assert (ours is None and theirs is None) or np.array_equal(ours, theirs), (i, field)
    assert all(h.released for h in handles)
