"""The real train step compiled for a TPU v5e slice (``v5e:2x4``, 8 chips) on a machine without one.

libtpu compiles for a named topology (``jaxscale.analysis.target``), with ``xla.preset tpu``'s flags in
``LIBTPU_INIT_ARGS``. Run by ``.ci/run``'s compile stage (a venv with ``jaxscale[tpu-compile]``); skipped,
with the reason, where libtpu is not installed.
"""

import pytest
from compile_target import TPU_MISSING, compiled

pytestmark = pytest.mark.skipif(TPU_MISSING is not None, reason=str(TPU_MISSING))

V5E_HBM = 16 * 2**30


def test_fsdp_tp_compiles_for_v5e_with_the_tpu_preset():
    out = compiled("v5e:2x4", "rules=fsdp_tp", "mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2")
    assert out["xla_preset"] == "tpu" and out["device"] == "TPU v5 lite" and out["devices"] == 8
    assert out["gemms"] and set(out["gemms"]) <= {"fused dot", "convolution bf16", "dot bf16"}
    assert "all-gather" in out["collectives"]  # FSDP's parameter gathers
    assert out["fits"] and out["hbm_bytes"] == V5E_HBM


def test_a_pipeline_with_fsdp_and_tp_inside_a_stage_compiles_for_v5e():
    out = compiled("v5e:2x4", "rules=pp_fsdp_tp", "mesh.data=1", "mesh.stage=2", "mesh.fsdp=2", "mesh.tensor=2",
                   "pipeline.schedule=1f1b", "train.microbatches=4")
    assert "collective-permute" in out["collectives"]  # the stages' activations and gradients
    assert out["fits"]


def test_the_tpu_preset_compiles_for_v5p():
    """libtpu refuses the v5e-only all-gather continuation fusion on v5p: the preset leaves it out."""
    out = compiled("v5p:2x2x2", "rules=fsdp_tp", "mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2")
    assert out["device"] == "TPU v5" and out["devices"] == 8 and out["fits"]
