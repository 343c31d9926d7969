#!/usr/bin/env bash
# GPU check for a lent GPU machine (torch present, maybe no vLLM): builds a ~0.5B Qwen2-architecture model
# locally (random init, no download), runs a few GRPO steps with HF generate and, if `import vllm` works,
# with vLLM; prints rollout tokens/s, step time and GPU memory per engine (JSON lines, last one "done").
#   bench/gpu_check.sh            # on the GPU machine
#   bench/gpu_check.sh --tiny     # dry run of the same code path on CPU with a tiny model
# Extra arguments go to bench/gpu_check.py (see --help). Uses .venv/bin/python if present, else python3;
# on a bare machine it installs the project's missing pure-Python dependencies without touching torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
missing=$("$PY" - <<'PY'
import importlib.util
need = {"transformers": "transformers==5.23.0", "peft": "peft==0.21.2", "tokenizers": "tokenizers==0.23.3",
        "jsonschema": "jsonschema==4.26.0", "re2": "google-re2==1.1.20251105", "safetensors": "safetensors"}
print(" ".join(v for k, v in need.items() if importlib.util.find_spec(k) is None))
PY
)
if [ -n "$missing" ]; then
  echo "installing: $missing" >&2
  "$PY" -m pip install -q $missing >&2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" >&2
exec "$PY" bench/gpu_check.py "$@"
