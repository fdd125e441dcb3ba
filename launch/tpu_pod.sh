#!/usr/bin/env bash
# A Cloud TPU VM pod slice: the same command on every worker, run from your machine.
#   launch/tpu_pod.sh TPU_NAME ZONE [jaxscale train arguments...]
# Needs gcloud, and this repository at the same path on every worker (e.g. cloned there and
# installed with `pip install -e .`). jax.distributed finds the workers itself on TPU VMs.
set -euo pipefail
if [[ $# -lt 2 ]]; then
  echo "usage: $0 TPU_NAME ZONE [jaxscale train arguments...]" >&2
  exit 2
fi
tpu="$1"
zone="$2"
shift 2
repo="${JAXSCALE_REPO:-$(pwd)}"
args=$(printf ' %q' "$@")
gcloud compute tpus tpu-vm ssh "${tpu}" --zone "${zone}" --worker=all \
  --command "cd ${repo} && python3 -m jaxscale train --no-progress${args}"
