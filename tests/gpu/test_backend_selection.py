"""Backend selection without a GPU: CuPy is imported lazily, only for CuPy arrays."""
import subprocess
import sys


def test_import_fusedrnn_does_not_import_cupy():
    code = ("import sys, numpy as np, fusedrnn\n"
            "n = fusedrnn.param_size(mode='gru', input_size=2, state_size=3)\n"
            "fusedrnn.RNN(np.ones((2, 1, 2)), np.ones(n), state_size=3, num_layers=1, mode='gru')\n"
            "assert 'cupy' not in sys.modules, 'cupy was imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_an_ops_call_on_another_stream_waits_for_its_last_one():
    """GpuBackend.follow on a stand-in for CuPy's streams: the same stream orders calls by
    itself; a call on another stream first waits on an event recorded on the last one."""
    import types

    from fusedrnn.gpu import GpuBackend
    log, current = [], {}

    class Stream:
        def __init__(self, ptr):
            self.ptr = ptr

        def wait_event(self, event):
            log.append(("wait", self.ptr, event.on))

    class Event:
        def __init__(self, disable_timing):
            assert disable_timing
            self.on = None

        def record(self, stream):
            self.on = stream.ptr

    cuda = types.SimpleNamespace(get_current_stream=lambda: current["s"], Event=Event)
    backend = GpuBackend(types.SimpleNamespace(cuda=cuda))
    a, b = Stream(1), Stream(2)
    current["s"] = a
    last = backend.follow(None)               # the op's first call
    last = backend.follow(last)               # again on a
    assert last is a and log == []
    current["s"] = b                          # a backward on another thread's stream
    last = backend.follow(last)
    assert last is b and log == [("wait", 2, 1)]
    current["s"] = a
    assert backend.follow(last) is a and log[-1] == ("wait", 1, 2)
