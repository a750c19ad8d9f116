"""fusedrnn/benchmark/loop_ablation.py cuts parts out of fused.py's kernels by source
text: each cut's pattern must still occur exactly once, or the script would time the uncut
kernel under a variant's name. Checked here on the text alone (no compile), so an edit to
fused.py that moves a pattern fails a test rather than a measurement."""
import pathlib

import numpy as np
import pytest

from fusedrnn.benchmark import loop_ablation as ablation
from fusedrnn.cpu import fused

CASES = [(direction, name) for direction, cuts in ablation.CUTS.items() for name in cuts]


@pytest.mark.parametrize("direction, name", CASES)
def test_every_cut_applies_to_the_current_kernel(direction, name):
    source = pathlib.Path(fused.__file__).read_text()
    cut = ablation.variant_source(source, ablation.CUTS[direction][name])
    if name == "base":
        assert cut == source.replace("cache=True", "cache=False")
    else:
        assert cut != source.replace("cache=True", "cache=False"), name


def test_a_variant_builds_without_the_disk_cache():
    # compiled from a string, a variant has no file for Numba's cache to sit beside: with
    # the cache on, building its layer raised before any timing
    layer = ablation.variant_layer("base", [], "rnn_tanh", np.float32)
    assert type(layer._forward._cache).__name__ == "NullCache"


def test_a_pattern_that_moved_is_an_error():
    with pytest.raises(RuntimeError, match="no longer has exactly one"):
        ablation.variant_source("no kernel here", ablation.CUTS["forward"]["no_cell"])
