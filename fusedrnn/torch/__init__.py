"""torch integration: fusedrnn.RNN on torch tensors with autograd, and drop-in modules.

Tensors cross to numpy (CPU) or CuPy (CUDA) through DLPack, without copies, and the
results come back the same way. Imported only when a torch tensor reaches fusedrnn.RNN
or when this module is imported, so `import fusedrnn` never needs torch.
"""
from __future__ import annotations

from .. import op
from .autograd import rnn, to_array, to_tensor  # noqa: F401  (to_array/to_tensor: public helpers)
from .modules import GRU, LSTM, RNN

__all__ = ["RNN", "LSTM", "GRU", "rnn"]

# From here on fusedrnn.RNN hands torch tensors straight to `rnn`, not through the
# facade's loader (fusedrnn/__init__.py; op.register_array_type: why a registry).
op.register_array_type("torch", rnn)
