"""The sequence recommender: causal self-attention over jagged item histories.

A jagged batch is padded to its own longest sample for the blocks and gathered back, so
nothing after them sees a pad. `model.attention`: "sasrec" (softmax; Kang & McAuley 2018)
or "hstu" (pointwise SiLU-gated, with a relative attention bias over positions and time
gaps; Zhai et al. 2024); `model.layer = "ligr"` swaps SASRec's blocks for eSASRec's gated
ones. Positions count back from the newest item (position 0), as SASRec's left-padded layout
does. docs/training.md gives the bias's buckets.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from training.config import ModelConfig


@dataclass
class Jagged:
    """Index maps between jagged tokens and the padded [B, L] layout of one batch."""

    lengths: torch.Tensor  # [B] tokens per sample
    batch_idx: torch.Tensor  # [N] sample of each token
    pos: torch.Tensor  # [N] index of each token inside its sample (0 = oldest)
    max_len: int  # padded length of this batch


def jagged_index(offsets: torch.Tensor, pad_to: int = 0) -> Jagged:
    lengths = offsets[1:] - offsets[:-1]
    n = int(offsets[-1])
    dev = offsets.device
    batch_idx = torch.repeat_interleave(torch.arange(len(lengths), device=dev), lengths)
    pos = torch.arange(n, device=dev) - offsets[:-1][batch_idx]
    max_len = max(int(lengths.max()) if len(lengths) else 0, pad_to)
    return Jagged(lengths, batch_idx, pos, max_len)


class SasrecBlock(nn.Module):
    """Pre-norm softmax self-attention and a point-wise feed-forward, both residual."""

    def __init__(self, dim: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ffn = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Dropout(dropout), nn.Linear(dim, dim))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, L, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask[:, None], dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(B, L, D)))
        return x + self.drop(self.ffn(self.ln2(x)))


class LigrBlock(nn.Module):
    """eSASRec's layer (LiGR, arXiv 2502.03417, as eSASRec uses it: arXiv 2508.06450): pre-norm
    softmax self-attention and a SwiGLU feed-forward, each added to the residual stream through
    a sigmoid gate computed from the stream itself (not its norm):
    x += sigmoid(G1 x) * drop(Attn(LN1 x));  x += sigmoid(G2 x) * drop(W2 drop(SiLU(W1 h) * W3 h)), h = LN2 x."""

    def __init__(self, dim: int, heads: int, dropout: float, ff_mult: int = 4):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.gate1, self.gate2 = nn.Linear(dim, dim), nn.Linear(dim, dim)
        # SwiGLU without biases, 4x wide: the eSASRec benchmark's feed-forward
        self.w1 = nn.Linear(dim, ff_mult * dim, bias=False)
        self.w3 = nn.Linear(dim, ff_mult * dim, bias=False)
        self.w2 = nn.Linear(ff_mult * dim, dim, bias=False)
        self.drop, self.ff_drop = nn.Dropout(dropout), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, L, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask[:, None], dropout_p=self.dropout if self.training else 0.0
        )
        x = x + torch.sigmoid(self.gate1(x)) * self.drop(self.proj(a.transpose(1, 2).reshape(B, L, D)))
        h = self.ln2(x)
        f = self.w2(self.ff_drop(F.silu(self.w1(h)) * self.w3(h)))
        return x + torch.sigmoid(self.gate2(x)) * self.drop(f)


TIME_BUCKET_WIDTH = 0.301  # ln-seconds per time bucket: each bucket ~1.35x the previous one


def position_buckets(d: torch.Tensor, num_buckets: int, max_len: int) -> torch.Tensor:
    """Distance d = i - j >= 0 -> bucket: d itself below num_buckets // 2, then log-spaced up
    to max_len (T5's scheme, causal half), so far-apart pairs share a few weights."""
    exact = max(num_buckets // 2, 1)
    if max_len <= exact:
        return d.clamp(max=num_buckets - 1)
    far = (
        exact
        + (torch.log(d.clamp(min=exact).float() / exact) / math.log(max_len / exact) * (num_buckets - exact)).long()
    )
    return torch.where(d < exact, d, far.clamp(max=num_buckets - 1))


def time_buckets(gap: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """|gap| in seconds -> floor(ln(max(|gap|, 1)) / 0.301), capped at num_buckets - 1."""
    g = gap.abs().float()  # a new tensor: the rest runs in place ([B, L, L] is large)
    return g.clamp_(min=1.0).log_().div_(TIME_BUCKET_WIDTH).long().clamp_(max=num_buckets - 1)


class RelativeBias(nn.Module):
    """rab^{p,t} of one HSTU layer: learned scalars per position bucket and per time bucket."""

    def __init__(self, pos_buckets: int, time_buckets: int):
        super().__init__()
        self.pos_w = nn.Parameter(torch.empty(pos_buckets).normal_(std=0.02))
        self.time_w = nn.Parameter(torch.empty(time_buckets).normal_(std=0.02)) if time_buckets else None

    def forward(self, buckets: torch.Tensor, timed: bool = False) -> torch.Tensor:
        """Bucket ids -> bias broadcastable to [B, H, L, L]: position buckets [L, L], or with
        `timed` pos * time_buckets + time [B, L, L] (one gather from the pos x time table
        instead of two gathers and a sum: ~40% less time on long histories)."""
        if timed:
            assert self.time_w is not None, "timed buckets need the time table (time_buckets > 0)"
            b = (self.pos_w[:, None] + self.time_w[None, :]).flatten()[buckets]
        else:
            b = self.pos_w[buckets]
        return b.unsqueeze(-3)  # one bias for all heads


class HstuBlock(nn.Module):
    """HSTU layer: U, V, Q, K = SiLU(f1(x)); A = SiLU(QK^T + rab)/n masked; y = f2(Norm(AV) * U)."""

    def __init__(self, dim: int, heads: int, dropout: float, n: int, rab: RelativeBias | None = None):
        super().__init__()
        self.heads, self.n = heads, n  # n: fixed normalizer (max_len) so a batch's padding cannot change it
        self.ln = nn.LayerNorm(dim)
        self.f1 = nn.Linear(dim, 4 * dim)
        self.norm_av = nn.LayerNorm(dim)
        self.f2 = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)
        self.rab = rab

    def forward(self, x: torch.Tensor, mask: torch.Tensor, buckets: tuple = ()) -> torch.Tensor:
        B, L, D = x.shape
        H = self.heads
        u, v, q, k = F.silu(self.f1(self.ln(x))).split(D, dim=-1)
        q, k, v = (t.view(B, L, H, D // H).transpose(1, 2) for t in (q, k, v))
        s = q @ k.transpose(-1, -2)
        if self.rab is not None:
            s = s + self.rab(*buckets)  # inside the SiLU, before the mask (the paper's A(X))
        a = F.silu(s) / self.n * mask[:, None]  # no softmax: pointwise weights
        av = (a @ v).transpose(1, 2).reshape(B, L, D)
        return x + self.f2(self.drop(self.norm_av(av) * u))


class SeqRec(nn.Module):
    """Item embeddings + positions -> causal blocks -> one hidden state per token."""

    def __init__(self, num_items: int, cfg: ModelConfig):
        super().__init__()
        if cfg.max_len <= 0:
            raise ValueError("model.max_len must be set (from the manifest) before building the model")
        self.cfg, self.num_items = cfg, num_items
        self.item_emb = nn.Embedding(num_items + 1, cfg.dim, padding_idx=0)  # row 0 = padding
        self.pos_emb = nn.Embedding(cfg.max_len, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)
        if cfg.layer == "ligr":
            self.blocks = nn.ModuleList(LigrBlock(cfg.dim, cfg.num_heads, cfg.dropout) for _ in range(cfg.num_layers))
        elif cfg.attention == "sasrec":
            self.blocks = nn.ModuleList(SasrecBlock(cfg.dim, cfg.num_heads, cfg.dropout) for _ in range(cfg.num_layers))
        else:
            time = cfg.rel_time_buckets if cfg.rel_bias == "pos+time" else 0
            self.blocks = nn.ModuleList(
                HstuBlock(
                    cfg.dim,
                    cfg.num_heads,
                    cfg.dropout,
                    cfg.max_len,
                    RelativeBias(cfg.rel_pos_buckets, time) if cfg.rel_bias != "none" else None,
                )
                for _ in range(cfg.num_layers)
            )
        self.ln_out = nn.LayerNorm(cfg.dim)
        nn.init.normal_(self.item_emb.weight, std=0.02)
        nn.init.normal_(self.pos_emb.weight, std=0.02)
        with torch.no_grad():
            self.item_emb.weight[0].zero_()

    def forward(
        self, values: torch.Tensor, offsets: torch.Tensor, pad_to: int = 0, timestamps: torch.Tensor | None = None
    ) -> torch.Tensor:
        """values [N] item ids, offsets [B+1] -> hidden [N, dim], one per input token.

        timestamps [N] (seconds, optional) feed HSTU's time-gap bias; without them the model
        runs the same, with the positional bias only. The hidden state at token t depends
        only on tokens 0..t of the same sample (and their timestamps).
        """
        j = jagged_index(offsets, pad_to)
        if j.max_len > self.cfg.max_len:
            raise ValueError(f"a sample has {j.max_len} items, more than model.max_len={self.cfg.max_len}")
        from_end = j.lengths[j.batch_idx] - 1 - j.pos
        tok = self.item_emb(values) * math.sqrt(self.cfg.dim) + self.pos_emb(from_end)
        B, L = len(j.lengths), j.max_len
        x = tok.new_zeros(B, L, self.cfg.dim)
        x[j.batch_idx, j.pos] = self.drop(tok)
        # Query t may see keys 0..t of its own sample; pads are never keys. Pad queries
        # (t >= length) still see real keys, so no softmax row is empty.
        valid = torch.arange(L, device=x.device)[None, :] < j.lengths[:, None]  # [B, L]
        causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()  # [L, L]
        mask = causal[None] & valid[:, None, :]  # [B, L, L]
        ts = None
        if timestamps is not None:
            ts = timestamps.new_zeros(B, L)
            ts[j.batch_idx, j.pos] = timestamps
        return self.ln_out(self.encode(x, mask, ts)[j.batch_idx, j.pos])

    def encode(self, x: torch.Tensor, mask: torch.Tensor, timestamps: torch.Tensor | None = None) -> torch.Tensor:
        """The blocks on a dense batch: x [B, L, d], mask [B, L, L], timestamps [B, L] or None."""
        buckets: tuple[torch.Tensor] | tuple[torch.Tensor, bool] | None = None
        if self.cfg.attention == "hstu" and self.cfg.rel_bias != "none":
            i = torch.arange(x.shape[1], device=x.device)
            # future pairs (j > i) get bucket 0: the mask removes them after the SiLU
            pos = position_buckets((i[:, None] - i[None]).clamp(min=0), self.cfg.rel_pos_buckets, self.cfg.max_len)
            buckets = (pos,)
            if timestamps is not None and self.cfg.rel_bias == "pos+time":
                t = (timestamps - timestamps[:, :1]).float()  # small numbers: float32 keeps the gaps exact enough
                time = time_buckets(t[:, :, None] - t[:, None, :], self.cfg.rel_time_buckets)
                buckets = (pos * self.cfg.rel_time_buckets + time, True)  # once for all layers
        for block in self.blocks:
            x = block(x, mask) if buckets is None else block(x, mask, buckets)
        return x

    def last_hidden(
        self, values: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Hidden state after each sample's newest item: [B, dim], what predicts the next item."""
        return self.forward(values, offsets, timestamps=timestamps)[offsets[1:] - 1]

    def _embed_out(self, items: torch.Tensor | None) -> torch.Tensor:
        e = self.item_emb.weight[1:] if items is None else self.item_emb(items)
        return F.normalize(e, dim=-1) if self.cfg.similarity == "cosine" else e

    def _hidden_out(self, h: torch.Tensor) -> torch.Tensor:
        return F.normalize(h, dim=-1) if self.cfg.similarity == "cosine" else h

    def scores(self, h: torch.Tensor, items: torch.Tensor | None = None) -> torch.Tensor:
        """h [N, d] against items [M] (all items 1..num_items when None) -> [N, M].

        With `similarity = "cosine"` both sides are L2-normalized: bounded logits, and the
        loss applies a temperature.
        """
        return self._hidden_out(h) @ self._embed_out(items).T

    def token_scores(self, h: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """h [N, d] against each row's own items [N, K] -> [N, K]. With fewer items in the
        catalogue than K x d, every row's scores against all of them and a gather cost less
        (two matrix products, no [N, K, d] rows to gather and scatter back)."""
        if self.num_items < items.shape[-1] * h.shape[-1] and isinstance(self.item_emb, nn.Embedding):
            return self.scores(h).gather(1, items - 1)
        return torch.einsum("nd,nkd->nk", self._hidden_out(h), self._embed_out(items))

    def pair_scores(self, h: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """h [N, d] against one item per row, items [N] -> [N]."""
        return (self._hidden_out(h) * self._embed_out(items)).sum(-1)


def padding_fraction(offsets: torch.Tensor, pad_to: int = 0) -> float:
    """Share of the padded [B, L] tokens that are padding for this batch."""
    lengths = offsets[1:] - offsets[:-1]
    L = max(int(lengths.max()), pad_to)
    return 1.0 - float(lengths.sum()) / float(L * len(lengths))
