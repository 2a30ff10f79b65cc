"""plugins.Registry: the one table class of the five extension points."""

from __future__ import annotations

import pytest

from fedelastic import plugins
from fedelastic.errors import ConfigError
from fedelastic.plugins import Registry


class Base:
    name = "base"


def test_entries_adopted_before_their_registry_exists_reach_it(monkeypatch):
    monkeypatch.setattr(plugins, "_CARRIED", {})
    monkeypatch.setattr(plugins, "_PENDING", {})
    plugins.adopt({"gadgets": {"mine": "pkg.mod:mine"}})  # a worker adopts before it imports the module
    table = Registry("gadgets", {"shipped": "pkg.mod:shipped"}, where="<register_gadget>", carried=True)
    assert dict(table) == {"shipped": "pkg.mod:shipped", "mine": "pkg.mod:mine"}
    assert table.user_entries() == {"mine": "pkg.mod:mine"}
    assert plugins.registered() == {"gadgets": {"mine": "pkg.mod:mine"}}
    plugins.adopt({"gadgets": {"mine": "other:thing", "new": "pkg.mod:new"}})  # a known name is kept
    assert table["mine"] == "pkg.mod:mine" and table["new"] == "pkg.mod:new"


def test_a_class_registers_under_its_own_name_once():
    table = Registry("things", where="<register_thing>")

    class Mine(Base):
        name = "mine"

    class Other(Base):
        name = "mine"

    class Nameless(Base):
        pass

    assert table.add_class(Mine, Base, key="x.thing") == "mine" and table["mine"] is Mine
    assert table.add_class(Mine, Base, key="x.thing") == "mine"  # the same class again: harmless
    with pytest.raises(ConfigError, match="a name not registered yet"):
        table.add_class(Other, Base, key="x.thing")
    with pytest.raises(ConfigError, match="a non-empty string of its own"):
        table.add_class(Nameless, Base, key="x.thing")  # 'base' is inherited, not its own
    with pytest.raises(ConfigError, match="a subclass of"):
        table.add_class(int, Base, key="x.thing")
    with pytest.raises(ConfigError, match="checked"):
        table.add_class(type("Late", (Base,), {"name": "late"}), Base, key="x.thing", check=_refuse)
    assert "late" not in table


def _refuse(cls):
    raise ConfigError("<test>", "late", "checked")


def test_a_factory_resolves_by_name_or_module_path():
    table = Registry("widgets", {"two": lambda: 2}, where="<register_widget>")
    table.add_factory("path", "fedelastic.data:load_digits_dataset")
    assert table.resolve("two", context="s.toml", key="k", returns="2", prefix="p_")() == 2
    assert table.resolve("path", context="s.toml", key="k", returns="x", prefix="p_").__name__ == "load_digits_dataset"
    with pytest.raises(ConfigError, match="a registered widgets \\['path', 'two'\\]"):
        table.resolve("nothing", context="s.toml", key="k", returns="x", prefix="p_")
    with pytest.raises(ConfigError, match="without ':'"):
        table.add_factory("a:b", lambda: 1)
