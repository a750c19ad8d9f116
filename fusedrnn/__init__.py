"""fusedrnn: one fused RNN operator (MXNet `RNN` semantics) for numpy arrays, CuPy arrays
and torch tensors (fusedrnn.torch: autograd and drop-in modules).

    out, hy, cy = fusedrnn.RNN(data, params, h0, c0, state_size=H, num_layers=L,
                               mode="lstm", state_outputs=True)

docs/usage.md: the arguments, training (RNN(..., train=True) + rnn_backward) and the op
cache; docs/parameters.md: the parameter layout (fusedrnn.param_layout).
"""
from . import op
from .cache import CacheInfo, cache_info, clear_cache, set_cache_limits
from .config import MODES, RNNConfig
from .layout import ParamLayout, param_layout, param_size
from .op import RNN, RNNGradients, TrainingHandle, rnn_backward

__version__ = "0.1.0"


def _torch_rnn(*args, **kwargs):
    """op's handler for torch tensors until fusedrnn.torch is imported, which registers
    its own `rnn` in this one's place: so torch loads on the first tensor, not here."""
    from . import torch as fused_torch
    return fused_torch.rnn(*args, **kwargs)


op.register_array_type("torch", _torch_rnn)

__all__ = ["RNN", "rnn_backward", "RNNGradients", "TrainingHandle", "param_size",
           "param_layout", "ParamLayout", "RNNConfig", "MODES", "cache_info", "clear_cache",
           "set_cache_limits", "CacheInfo", "__version__"]
