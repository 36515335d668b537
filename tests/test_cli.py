from elastic_ep.cli import main


def test_unknown_command_prints_usage_and_fails(capsys):
    assert main(["no-such-command"]) == 2
    assert "usage: elastic-ep" in capsys.readouterr().err
