"""docs/configuration.md is the generator's output, and every config key is described (no cluster)."""

import dataclasses
from pathlib import Path

import pytest

from yatt_ray.cli import keys_help, main
from yatt_ray.config import Config
from yatt_ray.config_reference import COMMAND, field_comments, reference_markdown, sections

DOC = Path(__file__).parents[2] / "docs" / "configuration.md"


def _leaf_keys(node, prefix=""):
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            yield from _leaf_keys(value, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name


def test_the_page_is_the_generators_output():
    assert DOC.read_text() == reference_markdown(), (
        f"{DOC.name} is out of date with yatt_ray/config.py; regenerate it: {COMMAND}"
    )


def test_every_key_has_a_type_a_default_and_a_comment():
    docs = [k for s in sections() for k in s.keys]
    assert [k.key for k in docs] == list(_leaf_keys(Config()))  # every key, once, in declaration order
    missing = [k.key for k in docs if not k.comment.strip()]
    assert not missing, (
        f"write a comment where these keys' defaults are declared in yatt_ray/config.py: {missing}"
    )
    assert all(k.type and k.default for k in docs)
    assert all(s.intro for s in sections()), "every section class needs a docstring"


def test_types_and_defaults_read_as_a_config_writer_writes_them():
    by_key = {k.key: k for s in sections() for k in s.keys}
    assert by_key["rollout.engine"].type == "one of `auto`, `vllm`, `hf`"
    assert by_key["checkpoint.every_steps"].type == "int or null"
    assert by_key["data.train_files"].type == "list of str"
    assert by_key["checkpoint.storage_options"].type == "mapping"
    assert by_key["output.wandb_mode"].type.startswith('one of `""`')
    assert (by_key["cluster.address"].default, by_key["train.steps"].default) == ("null", "80")
    assert (by_key["output.dir"].default, by_key["output.plot"].default) == ('"runs/grpo"', "true")


def test_comments_come_from_above_the_field_and_its_own_lines_without_pragmas():
    source = '''
class A:
    """Doc."""

    # first line
    # second line
    x: int = 1  # trailing
    y: float = (  # opening
        0.1  # inside
    )  # fmt: skip
    z: str = "# not a comment"

    # a comment after a blank line belongs to w only
    w: int = 2
'''
    got = field_comments(source)
    assert got[("A", "x")] == "first line second line trailing"
    assert got[("A", "y")] == "opening inside"
    assert got[("A", "z")] == ""
    assert got[("A", "w")] == "a comment after a blank line belongs to w only"


def test_markdown_cells_stay_in_their_column():
    page = reference_markdown()
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    assert len(rows) == len(list(_leaf_keys(Config())))
    for row in rows:  # 4 columns: 5 unescaped pipes
        assert row.replace("\\|", "").count("|") == 5, row
    assert "| `algo.policy_loss` |" in page and "ppo_clip \\| gspo" in page


def test_help_names_the_page_and_every_section(capsys):
    text = keys_help()
    assert "docs/configuration.md" in text
    for s in sections():
        assert f"  {s.name} " in text
    with pytest.raises(SystemExit) as info:  # every example's --help (they share yatt_ray.cli.main)
        main("examples/configs/grpo.yaml", description="GRPO", argv=["--help"])
    assert info.value.code == 0
    assert text in capsys.readouterr().out
