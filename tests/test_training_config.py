"""The trainer's settings: one `--set section.key=value` parser (values in TOML syntax, bare
text a string), errors that name the bad item, and `config --show` generated from the
sections' docstrings, one line for every setting."""

import dataclasses
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from training import config
from training.config import Config, ConfigError, load_config, parse_overrides

ROOT = Path(__file__).resolve().parent.parent


def test_values_are_toml_and_bare_text_is_a_string():
    got = parse_overrides(
        [
            "train.epochs=3",
            "optim.lr=3e-4",
            "mlflow.register=false",
            'data.name="beauty"',
            "data.alias=beauty",
            "eval.ks=[1, 5, 10]",
            "data.path=/data/events.txt",
            'job.plan={"faults": []}',
            "x.empty=",
            " y.k = 2 ",
        ]
    )
    assert got == {
        "train": {"epochs": 3},
        "optim": {"lr": 3e-4},
        "mlflow": {"register": False},
        "data": {"name": "beauty", "alias": "beauty", "path": "/data/events.txt"},
        "eval": {"ks": [1, 5, 10]},
        "job": {"plan": '{"faults": []}'},
        "x": {"empty": ""},
        "y": {"k": 2},
    }
    assert parse_overrides(["train.epochs=3", "train.epochs=4"]) == {"train": {"epochs": 4}}  # the last wins


@pytest.mark.parametrize("item", ["epochs=3", "train.epochs", "a.b.c=1", ".x=1", "x.=1", 'data.name="beauty'])
def test_a_malformed_item_is_named(item):
    with pytest.raises(ConfigError) as e:
        parse_overrides(["train.epochs=3", item])
    assert f"--set {item!r}" in str(e.value)


def test_the_trainer_reads_the_same_syntax():
    cfg = load_config(
        None,
        [
            "train.epochs=3",
            'mlflow.experiment="exp a"',
            "mlflow.run_name=true",
            "mlflow.run_id=123e4",
            "eval.ks=[1, 10]",
            "optim.betas=0.8,0.9",
            "mlflow.enabled=false",
            "optim.lr=0",
        ],
    )
    assert cfg.train.epochs == 3 and cfg.eval.ks == (1, 10) and cfg.optim.betas == (0.8, 0.9)
    # a string setting takes the text as written: true and 123e4 are not a bool and a float here
    assert (cfg.mlflow.experiment, cfg.mlflow.run_name, cfg.mlflow.run_id) == ("exp a", "true", "123e4")
    assert cfg.mlflow.enabled is False and cfg.optim.lr == 0.0
    for item, words in (
        ("train.epochs=true", "train.epochs"),
        ("train.epochs=2.5", "train.epochs"),
        ("train.nope=1", "unknown key 'nope'"),
        ("nosection.x=1", "unknown section"),
    ):
        with pytest.raises(ConfigError, match=words) as e:
            load_config(None, [item])
        assert repr(item) in str(e.value)


def test_every_setting_has_its_one_line():
    for sec in dataclasses.fields(Config):
        section = sec.default_factory()
        docs = config.setting_docs(type(section))
        assert set(docs) == {f.name for f in dataclasses.fields(section)}, sec.name
        assert all(len(line) > 5 for line in docs.values()), sec.name


def test_config_show_lists_every_setting_as_toml(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "training", "config", "--show"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    assert "dim = 64" in p.stdout and "# width of the item embeddings" in p.stdout
    path = tmp_path / "all.toml"
    path.write_text(p.stdout)
    assert tomllib.loads(p.stdout).keys() == Config().to_dict().keys()
    assert load_config(str(path)) == Config()  # it is a config file of the defaults
    shown = subprocess.run(
        [sys.executable, "-m", "training", "config", "--show", "--set", "train.epochs=3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert "\nepochs = 3 " in shown
    helped = subprocess.run(
        [sys.executable, "-m", "training", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    ).stdout
    assert "config --show" in helped


@pytest.mark.parametrize("dotted", sorted(config.CHOICES))
def test_every_choice_setting_refuses_another_value_by_name(dotted):
    """Choice settings are checked in one place (config.CHOICES): any other value is a
    ConfigError that names the setting and its choices; each choice itself passes."""
    with pytest.raises(config.ConfigError, match=f"{re.escape(dotted)} must be "):
        config.load_config(None, [f"{dotted}=not-a-choice"])
    for value in config.CHOICES[dotted]:
        try:
            config.load_config(None, [f'{dotted}="{value}"'])
        except config.ConfigError as e:  # another rule may tie it to a second setting (ligr: sasrec)
            assert dotted not in str(e).split(" must be ")[0], e


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_every_shipped_config_loads_and_sets_only_what_it_names(path):
    """A shipped preset must keep loading as the settings move; the file's own values win."""
    doc = tomllib.loads(path.read_text())
    cfg = load_config(str(path))
    for section, table in doc.items():
        for key, value in table.items():
            got = getattr(getattr(cfg, section), key)
            assert (list(got) if isinstance(got, tuple) else got) == value, f"{path.name}: {section}.{key}"


def test_the_public_recipe_is_the_esasrec_benchmarks_sasrec():
    """configs/public-sasrec-sampled-softmax.toml: the settings of the public figures'
    SASRec + sampled softmax (d=256, 1 block, 1 head, dropout 0.2, 256 negatives, Adam 1e-3)."""
    cfg = load_config(str(ROOT / "configs" / "public-sasrec-sampled-softmax.toml"))
    m, loss, o = cfg.model, cfg.loss, cfg.optim
    assert (m.attention, m.layer, m.dim, m.num_layers, m.num_heads, m.dropout) == ("sasrec", "standard", 256, 1, 1, 0.2)
    assert (loss.kind, loss.num_negatives, loss.negatives) == ("sampled_softmax", 256, "per_token")
    assert (o.lr, o.embedding_lr, o.betas, o.weight_decay) == (1e-3, 1e-3, (0.9, 0.999), 0)  # torch's Adam
    assert (o.warmup_steps, o.decay, o.grad_clip) == (0, "constant", 0)
    assert cfg.eval.patience > 0 and cfg.eval.best_metric == "valid/full/ndcg@10"
