"""The premise of tests/conftest.py's map guard: a compiled XLA:CPU step holds hundreds of memory mappings while it
lives and gives them back when it is released, so a worker that lets its shared steps go stays under
vm.max_map_count."""

from __future__ import annotations

import sys

import pytest
from helpers import Trainers, memory_maps

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps is Linux's")


def test_a_released_step_gives_its_mappings_back():
    before = memory_maps()
    trainers = Trainers()
    trainers.step(rules="fsdp_tp", mesh={"fsdp": 4, "tensor": 2})
    held = memory_maps() - before
    assert held > 200, held  # 576 measured for this step, on jax 0.10.2
    trainers.release()
    assert memory_maps() - before < held / 4
