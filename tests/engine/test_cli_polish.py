"""The console script's global surface: `python -m graphrunner`, `--version`, `--log-level`,
and a `--help` that builds every subcommand's parser without importing torch.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

import graphrunner
from graphrunner.cli import LOG_LEVEL_ENV, LOG_LEVELS, build_parser, configure_logging, main


def _run(*code_or_args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *code_or_args], capture_output=True, text=True, timeout=120, env=env)


@pytest.fixture
def restore_logger():
    logger = logging.getLogger("graphrunner")
    level, handlers = logger.level, list(logger.handlers)
    yield logger
    logger.setLevel(level)
    logger.handlers[:] = handlers


def test_version_attribute():
    assert isinstance(graphrunner.__version__, str)
    assert graphrunner.__version__[0].isdigit()


def test_python_m_help_and_version():
    help_ = _run("-m", "graphrunner", "--help")
    assert help_.returncode == 0, help_.stderr
    for word in ("generate", "inspect", "bench", "launch", "--log-level", "--version"):
        assert word in help_.stdout
    version = _run("-m", "graphrunner", "--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"graphrunner {graphrunner.__version__}"


def test_help_does_not_import_torch():
    out = _run("-c", "import sys, graphrunner.cli as c; c.build_parser(); print('torch' in sys.modules)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", "building the parser imported torch"


def test_configure_logging_shows_info_with_a_short_format():
    code = (
        "import logging; from graphrunner.cli import configure_logging; configure_logging('info');"
        "logging.getLogger('graphrunner.runner').info('KV cache: %d blocks', 7);"
        "logging.getLogger('graphrunner.runner').debug('hidden')"
    )
    out = _run("-c", code)
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip() == "INFO graphrunner.runner: KV cache: 7 blocks"


def test_configure_logging_keeps_a_configured_handler(restore_logger):
    handler = logging.NullHandler()
    restore_logger.handlers[:] = [handler]
    configure_logging("debug")
    assert restore_logger.level == logging.DEBUG
    assert restore_logger.handlers == [handler]


def test_configure_logging_rejects_an_unknown_level():
    with pytest.raises(ValueError, match="'verbose'.*debug, info, warning, error"):
        configure_logging("verbose")


TABLE = ["inspect", "table", "--model", "builtin:tiny-llama"]


@pytest.mark.parametrize(
    ("flag", "env", "expected"),
    [(["--log-level", "info"], None, "info"), ([], "DEBUG", "debug"), (["--log-level", "error"], "debug", "error")],
)
def test_log_level_from_flag_or_env(restore_logger, monkeypatch, capsys, flag, env, expected):
    if env is None:
        monkeypatch.delenv(LOG_LEVEL_ENV, raising=False)
    else:
        monkeypatch.setenv(LOG_LEVEL_ENV, env)
    assert main([*flag, *TABLE]) == 0
    assert restore_logger.level == LOG_LEVELS[expected]


def test_no_level_leaves_logging_as_it_was(restore_logger, monkeypatch, capsys):
    monkeypatch.delenv(LOG_LEVEL_ENV, raising=False)
    restore_logger.setLevel(logging.NOTSET)
    assert main(TABLE) == 0
    assert restore_logger.level == logging.NOTSET


def test_bad_log_level_flag_errors(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--log-level", "loud", *TABLE])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "'loud'" in err and "debug" in err and "error" in err


def test_bad_log_level_env_errors(monkeypatch, capsys):
    monkeypatch.setenv(LOG_LEVEL_ENV, "loud")
    with pytest.raises(SystemExit) as exit_:
        main(TABLE)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"{LOG_LEVEL_ENV}='loud'" in err and "debug, info, warning, error" in err
