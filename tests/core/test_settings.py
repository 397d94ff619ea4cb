"""The Python settings helper: strict parsing, caching, and the error that names variable, value and what is
accepted."""
import pytest

from ebbtide import settings as S
from ebbtide.errors import InvalidArgumentError, SettingError


@pytest.fixture
def fresh(monkeypatch):
    yield monkeypatch
    S.reset()


def _decl(name, parse, default):
    return S.declare(name, parse, default, f"test setting {name}")


def test_default_when_unset_or_empty(fresh):
    s = _decl("EBBTIDE_TEST_SETTING_A", S.parse_float(0.0, lo_open=True), 5.0)
    fresh.delenv(s.name, raising=False)
    assert S.get(s) == 5.0
    S.reset()
    fresh.setenv(s.name, "  ")
    assert S.get(s) == 5.0


def test_value_parsed_once_and_cached(fresh):
    s = _decl("EBBTIDE_TEST_SETTING_B", S.parse_int(0), 1)
    fresh.setenv(s.name, "7")
    assert S.get(s) == 7
    fresh.setenv(s.name, "9")
    assert S.get(s.name) == 7          # cached
    S.reset(s.name)
    assert S.get(s) == 9


@pytest.mark.parametrize("parse,text,needle", [
    (S.parse_int(0), "-5", "an integer >= 0"),
    (S.parse_int(0), "lots", "an integer >= 0"),
    (S.parse_float(0.0, lo_open=True), "0", "a number > 0.0"),
    (S.parse_float(0.0, lo_open=True), "nan", "a number > 0.0"),
    (S.parse_bool, "maybe", "1/true/yes/on or 0/false/no/off (any case)"),
    (S.parse_choice("cpu", "none"), "CPU", "one of cpu, none"),
])
def test_bad_value_is_a_setting_error_naming_everything(fresh, parse, text, needle):
    s = _decl("EBBTIDE_TEST_SETTING_C" + str(abs(hash((text, needle))) % 10_000), parse, None)
    fresh.setenv(s.name, text)
    with pytest.raises(SettingError) as ei:
        S.get(s)
    msg = str(ei.value)
    assert s.name in msg and repr(text) in msg and needle in msg
    assert isinstance(ei.value, InvalidArgumentError)
    assert ei.value.name == s.name and ei.value.value == text


def test_redeclare_with_other_meaning_is_refused():
    S.declare("EBBTIDE_TEST_SETTING_D", S.parse_bool, False, "d")
    S.declare("EBBTIDE_TEST_SETTING_D", S.parse_bool, False, "d")  # same meaning: fine
    with pytest.raises(RuntimeError):
        S.declare("EBBTIDE_TEST_SETTING_D", S.parse_bool, True, "d")
