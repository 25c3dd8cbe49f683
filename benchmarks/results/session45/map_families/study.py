"""Fidelity study: per layer, relative error of the attention output of SFA under several map families against dense,
on held-out windows. Maps fitted/learned on training windows. Usage: study.py METHODS LAYERS STEPS OUT.json"""
import sys, time, json, math, torch
sys.path.insert(0, "/tmp/overcomplete")
from maps import *

torch.set_num_threads(2)
torch.manual_seed(0)
ROWS = 128


def rel_err(method, q, k, v, alpha=None):
    """mean over windows and query heads of ||o_s - o_d||_F / ||o_d||_F (over all T tokens and D)."""
    errs = []
    for n in range(q.shape[0]):
        qs, ks, bias = method.transform(q[n:n + 1], k[n:n + 1])
        o = attn(qs, ks, v[n:n + 1], bias, alpha)
        od = dense_out(q[n:n + 1], k[n:n + 1], v[n:n + 1])
        errs.append(((o - od).flatten(-2).norm(dim=-1) / od.flatten(-2).norm(dim=-1)).flatten())
    return torch.cat(errs).mean().item()


def learn(method, params, make_AB, q, k, v, steps, lr=3e-3, rows_per=None, soft_until=0.6, temp=0.3, alpha=None):
    """Adam on params; loss = mean over (window, head) of ||o_s - o_d||^2 / ||o_d||^2 on random query rows.
    Selection: forward hard top-k; backward through a soft gate for the first soft_until of steps, then pure ST."""
    opt = torch.optim.Adam(params, lr=lr)
    T = q.shape[2]
    rows_per = rows_per or ROWS
    qa, ka, va = q, k, v
    for step in range(steps):
        if step % 10 == 0:
            with torch.no_grad():
                method.A, method.B = [t.detach() for t in make_AB()]
                method.set_weights(qa, ka)
        rows = torch.randperm(T)[:rows_per].sort().values
        if qa.shape[0] > 8:  # more windows than a step takes: 8 at random
            pick = torch.randperm(qa.shape[0])[:8]
            q, k, v = qa[pick], ka[pick], va[pick]
        with torch.no_grad():
            od = dense_out(q, k, v, rows)
        A, B = make_AB()
        soft = step < soft_until * steps
        sel = (lambda x, w: soft_mask(x, method.k, w, temp)) if soft else None
        qs, ks, bias = method.transform(q[:, :, rows], k, A, B, sel)
        if bias is not None:
            bias = bias  # [N,G,r,1,T]: per key, same for all rows
        o = attn(qs, ks, v, bias, alpha, rows)
        loss = ((o - od).pow(2).sum((-1, -2)) / od.pow(2).sum((-1, -2))).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"    step {step} loss {loss.item():.4f}", flush=True)
    with torch.no_grad():
        method.A, method.B = [t.detach() for t in make_AB()]
        method.set_weights(qa, ka)


def build(name, q, k, v, steps):
    """Fit method `name` on training (q, k, v); returns (method, alpha or None)."""
    parts = name.split("-")
    kk = int(parts[-1][1:])
    family = parts[0]
    ck = "ck" in parts or "cqk" in parts
    cq = "cqk" in parts
    m = Method(kk, center_k=ck, center_q=cq)
    Cq, Ck = m.fit_stats(q, k)
    alpha = None
    if family in ("pca", "pcamag", "id"):
        M = pca_map(Cq, Ck) if family != "id" else torch.eye(D).repeat(3, 1, 1)
        m.A = m.B = M
        m.set_weights(q, k)
        if family == "pcamag":
            m.wq, m.wk = torch.ones_like(m.wq), torch.ones_like(m.wk)
    elif family == "bal":
        W = balanced_map(Cq, Ck)
        m.A, m.B = W, torch.linalg.inv(W).transpose(-1, -2)
        m.set_weights(q, k)
    elif family in ("learnB", "learnBpca"):  # square, B = A^-T
        W0 = balanced_map(Cq, Ck) if family == "learnB" else pca_map(Cq, Ck)
        delta = torch.zeros(3, D, D, requires_grad=True)

        def make_AB():
            A = W0 @ (torch.eye(D) + delta)
            return A, torch.linalg.inv(A).transpose(-1, -2)
        learn(m, [delta], make_AB, q, k, v, steps)
    elif family == "learnS":  # control: one shared square map for q and k (what the library's fine-tune trains), PCA start
        W0 = pca_map(Cq, Ck)
        delta = torch.zeros(3, D, D, requires_grad=True)

        def make_AB():
            A = W0 @ (torch.eye(D) + delta)
            return A, A
        learn(m, [delta], make_AB, q, k, v, steps)
    elif family.startswith("learnC"):  # overcomplete D -> mdim, A and B independent
        mdim = int(family[6:])
        W0 = balanced_map(Cq, Ck)
        Wi = torch.linalg.inv(W0).transpose(-1, -2)
        g = torch.Generator().manual_seed(1)
        R = torch.randn(3, D, mdim - D, generator=g) / math.sqrt(D)
        # extra atoms: random directions in the balanced basis, scaled like the smaller balanced axes
        s = torch.linalg.norm(W0, dim=1).median(dim=-1).values[:, None, None]
        si = torch.linalg.norm(Wi, dim=1).median(dim=-1).values[:, None, None]
        A = torch.cat([W0, 0.5 * s * R * math.sqrt(D) / math.sqrt(D)], -1).clone().requires_grad_(True)
        B = torch.cat([Wi, 0.5 * si * R], -1).clone().requires_grad_(True)
        learn(m, [A, B], lambda: (A, B), q, k, v, steps, lr=1e-3 * float(s.mean()) * 8)
    else:
        raise ValueError(name)
    if "alpha" in parts:  # per-query-head logit scale, learned on top of the fixed map
        la = torch.zeros(3, 3, requires_grad=True)
        opt = torch.optim.Adam([la], lr=0.03)
        T = q.shape[2]
        for step in range(60):
            rows = torch.randperm(T)[:128].sort().values
            with torch.no_grad():
                od = dense_out(q, k, v, rows)
                qs, ks, bias = m.transform(q[:, :, rows], k)
            o = attn(qs, ks, v, bias, la.exp(), rows)
            loss = ((o - od).pow(2).sum((-1, -2)) / od.pow(2).sum((-1, -2))).mean()
            opt.zero_grad(); loss.backward(); opt.step()
        alpha = la.detach().exp()
        print("    alpha", [round(a, 3) for a in alpha.flatten().tolist()])
    return m, alpha


def main():
    methods, layers, steps, out = sys.argv[1].split(","), [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3]), sys.argv[4]
    data = torch.load("/tmp/overcomplete/cap.pt")
    results = {}
    try:
        results = json.load(open(out))
    except FileNotFoundError:
        pass
    for layer in layers:
        qt, kt, vt = data["train"][layer]
        qh, kh, vh = data["held"][layer]
        for name in methods:
            t = time.time()
            m, alpha = build(name, qt, kt, vt, steps)
            r = {"held": rel_err(m, qh, kh, vh, alpha), "train": rel_err(m, qt[:2], kt[:2], vt[:2], alpha),
                 "seconds": round(time.time() - t, 1)}
            results.setdefault(name, {})[str(layer)] = r
            print(f"layer {layer} {name}: held {r['held']:.4f} train(2 win) {r['train']:.4f} ({r['seconds']} s)", flush=True)
            json.dump(results, open(out, "w"), indent=1)
            if name.startswith("learn"):
                torch.save({"A": m.A, "B": m.B}, f"/tmp/overcomplete/maps_{name}_L{layer}.pt")


if __name__ == "__main__":
    main()
