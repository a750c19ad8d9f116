"""GPU backend (CuPy). Not built yet: fusedrnn.RNN raises NotImplementedError for CuPy arrays."""
