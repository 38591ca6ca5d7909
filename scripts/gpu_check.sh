#!/usr/bin/env bash
# Every CUDA path of ps_bench on this machine's GPU(s), in one command, and a report in DIR:
#
#   bash scripts/gpu_check.sh DIR
#
# For a machine that already has its own CUDA build of torch (and torchvision, numpy, tabulate,
# pytest) and may have no network: nothing is installed. ps_bench runs from this checkout
# (PYTHONPATH), over that torch. It runs every GPU test (python -m pytest tests/gpu -m gpu),
# then every example of docs/gpus.md, and writes DIR/report.md: the GPU, driver,
# torch and CUDA versions, and each command's exit status and batch p50. Each example also writes
# its trainers' traces (--profile) to DIR/profile-N: Chrome traces and, beside each, the traced
# operators by self time on the device and on the CPU (the traced iterations are left out of the
# batch times); the report ends with the top of trainer 0's table for each example. Exits 0
# when the tests pass and every example either ran or was refused for want of GPUs; 2, with one
# line, where there is no GPU. Each command has a time limit (the tests 420 s, each example
# 40 s), so with the page's four examples it ends within 10 minutes.
# PYTHON chooses the interpreter (default: python3).
set -uo pipefail

out=${1:-}
if [ -z "$out" ] || [ $# -ne 1 ]; then
    echo "usage: bash scripts/gpu_check.sh DIR (the folder for the report and the runs' results)" >&2
    exit 2
fi
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
if ! command -v "$python" > /dev/null; then
    echo "gpu_check: $python is not on PATH; set PYTHON to the interpreter that has torch" >&2
    exit 2
fi
if ! "$python" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2> /dev/null; then
    echo "gpu_check: no GPU here (torch.cuda.is_available() is False, or torch does not import); run it on a machine with one" >&2
    exit 2
fi
mkdir -p "$out" || exit 2
out=$(cd "$out" && pwd)
cd "$root" || exit 2
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
report="$out/report.md"
started=$(date +%s)

{
    echo "# ps_bench GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo
    "$python" - <<'EOF'
import platform, subprocess, torch
names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
try:
    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True, timeout=30).stdout.split()[0]
except Exception:  # noqa: BLE001 - the report says it could not tell
    driver = "unknown (nvidia-smi did not answer)"
print(f"- GPUs: {len(names)} x {', '.join(sorted(set(names)))}")
print(f"- driver: {driver}")
try:
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
except Exception:  # noqa: BLE001
    nccl = "unknown"
print(f"- torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, Python {platform.python_version()}")
EOF
    echo
    echo "| command | exit | batch p50 ms | samples/s | note |"
    echo "|---|---|---|---|---|"
} > "$report"

# One row of the table: the command, its exit status, and what its results file says.
row() {
    local command=$1 code=$2 results=$3 log=$4
    "$python" - "$command" "$code" "$results" "$log" >> "$report" <<'EOF'
import json, sys
from pathlib import Path
command, code, results, log = sys.argv[1:]
p50 = rate = "-"
note = ""
if Path(results).is_file():
    data = json.loads(Path(results).read_text())
    batch = [r for r in data.get("summary", []) if r["role"] == "trainer" and r["metric"] == "batch"]
    p50 = f"{batch[0]['p50']:.3f}" if batch else "-"
    rate = f"{data.get('throughput', {}).get('samples_per_s', 0):.0f}"
    note = data.get("error", "")
lines = [line for line in Path(log).read_text().splitlines() if line.strip()] if Path(log).is_file() else []
if code != "0" and not note and lines:
    note = lines[-1]
print(f"| `{command}` | {code} | {p50} | {rate} | {note.replace('|', '/')[:160]} |")
EOF
}

failed=0
echo "gpu_check: the GPU tests (python -m pytest tests/gpu -m gpu)"
timeout 420 "$python" -m pytest tests/gpu -m gpu -q -rfEs --durations=8 -p no:cacheprovider > "$out/pytest.log" 2>&1
code=$?
summary=$(grep -E "passed|failed|error|skipped" "$out/pytest.log" | tail -n 1)
echo "| \`python -m pytest tests/gpu -m gpu\` | $code | - | - | ${summary//|//} |" >> "$report"
[ "$code" -eq 0 ] || failed=1
echo "gpu_check: $summary"

index=0
rm -f "$out/where.md"  # this check's tables only, where DIR held an earlier one
while IFS= read -r example; do
    index=$((index + 1))
    results="$out/example-$index.json"
    log="$out/example-$index.log"
    echo "gpu_check: $example"
    # shellcheck disable=SC2086 # the page's words, as a user would type them
    timeout 40 "$python" $example --out "$results" --profile "$out/profile-$index" > "$log" 2>&1
    code=$?
    row "$example" "$code" "$results" "$log"
    # where its time went: the top of trainer 0's table of operators (the device's first)
    for table in "$out/profile-$index"/trainer0-rank*.txt; do
        [ -f "$table" ] || continue
        { echo; echo "Example $index, trainer 0 (\`$table\`):"; echo '```'; head -n 12 "$table"; echo '```'; } >> "$out/where.md"
    done
    # refused before anything starts for want of GPUs (exit 2) is what docs/gpus.md promises
    if [ "$code" -ne 0 ] && ! { [ "$code" -eq 2 ] && grep -q "needs one GPU per trainer" "$log"; }; then
        failed=1
    fi
done < <(grep '^python bench.py' docs/gpus.md | sed 's/^python //; s/  *#.*$//')

[ -f "$out/where.md" ] && cat "$out/where.md" >> "$report"
echo >> "$report"
echo "$(( $(date +%s) - started )) s in all; logs, results files and each example's traces (profile-N) are in $out." >> "$report"
cat "$report"
exit "$failed"
