"""The persistent kernels (fusedrnn/gpu/persistent.cuh) without a GPU: built for the host
and run phase by phase (host_harness.cpp) through the GPU backend's own plan, argument
packing and layer object, inside the shared recurrence; every result must equal the CPU
backend's (float64: its first tier, host_backend.reference). Also the selection rule. What this cannot cover: real concurrency (the
barriers are loop boundaries here), shared-memory capacity and speed; those need
tests/gpu/test_parity.py on a GPU with FUSEDRNN_GPU_PERSISTENT=1."""
import numpy as np
import pytest

from fusedrnn.config import CELLS, CallOptions
from fusedrnn.gpu import persistent
from fusedrnn.gpu.persistent import DeviceLimits, persistent_plan

from conftest import MODES, make_case, rel_err
from host_backend import HostCudaBackend, build_harness, reference, run_training

H100 = DeviceLimits(sm_count=132, smem_per_block=227 * 1024)
# Small "devices" that split H=9 units unevenly over blocks (last block partly idle).
TWO_SMS, FOUR_SMS = DeviceLimits(2, 1 << 20), DeviceLimits(4, 1 << 20)
LENGTHS = CallOptions(lengths=np.array([7, 1, 4, 7, 0][:5], np.int64))
CLIPPED = dict(clip_lo=-0.3, clip_hi=0.25, clip_flags=3)


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    return build_harness(tmp_path_factory.mktemp("harness"))


def _check(harness, case, kw, heads, dtype, opts=CallOptions(), limits=TWO_SMS, threads=None,
           chunk=None, tile=1, slices=1):
    backend = HostCudaBackend(harness, persistent=limits, threads=threads, chunk=chunk,
                              tile=tile, slices=slices)
    got = run_training(backend, case, kw, heads, dtype, opts)
    want = run_training(reference(dtype), case, kw, heads, dtype, opts)
    # Every layer and direction went through the persistent kernels: forward twice
    # (training, inference) and backward once.
    assert len(backend.launches) == 3 * kw["num_layers"] * (2 if kw["bidirectional"] else 1)
    tol = 1e-12 if dtype == np.float64 else 1e-5
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert rel_err(a, b) <= tol


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("D", [1, 2])
@pytest.mark.parametrize("L", [1, 2, 3])
@pytest.mark.parametrize("mode", MODES)
def test_persistent_equals_cpu_backend(harness, mode, L, D, dtype):
    case, kw, heads = make_case(mode, T=6, N=5, I=4, H=9, L=L, D=D, dtype=dtype, seed=L + D)
    _check(harness, case, kw, heads, dtype)


SPLITS = {"4-blocks": (FOUR_SMS, None, None), "4-threads": (TWO_SMS, 4, None),
          "1-block-7-threads": (DeviceLimits(1, 1 << 20), 7, None),
          "chunks-of-5": (TWO_SMS, None, 5), "chunks-of-1": (FOUR_SMS, 32, 1)}


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("mode", MODES)
def test_persistent_any_split_of_units_threads_and_chunks(harness, mode, split):
    limits, threads, chunk = SPLITS[split]
    case, kw, heads = make_case(mode, T=4, N=5, I=3, H=9, L=2, D=2, seed=11)
    _check(harness, case, kw, heads, np.float64, limits=limits, threads=threads, chunk=chunk)


# Both recurrent products with a register tile of samples and their reductions split in
# slices (persistent.cuh: forward_product over k, backward_accumulate over each chunk of
# gate rows): N=5 leaves a partial last group for tiles 2..4 (its padding samples read
# NaN-poisoned columns of h_s and x_s in the harness); H=9 leaves short and empty slices
# (9 k over 4 slices: 3+3+3+0; over 12: nine of one k, three empty).
TILES = [(2, 1), (4, 1), (3, 2), (4, 4), (1, 12), (4, None)]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("tile, slices", TILES)
@pytest.mark.parametrize("mode", MODES)
def test_persistent_tiled_product_equals_cpu_backend(harness, mode, tile, slices, dtype):
    case, kw, heads = make_case(mode, T=5, N=5, I=4, H=9, L=2, D=2, dtype=dtype, seed=tile)
    _check(harness, case, kw, heads, dtype, tile=tile, slices=slices)


@pytest.mark.parametrize("chunk", [1, 5, 7])
@pytest.mark.parametrize("mode", ["lstm", "gru"])
def test_persistent_tiled_backward_over_chunks(harness, mode, chunk):
    """Slices of short chunks (chunk 1: every slice but the first empty) and a partial
    last chunk, the partial sums gathered over the step's chunks."""
    case, kw, heads = make_case(mode, T=4, N=5, I=3, H=9, L=1, D=2, seed=chunk)
    _check(harness, case, kw, heads, np.float64, limits=FOUR_SMS, chunk=chunk, tile=2,
           slices=3)


@pytest.mark.parametrize("mode", MODES)
def test_persistent_tiled_product_with_lengths_clip_and_few_threads(harness, mode):
    case, kw, heads = make_case(mode, T=7, N=5, I=4, H=9, L=2, D=2, seed=9)
    clip = CLIPPED if CELLS[mode].has_cell_state else {}   # state clipping: cells with c
    options = CallOptions(lengths=LENGTHS.lengths, **clip)
    _check(harness, case, kw, heads, np.float64, options, limits=FOUR_SMS, threads=3,
           tile=4, slices=3)


def test_tiled_plan_pads_the_state_rows_to_whole_tiles_and_fills_the_block():
    plan = persistent_plan(4, 800, 20, 4, H100, tile=4, slices=None)
    groups = 5                                   # 20 samples in tiles of 4
    assert plan.ldn == 21 and plan.tile == 4
    assert plan.slices == persistent.tile_slices(7, 20, 800, 4) == 512 // (7 * groups) == 14
    assert plan.threads == 512 >= plan.slices * 7 * groups
    assert plan.forward_smem == (800 * 4 * 7 + 800 * 21 + 14 * 7 * 4 * 21) * 4
    assert plan.backward_smem == (4 * 800 * 7 + 14 * 7 * 21 + plan.chunk * 21) * 4
    assert persistent_plan(4, 800, 22, 4, H100, tile=4).ldn == 25   # 22 -> 24 -> odd
    assert persistent_plan(1, 64, 3, 4, H100, tile=2, slices=None).slices == 8   # H // 8
    # Where the partial sums do not fit beside W_h, the plan refuses the layer; chosen
    # slices shrink until they fit (LSTM H=1024 N=20: 12 would fill the block, 5 fit).
    assert persistent_plan(4, 800, 20, 4, H100, tile=1, slices=64) is None
    assert persistent.tile_slices(8, 20, 1024, 4) == 12
    assert persistent_plan(4, 1024, 20, 4, H100, tile=4, slices=None).slices == 5
    assert persistent_plan(4, 1024, 20, 4, H100, tile=4, slices=6) is None


@pytest.mark.parametrize("tile, slices", [(0, 1), (5, 1), (2.0, 1), (1, 0), (1, 1.5)])
def test_tiled_plan_refuses_a_bad_tile_or_slice_count(tile, slices):
    with pytest.raises(ValueError, match="tile must be|slices must be"):
        persistent_plan(4, 800, 20, 4, H100, tile=tile, slices=slices)


@pytest.mark.parametrize("text, want", [(None, (1, 1)), ("", (1, 1)), ("4", (4, None)),
                                        (" 2,7 ", (2, 7)), ("1,1", (1, 1))])
def test_tile_setting_reads_the_environment(text, want):
    env = {} if text is None else {persistent.TILE_ENV: text}
    assert persistent.tile_setting(env) == want


@pytest.mark.parametrize("text", ["0", "5", "x", "2,0", "2,3,4", "2,", ",3", "1.5"])
def test_tile_setting_names_the_variable_for_a_bad_value(text):
    with pytest.raises(ValueError, match=f"{persistent.TILE_ENV}: expected .* got '{text}'"):
        persistent.tile_setting({persistent.TILE_ENV: text})


@pytest.mark.parametrize("D", [1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_persistent_with_lengths(harness, mode, D):
    case, kw, heads = make_case(mode, T=7, N=5, I=4, H=9, L=2, D=D, seed=D)
    _check(harness, case, kw, heads, np.float64, LENGTHS)


@pytest.mark.parametrize("options", [CallOptions(**CLIPPED),
                                     CallOptions(lengths=LENGTHS.lengths, **CLIPPED)],
                         ids=["clip", "clip+lengths"])
def test_persistent_lstm_clip(harness, options):
    case, kw, heads = make_case("lstm", T=7, N=5, I=4, H=9, L=2, D=2, seed=4)
    _check(harness, case, kw, heads, np.float64, options)


def test_plan_for_the_design_doc_lstm_on_an_h100():
    plan = persistent_plan(4, 800, 20, 4, H100)
    assert (plan.units, plan.blocks, plan.ldn, plan.threads, plan.chunk) == (7, 115, 21, 256, 512)
    assert (plan.tile, plan.slices) == (1, 1)
    assert plan.forward_smem == (800 * 4 * 7 + 800 * 21) * 4 == 156800   # no partial sums
    assert plan.backward_smem == (4 * 800 * 7 + 7 * 21 + 512 * 21) * 4


def test_plan_refuses_what_does_not_fit_on_chip():
    assert persistent_plan(4, 800, 20, 8, H100) is None           # float64 LSTM H=800
    assert persistent_plan(1, 256, 1024, 4, H100) is None         # staged state too large
    assert persistent_plan(3, 512, 64, 4, H100) is not None       # the GRU decoder step
    assert persistent_plan(4, 1024, 1, 4, H100) is not None       # 8 units x 4 gates x 1024
    assert persistent_plan(4, 2048, 1, 4, H100) is None           # W_h alone is 64 MB


def test_plan_blocks_cover_every_unit_once():
    for hidden in (1, 5, 131, 132, 133, 800, 2048):
        plan = persistent_plan(1, hidden, 3, 4, H100)
        assert plan.blocks <= H100.sm_count
        assert (plan.blocks - 1) * plan.units < hidden <= plan.blocks * plan.units
        assert plan.threads % 32 == 0 and persistent.MIN_THREADS <= plan.threads <= persistent.MAX_THREADS


def test_persistent_is_on_unless_turned_off(monkeypatch):
    """On by default (measured on an H100: bench/results/gpu.md); FUSEDRNN_GPU_PERSISTENT=0
    keeps the per-step path without touching CuPy."""
    from fusedrnn.config import RNNConfig
    monkeypatch.delenv(persistent.ENV, raising=False)
    assert persistent.persistent_enabled()
    monkeypatch.setenv(persistent.ENV, "0")
    assert not persistent.persistent_enabled()
    assert persistent.cupy_persistent_layer(None, RNNConfig("lstm", 4, 9, 1, False), np.float32, 5) is None
    monkeypatch.setenv(persistent.ENV, "1")
    assert persistent.persistent_enabled()


def test_kernel_names_cover_every_mode_and_dtype():
    names = persistent.PERSISTENT_KERNELS.all_kernel_names()
    assert len(set(names)) == 16
    assert "fusedrnn::persistent_backward<fusedrnn::GruCell, double>" in names
