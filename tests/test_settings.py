"""The TIERRUN_* variables, read in one place (tierrun/settings.py), as tables."""

import os
import subprocess
import sys

import pytest

from tierrun import settings as settings_module
from tierrun.link.config import LinkConfig
from tierrun.settings import (
    FRONTEND_TOKEN, Settings, SettingsError, frontend_process_env, store_process_env, take_frontend_token,
    without_secrets,
)


@pytest.mark.parametrize("environ, expected", [
    ({}, Settings()),
    ({"TIERRUN_TOKEN": "t0k"}, Settings(token="t0k")),
    ({"TIERRUN_TOKEN": "", "TIERRUN_TOKEN_FILE": ""}, Settings()),
    ({"TIERRUN_TOKEN_FILE": "/run/token"}, Settings(token_file="/run/token")),
    ({"TIERRUN_LOG_LEVEL": "debug"}, Settings(log_level="DEBUG")),
    ({"TIERRUN_LOG_LEVEL": ""}, Settings()),  # (a template that left it blank: the default)
    ({"TIERRUN_LOG_LEVEL": "warn"}, Settings(log_level="WARN")),  # (logging's other names)
    ({"TIERRUN_ETCD_PASSWORD": "s3cret"}, Settings(etcd_password="s3cret")),
    ({"TIERRUN_ETCD_PASSWORD": ""}, Settings(etcd_password="")),
    ({"TIERRUN_LINK_HEARTBEAT": "0.2", "TIERRUN_LINK_TIMEOUT": "1", "TIERRUN_LINK_GRACE": "4"},
     Settings(link=LinkConfig(heartbeat_interval=0.2, heartbeat_timeout=1.0, grace=4.0))),
    ({"TIERRUN_LINK_BATCH_WINDOW": "0.01", "TIERRUN_LINK_BATCHES_IN_FLIGHT": "0"},
     Settings(link=LinkConfig(batch_window=0.01, batches_in_flight=0))),
    ({"TIERRUN_LINK_WRITE_HOLD": "0", "TIERRUN_LINK_HOLD_GRID": "0.05"},
     Settings(link=LinkConfig(contended_write_hold=0.0, hold_grid=0.05))),
    ({"TIERRUN_LINK_HANDSHAKE_TIMEOUT": "2", "TIERRUN_LINK_HANDSHAKES_PER_ADDRESS": "8"},
     Settings(link=LinkConfig(handshake_timeout=2.0, max_handshakes_per_address=8))),
    ({"PATH": "/bin", "TIERRUN_UNKNOWN": "x"}, Settings()),
])
def test_from_env(environ, expected):
    assert Settings.from_env(environ) == expected


@pytest.mark.parametrize("environ, message", [
    ({"TIERRUN_LINK_TIMEOUT": "soon"}, r"\$TIERRUN_LINK_TIMEOUT='soon': write a number of seconds"),
    ({"TIERRUN_LINK_HEARTBEAT": ""}, r"\$TIERRUN_LINK_HEARTBEAT='': write a number of seconds"),
    ({"TIERRUN_LINK_BATCHES_IN_FLIGHT": "1.5"}, r"\$TIERRUN_LINK_BATCHES_IN_FLIGHT='1.5': write a whole number"),
    ({"TIERRUN_LOG_LEVEL": "verbose"}, r"\$TIERRUN_LOG_LEVEL=.verbose.: write one of DEBUG, INFO, WARNING"),
])
def test_unusable_settings_are_named(environ, message):
    with pytest.raises(SettingsError, match=message):
        Settings.from_env(environ)


def test_job_token_from_the_variable_then_the_file(tmp_path):
    path = tmp_path / "token"
    path.write_bytes(b"  from-the-file\n")
    assert Settings(token="direct", token_file=str(path)).job_token() == b"direct"
    assert Settings(token_file=str(path)).job_token() == b"from-the-file"
    assert Settings().job_token() is None


def test_the_token_file_is_read_only_when_a_token_is_asked_for(tmp_path):
    settings = Settings.from_env({"TIERRUN_TOKEN_FILE": str(tmp_path / "missing")})
    with pytest.raises(OSError):
        settings.job_token()


def test_child_environments_hold_no_secret(monkeypatch):
    monkeypatch.setenv("TIERRUN_TOKEN", "inherited")
    monkeypatch.setenv("TIERRUN_ETCD_PASSWORD", "pw")
    monkeypatch.setenv("TIERRUN_TOKEN_FILE", "/run/token")  # (a name, no secret)
    for env in (store_process_env(), frontend_process_env(b"\x01\xff"), without_secrets()):
        assert "TIERRUN_TOKEN" not in env and "TIERRUN_ETCD_PASSWORD" not in env
        assert env["TIERRUN_TOKEN_FILE"] == "/run/token" and env["PATH"] == os.environ["PATH"]
    assert frontend_process_env(b"\x01\xff")[FRONTEND_TOKEN] == "01ff"
    assert FRONTEND_TOKEN not in os.environ and os.environ["TIERRUN_TOKEN"] == "inherited"


def test_take_from_env_reads_then_removes_the_secrets():
    environ = {"TIERRUN_TOKEN": "t0k", "TIERRUN_ETCD_PASSWORD": "", "TIERRUN_TOKEN_FILE": "/run/token",
               "TIERRUN_LOG_LEVEL": "INFO", "PATH": "/bin"}
    assert Settings.take_from_env(environ) == Settings(token="t0k", token_file="/run/token", etcd_password="",
                                                       log_level="INFO")
    assert environ == {"TIERRUN_TOKEN_FILE": "/run/token", "TIERRUN_LOG_LEVEL": "INFO", "PATH": "/bin"}
    assert Settings.take_from_env(environ).token is None  # (a mapping of its own: nothing remembered)


def test_take_from_env_remembers_what_it_took_from_this_process(monkeypatch):
    """A second launch in one process still has the secrets; one set anew wins."""
    monkeypatch.setattr(settings_module, "_taken", {})
    monkeypatch.setenv("TIERRUN_TOKEN", "first")
    monkeypatch.setenv("TIERRUN_ETCD_PASSWORD", "pw")
    assert Settings.take_from_env().token == "first"
    assert "TIERRUN_TOKEN" not in os.environ and "TIERRUN_ETCD_PASSWORD" not in os.environ
    again = Settings.take_from_env()
    assert (again.token, again.etcd_password) == ("first", "pw")
    monkeypatch.setenv("TIERRUN_TOKEN", "second")
    assert Settings.take_from_env().token == "second" and "TIERRUN_TOKEN" not in os.environ


def test_take_from_env_removes_nothing_when_a_variable_is_unusable():
    environ = {"TIERRUN_TOKEN": "t", "TIERRUN_LINK_TIMEOUT": "soon"}
    with pytest.raises(SettingsError):
        Settings.take_from_env(environ)
    assert environ["TIERRUN_TOKEN"] == "t"


def test_an_empty_token_file_is_an_error(tmp_path):
    path = tmp_path / "token"
    path.write_text(" \n")
    with pytest.raises(SettingsError, match=r"TIERRUN_TOKEN_FILE=.*token is empty"):
        Settings(token_file=str(path)).job_token()


def test_the_frontend_token_is_taken_out_of_the_environment(monkeypatch):
    monkeypatch.setenv(FRONTEND_TOKEN, "01ff")
    assert take_frontend_token() == b"\x01\xff"
    assert FRONTEND_TOKEN not in os.environ
    assert take_frontend_token() == b""


@pytest.mark.parametrize("argv, prefix", [
    (["store", "--port", "0"], "tierrun store: "),
    (["proxy", "--upstream", "127.0.0.1:1"], "tierrun proxy: "),
    (["--standalone", "--nproc_per_node", "1", "train.py"], "tierrun: error: "),
])
def test_commands_name_an_unusable_variable_in_one_line(argv, prefix):
    env = dict(os.environ, TIERRUN_TOKEN="t", TIERRUN_LINK_TIMEOUT="soon")
    done = subprocess.run([sys.executable, "-m", "tierrun", *argv], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert done.stderr == f"{prefix}$TIERRUN_LINK_TIMEOUT='soon': write a number of seconds\n"
