from slimecore.plugins import installed_entry_points, load_plugins


def test_discovered_with_its_options():
    assert "search_r1" in installed_entry_points()
    options = {o.name: o.default for o in load_plugins(["search_r1"]).declared_options()["search_r1"]}
    assert options == {"max_turns": 2, "search_url": None, "search_topk": 3}
