"""ShardSettings: checked once when made (a bad setting names its flag), frozen, and what
build_shards' keyword settings become."""

import dataclasses

import pytest

from dataprep.build import build_shards
from dataprep.errors import DataprepError
from dataprep.settings import ShardSettings


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("tail", "--tail 'x': choose one of fill, drop"),
        ("method", "--method 'x': choose one of auto, lpt, kk"),
        ("dedup", "--dedup 'x': unknown; choose one of exact, consecutive, none"),
        ("split", "--split 'x': unknown; choose one of leave_one_out, temporal"),
    ],
)
def test_a_bad_choice_names_the_setting_and_its_choices(setting, message):
    with pytest.raises(DataprepError) as e:
        ShardSettings(world_size=2, batch_size=8, **{setting: "x"})
    assert str(e.value) == message


def test_counts_and_the_split_window_are_checked_when_made():
    with pytest.raises(DataprepError, match="^--window-steps must be >= 1$"):
        ShardSettings(world_size=2, batch_size=8, window_steps=0)
    with pytest.raises(DataprepError, match="^--cut and --horizon belong to --split temporal$"):
        ShardSettings(world_size=2, batch_size=8, horizon=60)
    with pytest.raises(DataprepError, match="^--horizon 0: must be >= 1 second$"):
        ShardSettings(world_size=2, batch_size=8, split="temporal", horizon=0)


def test_the_record_is_frozen_its_reader_options_too():
    s = ShardSettings(world_size=2, batch_size=8, reader_options={"user_col": "who"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.tail = "drop"  # type: ignore[misc]
    with pytest.raises(TypeError):
        s.reader_options["item_col"] = "what"  # type: ignore[index]
    assert dataclasses.replace(s, tail="drop").reader_options == {"user_col": "who"}


def test_keyword_settings_make_the_record_others_are_reader_options(tmp_path):
    s = ShardSettings.from_kwargs(world_size=2, batch_size=8, tail="drop", user_col="who")
    assert s == ShardSettings(world_size=2, batch_size=8, tail="drop", reader_options={"user_col": "who"})
    with pytest.raises(TypeError, match="not both"):
        build_shards(str(tmp_path / "in.txt"), "sasrec", str(tmp_path / "out"), s, seed=1)
