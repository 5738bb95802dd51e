"""Webhook URLs and the allow-list (pure, table-driven): form, credentials, schemes, and every
resolved address inside TRAINYARD_WEBHOOK_ALLOW."""
import pytest

from jobs.notify.policy.targets import Target, TargetError, parse_allow, parse_url, pick_address


@pytest.mark.parametrize("url, target", [
    ("http://127.0.0.1:8080/hook", Target("http", "127.0.0.1", 8080, "/hook")),
    ("https://Hooks.Example.com/a/b?x=1", Target("https", "hooks.example.com", 443, "/a/b?x=1")),
    ("http://hooks.example.com", Target("http", "hooks.example.com", 80, "/")),
    ("http://[::1]:9000/h", Target("http", "::1", 9000, "/h")),
    ("https://hooks.example.com./x", Target("https", "hooks.example.com", 443, "/x")),
])
def test_good_urls_are_taken_apart(url, target):
    assert parse_url(url) == target


@pytest.mark.parametrize("url, problem", [
    ("", "give the URL"),
    (None, "give the URL"),
    ("ftp://example.com/x", "only http and https"),
    ("file:///etc/passwd", "only http and https"),
    ("gopher://127.0.0.1:6379/_PING", "only http and https"),
    ("example.com/hook", "only http and https"),
    ("http://user:pw@example.com/", "no credentials"),
    ("http://user@example.com/", "no credentials"),
    ("http:///nohost", "names no host"),
    ("http://exa mple.com/", "no spaces"),
    ("http://example.com/\r\nX-Evil: 1", "no spaces or control"),
    ("http://example.com:99999/", "not a valid URL"),
    ("http://bad_host!.com/", "not a valid host name"),
    ("http://e.com/" + "a" * 2000, "at most 2000"),
])
def test_bad_urls_are_refused_with_the_reason(url, problem):
    with pytest.raises(TargetError, match=problem):
        parse_url(url)


def test_the_allow_list_takes_hosts_addresses_and_cidrs():
    allow = parse_allow(["127.0.0.1", " 10.0.0.0/8 ", "Hooks.Example.com", "", "::1"])
    assert allow.hosts == {"hooks.example.com"}
    assert [str(n) for n in allow.networks] == ["127.0.0.1/32", "10.0.0.0/8", "::1/128"]
    with pytest.raises(TargetError, match="'not a host!' is not a host name"):
        parse_allow(["not a host!"])


ALLOW = parse_allow(["127.0.0.1", "10.1.0.0/16", "hooks.example.com", "2001:db8::/32"])


@pytest.mark.parametrize("url, addresses, address, error", [
    ("http://127.0.0.1:9/h", ["127.0.0.1"], "127.0.0.1", None),
    ("http://receiver.internal/h", ["10.1.2.3"], "10.1.2.3", None),                       # by network
    ("http://hooks.example.com/h", ["93.184.216.34"], "93.184.216.34", None),            # by name: anywhere
    ("http://[2001:db8::5]/h", ["2001:db8::5"], "2001:db8::5", None),
    ("http://127.0.0.2/h", ["127.0.0.2"], None, "does not allow"),                        # a /32 is one address
    ("http://169.254.169.254/latest/meta-data", ["169.254.169.254"], None, "does not allow"),  # cloud metadata
    ("http://localhost/h", ["::1", "127.0.0.1"], None, "resolves to ::1"),                 # every address must pass
    ("http://rebind.example.net/h", ["10.1.0.9", "192.168.0.1"], None, "resolves to 192.168.0.1"),
    ("http://x.example.net/h", ["::ffff:10.1.0.9"], "::ffff:10.1.0.9", None),              # v4-mapped judged as v4
    ("http://x.example.net/h", ["::ffff:192.168.0.1"], None, "does not allow"),
    ("http://x.example.net/h", [], None, "does not resolve"),
])
def test_every_resolved_address_must_be_allowed(url, addresses, address, error):
    target = parse_url(url)
    if error is None:
        assert pick_address(target, addresses, ALLOW) == address
    else:
        with pytest.raises(TargetError, match=error):
            pick_address(target, addresses, ALLOW)


def test_an_empty_allow_list_reaches_nothing():
    with pytest.raises(TargetError, match="TRAINYARD_WEBHOOK_ALLOW is empty"):
        pick_address(parse_url("http://127.0.0.1/"), ["127.0.0.1"], parse_allow([]))


def test_the_host_header_keeps_a_non_default_port():
    assert parse_url("http://127.0.0.1:8080/").host_header == "127.0.0.1:8080"
    assert parse_url("https://h.example.com/").host_header == "h.example.com"
    assert parse_url("http://[::1]:81/").host_header == "[::1]:81"
