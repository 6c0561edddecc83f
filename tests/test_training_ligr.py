"""model.layer: eSASRec's LiGR layer as an option, and the standard layers unchanged by it."""

import hashlib

import pytest
import torch
from conftest import synthetic_shards

from training.config import ConfigError, ModelConfig, load_config
from training.model import LigrBlock, SasrecBlock, SeqRec
from training.serving import Scorer
from training.train import train

VALUES = torch.tensor([3, 9, 4, 7, 1, 8, 2, 5, 11, 12, 13])
OFFSETS = torch.tensor([0, 6, 7, 11])  # three histories: 6, 1 and 4 items

# Recorded from the model before model.layer existed (commit aa7ead3), torch 2.13: the seeded
# initial state dict's sha256, and rows 0, 5, 6, 10 (columns 0-1) of the hidden states in eval
# mode, then in train mode (dropout drawn after torch.manual_seed(1)).
BEFORE = {
    "sasrec": (
        "229ae2fe00f44c650aea2ea91b96b150ac4f8379f4330543db49a91594202301",
        [-0.65557, 0.13625, -0.73758, -0.17379, 0.44466, -0.8259, -0.23757, -0.57676],
        [-1.11764, -0.17222, -0.15719, -0.45207, -0.77616, 0.93369, 0.24102, 0.16192],
    ),
    "hstu": (
        "d9ae07971f424643598e30bea8ca680a5cff64d25877e97dfde70187e25f245f",
        [1.04685, -1.04471, 0.47275, -1.40579, 1.066, -0.99424, 1.7317, 0.72871],
        [0.75641, -1.40744, 1.23559, 0.34035, 0.89112, -0.71104, 1.46608, 0.49506],
    ),
}


def _model(attention: str = "sasrec", layer: str = "standard", dropout: float = 0.3) -> SeqRec:
    torch.manual_seed(0)
    cfg = ModelConfig(attention=attention, layer=layer, dim=16, num_layers=2, num_heads=2, dropout=dropout, max_len=10)
    return SeqRec(30, cfg)


def _sha256(model: SeqRec) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _rows(out: torch.Tensor) -> list[float]:
    return [float(x) for x in out[[0, 5, 6, 10], :2].flatten()]


@pytest.mark.parametrize("attention", ["sasrec", "hstu"])
def test_the_standard_layer_is_the_model_from_before(attention):
    """model.layer = "standard" (the default): the same initial weights, bit for bit, and the
    same hidden states (to float32 rounding across CPUs), in eval and in train mode."""
    sha, eval_rows, train_rows = BEFORE[attention]
    m = _model(attention)
    assert _sha256(m) == sha
    assert not any(isinstance(b, LigrBlock) for b in m.blocks)
    with torch.no_grad():
        assert _rows(m.eval()(VALUES, OFFSETS)) == pytest.approx(eval_rows, abs=2e-5)
        m.train()
        torch.manual_seed(1)
        assert _rows(m(VALUES, OFFSETS)) == pytest.approx(train_rows, abs=2e-5)


def test_ligr_blocks_replace_sasrecs_and_stay_causal():
    m = _model(layer="ligr", dropout=0.0).eval()
    assert all(isinstance(b, LigrBlock) for b in m.blocks) and len(m.blocks) == 2
    # everything outside the blocks is the standard model's: the embeddings and the output norm
    outside = {k for k in m.state_dict() if not k.startswith("blocks.")}
    assert outside == {k for k in _model(dropout=0.0).state_dict() if not k.startswith("blocks.")}
    base = [3, 9, 4, 7, 1, 8]
    with torch.no_grad():
        h1 = m(torch.tensor(base), torch.tensor([0, 6]))
        for t in range(len(base) - 1):
            changed = base[: t + 1] + [(x % 29) + 1 for x in base[t + 1 :]]
            h2 = m(torch.tensor(changed), torch.tensor([0, 6]))
            assert torch.allclose(h1[: t + 1], h2[: t + 1], atol=1e-6), f"position <= {t} saw the future"
            assert not torch.allclose(h1[t + 1 :], h2[t + 1 :], atol=1e-6)
        # padding changes nothing: history 1 alone, and inside the batch (padded to 6)
        alone = m(torch.tensor([2]), torch.tensor([0, 1]))
        assert torch.allclose(m(VALUES, OFFSETS)[6:7], alone, atol=1e-6)


def test_ligr_gates_the_residuals_with_the_stream_itself():
    """Closed gates (sigmoid -> 0) leave the stream as it came; open gates (-> 1) add the
    pre-norm attention and SwiGLU branches in full, the standard residual layout."""
    torch.manual_seed(0)
    block = LigrBlock(8, 2, 0.0).eval()
    x = torch.randn(2, 5, 8)
    mask = torch.ones(5, 5, dtype=torch.bool).tril()[None].expand(2, 5, 5)
    with torch.no_grad():
        for gate in (block.gate1, block.gate2):
            gate.weight.zero_()
            gate.bias.fill_(-100.0)
        assert torch.equal(block(x, mask), x)
        for gate in (block.gate1, block.gate2):
            gate.bias.fill_(100.0)
        a = block.qkv(block.ln1(x)).view(2, 5, 3, 2, 4).permute(2, 0, 3, 1, 4)
        att = torch.nn.functional.scaled_dot_product_attention(a[0], a[1], a[2], attn_mask=mask[:, None])
        y = x + block.proj(att.transpose(1, 2).reshape(2, 5, 8))
        h = block.ln2(y)
        want = y + block.w2(torch.nn.functional.silu(block.w1(h)) * block.w3(h))
        assert torch.allclose(block(x, mask), want, atol=1e-6)
        # and the gate reads the stream, not its norm: scaling x moves it
        block.gate1.bias.zero_()
        block.gate1.weight.copy_(torch.eye(8))
        y1 = block(x, mask)
        y2 = block(3 * x, mask)
        assert not torch.allclose(y2 - 3 * x, y1 - x, atol=1e-3)
    assert not isinstance(block, SasrecBlock)


def test_the_setting_is_checked(tmp_path):
    base = [f"data.shards={tmp_path}"]
    assert load_config(None, base).model.layer == "standard"
    with pytest.raises(ConfigError, match="model.layer must be 'standard' or 'ligr'"):
        load_config(None, [*base, "model.layer=gated"])
    with pytest.raises(ConfigError, match="model.layer='ligr' is a softmax-attention layer"):
        load_config(None, [*base, "model.layer=ligr", "model.attention=hstu"])


def test_a_ligr_model_trains_evaluates_and_exports(tmp_path):
    shards = synthetic_shards(tmp_path, users=200, items=90, seed=0, world_size=1, batch_size=16, max_len=20)
    settings = [
        "model.layer=ligr",
        "model.dim=16",
        "loss.kind=sampled_softmax",
        "loss.num_negatives=16",
        "model.dropout=0",
        "optim.lr=0.01",
    ]
    settings += ["train.epochs=3", "mlflow.enabled=false", "eval.periodic=false"]
    res = train(load_config(None, [f"data.shards={shards}", f"train.out={tmp_path / 'run'}", *settings]))
    # trained: far above the most popular item's ~0.1 HR@10 on this data, from an untrained ~0.1
    assert res["metrics"]["test/full/hr@10"] > 0.3
    from training import checkpoint
    from training.config import config_from_dict

    meta = checkpoint.read_meta(res["checkpoint"])
    cfg = config_from_dict(meta["config"])
    assert cfg.model.layer == "ligr"
    model = SeqRec(90, cfg.model)
    model.load_state_dict(checkpoint.load(res["checkpoint"])["model"])
    model.eval()
    # the serving program's dense path scores as evaluation's jagged one does
    items = torch.tensor([[5, 7, 9, 0], [3, 0, 0, 0]])
    with torch.no_grad():
        dense = Scorer(model)(items)
        jagged = model.scores(model.last_hidden(torch.tensor([5, 7, 9, 3]), torch.tensor([0, 3, 4])))
    assert torch.allclose(dense, jagged, atol=1e-5)
    exported = torch.export.export(Scorer(model), (items,))
    assert torch.allclose(exported.module()(items), dense, atol=1e-5)
