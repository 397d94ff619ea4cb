#!/usr/bin/env bash
# tests/comm/run_multigpu.sh - the comm NCCL tests on a 2+ GPU machine, each in its own pytest process under an outer
# timeout, so a hang or a crash costs that test only and every log survives: per-test pytest output, per-rank logs
# (progress, ebbtide.comm DEBUG steps, tracebacks, stack dumps of hung ranks) and per-rank native output, all under
# $OUT (default ./comm-multigpu-out). Pure Python: no build needed (PYTHONPATH=python).
#   tests/comm/run_multigpu.sh [TEST_NAME ...]    default: all five, the split_group one (which hung before) first
set -uo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-comm-multigpu-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export EBBTIDE_COMM_LOGDIR="$out/comm-logs" NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
tests=("$@")
[ ${#tests[@]} -eq 0 ] && tests=(test_nccl_split_group_and_device_mesh test_nccl_flat_bound_world test_nccl_lazy_world
                                 test_nccl_megatron_topology_all_gpus test_release_with_a_collective_that_cannot_finish)
python3 -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version(),
            "gpus", torch.cuda.device_count())' 2>&1 | tee "$out/comm-env.txt"
python3 -c 'import pytest_timeout' 2>/dev/null && echo "pytest-timeout: yes (backstop marks)" | tee -a "$out/comm-env.txt"
rc=0
for t in "${tests[@]}"; do
  limit=$(python3 -c 'import ast, sys
m = ast.parse(open("tests/comm/test_comm_nccl.py").read())
d = next(n.value for n in m.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "DEADLINE_S")
print(int(ast.literal_eval(d)[sys.argv[1]]) + 35)' "$t") || { echo "$t: unknown test" | tee -a "$out/comm-summary.txt"; rc=1; continue; }
  start=$SECONDS
  timeout -k 10 "$limit" python3 -m pytest -q -rA -p no:cacheprovider "tests/comm/test_comm_nccl.py::$t" \
    > "$out/$t.log" 2>&1
  r=$?
  echo "$t: exit $r in $((SECONDS - start)) s (limit $limit s): $(tail -1 "$out/$t.log")" | tee -a "$out/comm-summary.txt"
  [ "$r" -ne 0 ] && rc=1
done
echo "logs: $out/*.log, per-rank: $EBBTIDE_COMM_LOGDIR/<scenario>-<time>-*/rank<r>.{log,out}"
exit $rc
