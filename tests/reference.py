"""A plain float64 numpy reference of the RNN contract (../shared/spec/rnn.md).

Deliberately naive and independent of fusedrnn's code: its own parameter slicing,
one step at a time, one sample's matrix-vector products, no shared helpers.
"""
import numpy as np

GATES = {"rnn_relu": 1, "rnn_tanh": 1, "lstm": 4, "gru": 3}


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def split_params(params, mode, I, H, L, D):
    """[(W_x, W_h, b_x, b_h) for each layer*D+d], read off the flat vector by the spec."""
    G = GATES[mode]
    params = np.asarray(params, dtype=np.float64)
    weights, pos = [], 0
    for layer in range(L):
        n_in = I if layer == 0 else D * H
        for _ in range(D):
            wx = params[pos:pos + G * H * n_in].reshape(G * H, n_in)
            pos += G * H * n_in
            wh = params[pos:pos + G * H * H].reshape(G * H, H)
            pos += G * H * H
            weights.append([wx, wh])
    for k in range(L * D):
        weights[k].append(params[pos:pos + G * H])
        pos += G * H
        weights[k].append(params[pos:pos + G * H])
        pos += G * H
    assert pos == params.size, (pos, params.size)
    return weights


def cell(mode, x, h, c, wx, wh, bx, bh):
    """One step for one sample: returns (h', c')."""
    H = h.shape[0]
    if mode in ("rnn_relu", "rnn_tanh"):
        a = wx @ x + bx + wh @ h + bh
        return (np.maximum(a, 0.0) if mode == "rnn_relu" else np.tanh(a)), c
    if mode == "lstm":
        a = wx @ x + bx + wh @ h + bh
        i, f = sigmoid(a[:H]), sigmoid(a[H:2 * H])
        g, o = np.tanh(a[2 * H:3 * H]), sigmoid(a[3 * H:])
        c_new = f * c + i * g
        return o * np.tanh(c_new), c_new
    ax, ah = wx @ x + bx, wh @ h + bh
    r = sigmoid(ax[:H] + ah[:H])
    z = sigmoid(ax[H:2 * H] + ah[H:2 * H])
    n = np.tanh(ax[2 * H:] + r * ah[2 * H:])
    return (1.0 - z) * n + z * h, c


def rnn_reference(data, parameters, state=None, state_cell=None, *, mode, state_size,
                  num_layers, bidirectional=False):
    """Returns (out, hy, cy) in float64; cy is None unless LSTM."""
    data = np.asarray(data, dtype=np.float64)
    T, N, I = data.shape
    H, L, D = state_size, num_layers, 2 if bidirectional else 1
    weights = split_params(parameters, mode, I, H, L, D)
    h0 = np.zeros((L * D, N, H)) if state is None else np.asarray(state, np.float64)
    c0 = np.zeros((L * D, N, H)) if state_cell is None else np.asarray(state_cell, np.float64)
    hy, cy = np.zeros((L * D, N, H)), np.zeros((L * D, N, H))
    x = data
    for layer in range(L):
        y = np.zeros((T, N, D * H))
        for d in range(D):
            k = layer * D + d
            wx, wh, bx, bh = weights[k]
            for n in range(N):
                h, c = h0[k, n].copy(), c0[k, n].copy()
                for t in (range(T) if d == 0 else reversed(range(T))):
                    h, c = cell(mode, x[t, n], h, c, wx, wh, bx, bh)
                    y[t, n, d * H:(d + 1) * H] = h
                hy[k, n], cy[k, n] = h, c
        x = y
    return x, hy, (cy if mode == "lstm" else None)


def loss_reference(data, parameters, state, state_cell, heads, **kwargs):
    """sum(out*dout) + sum(hy*dhy) + sum(cy*dcy), terms with a None head dropped."""
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
