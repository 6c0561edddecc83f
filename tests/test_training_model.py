"""Model shapes and masking, loss normalization, and the typed config."""

import dataclasses

import pytest
import torch

from training.config import ConfigError, LossConfig, ModelConfig, load_config, to_toml
from training.loss import SOFTMAX_MAX_ITEMS, loss_sum, negatives_per, resolve_kind
from training.model import SeqRec, padding_fraction

KINDS = ["sasrec", "hstu"]


def _model(kind: str, dropout: float = 0.0, num_items: int = 50, max_len: int = 12) -> SeqRec:
    torch.manual_seed(0)
    m = SeqRec(
        num_items, ModelConfig(attention=kind, dim=16, num_layers=2, num_heads=2, dropout=dropout, max_len=max_len)
    )
    return m.eval()


def _jagged(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    values = torch.tensor([x for s in seqs for x in s])
    offsets = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
    return values, offsets


@pytest.mark.parametrize("kind", KINDS)
def test_shapes(kind):
    m = _model(kind)
    values, offsets = _jagged([[1, 2, 3], [4], [5, 6, 7, 8, 9]])
    h = m(values, offsets)
    assert h.shape == (9, 16)
    assert m.last_hidden(values, offsets).shape == (3, 16)
    assert m.scores(h).shape == (9, 50)  # every item 1..num_items
    assert m.scores(h, torch.tensor([1, 2])).shape == (9, 2)
    assert m.pair_scores(h, values).shape == (9,)


@pytest.mark.parametrize("kind", KINDS)
def test_no_position_sees_the_future(kind):
    m = _model(kind)
    base = [3, 9, 4, 7, 1, 8]
    v1, o1 = _jagged([base])
    h1 = m(v1, o1)
    for t in range(len(base) - 1):
        changed = base[: t + 1] + [(x % 49) + 2 for x in base[t + 1 :]]  # every later item replaced
        h2 = m(*_jagged([changed]))
        assert torch.allclose(h1[: t + 1], h2[: t + 1], atol=1e-6), f"position <= {t} changed"
        assert not torch.allclose(h1[t + 1 :], h2[t + 1 :], atol=1e-6)  # the change is visible later


@pytest.mark.parametrize("kind", KINDS)
def test_padding_changes_nothing(kind):
    m = _model(kind)
    a, b = [5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    alone = m(*_jagged([a]))
    batched = m(*_jagged([a, b]))[:3]  # a padded to 10 inside this batch
    padded_to_max = m(*_jagged([a]), pad_to=12)
    assert torch.allclose(alone, batched, atol=1e-6)
    assert torch.allclose(alone, padded_to_max, atol=1e-6)
    # the pad item id 0 is never looked up as a real token and its row gets no gradient
    m.train()
    h = m(*_jagged([a, b]))
    h.sum().backward()
    assert torch.count_nonzero(m.item_emb.weight.grad[0]) == 0


def test_too_long_sample_is_refused():
    with pytest.raises(ValueError, match="max_len"):
        _model("sasrec", max_len=4)(*_jagged([[1, 2, 3, 4, 5]]))


def test_padding_fraction():
    _, offsets = _jagged([[1, 2], [1, 2, 3, 4]])
    assert padding_fraction(offsets) == pytest.approx(1 - 6 / 8)
    assert padding_fraction(offsets, pad_to=10) == pytest.approx(1 - 6 / 20)


def test_global_normalization_equals_one_big_batch():
    """Two ranks' sums divided by the GLOBAL count give the big batch's gradient."""
    m = _model("sasrec")
    cfg = LossConfig(kind="sampled_softmax", num_negatives=20, temperature=0.1)
    seqs = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12]]  # uneven: 6+1 tokens vs 2 tokens
    labels_all = torch.tensor([2, 3, 4, 5, 6, 7, 11, 9, 20, 11, 12, 13])
    values, offsets = _jagged(seqs)

    def grads(parts):
        m.zero_grad()
        total = sum(len(p[0]) for p in parts)
        g = torch.Generator().manual_seed(5)
        for vals, offs, labs in parts:
            state = g.get_state()  # shared negatives: same draw per "rank"
            loss = loss_sum(m, m(vals, offs), labs, cfg, g) / total
            loss.backward()
            g.set_state(state)
        return [p.grad.clone() for p in m.parameters()]

    big = grads([(values, offsets, labels_all)])
    v1, o1 = _jagged(seqs[:1])
    v2, o2 = _jagged(seqs[1:])
    split = grads([(v1, o1, labels_all[:7]), (v2, o2, labels_all[7:])])
    for a, b in zip(big, split, strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    # dividing by the LOCAL count instead would weight the 2-token rank 4.5x more per token
    m.zero_grad()
    g = torch.Generator().manual_seed(5)
    for vals, offs, labs in [(v1, o1, labels_all[:7]), (v2, o2, labels_all[7:])]:
        state = g.get_state()
        (loss_sum(m, m(vals, offs), labs, cfg, g) / len(vals)).backward()
        g.set_state(state)
    local = [p.grad.clone() for p in m.parameters()]
    assert not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(big, local, strict=True))


def test_bce_normalization_is_a_mean_over_tokens():
    m = _model("sasrec")
    cfg = LossConfig(kind="bce", temperature=1.0)
    values, offsets = _jagged([[1, 2, 3], [4, 5]])
    labels = torch.tensor([2, 3, 9, 5, 9])
    h = m(values, offsets)
    s = loss_sum(m, h, labels, cfg, torch.Generator().manual_seed(0))
    neg = torch.randint(1, 51, labels.shape, generator=torch.Generator().manual_seed(0))
    pos, negs = m.pair_scores(h, labels), m.pair_scores(h, neg)
    expect = -(torch.nn.functional.logsigmoid(pos) + torch.nn.functional.logsigmoid(-negs) * (neg != labels)).sum()
    assert torch.allclose(s, expect)


def test_sampled_softmax_masks_accidental_hits():
    """A negative equal to the target must not count against it."""
    m = _model("sasrec", num_items=3)
    cfg = LossConfig(kind="sampled_softmax", num_negatives=64, temperature=0.1)
    values, offsets = _jagged([[1, 2]])
    labels = torch.tensor([2, 3])
    h = m(values, offsets)
    g = torch.Generator().manual_seed(1)
    s = loss_sum(m, h, labels, cfg, g)
    negs = torch.randint(1, 4, (64,), generator=torch.Generator().manual_seed(1))
    pos = m.pair_scores(h, labels) / 0.1
    expect = 0.0
    for i in range(2):
        others = negs[negs != labels[i]]
        logits = torch.cat([pos[i : i + 1], m.scores(h[i : i + 1], others)[0] / 0.1])
        expect += torch.logsumexp(logits, 0) - pos[i]
    assert torch.allclose(s, expect, atol=1e-5)


def test_per_token_negatives_are_each_tokens_own_by_either_product():
    """loss.negatives = "per_token": every target meets its own draw, accidental hits masked;
    the gather of all items' scores and the gather of the negatives' rows agree."""
    cfg = LossConfig(kind="sampled_softmax", num_negatives=8, negatives="per_token", temperature=0.5)
    values, offsets = _jagged([[1, 2, 3], [4, 5]])
    labels = torch.tensor([2, 3, 9, 5, 9])
    for num_items in (50, 200):  # 50 < 8 x 16: scores of all items; 200: the rows gathered
        m = _model("sasrec", num_items=num_items)
        h = m(values, offsets)
        s = loss_sum(m, h, labels, cfg, torch.Generator().manual_seed(3))
        negs = torch.randint(1, num_items + 1, (5, 8), generator=torch.Generator().manual_seed(3))
        negs[0, 0] = labels[0]  # an accidental hit, placed
        s_hit = loss_sum(m, h, labels, cfg, negatives=negs)
        for got, drawn in (
            (s, torch.randint(1, num_items + 1, (5, 8), generator=torch.Generator().manual_seed(3))),
            (s_hit, negs),
        ):
            expect = 0.0
            for i in range(5):
                own = drawn[i][drawn[i] != labels[i]]
                logits = (
                    torch.cat([m.pair_scores(h[i : i + 1], labels[i : i + 1]), m.scores(h[i : i + 1], own)[0]]) / 0.5
                )
                expect += torch.logsumexp(logits, 0) - logits[0]
            assert torch.allclose(got, expect, atol=1e-5)


def test_softmax_is_the_full_catalogues_cross_entropy():
    m = _model("sasrec", num_items=30)
    values, offsets = _jagged([[1, 2, 3], [4, 5]])
    labels = torch.tensor([2, 3, 30, 5, 1])
    h = m(values, offsets)
    s = loss_sum(m, h, labels, LossConfig(kind="softmax", temperature=0.5))
    logits = h @ m.item_emb.weight[1:].T / 0.5
    expect = (torch.logsumexp(logits, 1) - logits[torch.arange(5), labels - 1]).sum()
    assert torch.allclose(s, expect, atol=1e-5)
    assert negatives_per(LossConfig(kind="softmax"), 30) == (0, 30)
    assert negatives_per(LossConfig(), 30) == (0, 30)  # auto: every item of a small catalogue
    sampled = LossConfig(kind="sampled_softmax", num_negatives=7)
    assert negatives_per(sampled, 30) == (0, 7)
    assert negatives_per(dataclasses.replace(sampled, negatives="per_token"), 30) == (7, 0)
    assert negatives_per(LossConfig(kind="bce"), 30) == (1, 0)


@pytest.mark.parametrize(
    "kind, items, sharded, chosen",
    [
        ("auto", 12101, False, "softmax"),
        ("auto", SOFTMAX_MAX_ITEMS, False, "softmax"),
        ("auto", SOFTMAX_MAX_ITEMS + 1, False, "sampled_softmax"),
        ("auto", 100, True, "sampled_softmax"),
        ("sampled_softmax", 100, False, "sampled_softmax"),
        ("softmax", 10**7, False, "softmax"),
        ("bce", 100, False, "bce"),
    ],
)
def test_auto_scores_every_item_of_a_small_catalogue_on_a_replicated_table(kind, items, sharded, chosen):
    got, why = resolve_kind(LossConfig(kind=kind), items, sharded)
    assert got == chosen and chosen in why


def test_config_toml_and_overrides(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[model]\nattention = "hstu"\ndim = 32\n[optim]\nlr = 0.002\n[eval]\nks = [1, 10]\n')
    cfg = load_config(str(f), ["model.dim=48", "train.resume=true", "optim.betas=0.9,0.95"])
    assert (cfg.model.attention, cfg.model.dim, cfg.optim.lr) == ("hstu", 48, 0.002)
    assert cfg.train.resume is True and cfg.optim.betas == (0.9, 0.95) and cfg.eval.ks == (1, 10)
    again = tmp_path / "again.toml"
    again.write_text(to_toml(cfg))
    assert load_config(str(again)) == cfg


@pytest.mark.parametrize(
    "override, words",
    [
        (["model.nope=1"], "unknown key 'nope'"),
        (["nosection.x=1"], "unknown section"),
        (["model.dim=abc"], "model.dim"),
        (["model.attention=gru"], "model.attention"),
        (["loss.negatives=per_step"], "loss.negatives"),
        (["loss.kind=full"], "loss.kind"),
        (["optim.lr"], "section.key=value"),
    ],
)
def test_config_errors_name_the_setting(override, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        load_config(None, override)


# --- HSTU's relative attention bias (rab^{p,t}) ---------------------------------------------

from training.model import RelativeBias, position_buckets, time_buckets  # noqa: E402


def _hstu(rel_bias: str = "pos+time", max_len: int = 12) -> SeqRec:
    torch.manual_seed(0)
    m = SeqRec(
        50,
        ModelConfig(
            attention="hstu",
            dim=16,
            num_layers=2,
            num_heads=2,
            dropout=0.0,
            max_len=max_len,
            rel_bias=rel_bias,
            rel_pos_buckets=8,
            rel_time_buckets=40,
        ),
    )
    with torch.no_grad():  # weights far from their 0.02 init, so a wrong bucket shows
        for name, p in m.named_parameters():
            if ".rab." in name:
                p.normal_(std=1.0)
    return m.eval()


def test_position_buckets_exact_then_log_spaced():
    d = torch.arange(50)
    b = position_buckets(d, 32, 50)
    assert b[:16].tolist() == list(range(16))  # exact below num_buckets / 2
    assert (b.diff() >= 0).all() and b[16] == 16 and b[-1] == 31  # then log-spaced up to max_len
    assert (b[32:] - b[31:-1]).sum() < 16  # far distances share buckets
    assert position_buckets(torch.arange(6), 32, 6).tolist() == list(range(6))  # short max_len: all exact
    assert position_buckets(torch.arange(1024), 32, 1024).max() == 31


def test_time_buckets_of_known_gaps():
    gaps = torch.tensor([0, 1, 2, 3, 60, 3600, 86400, 365 * 86400, -3600])
    # floor(ln(max(|gap|, 1)) / 0.301): 1 s and less share bucket 0, an hour 27, a day 37, a year 57
    assert time_buckets(gaps, 128).tolist() == [0, 0, 2, 3, 13, 27, 37, 57, 27]
    assert time_buckets(gaps, 30).max() == 29  # capped at the last bucket


def test_bias_shapes_and_parameters():
    rab = RelativeBias(8, 40)
    pos, time = torch.randint(0, 8, (5, 5)), torch.randint(0, 40, (3, 5, 5))
    assert rab(pos).shape == (1, 5, 5)  # positions: one bias for the batch
    both = rab(pos * 40 + time, timed=True)
    assert both.shape == (3, 1, 5, 5)  # with time: per sample, shared by heads
    assert torch.allclose(both[:, 0], rab.pos_w[pos] + rab.time_w[time])
    names = lambda m: {n for n, _ in m.named_parameters() if "rab" in n}  # noqa: E731
    assert names(_hstu()) == {f"blocks.{i}.rab.{w}" for i in (0, 1) for w in ("pos_w", "time_w")}  # per layer
    assert _hstu("pos").blocks[0].rab.time_w is None and _hstu("none").blocks[0].rab is None
    assert names(_model("sasrec")) == set()  # SASRec has no relative bias


@pytest.mark.parametrize("rel_bias", ["pos+time", "pos", "none"])
def test_timestamps_are_optional(rel_bias):
    m = _hstu(rel_bias)
    values, offsets = _jagged([[1, 2, 3], [4], [5, 6, 7, 8, 9]])
    ts = torch.tensor([10, 20, 4000, 7, 0, 1, 100, 10_000, 1_000_000])
    assert m(values, offsets).shape == m(values, offsets, timestamps=ts).shape == (9, 16)
    with_time = m(values, offsets, timestamps=ts)
    later = m(values, offsets, timestamps=ts * 7)  # other gaps, same order
    assert torch.allclose(with_time, later, atol=1e-6) == (rel_bias != "pos+time")  # only pos+time reads time
    if rel_bias == "pos":  # and without them pos+time is the positional model
        both = _hstu("pos+time")
        both.load_state_dict(m.state_dict(), strict=False)
        assert torch.allclose(both(values, offsets), m(values, offsets), atol=1e-6)
    s = _model("sasrec")  # SASRec ignores timestamps
    assert torch.equal(s(values, offsets), s(values, offsets, timestamps=ts))


@pytest.mark.parametrize("rel_bias", ["pos+time", "pos"])
def test_bias_is_causal_in_items_and_timestamps(rel_bias):
    m = _hstu(rel_bias)
    base, ts = [3, 9, 4, 7, 1, 8], [0, 5, 600, 700, 90_000, 90_030]
    h1 = m(*_jagged([base]), timestamps=torch.tensor(ts))
    for t in range(len(base) - 1):
        items = base[: t + 1] + [(x % 49) + 2 for x in base[t + 1 :]]
        times = ts[: t + 1] + [x * 3 + 11 for x in ts[t + 1 :]]
        for i2, t2 in ((items, ts), (base, times), (items, times)):
            h2 = m(*_jagged([i2]), timestamps=torch.tensor(t2))
            assert torch.allclose(h1[: t + 1], h2[: t + 1], atol=1e-6), f"position <= {t} changed"
            if i2 is items or rel_bias == "pos+time":
                assert not torch.allclose(h1[t + 1 :], h2[t + 1 :], atol=1e-6)  # visible later


def test_bias_padding_changes_nothing_with_timestamps():
    m = _hstu()
    a, b = [5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    ta, tb = [100, 200, 50_000], list(range(0, 10_000, 1000))
    alone = m(*_jagged([a]), timestamps=torch.tensor(ta))
    batched = m(*_jagged([a, b]), timestamps=torch.tensor(ta + tb))[:3]
    padded = m(*_jagged([a]), pad_to=12, timestamps=torch.tensor(ta))
    assert torch.allclose(alone, batched, atol=1e-6) and torch.allclose(alone, padded, atol=1e-6)
    assert torch.allclose(m.last_hidden(*_jagged([a]), timestamps=torch.tensor(ta)), alone[-1:], atol=1e-6)


def test_rel_bias_config_is_checked():
    with pytest.raises(ConfigError, match="model.rel_bias"):
        load_config(None, ["model.rel_bias=alibi"])
    with pytest.raises(ConfigError, match="rel_pos_buckets"):
        load_config(None, ["model.rel_pos_buckets=0"])
    assert load_config(None, ["model.attention=hstu"]).model.rel_bias == "pos+time"  # on by default


def test_a_checkpoint_config_from_before_the_relative_bias_builds_the_model_it_saved():
    """A meta.json written before HSTU had a relative attention bias has no `rel_bias`: its
    tensors have no bias weights, so the model rebuilt from it must have none either."""
    from training.config import Config, config_from_dict

    old = Config().to_dict()
    old["model"]["attention"] = "hstu"
    del old["model"]["rel_bias"]
    assert config_from_dict(old).model.rel_bias == "none"
    now = Config().to_dict()
    now["model"]["attention"] = "hstu"
    assert config_from_dict(now).model.rel_bias == "pos+time"
