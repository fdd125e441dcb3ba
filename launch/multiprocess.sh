#!/usr/bin/env bash
# N local processes x M simulated CPU devices each: the multi-host code path on one machine.
#   launch/multiprocess.sh [--processes N] [--devices M] [--port P] [--grace S] [--restarts R]
#                          [--elastic] [--rejoin-every K] [--rejoin FILE] [jaxscale train arguments...]
# Process 0 is the coordinator on 127.0.0.1:P; the collectives run over gloo. If any process
# fails, the others end (each names the lost process) or are killed S seconds later (default 30);
# then, up to R times (default 0), they are started again with checkpoint.resume=auto: they resume
# from the newest checkpoint (the fast tier's where newer), and read their programs back from the
# run's compilation cache (xla.compile_cache). The script exits with the code of the first process
# that failed in the last attempt.
#
# --elastic (distributed.elastic=true): a process that ended by a signal (kill -9, the OOM killer: its
# host lost) is counted out, and the survivors alone are started again: the run continues on a
# smaller data axis, the same global batch in more microbatches (jaxscale/runtime/elastic.py). Where
# the survivors cannot hold the run (its other axes need the lost devices, or the planner's memory on
# the smaller mesh is over the device's: one line from process 0, exit 2), all N are started again,
# restoring the newest checkpoint. --rejoin-every K (distributed.rejoin_every=K): a shrunk run saves
# and exits 75 every K steps; the lost hosts are then allowed back, and all N processes started again
# (re-expanded), if FILE exists (--rejoin FILE: a node agent or an operator creates it; the launcher
# removes it when it uses it), or always without --rejoin (local processes can always start again);
# else the survivors go on for K more steps. A re-expansion is not a failure: R counts failures only.
set -euo pipefail
processes=2
devices=4
port=8476
grace=30
restarts=0
elastic=0
rejoin_every=0
rejoin=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --processes) processes="${2:-}"; shift $(($# < 2 ? $# : 2)) ;;
    --devices) devices="${2:-}"; shift $(($# < 2 ? $# : 2)) ;;
    --port) port="${2:-}"; shift $(($# < 2 ? $# : 2)) ;;
    --grace) grace="${2:-}"; shift $(($# < 2 ? $# : 2)) ;;
    --restarts) restarts="${2:-}"; shift $(($# < 2 ? $# : 2)) ;;
    --elastic) elastic=1; shift ;;
    --rejoin-every) rejoin_every="${2:-}"; shift $(($# < 2 ? $# : 2)) ;;
    --rejoin) rejoin="${2:-}"; shift $(($# < 2 ? $# : 2)) ;;
    *) break ;;
  esac
done
for value in "${processes}" "${devices}" "${port}"; do
  if ! [[ "${value}" =~ ^[1-9][0-9]*$ ]]; then
    echo "launch/multiprocess.sh: error: --processes, --devices and --port take positive integers, got '${value}'" >&2
    exit 2
  fi
done
if ! [[ "${grace}" =~ ^[0-9]+$ && "${restarts}" =~ ^[0-9]+$ && "${rejoin_every}" =~ ^[0-9]+$ ]]; then
  echo "launch/multiprocess.sh: error: --grace, --restarts and --rejoin-every take whole numbers," \
    "got '${grace}', '${restarts}', '${rejoin_every}'" >&2
  exit 2
fi
if [[ ${elastic} -eq 0 && ( ${rejoin_every} -ne 0 || -n "${rejoin}" ) ]]; then
  echo "launch/multiprocess.sh: error: --rejoin-every and --rejoin re-expand a shrunk run: add --elastic" >&2
  exit 2
fi
export XLA_FLAGS="--xla_force_host_platform_device_count=${devices}"
export JAX_PLATFORMS=cpu
# One attempt of ${running_now} processes, watched until all have ended: in ${status} the first
# non-zero exit code, in ${lost} how many processes ended by a signal the launcher did not send (the
# last one's exit code in ${lost_code}).
attempt() {
  pids=()
  for ((i = 0; i < running_now; i++)); do
    # gloo prints a "[Gloo] Rank R is connected to N peer ranks" line on stdout for every
    # communicator it opens; only process 0 is meant to print, so those lines are dropped.
    python3 -m jaxscale train --coordinator "127.0.0.1:${port}" --num-processes "${running_now}" \
      --process-id "${i}" "$@" > >(grep --line-buffered -v '^\[Gloo\] Rank [0-9]* is connected to') &
    pids+=("$!")
  done
  # Watch the processes in the order they end: the first non-zero exit code is the script's. The others
  # then get the grace to report the lost peer and end by themselves before they are killed (a process
  # still running then is stuck: SIGTERM, a preemption, would have it wait for the lost peer).
  status=0
  lost=0
  lost_code=0
  killed=0
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
      if [[ ${code} -gt 128 && ${killed} -eq 0 ]]; then
        lost=$((lost + 1))
        lost_code=${code}
      fi
      if [[ ${code} -ne 0 && ${status} -eq 0 ]]; then
        status=${code}
        failed_at=${SECONDS}
      fi
    done
    running=("${left[@]}")
    if [[ ${status} -ne 0 && ${#running[@]} -gt 0 && $((SECONDS - failed_at)) -ge grace ]]; then
      kill -KILL "${running[@]}" 2>/dev/null || true
      killed=1
    fi
    sleep 0.2
  done
}

# The processes of the next attempt, after one of ${running_now} that ended with ${status}, ${lost} lost.
next_count() {
  if [[ ${status} -eq 75 && ${running_now} -lt ${processes} ]]; then
    if [[ -z "${rejoin}" || -e "${rejoin}" ]]; then
      rm -f "${rejoin}"
      echo "launch/multiprocess.sh: the lost hosts are back: re-expanding ${running_now} -> ${processes} processes" >&2
      running_now=${processes}
    fi
  elif [[ ${status} -eq 2 && ${running_now} -lt ${processes} ]]; then
    echo "launch/multiprocess.sh: ${running_now} processes cannot hold the run (the line above):" \
      "restarting all ${processes} from the newest checkpoint" >&2
    running_now=${processes}
  elif [[ ${elastic} -eq 1 && ${lost} -gt 0 && ${lost} -lt ${running_now} ]]; then
    echo "launch/multiprocess.sh: ${lost} of ${running_now} processes lost (exit ${lost_code}):" \
      "continuing on $((running_now - lost))" >&2
    running_now=$((running_now - lost))
  else
    echo "launch/multiprocess.sh: attempt ${round} failed (exit ${status}): restarting all ${running_now} processes" >&2
  fi
}

running_now=${processes}
resume=()
options=()
if [[ ${elastic} -eq 1 ]]; then
  options=(--set distributed.elastic=true --set "distributed.rejoin_every=${rejoin_every}")
fi
failures=0
for ((round = 1; ; round++)); do
  attempt "${resume[@]}" "${options[@]}" "$@"
  if [[ ${status} -eq 0 || ( ${status} -ne 75 && ${failures} -ge ${restarts} ) ]]; then
    break
  fi
  if [[ ${status} -ne 75 ]]; then
    failures=$((failures + 1))
  fi
  next_count
  resume=(--set checkpoint.resume=auto)
done
exit "${status}"
