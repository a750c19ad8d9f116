"""Concurrent calls from many Python threads: no abort, results identical to serial."""
import threading

import numpy as np

import fusedrnn
from conftest import MODES, make_case
from fusedrnn.cpu import threads


def test_threading_layer_is_guarded_when_not_threadsafe():
    if threads.LAYER == "workqueue":
        assert isinstance(threads.LAUNCH_LOCK, type(threading.Lock()))


def test_concurrent_calls_match_serial():
    cases = [make_case(mode, T=3 + i % 3, L=1 + i % 2, D=1 + i % 2, seed=i)
             for i, mode in enumerate(MODES * 2)]

    def run(case, kw, heads):
        *outs, handle = fusedrnn.RNN(**case, **kw, state_outputs=True, train=True)
        return outs, fusedrnn.rnn_backward(handle, **heads)

    serial = [run(*c) for c in cases]
    results, errors = {}, []

    def worker(w):
        try:
            for rep in range(10):
                i = (w + rep) % len(cases)
                results[(w, rep)] = (i, run(*cases[i]))
        except BaseException as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    pool = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert not errors
    assert len(results) == 80
    for i, (outs, grads) in results.values():
        want_outs, want_grads = serial[i]
        assert all(np.array_equal(a, b) for a, b in zip(outs, want_outs))
        assert all((a is None and b is None) or np.array_equal(a, b)
                   for a, b in zip(grads, want_grads))
