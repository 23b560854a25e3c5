#!/usr/bin/env bash
# The GPU checks as one prepared command: versions, the CUDA tests, the speed benchmark, and (with --main-job) the
# gpu preset's main job. Writes logs and JSON under $OUT (default /tmp/gpu_suite).
#
#   bash benchmarks/gpu_suite.sh              # tests + benchmark, ~4 min on one H200
#   bash benchmarks/gpu_suite.sh --main-job   # `vaswani-train --preset gpu --bf16`, ~7 min
#
# Wheels in .whl/ (packages the GPU machine lacks) are installed to /tmp/site first; the project installs editable
# without its dependencies, so the machine's own torch stays.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_suite}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

if compgen -G ".whl/*.whl" > /dev/null; then
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    python3 -c "import datasets, evaluate, sacremoses" 2>/dev/null || \
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl || exit 1
fi
python3 -c "import vaswani_training" 2>/dev/null || \
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 - <<'EOF'
import accelerate, datasets, torch, transformers
print(f"torch {torch.__version__}, transformers {transformers.__version__}, accelerate {accelerate.__version__}, "
      f"datasets {datasets.__version__}, cuda {torch.version.cuda}, {torch.cuda.get_device_name()}")
EOF
} 2>&1 | tee "$OUT/versions.txt"

if [ "${1:-}" = "--main-job" ]; then
    rm -rf /tmp/gpu_main_job
    start=$(date +%s)
    vaswani-train --preset gpu --bf16 --output_dir /tmp/gpu_main_job 2>&1 | tee "$OUT/main_job.log"
    rc=${PIPESTATUS[0]}
    echo "rc $rc, whole command $(( $(date +%s) - start )) s" | tee -a "$OUT/main_job.log"
    cp /tmp/gpu_main_job/metrics.json "$OUT/main_job_metrics.json" 2>/dev/null
    exit "$rc"
fi

timeout 200 python3 -m pytest tests/test_cuda.py -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/cuda_tests.log"
timeout 150 python3 benchmarks/benchmark.py --device cuda --dtype bf16 --vocab-size 8000 --batch-tokens 25000 \
    --gen-batch 64 --memory-batch-tokens 4096 --output "$OUT/benchmark_cuda.json" 2>&1 | tee "$OUT/benchmark.log"
