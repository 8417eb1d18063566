# The whole-model step's routed experts (src/engine/kernels/step/moe.rs, moe_mm.rs, moe.cuh) emulated in
# float64: the kernels' index logic and every cuBLAS call with its column-major transposes, sizes
# and leading dimensions, checked against finite differences of the plain math (numpy only:
# `python3 scripts/moe_step_emulation.py`). Keep it in step with those files when their layouts change.
import numpy as np
rng = np.random.default_rng(0)
n, c, E, k, I = 10, 16, 5, 2, 8
coef = 0.3
ldx = c + 8  # a wider input stride (LoRA concat), the x part first
X = rng.normal(size=(n, ldx))
Wr = rng.normal(size=(E, c)) * 0.5
Wgu = rng.normal(size=(E, 2 * I, c)) * 0.3
Wd = rng.normal(size=(E, c, I)) * 0.3
DY = rng.normal(size=(n, c))
sc = 0.7  # scale owed to dy

def silu(v): return v / (1 + np.exp(-v))

def plain_loss(X, Wr, Wgu, Wd):
    x = X[:, :c]
    logits = x @ Wr.T
    out = np.zeros((n, c))
    cnt = np.zeros(E); psum = np.zeros(E)
    for r in range(n):
        l = logits[r]
        order = sorted(range(E), key=lambda e: (-l[e], e))[:k]
        p = np.exp(l - l.max()); p /= p.sum(); psum += p
        wl = np.exp(l[order] - l[order].max()); wl /= wl.sum()
        for s, e in enumerate(order):
            cnt[e] += 1
            h = Wgu[e] @ x[r]
            a = silu(h[:I]) * h[I:]
            out[r] += wl[s] * (Wd[e] @ a)
    aux = E / n**2 * (cnt * psum).sum()
    return sc * (DY * out).sum() + coef * aux, out

# --- cuBLAS emulation: column-major C = alpha op(A) op(B) + beta C on flat buffers ---
def gemm(buf, ta, tb, m, nn, kk, A, lda, B, ldb, C, ldc, alpha, beta):
    a = buf[A[0]]; b = buf[B[0]]; cbuf = buf[C[0]]
    ao, bo, co = A[1], B[1], C[1]
    opA = np.empty((m, kk)); opB = np.empty((kk, nn))
    for i in range(m):
        for j in range(kk):
            opA[i, j] = a[ao + (j + i * lda if ta else i + j * lda)]
    for i in range(kk):
        for j in range(nn):
            opB[i, j] = b[bo + (j + i * ldb if tb else i + j * ldb)]
    R = opA @ opB
    for i in range(m):
        for j in range(nn):
            idx = co + i + j * ldc
            cbuf[idx] = alpha * R[i, j] + beta * cbuf[idx]

def step(X, Wr, Wgu, Wd):
    P = n * k
    buf = {
        'x': X.flatten().copy(), 'wr': Wr.flatten().copy(), 'wgu': Wgu.flatten().copy(),
        'wd': Wd.flatten().copy(), 'dy': DY.flatten().copy(),
        'logits': np.zeros(n * E), 'gu': np.zeros(P * 2 * I), 'xs': np.zeros(P * c),
        'ys': np.zeros(P * c), 'act': np.zeros(P * I), 'du': np.zeros(P * I),
        'dgu': np.zeros(P * 2 * I), 'dlogits': np.zeros(n * E), 'out': np.zeros(n * c),
        'da': np.zeros(n * ldx), 'gwr': np.zeros(E * c), 'ggu': np.zeros(E * 2 * I * c),
        'gwd': np.zeros(E * c * I),
    }
    # router: (true,false), (E, n, c), a = router ld c, b = x ld ldx, c = logits ld E
    gemm(buf, True, False, E, n, c, ('wr', 0), c, ('x', 0), ldx, ('logits', 0), E, 1, 0)
    L = buf['logits'].reshape(n, E)
    topi = np.zeros(n * k, int); topw = np.zeros(n * k); counts = np.zeros(E, int); psum = np.zeros(E)
    for r in range(n):  # moe_route
        v = L[r]; mx = v.max(); p = np.exp(v - mx); p /= p.sum(); psum += p
        taken = set(); chosen = []
        for t in range(k):
            best = None
            for e in range(E):
                if e in taken: continue
                if best is None or v[e] > v[best] or (v[e] == v[best] and e < best): best = e
            taken.add(best); chosen.append(best)
        top = v[chosen[0]]
        w = np.exp(np.array([v[e] for e in chosen]) - top); w /= w.sum()
        for t, e in enumerate(chosen):
            topi[r * k + t] = e; topw[r * k + t] = w[t]; counts[e] += 1
    perm = np.zeros(P, int); pos = np.zeros(n * k, int)
    for e in range(E):  # moe_sort
        base = counts[:e].sum(); at = base
        for q in range(n * k):
            if topi[q] == e:
                perm[at] = q; pos[q] = at; at += 1
    def gather(src, lds, dst, scale):
        for p in range(P):
            row = perm[p] // k
            buf[dst][p * c:(p + 1) * c] = scale * buf[src][row * lds:row * lds + c]
    def per_expert(f):
        off = 0
        for j in range(E):
            cnt = counts[j]
            if cnt > 0: f(j, off, cnt)
            off += cnt
    gather('x', ldx, 'xs', 1.0)
    per_expert(lambda j, off, cnt: gemm(buf, True, False, 2 * I, cnt, c, ('wgu', j * 2 * I * c), c,
                                         ('xs', off * c), c, ('gu', off * 2 * I), 2 * I, 1, 0))
    gu = buf['gu'].reshape(P, 2 * I)
    buf['act'][:] = (silu(gu[:, :I]) * gu[:, I:]).flatten()
    per_expert(lambda j, off, cnt: gemm(buf, True, False, c, cnt, I, ('wd', j * c * I), I,
                                         ('act', off * I), I, ('ys', off * c), c, 1, 0))
    def combine(outk, ldo, y, w):
        for r in range(n):
            acc = buf[outk][r * ldo:r * ldo + c].copy()
            for s in range(k):
                q = r * k + s
                acc += (w[q] if w is not None else 1.0) * buf[y][pos[q] * c:(pos[q] + 1) * c]
            buf[outk][r * ldo:r * ldo + c] = acc
    combine('out', c, 'ys', topw)
    out = buf['out'].reshape(n, c).copy()
    # aux grad factor (g_mean = 1 here), r = n rows, one layer
    aux = coef * E / n**2 * (counts * psum).sum()
    auxg = coef * (E / n**2) * counts
    # backward
    gather('dy', c, 'ys', sc)
    per_expert(lambda j, off, cnt: gemm(buf, False, False, I, cnt, c, ('wd', j * c * I), I,
                                         ('ys', off * c), c, ('du', off * I), I, 1, 0))
    dw = np.zeros(n * k)
    for p in range(P):  # moe_pair_bwd (trains_down)
        q = perm[p]; w = topw[q]
        g = gu[p]
        a = silu(g[:I]) * g[I:]
        u = buf['du'][p * I:(p + 1) * I].copy()
        dw[q] = (a * u).sum()
        buf['du'][p * I:(p + 1) * I] = w * u
        buf['act'][p * I:(p + 1) * I] = a
        buf['ys'][p * c:(p + 1) * c] *= w
    per_expert(lambda j, off, cnt: gemm(buf, False, True, I, c, cnt, ('act', off * I), I,
                                         ('ys', off * c), c, ('gwd', j * c * I), I, 1, 1))
    # swiglu backward
    du = buf['du'].reshape(P, I)
    gg, uu = gu[:, :I], gu[:, I:]
    sg = 1 / (1 + np.exp(-gg))
    dg = du * uu * sg * (1 + gg * (1 - sg)); dup = du * gg * sg
    buf['dgu'][:] = np.concatenate([dg, dup], axis=1).flatten()
    gather('x', ldx, 'xs', 1.0)
    per_expert(lambda j, off, cnt: gemm(buf, False, True, c, 2 * I, cnt, ('xs', off * c), c,
                                         ('dgu', off * 2 * I), 2 * I, ('ggu', j * 2 * I * c), c, 1, 1))
    per_expert(lambda j, off, cnt: gemm(buf, False, False, c, cnt, 2 * I, ('wgu', j * 2 * I * c), c,
                                         ('dgu', off * 2 * I), 2 * I, ('xs', off * c), c, 1, 0))
    combine('da', ldx, 'xs', None)
    for r in range(n):  # moe_router_bwd
        wt = topw[r * k:(r + 1) * k]; dt = dw[r * k:(r + 1) * k]
        m = (wt * dt).sum(); mine = wt * (dt - m)
        v = L[r]; pp = np.exp(v - v.max()); pp /= pp.sum()
        pg = (pp * auxg).sum()
        gl = pp * (auxg - pg)
        for t in range(k): gl[topi[r * k + t]] += mine[t]
        buf['dlogits'][r * E:(r + 1) * E] = gl
    gemm(buf, False, False, c, n, E, ('wr', 0), c, ('dlogits', 0), E, ('da', 0), ldx, 1, 1)
    gemm(buf, False, True, c, E, n, ('x', 0), ldx, ('dlogits', 0), E, ('gwr', 0), c, 1, 1)
    grads = dict(x=buf['da'].reshape(n, ldx), wr=buf['gwr'].reshape(E, c),
                 wgu=buf['ggu'].reshape(E, 2 * I, c), wd=buf['gwd'].reshape(E, c, I))
    return out, aux, grads

out, aux, grads = step(X, Wr, Wgu, Wd)
Lp, out_ref = plain_loss(X, Wr, Wgu, Wd)
print("forward max err", np.abs(out - out_ref).max())
print("loss", sc * (DY * out).sum() + aux, "ref", Lp)
def numgrad(name, arr):
    g = np.zeros_like(arr); eps = 1e-6
    it = np.nditer(arr, flags=['multi_index'])
    for _ in it:
        idx = it.multi_index
        old = arr[idx]
        arr[idx] = old + eps; lp = plain_loss(X, Wr, Wgu, Wd)[0]
        arr[idx] = old - eps; lm = plain_loss(X, Wr, Wgu, Wd)[0]
        arr[idx] = old; g[idx] = (lp - lm) / (2 * eps)
    return g
for name, arr in [('x', X), ('wr', Wr), ('wgu', Wgu), ('wd', Wd)]:
    ng = numgrad(name, arr)
    got = grads[name]
    if name == 'x':
        print("x tail (past c) untouched:", np.abs(got[:, c:]).max())
        ng, got = ng[:, :c], got[:, :c]
    print(name, "max rel err", np.abs(got - ng).max() / np.abs(ng).max())
