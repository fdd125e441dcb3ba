"""jaxscale.config.refusals: every error naming two or more config settings is a row of the one table; each row's
line names its settings; docs/compatibility.md is what the table gives; the silent selections a run took."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import tiny_config

from jaxscale.config import compatibility, refusals, selections
from jaxscale.config.read import MESH_AXES, ConfigError
from jaxscale.layout.rules import Layout, Rules

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jaxscale"
SECTION = "|".join(refusals.SECTIONS)
KEY = re.compile(rf"\b(?:{SECTION})\.[a-z_][a-z_0-9]*(?:\.[a-z_][a-z_0-9]*)*|\brules '")

# Errors that name two settings but compare the config with something that is not a setting: a checkpoint, the
# data, a Hugging Face config.json, a traced weight's share on a device. The table checks settings against settings.
ELSEWHERE = {
    ("checkpoint/store.py", "check_compatible"): "a checkpoint's learning-rate schedule against train.steps",
    ("checkpoint/params.py", "_with_balance"): "a checkpoint's routing biases against model.moe.balance",
    ("data/batches.py", "byte_streams"): "the bytes of the corpus against data.eval_bytes",
    ("data/batches.py", "open_tokens"): "a token file's ids against model.vocab_size",
    ("data/packing.py", "check_lengths"): "the documents' lengths against train.seq_len",
    ("hf/convert_deepseek.py", "hf_config"): "what DeepSeek-V3's config.json can express (the export)",
    ("hf/models.py", "architecture"): "which Hugging Face architecture a model converts to",
    ("hf/models.py", "check_model"): "a config.json's head counts",
    ("precision/fp8/blockwise.py", "einsum"): "a traced weight's share on one device against precision.fp8_block",
    ("precision/policy.py", "check_resume"): "a checkpoint's copies against precision.params and precision.master",
    ("training/loop.py", "_start"): "checkpoints already in the run's directory",
    ("runtime/elastic.py", "fit"): "the devices left after a failure against train.global_batch (known at start-up)",
}


def _strings(node: ast.AST) -> list[str]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def config_error_sites() -> list[tuple[str, str, int, list[str]]]:
    """Every ``raise ConfigError(...)`` of the package outside the table: (file, function, line, settings named),
    the message's strings read with those of the module's constants it names."""
    sites = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "refusals.py" and path.parent.name == "config":
            continue
        tree = ast.parse(path.read_text())
        constants = {t.id: _strings(a.value) for a in tree.body if isinstance(a, ast.Assign)
                     for t in a.targets if isinstance(t, ast.Name)}
        for function in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)):
            for node in ast.walk(function):
                if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                        and getattr(node.exc.func, "id", None) == "ConfigError"):
                    continue
                texts = _strings(node.exc) + [s for name in ast.walk(node.exc) if isinstance(name, ast.Name)
                                              for s in constants.get(name.id, [])]
                named = sorted(set(KEY.findall(" ".join(texts))))
                sites.append((str(path.relative_to(PACKAGE)), function.name, node.lineno, named))
    return sites


def test_every_error_naming_two_settings_is_raised_from_the_table():
    sites = config_error_sites()
    assert len(sites) > 200  # the walk sees the package's errors
    outside = [f"{file}:{line} {function}: {named}" for file, function, line, named in sites
               if len(named) >= 2 and (file, function) not in ELSEWHERE]
    assert not outside, "rules naming two settings belong in jaxscale/config/refusals.py:\n" + "\n".join(outside)
    stale = set(ELSEWHERE) - {(file, function) for file, function, _, named in sites if len(named) >= 2}
    assert not stale, f"no longer raised there: {stale}"


def test_the_walk_finds_a_refusal_written_outside_the_table(tmp_path, monkeypatch):
    """The walk is not blind: a module raising a two-setting line is caught."""
    package = tmp_path / "jaxscale"
    package.mkdir()
    (package / "m.py").write_text('def f(c):\n    raise ConfigError("model.moe: not with precision.fp8")\n')
    monkeypatch.setattr(__import__(__name__), "PACKAGE", package)
    assert config_error_sites() == [("m.py", "f", 2, ["model.moe", "precision.fp8"])]


def test_the_tables_import_no_jax():
    code = "import sys, jaxscale.config.compatibility; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_docs_compatibility_matrix_is_generated_from_the_table():
    doc = (ROOT / "docs" / "compatibility.md").read_text()
    regenerate = "python -m jaxscale.config.compatibility > docs/compatibility.md"
    assert doc == compatibility.markdown(), f"regenerate: {regenerate}"


def test_the_matrix_holds_each_rule_under_each_pair_it_names():
    names, found = compatibility.features(), compatibility.pairs()
    number = [r.name for r in refusals.RULES].index("fused-fp8") + 1
    assert number in found[("model.fused_projections", "precision.fp8")]
    assert number in found[("precision.fp8", "model.fused_projections")]
    row = next(line for line in compatibility.matrix() if "`model.fused_projections`" in line)
    column = names.index("precision.fp8") + 1
    assert str(number) in row.split("|")[column + 1]
    assert all(len(rule.keys) >= 2 for rule in refusals.RULES)
    assert len({rule.name for rule in refusals.RULES}) == len(refusals.RULES)


MOE = "model.moe={experts: 4, top_k: 2}"
TOKENS = ("data.source=tokens", "data.path=/tokens", "data.documents=true")
PP = ("pp", {"stage": 2, "data": 4})
# One config breaking each rule (and no rule before it): overrides, and for a layout rule the rules and mesh.
EXAMPLES: dict[str, tuple[tuple[str, ...], tuple[str, dict[str, int]] | None]] = {
    "moe-top-k": (("model.moe={experts: 2, top_k: 3}",), None),
    "moe-every": (("model.moe={experts: 4, top_k: 2, every_n_layers: 3}",), None),
    "moe-groups": (("model.moe={experts: 6, top_k: 2, groups: 4, top_groups: 4}",), None),
    "top-groups": (("model.moe={experts: 8, top_k: 4, groups: 4, top_groups: 1}",), None),
    "quantile-top-k": (("model.moe={experts: 4, top_k: 4, balance: quantile}",), None),
    "quantile-groups": (("model.moe={experts: 8, top_k: 2, groups: 2, balance: quantile}",), None),
    "deepseek-moe": (("model.deepseek={dense_layers: 1}",), None),
    "deepseek-every": (("model.moe={experts: 4, top_k: 2, every_n_layers: 2}", "model.deepseek={dense_layers: 0}"),
                       None),
    "deepseek-dense": ((MOE, "model.deepseek={dense_layers: 2}"), None),
    "heads-kv": (("model.kv_heads=3",), None),
    "continuous-async": (("checkpoint.continuous=true", "checkpoint.async_save=false"), None),
    "fast-dir-continuous": (("checkpoint.fast_dir=/tmp/jaxscale-fast",), None),
    "interval-continuous": (("checkpoint.continuous_interval_s=2",), None),
    "fast-dir-dir": (("checkpoint.continuous=true", "checkpoint.fast_dir=/tmp/jaxscale-ck",
                      "checkpoint.dir=/tmp/jaxscale-ck"), None),
    "cudnn-float32": (("model.attention=cudnn", "model.dtype=float32"), None),
    "cudnn-documents": ((*TOKENS, "model.attention=cudnn", "model.dtype=bfloat16"), None),
    "qk-clip-cudnn": (("train.qk_clip=100", "model.attention=cudnn", "model.dtype=bfloat16"), None),
    "qk-clip-qk-norm": (("train.qk_clip=100", "model.qk_norm=true"), None),
    "qk-clip-fused": (("train.qk_clip=100", "model.fused_projections=true"), None),
    "qk-clip-pipeline": (("train.qk_clip=100",), PP),
    "mtp-documents-ring": ((*TOKENS, MOE, "model.deepseek={dense_layers: 0, mtp_depth: 1}", "model.attention=ring"),
                           ("cp", {"fsdp": 2, "context": 4})),
    "loss-chunk": (("model.loss_chunk=5",), None),
    "stage-layers-sum": (("pipeline.layers_per_stage=[1, 2]",), None),
    "stage-layers-unit": (("model.moe={experts: 4, top_k: 2, every_n_layers: 2}", "model.layers=4",
                           "pipeline.layers_per_stage=[1, 3]"), None),
    "vocab-bytes": (("model.vocab_size=100",), None),
    "prompt-response": (("data.prompt_field=prompt",), None),
    "mixture-tokens": (("data.mixture=[{path: /a}]",), None),
    "documents-tokens": (("data.documents=true",), None),
    "ring-balance-documents": (("data.ring_balance=true",), None),
    "ring-balance-ring": ((*TOKENS, "data.ring_balance=true", "model.attention=dot"), ("cp", {"context": 4})),
    "first-fit-documents": (("data.packing=first_fit",), None),
    "tokens-path": (("data.source=tokens",), None),
    "batch-microbatches": (("train.microbatches=3",), None),
    "repeats-schedule": (("pipeline.repeats=2",), None),
    "schedule-repeats": (("pipeline.schedule=circular",), None),
    "fused-fp8": (("model.fused_projections=true", "precision.fp8=delayed"), None),
    "fp8-head-off": (("precision.fp8_head=true",), None),
    "fp8-head-loss-chunk": (("precision.fp8=delayed", "precision.fp8_head=true", "model.loss_chunk=16"), None),
    "blockwise-dims": (("precision.fp8=blockwise",), None),
    "block-scaled-dims": (("precision.fp8=mxfp8", "model.embed=48"), None),
    "nvfp4-settings": (("precision.fp8=mxfp8", "precision.nvfp4.hadamard=false"), None),
    "master-narrower": (("precision.master=bfloat16",), None),
    "offload-params-gradients": (("precision.offload_params=true",), ("zero2", {"data": 8})),
    "offload-params-pipeline": (("precision.offload_params=true",), PP),
    "offload-stash-pipeline": (("pipeline.offload_stash=true",), ("dp", {})),
    "explicit-pipeline": (("mesh.axis_types=explicit",), PP),
    "explicit-context": (("mesh.axis_types=explicit", "model.attention=ring"), ("cp", {"context": 2})),
    "explicit-moe": (("mesh.axis_types=explicit", MOE), ("dp", {})),
    "explicit-fp8": (("mesh.axis_types=explicit", "precision.fp8=delayed"), ("dp", {})),
    "blockwise-tp-overlap": (("precision.fp8=blockwise", "precision.fp8_block=8", "model.tp_overlap=true"),
                             ("tp_sp", {"tensor": 8})),
    "pipeline-tp-overlap": (("model.tp_overlap=true",), PP),
    "pipeline-context-moe": ((MOE, "model.moe.impl=partitioner", "model.attention=ring"),
                             ("pp_tp_cp", {"stage": 2, "context": 2})),
    "pipeline-context-ring": (("model.attention=dot",), ("pp_tp_cp", {"stage": 2, "context": 2})),
    "visit-fp8": (("pipeline.fsdp=visit", "precision.fp8=delayed"), PP),
    "nvfp4-bf16-pipeline": (("precision.fp8=nvfp4", "precision.nvfp4.bf16_last=0.5"), PP),
    "stage-experts-manual": ((MOE, "model.moe.impl=shard_map"), ("pp_tp_sp", {"stage": 2, "tensor": 2})),
    "stage-experts-fp8": ((MOE, "precision.fp8=delayed"), ("pp_ep", {"stage": 2, "expert": 2})),
    "layers-per-stage-pipeline": (("pipeline.layers_per_stage=[1, 1]",), ("dp", {})),
    "layers-per-stage-count": (("pipeline.layers_per_stage=[2]",), PP),
    "stage-slots": (("pipeline.schedule=circular", "pipeline.repeats=2"), PP),
    "microbatches-stages": (("pipeline.microbatches=1",), PP),
    "interleaved-groups": (("model.layers=4", "pipeline.schedule=interleaved_1f1b", "pipeline.repeats=2",
                            "pipeline.microbatches=3"), PP),
    "pipeline-rows": (("pipeline.microbatches=3",), PP),
    "tp-overlap-sequence": (("model.tp_overlap=true",), ("tp", {"data": 2, "tensor": 4})),
    "ulysses-mesh-axis": (("model.attention=ring",), ("cp", {"fsdp": 2, "context": 2, "ulysses": 2})),
    "ulysses-unmapped": (("model.attention=ring",), ("usp", {"fsdp": 2, "context": 2, "expert": 2})),
    "ring-chunks": (("model.attention=ring", "train.seq_len=36"), ("cp", {"fsdp": 2, "context": 4})),
    "attention-block": (("model.attention=blockwise", "model.attention_block=12"), ("dp", {})),
    "pipeline-fp8-outside": (("precision.fp8=delayed",), PP),
}


def template(rule: refusals.Refusal) -> re.Pattern[str]:
    """The rule's line as a pattern, each value any text: the error came from this row."""
    return re.compile(".*?".join(re.escape(part) for part in re.split(r"\{[^{}]*\}", rule.line)))


def refusal_of(rule: refusals.Refusal) -> str:
    """The one line a config breaking ``rule`` gets, from where it is checked."""
    overrides, place = EXAMPLES[rule.name]
    if place is None:
        with pytest.raises(ConfigError) as error:
            tiny_config(*overrides)
        return str(error.value)
    name, sizes = place
    config = tiny_config(*overrides, rules=name, mesh=sizes)
    layout = Layout(Rules.load(name), {a: sizes.get(a, 1) for a in MESH_AXES})
    with pytest.raises(ConfigError) as error:
        if rule.needs == "model":
            refusals.check(refusals.Context(config, layout, parts=frozenset({"prefix"}), model_name="M"),
                           needs=("model",))
        layout.validate(config)
    return str(error.value)


@pytest.mark.parametrize("rule", refusals.RULES, ids=lambda r: r.name)
def test_each_refusal_is_one_line_naming_its_settings(rule):
    line = refusal_of(rule)
    assert "\n" not in line and template(rule).fullmatch(line), f"{rule.name} did not raise: {line}"
    for key in rule.keys:
        assert ("rules '" if key == "rules" else key) in line, f"{rule.name}: {key} not named in: {line}"


def test_selections_say_what_a_run_took():
    asked = tiny_config("model.attention=auto", "model.remat=full", rules="pp", mesh={"stage": 2, "data": 4})
    pipelined = Layout(Rules.load("pp"), {**dict.fromkeys(MESH_AXES, 1), "stage": 2, "data": 4})
    ran = tiny_config("model.attention=dot", "model.remat=full", rules="pp", mesh={"stage": 2, "data": 4})
    lines = selections.taken(selections.Facts(asked, ran, pipelined, builtin=True))
    assert lines == ["model.attention: auto -> dot", "model.remat=full: not applied inside the pipeline's stages "
                     "(each layer runs forward twice there)"]
    wide = tiny_config("model.dtype=bfloat16", "precision.master=float32")
    one = Layout(Rules.load("tp"), {**dict.fromkeys(MESH_AXES, 1), "tensor": 8})
    assert selections.wide_grads(wide, one, builtin=True)
    assert selections.taken(selections.Facts(wide, wide, one, builtin=True)) == [
        "wide gradients: the step differentiates the float32 master (precision.grads_reduce=float32), not the "
        "bfloat16 copy"]
    assert not selections.wide_grads(wide, one, builtin=False)  # a model of one's own: its einsums, not ours
    assert not selections.wide_grads(wide, pipelined, builtin=True)
