"""The examples' shared command line: bad input exits with status 2 and the fix, before any cluster work."""

import pytest

from yatt_ray.cli import main


def test_bad_override_exits_2_with_the_message(capsys):
    with pytest.raises(SystemExit) as info:
        main("examples/configs/grpo.yaml", argv=["algo.kl_estimator=k9"])
    assert info.value.code == 2
    assert "algo.kl_estimator='k9' is unknown; valid: k1, k2, k3" in capsys.readouterr().out


def test_missing_config_file(capsys):
    with pytest.raises(SystemExit):
        main("examples/configs/grpo.yaml", argv=["--config", "nope.yaml"])
    assert "config file 'nope.yaml' does not exist" in capsys.readouterr().out
