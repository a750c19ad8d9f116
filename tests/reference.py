"""A plain float64 numpy reference of the RNN contract (docs/rnn-spec.md).

Deliberately naive and independent of fusedrnn's code: its own parameter slicing,
one step at a time, one sample's matrix-vector products, no shared helpers.
Covers LSTM projection, per-sample sequence lengths, LSTM cell-state clipping and
given dropout masks; tests/test_reference.py checks it against torch where torch
has the feature.
"""
import numpy as np

GATES = {"rnn_relu": 1, "rnn_tanh": 1, "lstm": 4, "gru": 3}


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def param_count(mode, I, H, L, D, P=None):
    """The spec's param_size formulas."""
    G = GATES[mode]
    if P is None:
        return D * G * H * (I + H + 2) + (L - 1) * D * G * H * (D * H + H + 2)
    return D * G * H * (I + P + 2) + (L - 1) * D * G * H * (D * P + P + 2) + L * D * P * H


def split_params(params, mode, I, H, L, D, P=None):
    """[{"W_x", "W_h", "W_r", "b_x", "b_h"} for each layer*D+d], read off the flat vector
    by the spec. W_r is None without projection. The blocks are views when `params` is
    already a float64 array (join_params relies on that)."""
    G = GATES[mode]
    R = H if P is None else P
    params = np.asarray(params, dtype=np.float64)
    blocks, pos = [], 0

    def take(*shape):
        nonlocal pos
        size = int(np.prod(shape))
        block = params[pos:pos + size].reshape(shape)
        pos += size
        return block

    for layer in range(L):
        n_in = I if layer == 0 else D * R
        for _ in range(D):
            blocks.append({"W_x": take(G * H, n_in), "W_h": take(G * H, R),
                           "W_r": take(R, H) if P is not None else None})
    for k in range(L * D):
        blocks[k]["b_x"] = take(G * H)
        blocks[k]["b_h"] = take(G * H)
    assert pos == params.size, (pos, params.size)
    return blocks


TORCH_NAMES = {"W_x": "weight_ih", "W_h": "weight_hh", "W_r": "weight_hr",
               "b_x": "bias_ih", "b_h": "bias_hh"}


def torch_name(layer, direction, kind):
    return f"{TORCH_NAMES[kind]}_l{layer}" + ("_reverse" if direction else "")


def to_torch_names(params, mode, I, H, L, D, P=None):
    """{torch.nn parameter name: float64 block} for the flat vector `params`."""
    blocks = split_params(params, mode, I, H, L, D, P)
    return {torch_name(k // D, k % D, kind): np.array(value)
            for k, block in enumerate(blocks) for kind, value in block.items()
            if value is not None}


def join_params(named, mode, I, H, L, D, P=None):
    """The flat float64 vector from {torch.nn parameter name: array} (e.g. gradients)."""
    flat = np.zeros(param_count(mode, I, H, L, D, P))
    for k, block in enumerate(split_params(flat, mode, I, H, L, D, P)):
        for kind, view in block.items():
            if view is not None:
                view[...] = np.asarray(named[torch_name(k // D, k % D, kind)])
    return flat


def cell(mode, x, h, c, wx, wh, bx, bh, clip=None, trace=None):
    """One step for one sample: returns (h', c'). h is the recurrent input (r with
    projection); `clip` (LSTM) maps the updated c' to the clipped one; `trace`, a list,
    gets rnn_relu's pre-activation appended (its kink is at 0)."""
    H = wh.shape[0] // GATES[mode]
    if mode in ("rnn_relu", "rnn_tanh"):
        a = wx @ x + bx + wh @ h + bh
        if trace is not None and mode == "rnn_relu":
            trace.append(a.copy())
        return (np.maximum(a, 0.0) if mode == "rnn_relu" else np.tanh(a)), c
    if mode == "lstm":
        a = wx @ x + bx + wh @ h + bh
        i, f = sigmoid(a[:H]), sigmoid(a[H:2 * H])
        g, o = np.tanh(a[2 * H:3 * H]), sigmoid(a[3 * H:])
        c_new = f * c + i * g
        if clip is not None:
            c_new = clip(c_new)
        return o * np.tanh(c_new), c_new
    ax, ah = wx @ x + bx, wh @ h + bh
    r = sigmoid(ax[:H] + ah[:H])
    z = sigmoid(ax[H:2 * H] + ah[H:2 * H])
    n = np.tanh(ax[2 * H:] + r * ah[2 * H:])
    return (1.0 - z) * n + z * h, c


def rnn_reference(data, parameters, state=None, state_cell=None, *, mode, state_size,
                  num_layers, bidirectional=False, projection_size=None, sequence_length=None,
                  clip_min=None, clip_max=None, clip_nan=False, dropout_masks=None,
                  trace=None):
    """Returns (out, hy, cy) in float64; cy is None unless LSTM.

    sequence_length: (N,) ints in 1..T; dropout_masks: None or L-1 arrays (T, N, D*R)
    that multiply the input of layers 1..L-1 (scale included). `trace`, a list, gets
    every value that meets a kink of the math appended, to see how close values sit to
    it: every LSTM c' before clipping, every rnn_relu pre-activation.
    """
    data = np.asarray(data, dtype=np.float64)
    T, N, I = data.shape
    H, L, D, P = state_size, num_layers, 2 if bidirectional else 1, projection_size
    R = H if P is None else P
    assert P is None or mode == "lstm", "projection is LSTM only"
    weights = split_params(parameters, mode, I, H, L, D, P)
    h0 = np.zeros((L * D, N, R)) if state is None else np.asarray(state, np.float64)
    c0 = np.zeros((L * D, N, H)) if state_cell is None else np.asarray(state_cell, np.float64)
    assert h0.shape == (L * D, N, R) and c0.shape == (L * D, N, H), (h0.shape, c0.shape)

    if sequence_length is None:
        lengths = [T] * N
    else:
        lengths = np.asarray(sequence_length)
        assert lengths.shape == (N,) and lengths.dtype.kind in "iu", lengths
        assert lengths.min() >= 1 and lengths.max() <= T, lengths
        lengths = [int(n) for n in lengths]

    clip = None
    assert (clip_min is None) == (clip_max is None), "both clip bounds or neither"
    if clip_min is not None:
        assert mode == "lstm" and clip_min <= clip_max, (mode, clip_min, clip_max)
        lo, hi = float(clip_min), float(clip_max)

        def clip(c):
            if trace is not None:
                trace.append(c.copy())
            if clip_nan:  # fmax/fmin pick the number over a NaN: NaN -> clip_min
                return np.fmin(np.fmax(c, lo), hi)
            return np.minimum(np.maximum(c, lo), hi)  # NaN propagates

    assert dropout_masks is None or len(dropout_masks) == L - 1
    hy, cy = np.zeros((L * D, N, R)), np.zeros((L * D, N, H))
    x = data
    for layer in range(L):
        if layer > 0 and dropout_masks is not None:
            mask = np.asarray(dropout_masks[layer - 1], np.float64)
            assert mask.shape == (T, N, D * R), mask.shape
            x = x * mask
        y = np.zeros((T, N, D * R))  # steps past a sample's length stay 0
        for d in range(D):
            k = layer * D + d
            w = weights[k]
            for n in range(N):
                r, c = h0[k, n].copy(), c0[k, n].copy()
                steps = range(lengths[n])
                for t in (steps if d == 0 else reversed(steps)):
                    h, c = cell(mode, x[t, n], r, c, w["W_x"], w["W_h"], w["b_x"], w["b_h"],
                                clip, trace)
                    r = h if w["W_r"] is None else w["W_r"] @ h
                    y[t, n, d * R:(d + 1) * R] = r
                hy[k, n], cy[k, n] = r, c
        x = y
    return x, hy, (cy if mode == "lstm" else None)


def loss_reference(data, parameters, state, state_cell, heads, **kwargs):
    """sum(out*dout) + sum(hy*dhy) + sum(cy*dcy), terms with a None head dropped.
    kwargs go to rnn_reference (projection, lengths, clipping, dropout masks...)."""
    outputs = rnn_reference(data, parameters, state, state_cell, **kwargs)
    return sum(float(np.sum(o * g)) for o, g in zip(outputs, heads) if g is not None)


def finite_difference(f, x, eps=1e-6):
    """Central differences of the scalar f() w.r.t. every element of x (modified in place)."""
    grad = np.empty(x.shape)
    flat, g = x.reshape(-1), grad.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + eps
        up = f()
        flat[i] = old - eps
        down = f()
        flat[i] = old
        g[i] = (up - down) / (2 * eps)
    return grad
