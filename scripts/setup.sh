#!/usr/bin/env bash
# Installs qca_lowmem into the current Python environment with a plain `pip install .`, which builds
# it against the torch there. With no torch installed it takes torch==2.13.0 first (QCA_TORCH_SPEC
# overrides); an existing torch (a CUDA build, say) is kept, and the CUDA kernels are built when it
# and the toolkit allow. Arguments are packages to install alongside (the test tools, say).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
  "$PYTHON" -m pip install -q "${QCA_TORCH_SPEC:-torch==2.13.0}"
fi
if [ $# -gt 0 ]; then
  "$PYTHON" -m pip install -q "$@"
fi
"$PYTHON" -m pip install -q .
