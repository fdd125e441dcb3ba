#!/usr/bin/env bash
# One process, N simulated CPU devices (default 8): jaxscale train with any extra arguments.
#   launch/local.sh [--devices N] [jaxscale train arguments...]
set -euo pipefail
devices=8
if [[ "${1:-}" == "--devices" ]]; then
  devices="${2:-}"
  shift $(($# < 2 ? $# : 2))
fi
if ! [[ "${devices}" =~ ^[1-9][0-9]*$ ]]; then
  echo "launch/local.sh: error: --devices must be a positive integer, got '${devices}'" >&2
  exit 2
fi
export XLA_FLAGS="${XLA_FLAGS:---xla_force_host_platform_device_count=${devices}}"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
exec python3 -m jaxscale train "$@"
