"""The fp8 scaling state under the pipelines (tests/test_fp8_state.py's pipeline cases): the same as one
device's."""

import pytest
from test_fp8_state import PIPELINES, matches_single_device


@pytest.fixture(scope="module")
def one_device() -> dict:
    """The one-device runs by their overrides, each made once (blockwise-pp_1f1b and blockwise-pp_fsdp_tp share)."""
    return {}


@pytest.mark.slow
@pytest.mark.parametrize("case", PIPELINES)
def test_fp8_pipeline_matches_single_device(one_device, case):
    matches_single_device(one_device, case)
