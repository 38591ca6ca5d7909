#!/usr/bin/env bash
# Writes the example sbatch scripts in this folder with `bench.py slurm` (tests check they match).
set -euo pipefail
cd "$(dirname "$0")/../.."
python bench.py slurm --nodes 2 --gpus-per-node 4 --partition gpu --time 00:30:00 --iface eth1 --python python3 \
  -o scripts/slurm/two_nodes_gpu.sbatch -- --ntrainer 6 --nserver 1 --backend nccl --hook ps --rounds 10 \
  --out results/two_nodes_gpu.json
python bench.py slurm --nodes 2 --python python3 --max-restarts 1 \
  -o scripts/slurm/two_nodes_cpu.sbatch -- --ntrainer 2 --nserver 1 --out results/two_nodes_cpu.json
