"""Every bad input: a one-line ConfigError naming the key or axis, before anything compiles; exit 2 from the CLI."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import pytest
import yaml
from helpers import MAX_SECONDS, compilations, fails_early, subprocess_env, tiny_config

from jaxscale import cli
from jaxscale.config.read import CONFIG_DIR, load_config
from jaxscale.layout.sharding import Rules
from jaxscale.training.trainer import Trainer

TINY_EXPERIMENT = CONFIG_DIR / "experiments" / "tiny.yaml"


@pytest.fixture(scope="module", autouse=True)
def warm_eager_kernels() -> None:
    """One valid build first: eager jax ops (optax initialises Adam's step counter eagerly when
    mapping the optimizer state's shardings) compile a one-primitive kernel on their first use in a
    process. After this, any compilation inside a build is the model's."""
    Trainer.build(tiny_config(rules="fsdp_tp", mesh={"fsdp": 4, "tensor": 2}))


def write_rules(tmp_path: Path, name: str, edit: Any, base: str = "dp") -> str:
    """A rules file ``<tmp_path>/<name>.yaml``: the preset ``base`` changed in place by ``edit(table)``."""
    table = yaml.safe_load((CONFIG_DIR / "rules" / f"{base}.yaml").read_text())
    edit(table)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(table))
    return str(path)


# -- the compile monitor itself ------------------------------------------------------


def test_compile_monitor_sees_a_compilation():
    with compilations() as compiled:
        jax.jit(lambda x: x * 3 + 1)(jnp.arange(7.0)).block_until_ready()
    assert compiled


def test_valid_build_compiles_nothing():
    """Trainer.build traces the whole step abstractly (so it catches every layout error) but compiles nothing."""
    start = time.perf_counter()
    with compilations() as compiled:
        Trainer.build(tiny_config(rules="tp_sp", mesh={"data": 2, "tensor": 4}))
    assert compiled == []
    assert time.perf_counter() - start < MAX_SECONDS


# -- 1. unknown keys -----------------------------------------------------------------


@pytest.mark.parametrize(
    "override, key",
    [
        ("bogus=1", "bogus"),
        ("train.stpes=3", "train.stpes"),
        ("model.embedd=64", "model.embedd"),
        ("mesh.tensr=2", "mesh.tensr"),
        ("mesh.dcn.bogus=2", "mesh.dcn.bogus"),
        ("data.sorce=stdlib", "data.sorce"),
    ],
)
def test_unknown_key(override, key):
    with fails_early(rf"unknown config key '{key}' \(known: "):
        tiny_config(override)


def test_unknown_key_lists_the_known_ones():
    with fails_early(r"'train\.stpes' \(known: .*\bsteps\b"):
        tiny_config("train.stpes=3")


@pytest.mark.parametrize(
    "text, key",
    [
        ("train:\n  stpes: 3\n", "train.stpes"),
        ("model: tiny\nmesh:\n  data: 8\n  tensr: 1\n", "mesh.tensr"),
        ("model:\n  embed: 64\n  embedd: 3\n", "model.embedd"),
        ("run_dir: x\nrulez: dp\n", "rulez"),
    ],
)
def test_unknown_key_in_experiment_file(tmp_path, text, key):
    path = tmp_path / "experiment.yaml"
    path.write_text(text)
    with fails_early(rf"unknown config key '{key}'"):
        load_config(path)


def test_unknown_key_in_model_file(tmp_path):
    model = tmp_path / "my_model.yaml"
    model.write_text("embed: 64\nlayerz: 2\n")
    experiment = tmp_path / "experiment.yaml"
    experiment.write_text(f"model: {model}\n")
    with fails_early(r"unknown config key 'model\.layerz'"):
        load_config(experiment)


# -- 2. wrong types ------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, match",
    [
        ("train.steps=abc", r"^train\.steps: expected int, got 'abc'$"),
        ("train.steps=1.5", r"^train\.steps: expected int, got 1\.5$"),
        ("train.global_batch=true", r"^train\.global_batch: expected an integer, got True$"),
        ("model.tie_embeddings=3", r"^model\.tie_embeddings: expected true or false, got 3$"),
        ("mesh.data=[1]", r"^mesh\.data: expected int, got \[1\]$"),
        ("mesh.dcn=3", r"^mesh\.dcn: expected a mapping, got 3$"),
        ("train.learning_rate=fast", r"^train\.learning_rate: expected float, got 'fast'$"),
        ("train.peak_flops=lots", r"^train\.peak_flops: expected float, got 'lots'$"),
        ("model.remat_names=[attention, 1]", r"^model\.remat_names\[1\]: expected str, got 1$"),
        ("model.remat_names=attention", r"^model\.remat_names: expected a list"),
        ("rules=[dp]", r"^rules: expected str, got \['dp'\]$"),
        ("train=3", r"^train: expected a mapping, got 3$"),
        ("train.steps.x=1", r"'train\.steps' is not a section"),
    ],
)
def test_wrong_type(override, match):
    with fails_early(match):
        tiny_config(override)


def test_lossless_conversions_are_accepted():
    config = tiny_config("train.learning_rate=1", "train.peak_flops=1e12", "mesh.dcn=null")
    assert config.train.learning_rate == 1.0 and isinstance(config.train.learning_rate, float)
    assert config.train.peak_flops == 1e12
    assert config.mesh.dcn is None


@pytest.mark.parametrize(
    "override, match",
    [
        ("model.remat=sometimes", r"model\.remat: 'sometimes' is not one of none, selective, full"),
        ("model.dtype=fp8", r"model\.dtype: 'fp8' is not one of"),
        ("model.param_dtype=int8", r"model\.param_dtype: 'int8'"),
        ("model.mlp=0", r"model\.mlp must be positive"),
        ("model.heads=6", r"model\.heads \(6\) is not divisible by model\.kv_heads \(4\)"),
        ("model.head_dim=7", r"model\.head_dim \(7\) must be even"),
        ("train.global_batch=0", r"train\.global_batch must be at least 1, got 0"),
        ("train.steps=0", r"train\.steps must be at least 1, got 0"),
        ("train.microbatches=3", r"train\.global_batch \(16\) is not divisible by train\.microbatches \(3\)"),
        ("mesh.tensor=0", r"mesh\.tensor: size must be positive or -1, got 0"),
        ("mesh.fsdp=-2", r"mesh\.fsdp: size must be positive or -1, got -2"),
        ("mesh.dcn.data=0", r"mesh\.dcn\.data: size must be positive, got 0"),
        ("data.source=web", r"data\.source: 'web' is not one of builtin, stdlib, tokens"),
    ],
)
def test_bad_value(override, match):
    with fails_early(match):
        tiny_config(override)


@pytest.mark.parametrize(
    "override, match",
    [
        ("train.steps", r"override 'train\.steps' is not KEY=VALUE"),
        ("=3", r"override '=3' has an empty key"),
        ("train..steps=3", r"override 'train\.\.steps=3' has an empty key"),
        ("train.steps=[1", r"override 'train\.steps=\[1': value is not valid YAML"),
    ],
)
def test_malformed_override(override, match):
    with fails_early(match):
        load_config(None, [override])


# -- 3. the mesh against the devices -------------------------------------------------


@pytest.mark.parametrize(
    "mesh, match",
    [
        ({"data": 3}, r"^mesh: data=3 needs 3 devices, but 8 are available$"),
        ({"fsdp": 4, "tensor": 4}, r"^mesh: fsdp=4 x tensor=4 needs 16 devices, but 8 are available$"),
        ({}, r"^mesh: all axes 1 needs 1 device, but 8 are available$"),
        (
            {"data": -1, "fsdp": 3},
            r"^mesh\.data=-1: 8 devices are not divisible by the other axes \(fsdp=3: 3 devices\)$",
        ),
    ],
)
def test_mesh_does_not_match_devices(mesh, match):
    config = tiny_config(mesh=mesh)
    with fails_early(match):
        Trainer.build(config)


def test_mesh_with_dcn_does_not_match_devices():
    config = tiny_config("mesh.dcn.data=2", mesh={"data": 1, "fsdp": 8})
    with fails_early(r"^mesh: fsdp=8 with dcn data=2 needs 16 devices, but 8 are available$"):
        Trainer.build(config)


def test_mesh_larger_than_the_devices_given():
    config = tiny_config(mesh={"data": 8})
    with fails_early(r"mesh: data=8 needs 8 devices, but 4 are available"):
        Trainer.build(config, devices=jax.devices()[:4])


def test_two_fill_axes():
    with fails_early(r"^mesh: at most one axis may be -1, got mesh\.data, mesh\.fsdp$"):
        tiny_config(mesh={"data": -1, "fsdp": -1})


def test_fill_axis_takes_the_rest():
    trainer = Trainer.build(tiny_config(rules="zero3", mesh={"data": -1, "fsdp": 4}))
    assert dict(trainer.mesh.shape)["data"] == 2


# -- 4. parameters not divisible by their mesh axes ----------------------------------


@pytest.mark.parametrize(
    "overrides, rules, mesh, match",
    [
        (
            ["model.mlp=100", "model.kv_heads=8"],
            "tp",
            {"tensor": 8},
            r"^param blocks\.mlp\.w_\w+: dimension \d \('mlp', size 100\) is not divisible by "
            r"mesh axes tensor of size 8$",
        ),
        (
            ["model.embed=60"],
            "zero3",
            {"fsdp": 8},
            r"^param [\w.]+: dimension \d \('embed', size 60\) is not divisible by mesh axes fsdp of size 8$",
        ),
        (
            ["model.kv_heads=2"],
            "tp",
            {"data": 2, "tensor": 4},
            r"^param blocks\.attn\.w[kv]: dimension 2 \('kv_heads', size 2\) is not divisible by "
            r"mesh axes tensor of size 4$",
        ),
        (
            ["model.vocab_size=258"],
            "fsdp_tp",
            {"fsdp": 2, "tensor": 4},
            r"^param embedding: dimension 0 \('vocab', size 258\) is not divisible by mesh axes tensor of size 4$",
        ),
        (
            # ZeRO-1 keeps the parameters whole but shards the optimizer state over (data, fsdp).
            ["model.embed=60"],
            "zero1",
            {"data": 8},
            r"^param [\w.]+ \(optimizer layout\): dimension \d \('embed', size 60\) is not divisible by "
            r"mesh axes \('data', 'fsdp'\) of size 8$",
        ),
    ],
)
def test_parameter_not_divisible(overrides, rules, mesh, match):
    config = tiny_config(*overrides, rules=rules, mesh=mesh)
    with fails_early(match):
        Trainer.build(config)


# -- 5. batches and activations not divisible ----------------------------------------


def test_global_batch_not_divisible():
    config = tiny_config("train.global_batch=12", rules="dp", mesh={"data": 8})
    with fails_early(
        r"^train\.global_batch: dimension 0 \('batch', size 12\) is not divisible by "
        r"mesh axes \('data', 'fsdp'\) of size 8$"
    ):
        Trainer.build(config)


def test_global_batch_not_divisible_over_fsdp():
    config = tiny_config("train.global_batch=12", rules="zero3", mesh={"data": 2, "fsdp": 4})
    with fails_early(r"train\.global_batch: .*size 12.* of size 8"):
        Trainer.build(config)


def test_microbatch_not_divisible():
    # 16 rows divide over 8 devices, but 4 microbatches of 4 rows do not.
    config = tiny_config("train.microbatches=4", rules="dp", mesh={"data": 8})
    with fails_early(
        r"^train.global_batch / train.microbatches: dimension 0 \('batch', size 4\) is not divisible by "
        r"mesh axes \('data', 'fsdp'\) of size 8$"
    ):
        Trainer.build(config)


def test_sequence_not_divisible_under_sequence_parallelism():
    # Found while tracing the step: the residual stream's sequence is sharded over tensor.
    config = tiny_config("train.seq_len=30", rules="tp_sp", mesh={"data": 2, "tensor": 4})
    with fails_early(
        r"^activation \('batch', 'norm_length', 'act_embed'\): dimension 1 \('norm_length', size 30\) "
        r"is not divisible by mesh axes tensor of size 4"
    ):
        Trainer.build(config)


# -- 6. logical axes the rules table does not mention --------------------------------


@pytest.mark.parametrize("axis", ["mlp", "vocab", "layers", "batch", "norm_length", "act_embed"])
def test_logical_axis_missing_from_rules(tmp_path, axis):
    path = write_rules(tmp_path, f"no_{axis}", lambda t: t["rules"].pop(axis))
    config = tiny_config(rules=path, mesh={"data": 8})
    # A parameter's axis names the parameter (its first in tree order); an activation's, only itself.
    where = {"mlp": r"param blocks\.mlp\.w_down: ", "vocab": r"param embedding: ",
             "layers": r"param blocks\.attn\.wk: "}
    with fails_early(rf"^{where.get(axis, '')}logical axis '{axis}' is not in rules table 'no_{axis}'"):
        Trainer.build(config)


# -- 7. malformed rules files --------------------------------------------------------


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda t: t["rules"].update(mlp="tensr"), r" rules\.mlp: 'tensr' is not a mesh axis \(data, "),
        (lambda t: t["rules"].update(batch=["data", "fsdb"]), r" rules\.batch: 'fsdb' is not a mesh axis"),
        (lambda t: t.update(optimzer={"embed": "data"}), r": unknown section 'optimzer'$"),
        (lambda t: t["rules"].update(mlp=3), r" rules\.mlp: expected a mesh axis, a list of them, or null; got 3$"),
        (lambda t: t["rules"].update(mlp={"tensor": 1}), r" rules\.mlp: expected a mesh axis.*got \{'tensor': 1\}$"),
        (lambda t: t["rules"].update(mlp=["tensor", 2]), r" rules\.mlp: expected a mesh axis.*got \['tensor', 2\]$"),
        (lambda t: t.update(optimizer=["data"]), r" optimizer: expected a mapping of logical axes, got \['data'\]$"),
        (lambda t: t.update(gradients="data"), r" gradients: expected a mapping of logical axes, got 'data'$"),
        (lambda t: t.update(optimizer={"embd": "data"}), r" optimizer\.embd: not in the 'rules' section$"),
        (lambda t: t.update(gradients={"embed": "datta"}), r" gradients\.embed: 'datta' is not a mesh axis"),
        (lambda t: t.pop("rules"), r": a 'rules' mapping is required$"),
        (lambda t: t.update(rules=["batch"]), r": a 'rules' mapping is required$"),
    ],
)
def test_malformed_rules_file(tmp_path, edit, match):
    path = write_rules(tmp_path, "bad", edit)
    with fails_early("^rules 'bad'" + match):
        Rules.load(path)
    with fails_early("^rules 'bad'" + match):
        Trainer.build(tiny_config(rules=path, mesh={"data": 8}))


def test_rules_file_not_a_mapping(tmp_path):
    path = tmp_path / "listed.yaml"
    path.write_text("- batch\n- mlp\n")
    with fails_early(r"listed\.yaml: expected a mapping at the top level$"):
        Rules.load(str(path))


def test_mesh_axis_used_twice_in_one_array(tmp_path):
    path = write_rules(tmp_path, "twice", lambda t: t["rules"].update(head_dim="tensor"), base="tp")
    config = tiny_config(rules=path, mesh={"data": 4, "tensor": 2})
    match = r"^param blocks\.attn\.wk: rules 'twice': mesh axis 'tensor' shards both '\w+' and 'head_dim' of \("
    with fails_early(match):
        Trainer.build(config)


# -- 8. presets, files, YAML ---------------------------------------------------------


def test_unknown_rules_preset():
    config = tiny_config(rules="zero4", mesh={"data": 8})
    with fails_early(r"^no rule named 'zero4' \(a path, or one of: (.*, )?dp, .*zero3\)$"):
        Trainer.build(config)


def test_missing_rules_path(tmp_path):
    config = tiny_config(rules=str(tmp_path / "missing.yaml"), mesh={"data": 8})
    with fails_early(r"no rule named '.*missing\.yaml'"):
        Trainer.build(config)


def test_unknown_model_preset_in_override():
    with fails_early(r"^no model named 'huge' \(a path, or one of: .*tiny"):
        tiny_config("model=huge")


def test_unknown_model_preset_in_experiment_file(tmp_path):
    path = tmp_path / "experiment.yaml"
    path.write_text("model: huge\n")
    with fails_early(r"^no model named 'huge'"):
        load_config(path)


def test_missing_config_file(tmp_path):
    with fails_early(r"^config file not found: .*nowhere\.yaml$"):
        load_config(tmp_path / "nowhere.yaml")


def test_config_path_is_a_directory(tmp_path):
    with fails_early(r"^cannot read config file .*: Is a directory$"):
        load_config(tmp_path)


@pytest.mark.parametrize(
    "text, match",
    [
        ("train: [1, 2\n", r"not valid YAML at line 2, column 1: expected ',' or '\]'"),
        ("train:\n  steps: 3\n bad indent: 1\n", r"not valid YAML at line \d+, column \d+: "),
        ("train:\n\tsteps: 3\n", r"not valid YAML at line 2, column 1: "),
    ],
)
def test_invalid_yaml(tmp_path, text, match):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with fails_early(r"broken\.yaml: " + match):
        load_config(path)


def test_experiment_file_not_a_mapping(tmp_path):
    path = tmp_path / "listed.yaml"
    path.write_text("- train\n")
    with fails_early(r"listed\.yaml: expected a mapping at the top level$"):
        load_config(path)


# -- 9. the command line -------------------------------------------------------------


def run_cli(tmp_path: Path, *args: str, xla_flags: str | None = "--xla_force_host_platform_device_count=8"):
    return subprocess.run(
        [sys.executable, "-m", "jaxscale", "train", *args],
        cwd=tmp_path,
        env=subprocess_env(xla_flags),
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_one_error_line(result: subprocess.CompletedProcess, *names: str) -> str:
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("jaxscale: error: ")
    for name in names:
        assert name in lines[0]
    return lines[0]


@pytest.mark.parametrize(
    "args, names",
    [
        (["--set", "train.stpes=3"], ["'train.stpes'"]),
        (["--set", "train.steps=abc"], ["train.steps", "'abc'"]),
        (["--set", "mesh.data=[1]"], ["mesh.data"]),
        (["--set", "train.steps"], ["'train.steps'", "KEY=VALUE"]),
    ],
)
def test_cli_bad_override(tmp_path, args, names):
    assert_one_error_line(run_cli(tmp_path, "--config", str(TINY_EXPERIMENT), *args), *names)


def test_cli_bad_config_files(tmp_path):
    assert_one_error_line(run_cli(tmp_path, "--config", "missing.yaml"), "config file not found", "missing.yaml")
    (tmp_path / "broken.yaml").write_text("train: [1, 2\n")
    assert_one_error_line(run_cli(tmp_path, "--config", "broken.yaml"), "broken.yaml", "not valid YAML")


def test_cli_layout_error(tmp_path):
    # tiny.yaml: fsdp_tp with tensor=2; an odd MLP width cannot split in two.
    result = run_cli(tmp_path, "--config", str(TINY_EXPERIMENT), "--set", "model.mlp=99")
    assert_one_error_line(result, "'mlp'", "size 99", "tensor")
    assert not (tmp_path / "runs").exists()


def test_cli_keeps_xla_flags(tmp_path):
    # tiny.yaml asks for fsdp=4 x tensor=2; with 4 devices in XLA_FLAGS the CLI must not ask for 8.
    result = run_cli(tmp_path, "--config", str(TINY_EXPERIMENT), xla_flags="--xla_force_host_platform_device_count=4")
    assert_one_error_line(result, "fsdp=4 x tensor=2", "needs 8 devices", "4 are available")


def test_cli_simulates_the_devices_the_mesh_asks_for(tmp_path):
    # With no XLA_FLAGS the CLI makes exactly 3 CPU devices for fsdp=3: the mesh fits, the batch of 16 does not.
    overrides = ["--set", "rules=dp", "--set", "mesh.fsdp=3", "--set", "mesh.tensor=1"]
    result = run_cli(tmp_path, "--config", str(TINY_EXPERIMENT), *overrides, xla_flags=None)
    assert_one_error_line(result, "train.global_batch", "size 16", "of size 3")


def test_cli_main_in_process(capsys):
    assert cli.main(["train", "--config", str(TINY_EXPERIMENT), "--set", "model.tie_embeddings=3"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "jaxscale: error: model.tie_embeddings: expected true or false, got 3\n"


def test_cli_takes_several_overrides_after_one_set(capsys):
    # MaxText's habit: --set a=1 b=2. The second pair is read (and refused by name), not rejected by argparse.
    args = ["train", "--config", str(TINY_EXPERIMENT), "--set", "train.steps=1", "model.tie_embeddings=3"]
    assert cli.main(args) == 2
    assert capsys.readouterr().err == "jaxscale: error: model.tie_embeddings: expected true or false, got 3\n"


@pytest.mark.parametrize(
    "script, args",
    [
        ("local.sh", ["--devices", "abc"]),
        ("local.sh", ["--devices"]),
        ("multiprocess.sh", ["--processes", "two"]),
        ("multiprocess.sh", ["--devices", "0"]),
    ],
)
def test_launchers_refuse_a_bad_count_in_one_line(script, args):
    launcher = CONFIG_DIR.parent / "launch" / script
    result = subprocess.run([str(launcher), *args], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and "positive integer" in result.stderr, result.stderr

