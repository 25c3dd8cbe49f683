# Device call G (session 13): the integration tests (composed models, generate with the SFA and Focus caches, whose
# decode steps now run the v6 SFA kernel and the Focus kernel's new plan) and the op tests on the GPU.
set -o pipefail; export PYTHONUNBUFFERED=1 PYTHONPATH=.
timeout 420 python3 -m pytest -q tests/integrations tests/ops 2>&1 | tee $OUT/pytest_cuda_integrations_ops_stdout.txt | tail -4
