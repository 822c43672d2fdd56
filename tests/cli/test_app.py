from typer.testing import CliRunner

from scalegp.cli.app import app

runner = CliRunner()


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.startswith("scalegp ")


def test_info_reports_backend_and_auto_choice():
    result = runner.invoke(app, ["info", "--n", "65536", "--d", "4"])
    assert result.exit_code == 0, result.output
    assert "backend: cpu" in result.output
    assert "pallas  interpret mode" in result.output
    assert "auto at n = m = 65536, d = 4: xla" in result.output
