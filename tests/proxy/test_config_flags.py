"""The prefill+decode role's flag: --prefill-decode, with the old --pd still read."""

from __future__ import annotations

import pytest

from epdctl.proxy.argv import parse_argv
from epdctl.proxy.config import ProxyConfig


def test_the_old_pd_flag_is_read_as_prefill_decode_and_never_written(capsys):
    config = parse_argv(["--model", "m", "--pd", "http://a", "--prefill-decode", "http://b"])
    assert config.prefill_decode == ("http://a", "http://b")
    assert "--pd is deprecated; use --prefill-decode" in capsys.readouterr().err
    argv = config.to_argv()
    assert "--pd" not in argv and argv.count("--prefill-decode") == 2
    assert parse_argv(argv) == config
    assert capsys.readouterr().err == ""  # the new flag alone: no warning


def test_help_names_only_the_new_flag(capsys):
    with pytest.raises(SystemExit):
        parse_argv(["--help"])
    out = capsys.readouterr().out
    assert "--prefill-decode URL" in out and "--pd " not in out


def test_without_a_final_stage_the_error_names_the_flags(capsys):
    with pytest.raises(SystemExit):
        parse_argv(["--model", "m"])
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        "error: give --prefill-decode, or --prefill and --decode")


@pytest.mark.parametrize(("argv", "refused"), [
    (["--prefill-decode", "http://pd", "--decode-timeout", "60"], "--decode-timeout (60s)"),
    (["--prefill", "http://p", "--decode", "http://d", "--prefill-timeout", "59",
      "--decode-timeout", "600"], "--prefill-timeout (59s)"),
])
def test_with_overlap_encode_timeout_must_be_below_the_waiting_stages(capsys, argv, refused):
    base = ["--model", "m", "--encode", "http://e", "--encode-timeout", "60", *argv]
    assert not parse_argv(base).overlap  # without overlap: E first, no wait at PD
    with pytest.raises(SystemExit):
        parse_argv([*base, "--overlap"])
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        f"error: --encode-timeout (60s) must be below {refused} with --overlap: P or PD "
        "waits for E that long before it encodes the item itself")


@pytest.mark.parametrize(("kwargs", "role"), [
    ({"prefill_decode": ("http://pd0",)}, "prefill_decode"),
    ({"prefill": ("http://p0",), "decode": ("http://d0",)}, "decode"),
])
def test_the_final_role_is_a_pool_name(kwargs, role):
    from epdctl.proxy.upstreams import Upstreams

    config = ProxyConfig(models=("m",), **kwargs)
    assert config.final_role == role and role in Upstreams(config).pools


def test_every_role_is_a_proxyconfig_field():
    """The plan hands each role's instance URLs to the ProxyConfig field of the role's name."""
    import dataclasses

    from epdctl.topology.model import ROLE_NAMES

    assert set(ROLE_NAMES) <= {f.name for f in dataclasses.fields(ProxyConfig)}


@pytest.mark.parametrize(("url", "refused"), [
    ("https://pd:8443", "https is not supported to instances"),
    ("pd:8000", "expected http://host:port"),
    ("http://pd:99999", "the port is not a number from 0 to 65535"),
])
def test_an_instance_url_the_proxy_cannot_speak_to_is_refused_at_start(capsys, url, refused):
    """An https URL once went out as plain HTTP to port 443: refused before anything runs,
    in one error line that names the flag and the URL."""
    with pytest.raises(SystemExit):
        parse_argv(["--model", "m", "--prefill-decode", "http://pd", "--encode", url])
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(f"python -m epdctl.proxy: error: --encode {url}: ") and refused in err
