"""Full-ranking counts: how many catalogue items score at least as high as each user's target.

`rank_targets` is the reference: float32 scores of the catalogue in chunks. `BoundedRanker`
returns the same ranks, bit for bit, from bfloat16 matrix units: an approximate score with a
proven error bound settles almost every item, and the few it cannot are rescored with the
reference's own float32 arithmetic. `make_ranker` picks one (eval.precision); docs/training.md
has the argument.
"""

import logging
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)

BLOCK = 64  # items per counted block: 16 int64 words of four int16 classes
MID = 512.0  # a band score lands on this bf16 value: ulp 2 below it, 4 above
MID_BITS, BELOW_BITS, ABOVE_BITS = 0x4400, 0x43FF, 0x4401  # 512 and its two bf16 neighbours
FAST_CHUNK = 4096  # items per bf16 product (a multiple of eval.item_chunk near this): z is batch x this
PENDING = 1 << 16  # band pairs rescored together
_U32 = 2.0**-24


def _by_chunk(rows: torch.Tensor, items: torch.Tensor, chunk: int, num_chunks: int):
    """(rows, items) sorted by the catalogue chunk of each item, and each chunk's bounds."""
    key = torch.div(items - 1, chunk, rounding_mode="floor")
    order = torch.argsort(key, stable=True)
    key = key[order]
    bounds = torch.searchsorted(key, torch.arange(num_chunks + 1, device=key.device)).tolist()
    return rows[order], items[order], order, bounds


def rank_targets(
    model,
    h: torch.Tensor,
    target: torch.Tensor,
    negatives: torch.Tensor,
    history: tuple[torch.Tensor, torch.Tensor] | None,
    num_items: int,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """0-based ranks of each row's target: (full ranking, sampled protocol).

    Streams the catalogue in chunks of `chunk` items: memory is [B, chunk] scores, never
    [B, num_items]. Full rank = items scoring >= the target (ties count against it) among
    the items not excluded: the target itself and, given `history` = (row, item) pairs, the
    items of each row's input. Sampled rank = negatives scoring >= the target; their scores
    come from the same chunk matmul (negatives are never history items).
    """
    B, dev = len(target), target.device
    t_score = model.scores(h, target).diagonal()[:, None]  # [B, 1]
    num_chunks = -(-num_items // chunk)
    rows, items = _excluded(target, history)
    ex_rows, ex_items, _, ex_bounds = _by_chunk(rows, items, chunk, num_chunks)
    neg_rows = torch.arange(B, device=dev).repeat_interleave(negatives.shape[1])
    ng_rows, ng_items, ng_order, ng_bounds = _by_chunk(neg_rows, negatives.reshape(-1), chunk, num_chunks)
    neg_scores = t_score.new_empty(negatives.numel())
    full = torch.zeros(B, dtype=torch.int64, device=dev)
    above = torch.empty(B, min(chunk, num_items), dtype=torch.bool, device=dev)  # reused: no allocation per chunk
    for c in range(num_chunks):
        lo = 1 + c * chunk
        scores = model.scores(h, torch.arange(lo, min(lo + chunk, num_items + 1), device=dev))  # [B, C]
        a, b = ng_bounds[c], ng_bounds[c + 1]
        neg_scores[ng_order[a:b]] = scores[ng_rows[a:b], ng_items[a:b] - lo]
        a, b = ex_bounds[c], ex_bounds[c + 1]
        scores[ex_rows[a:b], ex_items[a:b] - lo] = float("-inf")
        full += torch.ge(scores, t_score, out=above[:, : scores.shape[1]]).sum(1)
    sampled = (neg_scores.view_as(negatives) >= t_score).sum(1)
    return full, sampled


def _excluded(
    target: torch.Tensor, history: tuple[torch.Tensor, torch.Tensor] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, item) pairs left out of the full ranking: each row's target and its history."""
    rows = torch.arange(len(target), device=target.device)
    if history is None:
        return rows, target
    return torch.cat([history[0], rows]), torch.cat([history[1], target])


# --- float32 dot products exactly as a BLAS kernel that chains fused multiply-adds computes them


def fma_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise a[i] . b[i] in float32 as c = fma(a[i,k], b[i,k], c) for k = 0, 1, ...: [P].

    That is what MKL's sgemm computes per element for the shapes `chain_verified` accepts.
    Each step runs in float64 (the product is exact there) and rounds to float32; the rare
    step whose float64 sum lands on a float32 rounding boundary is redone by `_fma_dot_odd`.
    """
    A, Bt = a.double().T.contiguous(), b.double().T.contiguous()
    c = torch.zeros(a.shape[0], dtype=torch.float64, device=a.device)
    suspect = torch.zeros(a.shape[0], dtype=torch.bool, device=a.device)
    low = torch.empty(a.shape[0], dtype=torch.int64, device=a.device)
    for k in range(a.shape[1]):
        s = torch.addcmul(c, A[k], Bt[k])
        # a float32 midpoint has exactly bit 28 set in the 29 bits float64 has beyond float32
        torch.bitwise_and(s.view(torch.int64), (1 << 29) - 1, out=low)
        suspect |= low == 1 << 28
        suspect |= (s.abs() < 2.0**-126) & (s != 0)  # float32 subnormals round on another grid
        c = s.float().double()
    out = c.float()
    if bool(suspect.any()):
        out[suspect] = _fma_dot_odd(A[:, suspect], Bt[:, suspect])
    return out


def _fma_dot_odd(A: torch.Tensor, Bt: torch.Tensor) -> torch.Tensor:
    """fma_dot of columns A, Bt [d, P] (float64) with each sum rounded to odd in float64 before
    float32: round-to-odd at 53 bits then to nearest at 24 is the correctly rounded fma."""
    c = torch.zeros(A.shape[1], dtype=torch.float64, device=A.device)
    for k in range(A.shape[0]):
        p = A[k] * Bt[k]
        s = c + p
        bb = s - c
        err = (c - (s - bb)) + (p - bb)  # two-sum: s + err == c + p exactly
        bits = s.view(torch.int64)
        fix = (err != 0) & ((bits & 1) == 0)
        step = torch.where((err > 0) == (s > 0), 1, -1)  # toward the exact sum, in magnitude
        c = torch.where(fix, bits + step, bits).view(torch.float64).float().double()
    return c.float()


_CHAIN: dict[tuple, bool] = {}


def _probe_data(rows: int, cols: int, dim: int, device: torch.device):
    g = torch.Generator().manual_seed(rows * 7919 + cols * 31 + dim)
    q = torch.randn(rows, dim, generator=g) * torch.rand(rows, 1, generator=g) * 4
    e = torch.randn(cols, dim, generator=g) * torch.rand(cols, 1, generator=g)
    return q.to(device), e.to(device), g


def chain_verified(rows: int, cols: int, dim: int, device: torch.device) -> bool:
    """Whether torch's float32 `[rows, dim] @ [dim, cols]` equals `fma_dot` element by element,
    checked once per shape (and thread count) on seeded data; gemv-like shapes are not."""
    key = (rows, cols, dim, torch.get_num_threads(), device.type)
    if key not in _CHAIN:
        q, e, g = _probe_data(rows, cols, dim, device)
        ref = q @ e.T
        # every row against the first and last columns, those around where threads may split the
        # columns and some others; every column against the first and last rows
        edges = [torch.arange(max(cols * k // 4 - 8, 0), min(cols * k // 4 + 8, cols)) for k in (1, 2, 3)]
        cs = torch.cat([torch.arange(min(cols, 24)), torch.arange(max(cols - 24, 0), cols), *edges])
        cs = torch.unique(torch.cat([cs, torch.randint(0, cols, (16,), generator=g)])).to(device)
        rs = torch.unique(torch.cat([torch.arange(min(rows, 4)), torch.arange(max(rows - 4, 0), rows)])).to(device)
        r = torch.cat([torch.arange(rows, device=device).repeat_interleave(len(cs)), rs.repeat_interleave(cols)])
        c = torch.cat([cs.repeat(rows), torch.arange(cols, device=device).repeat(len(rs))])
        _CHAIN[key] = bool(torch.equal(fma_dot(q[r], e[c]), ref[r, c]))
        if not _CHAIN[key]:
            log.info("float32 [%d, %d] x [%d, %d] is not a plain fma chain here", rows, dim, dim, cols)
    return _CHAIN[key]


def _bmm_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise dot products as diagonals of [16, d] x [d, 16] products: 16x the work, GEMM's own
    arithmetic (float32 sgemm), at a fraction of fma_dot's cost."""
    P, d = a.shape
    pad = -P % 16
    if pad:
        a, b = torch.cat([a, a.new_zeros(pad, d)]), torch.cat([b, b.new_zeros(pad, d)])
    out = torch.bmm(a.view(-1, 16, d), b.view(-1, 16, d).transpose(1, 2))
    return out.diagonal(dim1=1, dim2=2).reshape(-1)[:P]


def exact_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Row-wise float32 dot products equal to `fma_dot`: blocked GEMM where that was checked to
    agree (once per dim and thread count), fma_dot itself otherwise."""
    key = ("bmm", a.shape[1], torch.get_num_threads(), a.device.type)
    if key not in _CHAIN:
        q, e, _ = _probe_data(4096, 4096, a.shape[1], a.device)
        _CHAIN[key] = bool(torch.equal(_bmm_dot(q, e), fma_dot(q, e)))
    return _bmm_dot(a, b) if _CHAIN[key] else fma_dot(a, b)


_BF16: dict[str, bool] = {}


def bf16_sound(device: torch.device) -> bool:
    """Whether bf16 matmul here accumulates in float32 and rounds its output to nearest: the two
    facts the error bound stands on, checked once per device type on values that tell."""
    if device.type not in _BF16:
        a = torch.tensor([[256.0] + [0.5] * 199, [512.0, 1.0, 1.0, 1.0] + [0.0] * 196], device=device)
        out = (a.bfloat16() @ torch.ones(200, 1, device=device).bfloat16()).float().flatten().tolist()
        _BF16[device.type] = out == [356.0, 516.0]  # bf16 sums would stay at 256; truncation gives 512
    return _BF16[device.type]


def fast_bf16(device: torch.device) -> bool:
    """bf16 matrix units: a CPU whose oneDNN runs bf16 natively (AVX512-BF16, AMX)."""
    return (
        device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


@dataclass
class _Rows:
    """A batch's left operand [Qh Qh Ql 512 tau1 tau2 tau3] (bf16) and its error terms."""

    q: torch.Tensor  # [B, d] float32: the model's side of the dot product
    t: torch.Tensor  # [B] float32: each target's reference score
    A: torch.Tensor  # [B, 3d + 4] bf16
    norms: torch.Tensor  # [B, 4] float64: ||Qh||, ||Ql||, ||Q - Qh - Ql||, ||Q|| with Q = lambda q
    fixed: torch.Tensor  # [B] float64: error of the threshold columns, per unit of the chunk scale


@dataclass
class _Pending:
    """Band pairs waiting for their exact float32 score: (row, item vector), full and sampled."""

    rows: list = field(default_factory=list)
    vecs: list = field(default_factory=list)
    slots: list = field(default_factory=list)  # per pair: -1 (full ranking) or the negative's slot
    size: int = 0

    def add(self, rows: torch.Tensor, vecs: torch.Tensor, slots: torch.Tensor) -> None:
        self.rows.append(rows)
        self.vecs.append(vecs)
        self.slots.append(slots)
        self.size += len(rows)


@dataclass
class _Worker:
    """One worker's buffers and tallies: it takes every n-th chunk of the catalogue."""

    z: torch.Tensor  # [B, padded] bf16: the chunk's z, then its classes
    right: torch.Tensor  # [padded, 3d + 4] bf16: the right operand
    scaled: torch.Tensor  # [padded, d] float32
    full: torch.Tensor | None = None  # [B] items surely or exactly >= the target
    pending: _Pending = field(default_factory=_Pending)
    band: int = 0  # band pairs of the full ranking rescored


class BoundedRanker:
    """`rank_targets`' ranks from bf16 products with a proven error bound (docs/training.md).

    Per row, z = f * lambda * (score - target score) + 512 comes out of one bf16 GEMM (split
    operands give ~16 bits); with the error below 1, z rounded to bf16 is 510 or less only
    for items below the target, 516 or more only above it, and exactly 512 for the band in
    between, which is rescored with the reference's own float32 arithmetic (`exact_dot`).
    """

    def __init__(self, model, num_items: int, item_chunk: int, chunk: int = FAST_CHUNK):
        self.model, self.num_items, self.item_chunk = model, num_items, item_chunk
        self.chunk = item_chunk * max(1, round(chunk / item_chunk))  # whole reference chunks
        self.padded = -(-self.chunk // BLOCK) * BLOCK
        self.num_chunks = -(-num_items // self.chunk)
        self.dim = model.item_emb.weight.shape[1]
        self.width = 3 * self.dim + 4
        self._gamma = {n: n * _U32 / (1 - n * _U32) for n in (self.dim, self.width)}
        # the error budget in units of z (at most 1, see above), less what the 512 column and
        # flushed subnormals (2^-50, generously) may add
        self.room = 0.9 - self._gamma[self.width] * MID - 2.0**-50
        self._stats: torch.Tensor | None = None
        self._workers: list[_Worker] = []
        self.counts = {"batches": 0, "plain_batches": 0, "band_pairs": 0, "pairs": 0}

    def _embed(self, c: int) -> torch.Tensor:
        """Fast chunk c's item vectors [C, d]: the reference's own, chunk by reference chunk (a
        view of the table when the model scores with a plain dot product)."""
        weight = self.model.item_emb.weight
        lo, hi = 1 + c * self.chunk, min(1 + (c + 1) * self.chunk, self.num_items + 1)
        if self.model.cfg.similarity == "dot":  # _embed_out is the table's rows, copied
            return weight[lo:hi]
        parts = [
            self.model._embed_out(torch.arange(a, min(a + self.item_chunk, hi), device=weight.device))
            for a in range(lo, hi, self.item_chunk)
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _chunk_stats(self) -> torch.Tensor:
        """[chunks, 4] float64: per fast chunk, max ||r|| + g (||eh|| + ||el||), max (||el|| + ||r||)
        + g ||eh||, max ||e||, gamma_d max ||e|| over its items, with e = eh + el + r the bf16
        split of an item vector: the item side of the error bound; one pass over the table."""
        if self._stats is None:
            g, gd = self._gamma[self.width], self._gamma[self.dim]

            def bounds(c: int) -> torch.Tensor:
                e = self._embed(c)
                eh = e.bfloat16().float()
                rest = e - eh  # exact in float32, and so is rest - el
                el = rest.bfloat16().float()
                ne, nh, nl, nr = (torch.linalg.vector_norm(v, dim=1) for v in (e, eh, el, rest.sub_(el)))
                return torch.stack([nr.max() + g * (nh.max() + nl.max()), (nl + nr).max() + g * nh.max(), ne.max()])

            stats = torch.stack(_in_threads(bounds, self.num_chunks, self._threads())).double()
            self._stats = torch.cat([stats, gd * stats[:, 2:]], dim=1) * (1 + 2.0**-10)  # float32 norms
        return self._stats

    def _threads(self) -> int:
        """Workers: one per torch thread on CPU, never more than chunks."""
        cpu = self.model.item_emb.weight.device.type == "cpu"
        return min(torch.get_num_threads(), self.num_chunks) if cpu else 1

    def _rows(self, h: torch.Tensor, target: torch.Tensor, stats: torch.Tensor) -> _Rows | None:
        """The batch's left operand, each row scaled by a power of two lambda that puts its error
        in a median chunk near the budget (chunks scale the rest); None when a value is out of
        range (the reference ranks the batch)."""
        q = self.model._hidden_out(h)
        t = self.model.scores(h, target).diagonal()  # the reference's own target scores
        if not (bool(torch.isfinite(q).all()) and bool(torch.isfinite(t).all())):
            return None
        nq = torch.linalg.vector_norm(q.double(), dim=1)
        lam = torch.where(nq > 0, torch.exp2(-torch.floor(torch.log2(nq))), torch.ones_like(nq))  # ||lambda q|| ~ 1
        Q64 = q.double() * lam[:, None]
        Qh = Q64.float().bfloat16()
        Ql = (Q64 - Qh.double()).float().bfloat16()
        splits = (Qh.double(), Ql.double(), Q64 - Qh.double() - Ql.double(), Q64)
        norms = torch.stack([torch.linalg.vector_norm(v, dim=1) for v in splits], dim=1) * (1 + 2.0**-40)
        # the threshold's share: its three bf16 pieces' sum error and the 2^-24 they leave
        per_t = (self._gamma[self.width] * (1 + 2.0**-7) + 2.0**-23) * lam * t.double().abs()
        typical = (norms @ stats.T).median(1).values + per_t
        mu = torch.exp2(torch.floor(torch.log2(self.room / typical)).clamp(max=40.0))
        lam, norms = lam * mu, norms * mu[:, None]
        v = -lam * t.double()  # the threshold in three bf16 pieces, the rest bounded
        taus = []
        for _ in range(3):
            taus.append(v.float().bfloat16())
            v = v - taus[-1].double()
        tau = torch.stack(taus, dim=1)
        fixed = (v.abs() + self._gamma[self.width] * tau.double().abs().sum(1)) * (1 + 2.0**-40)
        scale = mu.float()[:, None]
        A = torch.cat([Qh * scale, Qh * scale, Ql * scale, torch.full_like(tau[:, :1], MID), tau], dim=1)
        if not (bool(torch.isfinite(A).all()) and float(A.abs().max()) <= 2.0**60):
            return None
        return _Rows(q, t, A.bfloat16(), norms, fixed)

    def _scale(self, rows: _Rows, stats: torch.Tensor) -> float | None:
        """The chunk's power-of-two scale f: every row's error within budget (in units of z);
        None when the chunk's values are out of range (the reference ranks the batch)."""
        worst = float((rows.norms @ stats + rows.fixed).max()) * (1 + 2.0**-40)
        f = 2.0**40 if worst == 0 else min(2.0**40, 2.0 ** math.floor(math.log2(self.room / worst)))
        return f if f >= 2.0**-40 and f * float(stats[2]) <= 2.0**60 else None

    def _fill(self, w: _Worker, e: torch.Tensor, f: float) -> torch.Tensor:
        """The right operand [f eh, f el, f eh, 1, f, f, f] of chunk items, padding rows at -512."""
        d, n, R, es = self.dim, len(e), w.right, w.scaled[: len(e)]
        torch.mul(e, f, out=es)  # exact: f is a power of two
        R[:n, :d].copy_(es)  # rounds to bf16
        R[:n, d : 2 * d].copy_(es.sub_(R[:n, :d]))
        R[:n, 2 * d : 3 * d].copy_(R[:n, :d])
        R[:n, 3 * d] = 1.0
        R[:, 3 * d + 1 :] = f
        if n < self.padded:  # past the catalogue's end: a sure "below"
            R[n:] = 0.0
            R[n:, 3 * d] = -1.0
        return R

    def _plan(self, h: torch.Tensor, target: torch.Tensor) -> tuple[_Rows, list[float]] | None:
        """The batch's rows and each chunk's scale; None where the bound does not apply."""
        if not self._usable(len(target)):
            return None
        stats = self._chunk_stats()
        rows = self._rows(h, target, stats) if bool(torch.isfinite(stats).all()) else None
        if rows is None:
            return None
        scales = [self._scale(rows, s) for s in stats]
        kept = [f for f in scales if f is not None]
        return (rows, kept) if len(kept) == len(scales) else None

    def _usable(self, rows: int) -> bool:
        """The reference's float32 products for this batch size are fma chains (exact_dot's)."""
        dev = self.model.item_emb.weight.device
        shapes = {min(self.item_chunk, self.num_items), self.num_items % self.item_chunk or self.item_chunk}
        return bf16_sound(dev) and all(chain_verified(rows, n, self.dim, dev) for n in shapes)

    @torch.no_grad()
    def rank(
        self,
        h: torch.Tensor,
        target: torch.Tensor,
        negatives: torch.Tensor,
        history: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """rank_targets(model, h, target, negatives, history, num_items, item_chunk), exactly."""
        B, dev = len(target), target.device
        self.counts["batches"] += 1
        plan = self._plan(h, target)
        if plan is None:
            self.counts["plain_batches"] += 1
            return rank_targets(self.model, h, target, negatives, history, self.num_items, self.item_chunk)
        rows, scales = plan
        ex = _by_chunk(*_excluded(target, history), self.chunk, self.num_chunks)
        neg_rows = torch.arange(B, device=dev).repeat_interleave(negatives.shape[1])
        ng = _by_chunk(neg_rows, negatives.reshape(-1), self.chunk, self.num_chunks)
        neg_class = torch.empty(negatives.numel(), dtype=torch.int16, device=dev)
        workers = self._ready(B, dev)

        def run(k: int) -> None:  # every len(workers)-th chunk, from chunk k
            w = workers[k]
            for c in range(k, self.num_chunks, len(workers)):
                self._chunk(w, c, scales[c], rows, ex, ng, neg_class)
            self._resolve(rows, w, neg_class)

        _in_threads(run, len(workers), len(workers))
        full = torch.stack([w.full for w in workers if w.full is not None]).sum(0)
        self.counts["band_pairs"] += sum(w.band for w in workers)
        self.counts["pairs"] += B * self.num_chunks * self.padded
        sampled = (neg_class.view_as(negatives) == ABOVE_BITS).sum(1)
        return full, sampled

    def _ready(self, B: int, dev: torch.device) -> list[_Worker]:
        """Workers (`_threads`) with buffers for B rows."""
        n = self._threads()
        if len(self._workers) != n or len(self._workers[0].z) < B:
            self._workers = [
                _Worker(
                    torch.empty(B, self.padded, dtype=torch.bfloat16, device=dev),
                    torch.zeros(self.padded, self.width, dtype=torch.bfloat16, device=dev),
                    torch.empty(self.padded, self.dim, device=dev),
                )
                for _ in range(n)
            ]
        for w in self._workers:
            w.full, w.band = torch.zeros(B, dtype=torch.int64, device=dev), 0
        return self._workers

    def _chunk(self, w: _Worker, c: int, f: float, rows: _Rows, ex: tuple, ng: tuple, neg_class: torch.Tensor) -> None:
        """Chunk c into worker w's tallies: sure counts, band pairs pending, negatives' classes."""
        B, lo = len(rows.t), 1 + c * self.chunk
        e = self._embed(c)
        x = torch.mm(rows.A, self._fill(w, e, f).T, out=w.z[:B]).view(torch.int16)
        x.clamp_(BELOW_BITS, ABOVE_BITS)  # bf16 bits order like values for these signs
        a, b = ng[3][c], ng[3][c + 1]
        cls = x[ng[0][a:b], ng[1][a:b] - lo]  # before the exclusions, as the reference reads them
        neg_class[ng[2][a:b]] = cls
        band = (cls == MID_BITS).nonzero().flatten()
        w.pending.add(ng[0][a:b][band], self._keep(e, ng[1][a:b][band] - lo, lo), ng[2][a:b][band])
        a, b = ex[3][c], ex[3][c + 1]
        x[ex[0][a:b], ex[1][a:b] - lo] = BELOW_BITS
        assert w.full is not None
        w.full += self._count(x, e, lo, w.pending)
        if w.pending.size >= PENDING:
            self._resolve(rows, w, neg_class)

    def _count(self, x: torch.Tensor, e: torch.Tensor, lo: int, pending: _Pending) -> torch.Tensor:
        """Items surely above each row's target in this chunk; the band's (row, item) pairs go to
        `pending`. Classes 255 / 0 / 1 (low byte) summed by 64-item blocks in int64 words."""
        B = len(x)
        x.bitwise_and_(0xFF)
        words = x.view(torch.int64).view(B, -1, BLOCK // 4).sum(-1)  # 4 lanes of 16 bits, no carry
        lanes = (words * 0x0001000100010001) >> 48  # the 4 lanes summed into the top one: 255 below + above
        below = (lanes * 16449) >> 22  # lanes // 255, exact up to 64 * 255
        above = lanes - 255 * below
        cells = ((below + above) < BLOCK).nonzero()
        if len(cells):
            blocks = x.view(B, -1, BLOCK)[cells[:, 0], cells[:, 1]]
            k, j = (blocks == 0).nonzero(as_tuple=True)
            items = cells[k, 1] * BLOCK + j
            pending.add(cells[k, 0], self._keep(e, items, lo), torch.full_like(items, -1))
        return above.sum(1)

    def _keep(self, e: torch.Tensor, local: torch.Tensor, lo: int) -> torch.Tensor:
        """What a pending pair keeps of its item: the id when e is the table's rows, else e's row."""
        return local + lo if self.model.cfg.similarity == "dot" else e[local]

    def _resolve(self, rows: _Rows, w: _Worker, neg_class: torch.Tensor) -> None:
        """Score worker w's pending band pairs exactly; count those >= their row's target."""
        pending = w.pending
        if not pending.size:
            return
        pad = -pending.size % 16  # gathered whole: exact_dot's 16-pair blocks need no copy
        first = pending.vecs[0]
        r = torch.cat(pending.rows + [pending.rows[0].new_zeros(pad)])
        vecs = torch.cat(pending.vecs + [first.new_zeros((pad, *first.shape[1:]))])  # ids: row 0
        slots = torch.cat(pending.slots)
        if vecs.dim() == 1:  # item ids: rows of the table
            vecs = self.model.item_emb.weight[vecs]
        hit = (exact_dot(rows.q[r], vecs) >= rows.t[r])[: pending.size]
        r = r[: pending.size]
        ranked = slots < 0
        assert w.full is not None
        w.full += torch.bincount(r[hit & ranked], minlength=len(w.full))
        neg_class[slots[~ranked]] = torch.where(hit[~ranked], ABOVE_BITS, BELOW_BITS).to(torch.int16)
        w.band += int(ranked.sum())
        w.pending = _Pending()


def _in_threads(fn, n: int, threads: int) -> list:
    """[fn(0), ..., fn(n - 1)] on `threads` threads of one torch thread each: whole tasks per
    thread, no barrier per operation (which a core busy elsewhere stalls)."""
    if threads <= 1:
        return [fn(k) for k in range(n)]
    before = torch.get_num_threads()
    torch.set_num_threads(1)

    def task(k: int):
        with torch.no_grad():  # grad mode is per thread
            return fn(k)

    try:
        with ThreadPoolExecutor(threads) as pool:
            return list(pool.map(task, range(n)))
    finally:
        torch.set_num_threads(before)


def make_ranker(model, num_items: int, item_chunk: int, precision: str, device: torch.device):
    """eval.precision -> a ranker with .rank(h, target, negatives, history): "fp32" the
    reference; "bf16" BoundedRanker; "auto" BoundedRanker where bf16 runs natively and the
    model scores with a plain dot product (SeqRec), the reference elsewhere."""
    from training.model import SeqRec

    plain = type(model).scores is not SeqRec.scores or model.item_emb.weight.dtype != torch.float32
    if precision == "fp32" or plain or (precision == "auto" and not fast_bf16(device)):
        return ReferenceRanker(model, num_items, item_chunk)
    return BoundedRanker(model, num_items, item_chunk)


class ReferenceRanker:
    """rank_targets behind the ranker interface."""

    def __init__(self, model, num_items: int, item_chunk: int):
        self.model, self.num_items, self.item_chunk = model, num_items, item_chunk

    def rank(self, h, target, negatives, history):
        return rank_targets(self.model, h, target, negatives, history, self.num_items, self.item_chunk)
