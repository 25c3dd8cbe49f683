"""Map families for SFA's q/k (post-RoPE), fitted per layer on captured training windows.

Shapes: q [N, Hq, T, D] grouped as [N, G, r, T, D] (G KV heads, r query heads each), k, v [N, G, T, D].
A method turns (q, k) into sparse mapped (qs [N,G,r,T,m], ks [N,G,T,m]), an optional exact per-key bias
[N,G,r,1,T] (already divided by sqrt(D)) and an optional per-query-head logit scale alpha [G, r]."""
import math, torch, torch.nn.functional as F

D = 64


def grp(q, G=3):
    return q.unflatten(1, (G, q.shape[1] // G))


def topk_mask(x, k, w):
    """Hard 0/1 mask of the top-k of |x| * w along the last dim (no grad)."""
    with torch.no_grad():
        idx = (x.abs() * w).topk(k, dim=-1).indices
        return torch.zeros_like(x).scatter_(-1, idx, 1.0)


def soft_mask(x, k, w, temp):
    """Straight-through-on-values plus a soft gate: forward = hard mask, backward through
    sigmoid((|x| w - tau) / (temp * scale)), tau between the k-th and (k+1)-th ranked value."""
    r = x.abs() * w
    with torch.no_grad():
        top = r.topk(k + 1, dim=-1).values
        tau = (top[..., k - 1:k] + top[..., k:k + 1]) / 2
        scale = top[..., :1].clamp_min(1e-6)
    g = torch.sigmoid((r - tau) / (temp * scale))
    hard = (r >= tau).float()
    return hard + g - g.detach()


def pca_map(Cq, Ck):
    joint = Ck / Ck.diagonal(dim1=-2, dim2=-1).sum(-1)[:, None, None] + Cq / Cq.diagonal(dim1=-2, dim2=-1).sum(-1)[:, None, None]
    return torch.linalg.eigh(joint.double()).eigenvectors.flip(-1).float()


def sqrtm(C, inv=False):
    e, U = torch.linalg.eigh(C.double())
    e = e.clamp_min(1e-10 * e.max())
    p = -0.5 if inv else 0.5
    return (U * e[..., None, :] ** p) @ U.transpose(-1, -2)


def balanced_map(Cq, Ck):
    """W with W^T C_q W = W^-1 C_k W^-T = Sigma (diagonal, decreasing): q' = q W, k' = k W^-T."""
    Cqh, Cqih = sqrtm(Cq), sqrtm(Cq, inv=True)
    P = Cqh @ Ck.double() @ Cqh
    e, U = torch.linalg.eigh(P)
    e, U = e.flip(-1).clamp_min(1e-20), U.flip(-1)
    W = Cqih @ U * e[..., None, :] ** 0.25  # Sigma^{1/2} = e^{1/4}
    return W.float()


class Method:
    """Fixed linear maps A (queries) and B (keys) [G, D, m], importance selection, optional centering/bias/alpha."""

    def __init__(self, k=16, center_k=False, center_q=False):
        self.k, self.center_k, self.center_q = k, center_k, center_q
        self.A = self.B = None
        self.alpha = None

    def prep(self, q, k):
        """(q grouped [N,G,r,T,D] possibly centered, k possibly centered, bias or None)."""
        qg = grp(q)
        bias = None
        if self.center_k:
            k = k - self.nu[None, :, None, :]
        if self.center_q:
            mu = self.mu[None, :, :, None, :]
            bias = torch.einsum("ngtd,grd->ngrt", k, self.mu)[:, :, :, None, :] / math.sqrt(D)
            qg = qg - mu
        return qg, k, bias

    def fit_stats(self, q, k):
        qg = grp(q)
        self.nu = k.mean((0, 2)) if self.center_k else None           # [G, D]
        self.mu = qg.mean((0, 3)) if self.center_q else None           # [G, r, D]
        qc, kc, _ = self.prep(q, k)
        Cq = torch.einsum("ngrtd,ngrte->gde", qc, qc) / (qc.shape[0] * qc.shape[2] * qc.shape[3])
        Ck = torch.einsum("ngtd,ngte->gde", kc, kc) / (kc.shape[0] * kc.shape[2])
        return Cq, Ck

    def set_weights(self, q, k):
        """Importance weights from training data in the mapped basis: queries rank by keys' rms, keys by queries'."""
        with torch.no_grad():
            qc, kc, _ = self.prep(q, k)
            qm = torch.einsum("ngrtd,gdm->ngrtm", qc, self.A)
            km = torch.einsum("ngtd,gdm->ngtm", kc, self.B)
            self.wq = km.pow(2).mean((0, 2)).sqrt()                    # [G, m]: weights for queries
            self.wk = qm.pow(2).mean((0, 2, 3)).sqrt()                 # [G, m]: weights for keys

    def transform(self, q, k, A=None, B=None, sel=None):
        A = self.A if A is None else A
        B = self.B if B is None else B
        qc, kc, bias = self.prep(q, k)
        qm = torch.einsum("ngrtd,gdm->ngrtm", qc, A)
        km = torch.einsum("ngtd,gdm->ngtm", kc, B)
        if sel is None:
            mq, mk = topk_mask(qm, self.k, self.wq[None, :, None, None]), topk_mask(km, self.k, self.wk[None, :, None])
        else:
            mq, mk = sel(qm, self.wq[None, :, None, None]), sel(km, self.wk[None, :, None])
        return qm * mq, km * mk, bias


def attn(qs, ks, v, bias=None, alpha=None, rows=None):
    """Causal attention output [N,G,r,Tq,D] from sparse mapped q (rows: query positions, or all) and k."""
    T = ks.shape[-2]
    logits = torch.einsum("ngrtm,ngsm->ngrts", qs, ks) / math.sqrt(D)
    if alpha is not None:
        logits = logits * alpha[None, :, :, None, None]
    if bias is not None:
        logits = logits + bias
    pos = torch.arange(T) if rows is None else rows
    mask = torch.arange(T)[None, :] > pos[:, None]
    logits = logits.masked_fill(mask, float("-inf"))
    return torch.einsum("ngrts,ngsd->ngrtd", logits.softmax(-1), v)


def dense_out(q, k, v, rows=None):
    qg = grp(q)
    if rows is not None:
        qg = qg[:, :, :, rows]
    T = k.shape[-2]
    logits = torch.einsum("ngrtd,ngsd->ngrts", qg, k) / math.sqrt(D)
    pos = torch.arange(T) if rows is None else rows
    logits = logits.masked_fill(torch.arange(T)[None, :] > pos[:, None], float("-inf"))
    return torch.einsum("ngrts,ngsd->ngrtd", logits.softmax(-1), v)
