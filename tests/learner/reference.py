"""Float64 numpy references for the learner kernels, written as plain loops (independent of the
jax implementations)."""

import numpy as np


def shift(x):
    x = np.asarray(x, np.float64)
    out = np.zeros_like(x)
    out[..., :-1] = x[..., 1:]
    return out


def gae(rewards, values, mask, gamma, lam, bootstrap=None):
    B, T = rewards.shape
    adv = np.zeros((B, T))
    for b in range(B):
        a = 0.0
        nv = 0.0 if bootstrap is None else float(bootstrap[b])
        for t in reversed(range(T - 1)):
            if mask[b, t]:
                a = rewards[b, t] + gamma * nv - values[b, t] + gamma * lam * a
                nv = values[b, t]
            adv[b, t] = a
    return adv, adv + values


def normalize(x, mask, group_ids, mean_level, std_level, unbiased=True, eps=1e-5):
    x = np.asarray(x, np.float64)
    m = np.asarray(mask) > 0
    B = x.shape[0]
    groups = {}
    for b in range(B):
        groups.setdefault(int(group_ids[b]) if group_ids is not None else 0, []).append(b)

    def rows_of(level, b):
        if level == "batch":
            return list(range(B))
        return groups[int(group_ids[b])]

    out = np.zeros_like(x)
    for b in range(B):
        if mean_level is None:
            mean = 0.0
        else:
            vals = np.concatenate([x[r][m[r]] for r in rows_of(mean_level, b)])
            mean = vals.mean() if vals.size else 0.0
        if std_level is None:
            std, e = 1.0, 0.0
        else:
            rows = rows_of(std_level, b)
            centered = []
            for r in rows:
                if mean_level is None:
                    mr = 0.0
                else:
                    vr = np.concatenate([x[q][m[q]] for q in rows_of(mean_level, r)])
                    mr = vr.mean() if vr.size else 0.0
                centered.append(x[r][m[r]] - mr)
            c = np.concatenate(centered)
            n = c.size
            single_row = std_level == "group" and unbiased and len(rows) == 1
            if n <= 1 or single_row:
                std = 1.0
            else:
                std = np.sqrt((c ** 2).sum() / (n - (1 if unbiased else 0)))
            e = eps
        out[b] = np.where(m[b], (x[b] - mean) / (std + e), 0.0)
    return out


def shape(A, p, mask, mode, negative_scale=0.2, zero_penalty=0.4, zero_eps=1e-6):
    A = np.asarray(A, np.float64).copy()
    out = A.copy()
    for idx in np.ndindex(A.shape):
        a, q = A[idx], p[idx]
        if mode == "additive":
            out[idx] = a + q
        elif not mask[idx]:
            continue
        elif mode == "gvpo":
            if q < 0:
                if a < -zero_eps:
                    out[idx] = (1 + negative_scale) * a
                elif a > zero_eps:
                    out[idx] = 0.0
                else:
                    out[idx] = -zero_penalty
        else:
            out[idx] = a * q if a >= 0 else (q if q > 0 else a)
    return out


def behaviour_weights(prox, behave, mask, cap, mode):
    m = np.asarray(mask) > 0
    w = np.where(m, np.exp(prox - behave), 0.0)
    if cap is None:
        return w
    if mode == "truncate":
        return np.minimum(w, cap)
    if mode == "mask":
        return np.where(w > cap, 0.0, w)
    seq = np.array([np.prod(w[b][m[b]]) for b in range(w.shape[0])])  # mask_sequence
    return np.where((seq > cap)[:, None], 0.0, w)


def policy_loss(logp, old, A, mask, eps_clip, eps_hi, c_clip, agg, weights=None):
    m = np.asarray(mask) > 0
    hi = eps_clip if eps_hi is None else eps_hi
    ratio = np.where(m, np.exp(logp - old), 0.0)
    pg = np.maximum(-A * ratio, -A * np.clip(ratio, 1 - eps_clip, 1 + hi))
    if c_clip is not None:
        pg = np.minimum(pg, c_clip * np.abs(A))
    pg = np.where(m, pg, 0.0)
    if weights is not None:
        pg = pg * weights
    if agg == "token-mean":
        return pg.sum() / max(m.sum(), 1)
    per_row = []
    for b in range(pg.shape[0]):
        if m[b].any():
            per_row.append(pg[b].sum() / (m[b].sum() if agg == "seq-mean-token-mean" else 1))
    return float(np.mean(per_row)) if per_row else 0.0


def kl(logp, ref, estimator):
    d = np.asarray(logp, np.float64) - np.asarray(ref, np.float64)
    k = {"k1": d, "k2": 0.5 * d * d, "k3": np.exp(-d) - 1 + d}[estimator]
    return np.clip(k, -10, 10)
