#!/usr/bin/env bash
# N local processes x M simulated CPU devices each: the multi-host code path on one machine.
#   launch/multiprocess.sh [--processes N] [--devices M] [--port P] [--grace S] [--restarts R]
#                          [jaxscale train arguments...]
# Process 0 is the coordinator on 127.0.0.1:P; the collectives run over gloo. If any process
# fails, the others end (each names the lost process) or are killed S seconds later (default 30);
# then, up to R times (default 0), all are started again with checkpoint.resume=auto: they resume
# from the newest checkpoint, and read their programs back from the run's compilation cache
# (xla.compile_cache). The script exits with the code of the first process that failed in the
# last attempt.
set -euo pipefail
processes=2
devices=4
port=8476
grace=30
restarts=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --processes) processes="${2:-}"; shift $(($# < 2 ? $# : 2)) ;;
    --devices) devices="${2:-}"; shift $(($# < 2 ? $# : 2)) ;;
    --port) port="${2:-}"; shift $(($# < 2 ? $# : 2)) ;;
    --grace) grace="${2:-}"; shift $(($# < 2 ? $# : 2)) ;;
    --restarts) restarts="${2:-}"; shift $(($# < 2 ? $# : 2)) ;;
    *) break ;;
  esac
done
for value in "${processes}" "${devices}" "${port}"; do
  if ! [[ "${value}" =~ ^[1-9][0-9]*$ ]]; then
    echo "launch/multiprocess.sh: error: --processes, --devices and --port take positive integers, got '${value}'" >&2
    exit 2
  fi
done
if ! [[ "${grace}" =~ ^[0-9]+$ && "${restarts}" =~ ^[0-9]+$ ]]; then
  echo "launch/multiprocess.sh: error: --grace and --restarts take whole numbers, got '${grace}', '${restarts}'" >&2
  exit 2
fi
export XLA_FLAGS="--xla_force_host_platform_device_count=${devices}"
export JAX_PLATFORMS=cpu
# One attempt: every process started, watched until all have ended; its status in ${status}.
attempt() {
  pids=()
  for ((i = 0; i < processes; i++)); do
    # gloo prints a "[Gloo] Rank R is connected to N peer ranks" line on stdout for every
    # communicator it opens; only process 0 is meant to print, so those lines are dropped.
    python3 -m jaxscale train --coordinator "127.0.0.1:${port}" --num-processes "${processes}" \
      --process-id "${i}" "$@" > >(grep --line-buffered -v '^\[Gloo\] Rank [0-9]* is connected to') &
    pids+=("$!")
  done
  # Watch the processes in the order they end: the first non-zero exit code is the script's. The others
  # then get the grace to report the lost peer and end by themselves before they are killed (a process
  # still running then is stuck: SIGTERM, a preemption, would have it wait for the lost peer).
  status=0
  failed_at=0
  running=("${pids[@]}")
  while [[ ${#running[@]} -gt 0 ]]; do
    left=()
    for pid in "${running[@]}"; do
      if kill -0 "${pid}" 2>/dev/null; then
        left+=("${pid}")
        continue
      fi
      code=0
      wait "${pid}" || code=$?
      if [[ ${code} -ne 0 && ${status} -eq 0 ]]; then
        status=${code}
        failed_at=${SECONDS}
      fi
    done
    running=("${left[@]}")
    if [[ ${status} -ne 0 && ${#running[@]} -gt 0 && $((SECONDS - failed_at)) -ge grace ]]; then
      kill -KILL "${running[@]}" 2>/dev/null || true
    fi
    sleep 0.2
  done
}

resume=()
for ((round = 0; ; round++)); do
  attempt "${resume[@]}" "$@"
  if [[ ${status} -eq 0 || ${round} -ge ${restarts} ]]; then
    break
  fi
  echo "launch/multiprocess.sh: attempt $((round + 1)) failed (exit ${status}): restarting all ${processes} processes" >&2
  resume=(--set checkpoint.resume=auto)
done
exit "${status}"
