"""``jaxscale train --config FILE [--set KEY=VALUE ...]``.

The config is read and validated before jax is imported, so that when no
``XLA_FLAGS`` is set the command can ask the host platform for as many
simulated CPU devices as the mesh needs (an ``XLA_FLAGS`` already in the
environment is always kept; the flag only affects the CPU backend). A bad
config prints one line naming the key or axis and exits with code 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from jaxscale.config import CONFIG_DIR, ConfigError, load_config, requested_devices

DEFAULT_CPU_DEVICES = 8


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxscale", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a model")
    train.add_argument("--config", default=str(CONFIG_DIR / "experiments" / "tiny.yaml"), help="experiment YAML file")
    train.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key, e.g. --set train.steps=20 (repeatable)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def _simulate_cpu_devices(count: int) -> None:
    if "XLA_FLAGS" not in os.environ:
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={count}"


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        _simulate_cpu_devices(requested_devices(config.mesh) or DEFAULT_CPU_DEVICES)
        from jaxscale.train import Trainer

        trainer = Trainer.build(config)
    except ConfigError as e:
        print(f"jaxscale: error: {e}", file=sys.stderr)
        return 2
    _, history = trainer.fit(progress=not args.no_progress)
    if history:
        first, last = history[0], history[-1]
        print(
            f"step {first['step']} loss {first['loss']:.4f} -> step {last['step']} loss {last['loss']:.4f}; "
            f"{last['tokens_per_sec']:.0f} tokens/s, metrics in {config.run_dir}/metrics.jsonl"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
