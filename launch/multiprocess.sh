#!/usr/bin/env bash
# N local processes x M simulated CPU devices each: the multi-host code path on one machine.
#   launch/multiprocess.sh [--processes N] [--devices M] [--port P] [jaxscale train arguments...]
# Process 0 is the coordinator on 127.0.0.1:P; the collectives run over gloo. If any process
# fails, the others are stopped and the script exits with the first failure's code.
set -euo pipefail
processes=2
devices=4
port=8476
while [[ $# -gt 0 ]]; do
  case "$1" in
    --processes) processes="${2:-}"; shift $(($# < 2 ? $# : 2)) ;;
    --devices) devices="${2:-}"; shift $(($# < 2 ? $# : 2)) ;;
    --port) port="${2:-}"; shift $(($# < 2 ? $# : 2)) ;;
    *) break ;;
  esac
done
for value in "${processes}" "${devices}" "${port}"; do
  if ! [[ "${value}" =~ ^[1-9][0-9]*$ ]]; then
    echo "launch/multiprocess.sh: error: --processes, --devices and --port take positive integers, got '${value}'" >&2
    exit 2
  fi
done
export XLA_FLAGS="--xla_force_host_platform_device_count=${devices}"
export JAX_PLATFORMS=cpu
pids=()
for ((i = 0; i < processes; i++)); do
  # gloo prints a "[Gloo] Rank R is connected to N peer ranks" line on stdout for every
  # communicator it opens; only process 0 is meant to print, so those lines are dropped.
  python3 -m jaxscale train --coordinator "127.0.0.1:${port}" --num-processes "${processes}" \
    --process-id "${i}" "$@" > >(grep --line-buffered -v '^\[Gloo\] Rank [0-9]* is connected to') &
  pids+=("$!")
done
status=0
for pid in "${pids[@]}"; do
  wait "${pid}" || {
    code=$?
    [[ ${status} -eq 0 ]] && status=${code}
    kill "${pids[@]}" 2>/dev/null || true
  }
done
exit "${status}"
