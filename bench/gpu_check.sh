#!/usr/bin/env bash
# GPU check for a lent GPU machine (torch present, maybe no vLLM, no network): builds a Qwen2-architecture
# model here with `build-tiny` (warm-started, so it ends its turns and its rewards vary), runs a few GRPO
# steps with HF generate and, if `import vllm` works, with vLLM; prints rollout tokens/s, step time and GPU
# memory per engine (JSON lines, last one "done").
#   bench/gpu_check.sh [--wheels DIR]          # on the GPU machine
#   bench/gpu_check.sh --tiny [--wheels DIR]   # dry run of the same code path on CPU with a tiny model
# Nothing is fetched from the network: a dependency that is missing is installed from the wheels in DIR only
# (pip --no-index), and without --wheels the check stops and names what is missing. Make DIR on a machine
# with network, for the GPU machine's Python and platform, e.g.
#   pip download --only-binary=:all: --python-version 3.11 --platform manylinux2014_x86_64 -d DIR \
#       transformers==5.23.0 peft==0.21.2 tokenizers==0.23.3 jsonschema==4.26.0 google-re2==1.1.20251105 safetensors jinja2
# (and `vllm` with its dependencies, matched to the machine's torch, to measure vLLM too: a vllm wheel in DIR
# is installed when `import vllm` fails, and if that does not work the check goes on with HF alone).
# Other arguments go to bench/gpu_check.py (see --help). Uses .venv/bin/python if present, else python3.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
WHEELS=""
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) [ $# -ge 2 ] || { echo "gpu_check: --wheels needs a directory" >&2; exit 2; }; WHEELS=$2; shift 2 ;;
    --wheels=*) WHEELS=${1#--wheels=}; shift ;;
    *) args+=("$1"); shift ;;
  esac
done
if [ -n "$WHEELS" ] && [ ! -d "$WHEELS" ]; then
  echo "gpu_check: --wheels $WHEELS is not a directory" >&2
  exit 2
fi
# The network is never used, whatever pip's configuration says.
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
missing=$("$PY" - <<'PY'
import importlib.util
need = {"transformers": "transformers==5.23.0", "peft": "peft==0.21.2", "tokenizers": "tokenizers==0.23.3",
        "jsonschema": "jsonschema==4.26.0", "re2": "google-re2==1.1.20251105", "safetensors": "safetensors",
        "jinja2": "jinja2"}
print(" ".join(v for k, v in need.items() if importlib.util.find_spec(k) is None))
PY
)
if [ -n "$missing" ]; then
  if [ -z "$WHEELS" ]; then
    echo "gpu_check: missing $missing; there is no network: pass --wheels DIR with their wheels" >&2
    exit 2
  fi
  echo "installing from $WHEELS: $missing" >&2
  # torch is never touched: a wheel that would replace it fails here instead of downloading another.
  "$PY" -m pip install -q --no-index --find-links "$WHEELS" $missing >&2
fi
if [ -n "$WHEELS" ] && ! "$PY" -c "import vllm" >/dev/null 2>&1 && compgen -G "$WHEELS/vllm-*.whl" >/dev/null; then
  echo "installing vllm from $WHEELS" >&2
  "$PY" -m pip install -q --no-index --find-links "$WHEELS" vllm >&2 \
    || echo "gpu_check: vllm from $WHEELS did not install; measuring HF only" >&2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" >&2
exec "$PY" bench/gpu_check.py ${args[@]+"${args[@]}"}
