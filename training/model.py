"""The sequence recommender: causal self-attention over jagged item histories.

A batch arrives jagged (`values` = all items of all samples back to back, `offsets` =
where each sample starts). The blocks need a dense [B, L, d] tensor for the attention
kernel, so each batch is padded to its OWN longest sample (dataprep's balanced shards
put similar lengths in the same step, so little is padded) and the output is gathered
back to jagged form: nothing after the blocks (similarities, loss) sees a pad.

Two attention kinds behind `model.attention`:
- "sasrec": softmax attention + point-wise feed-forward (Kang & McAuley, ICDM 2018).
- "hstu": pointwise SiLU-gated attention, `SiLU(QK^T)/n` instead of softmax, with the
  output gated by U (Zhai et al., "Actions Speak Louder than Words", ICML 2024).

Positions count back from the most recent item (position 0 = newest), as SASRec's
left-padded layout does, so the prediction for "what comes next" always sits at
position 0 at inference time.
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
    lengths: torch.Tensor    # [B] tokens per sample
    batch_idx: torch.Tensor  # [N] sample of each token
    pos: torch.Tensor        # [N] index of each token inside its sample (0 = oldest)
    max_len: int             # padded length of this batch


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
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None],
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(B, L, D)))
        return x + self.drop(self.ffn(self.ln2(x)))


class HstuBlock(nn.Module):
    """HSTU layer: U, V, Q, K = SiLU(f1(x)); A = SiLU(QK^T)/n masked; y = f2(Norm(AV) * U)."""

    def __init__(self, dim: int, heads: int, dropout: float, n: int):
        super().__init__()
        self.heads, self.n = heads, n  # n: fixed normalizer (max_len) so a batch's padding cannot change it
        self.ln = nn.LayerNorm(dim)
        self.f1 = nn.Linear(dim, 4 * dim)
        self.norm_av = nn.LayerNorm(dim)
        self.f2 = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, L, D = x.shape
        H = self.heads
        u, v, q, k = F.silu(self.f1(self.ln(x))).split(D, dim=-1)
        q, k, v = (t.view(B, L, H, D // H).transpose(1, 2) for t in (q, k, v))
        a = F.silu(q @ k.transpose(-1, -2)) / self.n * mask[:, None]  # no softmax: pointwise weights
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
        if cfg.attention == "sasrec":
            self.blocks = nn.ModuleList(SasrecBlock(cfg.dim, cfg.num_heads, cfg.dropout) for _ in range(cfg.num_layers))
        else:
            self.blocks = nn.ModuleList(HstuBlock(cfg.dim, cfg.num_heads, cfg.dropout, cfg.max_len)
                                        for _ in range(cfg.num_layers))
        self.ln_out = nn.LayerNorm(cfg.dim)
        nn.init.normal_(self.item_emb.weight, std=0.02)
        nn.init.normal_(self.pos_emb.weight, std=0.02)
        with torch.no_grad():
            self.item_emb.weight[0].zero_()

    def forward(self, values: torch.Tensor, offsets: torch.Tensor, pad_to: int = 0) -> torch.Tensor:
        """values [N] item ids, offsets [B+1] -> hidden [N, dim], one per input token.

        The hidden state at token t depends only on tokens 0..t of the same sample.
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
        valid = torch.arange(L, device=x.device)[None, :] < j.lengths[:, None]          # [B, L]
        causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()           # [L, L]
        mask = causal[None] & valid[:, None, :]                               # [B, L, L]
        for block in self.blocks:
            x = block(x, mask)
        return self.ln_out(x[j.batch_idx, j.pos])

    def last_hidden(self, values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Hidden state after each sample's newest item: [B, dim], what predicts the next item."""
        return self.forward(values, offsets)[offsets[1:] - 1]

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

    def pair_scores(self, h: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """h [N, d] against one item per row, items [N] -> [N]."""
        return (self._hidden_out(h) * self._embed_out(items)).sum(-1)

def padding_fraction(offsets: torch.Tensor, pad_to: int = 0) -> float:
    """Share of the padded [B, L] tokens that are padding for this batch."""
    lengths = offsets[1:] - offsets[:-1]
    L = max(int(lengths.max()), pad_to)
    return 1.0 - float(lengths.sum()) / float(L * len(lengths))
