"""Plans and profiles are written whole or not at all (``jvarlen.plan.json_file``). Pure planner: no JAX."""

from __future__ import annotations

import json
import os
import stat

import pytest

from jvarlen.plan.coefficients import CostCoefficients, LayerTime
from jvarlen.plan.json_file import write_json


def test_a_write_that_fails_midway_leaves_the_previous_file_whole(tmp_path):
    path = tmp_path / "plan.json"
    write_json(path, {"a": 1, "b": [2, 3]})
    before = path.read_text()
    with pytest.raises(TypeError):  # json.dump fails after it has written the first keys
        write_json(path, {"a": 2, "b": [4], "c": object()})
    assert path.read_text() == before and json.loads(before) == {"a": 1, "b": [2, 3]}
    assert os.listdir(tmp_path) == ["plan.json"]  # no temporary file left behind


def test_a_written_file_has_the_umasks_permissions_and_its_folder_is_made(tmp_path):
    old = os.umask(0o022)
    try:
        path = tmp_path / "new" / "profile.json"
        write_json(path, {"x": 1.5}, indent=2)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # readable by the cluster's other users
    assert path.read_text() == '{\n  "x": 1.5\n}\n'
    # a profile's measurement report keeps its keys' order, and keys of mixed types
    write_json(path, {"b": 1, "a": {2: "x", "1": "y"}}, indent=None, sort_keys=False)
    assert path.read_text() == '{"b": 1, "a": {"2": "x", "1": "y"}}\n'


def test_a_cost_profile_saved_over_another_loads_as_the_new_one(tmp_path):
    path = tmp_path / "profile.json"
    first = CostCoefficients(fwd=LayerTime(1e-9, 2e-9, 0.0))
    second = CostCoefficients(fwd=LayerTime(3e-9, 4e-9, 1e-5))
    first.save(path)
    second.save(path)
    assert CostCoefficients.load(path) == second
    assert path.read_text().startswith('{\n  "')  # the profile keeps its two-space indent
