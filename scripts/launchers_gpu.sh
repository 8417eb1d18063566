#!/usr/bin/env bash
# The launchers of issue 42 on a machine with 2 GPUs: one small config, N steps, started as
#   gpus2       cockpit train --gpus 2                         (the reference)
#   standalone  torchrun --standalone --nproc_per_node 2
#   static      torchrun --nnodes 1 --master_addr/--master_port
#   two-nodes   two torchrun agents as two "nodes" (--nnodes 2, one GPU each, c10d rendezvous)
#   slurm       two ranks with an srun-shaped environment set by hand
#   restart     torchrun --max-restarts 1, rank 1's process killed (SIGKILL) at step KILL
# Each run's final loss must match --gpus 2 within 1e-3; after the restart every step's loss
# from the resumed step on must match the uninterrupted --gpus 2 run within 1e-3.
#
# usage: scripts/launchers_gpu.sh COCKPIT_BINARY [CONFIG] [STEPS]
#   COCKPIT_BINARY  built with --features nccl;  CONFIG  default configs/tiny.toml;  STEPS  default 40
# needs: torchrun and python3 on PATH. Output: a table; exit 1 when a case fails.
# COCKPIT_EXTRA_ARGS (words) go to every run, e.g. "--device cpu --set optim.micro_batch=4" to
# try the script on a machine without GPUs (then every case runs over tcp).
set -u
BIN=$(readlink -f "${1:?usage: $0 COCKPIT_BINARY [CONFIG] [STEPS]}")
CFG=$(readlink -f "${2:-configs/tiny.toml}")
STEPS=${3:-40}
EVERY=$((STEPS / 4))            # checkpoint every quarter of the run
KILL=$((EVERY * 2 + EVERY / 2)) # kill rank 1 between the second and third checkpoint
OUT=$(mktemp -d "${TMPDIR:-/tmp}/cockpit-launchers.XXXXXX")
command -v torchrun >/dev/null || { echo "torchrun not on PATH" >&2; exit 2; }
[ -x "$BIN" ] || { echo "$BIN: not an executable" >&2; exit 2; }
read -ra EXTRA <<<"${COCKPIT_EXTRA_ARGS:-}"
COMMON=(train "$CFG" --no-tui --max-steps "$STEPS" --set "checkpoint.every_steps=$EVERY" --set "checkpoint.keep_last=8" "${EXTRA[@]}")
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("",0)); print(s.getsockname()[1])'; }
echo "runs and logs in $OUT (steps $STEPS, checkpoints every $EVERY, kill at step $KILL)"

# gpus2: the reference
"$BIN" "${COMMON[@]}" --gpus 2 --run-dir "$OUT/gpus2" >"$OUT/gpus2.log" 2>&1
echo "gpus2: exit $?"

torchrun --standalone --nproc_per_node 2 --no-python "$BIN" "${COMMON[@]}" --run-dir "$OUT/standalone" >"$OUT/standalone.log" 2>&1
echo "standalone: exit $?"

torchrun --nnodes 1 --nproc_per_node 2 --master_addr 127.0.0.1 --master_port "$(free_port)" --no-python \
  "$BIN" "${COMMON[@]}" --run-dir "$OUT/static" >"$OUT/static.log" 2>&1
echo "static: exit $?"

# two agents, one GPU each; node 0 hosts the rendezvous store
RDZV=$(free_port)
for node in 0 1; do
  host=$([ $node = 0 ] && echo 1 || echo 0)
  CUDA_VISIBLE_DEVICES=$node torchrun --nnodes 2 --node_rank $node --nproc_per_node 1 \
    --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$RDZV" --rdzv-id two-nodes --rdzv-conf "is_host=$host" \
    --no-python "$BIN" "${COMMON[@]}" --run-dir "$OUT/two-nodes" >"$OUT/two-nodes-$node.log" 2>&1 &
done
wait
echo "two-nodes: done"

# srun-shaped: no RANK/WORLD_SIZE/MASTER_*; the master from the nodelist, the port from the job id
# a job id whose derived port (15000 + id % 20000) is free now
JOB=$(python3 -c 'import random, socket
for i in random.sample(range(20000), 20000):
    s = socket.socket()
    try:
        s.bind(("", 15000 + i)); print(i + 20000); break
    except OSError: pass
    finally: s.close()')
for r in 0 1; do
  env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u MASTER_ADDR -u MASTER_PORT \
    SLURM_PROCID=$r SLURM_NTASKS=2 SLURM_LOCALID=$r SLURM_STEP_ID=0 SLURM_JOB_ID=$JOB \
    SLURM_JOB_NODELIST=localhost "$BIN" "${COMMON[@]}" --run-dir "$OUT/slurm" >"$OUT/slurm-$r.log" 2>&1 &
done
wait
echo "slurm: done"

# restart: rank 1 of the first attempt is killed once rank 0 has logged step KILL
cat >"$OUT/worker.sh" <<EOF
#!/usr/bin/env bash
if [ "\$TORCHELASTIC_RESTART_COUNT" = 0 ] && [ "\$RANK" = 1 ]; then
  "\$@" & pid=\$!
  while kill -0 \$pid 2>/dev/null; do
    if python3 - "$OUT/restart/metrics.jsonl" $KILL <<'PY'
import json, sys
try:
    steps = [json.loads(l).get("step", 0) for l in open(sys.argv[1]) if '"event":"step"' in l.replace(" ", "")]
except OSError:
    steps = []
sys.exit(0 if steps and max(steps) >= int(sys.argv[2]) else 1)
PY
    then kill -9 \$pid; wait \$pid; exit 137; fi
    sleep 0.2
  done
  wait \$pid; exit \$?
fi
exec "\$@"
EOF
chmod +x "$OUT/worker.sh"
torchrun --standalone --nproc_per_node 2 --max-restarts 1 --no-python "$OUT/worker.sh" \
  "$BIN" "${COMMON[@]}" --run-dir "$OUT/restart" >"$OUT/restart.log" 2>&1
echo "restart: exit $?"

python3 - "$OUT" <<'PY'
import json, os, re, sys
out = sys.argv[1]
def losses(case):
    path = os.path.join(out, case, "metrics.jsonl")
    d = {}
    try:
        for l in open(path):
            try:
                e = json.loads(l)
            except ValueError:
                continue
            if e.get("event") == "step":
                d[e["step"]] = e["loss"]  # the last line of a step (a restart logs some again)
    except OSError:
        pass
    return d
ref = losses("gpus2")
bad = 0
print(f"{'case':<12} {'steps':>5} {'final loss':>11} {'--gpus 2':>11} {'|diff|':>9}  result")
last = max(ref) if ref else None
for case in ["standalone", "static", "two-nodes", "slurm", "restart"]:
    d = losses(case)
    if not d or last is None or last not in d:
        print(f"{case:<12} {len(d):>5} {'-':>11} {ref.get(last, float('nan')):>11.5f} {'-':>9}  FAIL (no step {last}; see {out}/{case}*.log)")
        bad += 1
        continue
    diff = abs(d[last] - ref[last])
    note = ""
    ok = diff <= 1e-3
    if case == "restart":
        log = open(os.path.join(out, "restart.log"), errors="replace").read()
        m = re.search(r"resumes from \S*step-0*(\d+)", log)
        if not m:
            ok, note = False, " (no resume in restart.log)"
        else:
            start = int(m.group(1))
            worst = max(abs(d[s] - ref[s]) for s in ref if s > start)
            ok = ok and worst <= 1e-3 and all(s in d for s in ref if s > start)
            note = f" (resumed at step {start}; worst step diff after it {worst:.2e})"
    print(f"{case:<12} {len(d):>5} {d[last]:>11.5f} {ref[last]:>11.5f} {diff:>9.2e}  {'PASS' if ok else 'FAIL'}{note}")
    bad += 0 if ok else 1
sys.exit(1 if bad else 0)
PY
