#!/usr/bin/env bash
# The GPU suite in one call, for a GPU machine with torch and no network (a bare H200 image): the warm start
# built on the GPU against the shipped one, the learning check (holdout success before and after GRPO, never
# `no_gradient`), ours against TRL at three sizes (bf16 both sides, TRL without vLLM), memory at a 152k
# vocabulary, rollout throughput (HF; vLLM only when `import vllm` works), and LoRA on a 7.6B Qwen2 of random
# weights built on the GPU (seconds a step, peak memory, ours beside TRL, the longest completions that fit).
# One JSON line per part, a summary last; bench/gpu_check.py says what each part measures.
#   bench/gpu_check.sh [--wheels DIR] [gpu_check.py args]   # on the GPU machine, under 8 minutes (--budget-s)
#   bench/gpu_check.sh --tiny [--wheels DIR]                # the same path on the CPU with a tiny model
# Nothing is fetched from the network: a dependency that is missing, or at another version than the one
# pinned below, is installed from the wheels in DIR only (pip --no-index), and without --wheels the check
# stops and names what is missing. The wheels (about 20 MB), made on a machine with network for the GPU
# machine's Python and platform:
#   pip download --no-deps --only-binary=:all: --python-version 3.11 --platform manylinux2014_x86_64 -d DIR \
#       transformers==5.23.0 peft==0.21.2 trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
#       jsonschema==4.26.0 referencing==0.37.0 jsonschema-specifications==2025.9.1 rpds-py==2026.9.1 \
#       google-re2==1.1.20251105
# (and `vllm` with its dependencies, matched to the machine's torch, to measure vLLM too: a vllm wheel in DIR
# is installed when `import vllm` fails, and if that does not work the suite goes on with HF alone; vLLM is
# too large to carry in the usual case, so its engine stays verified against its stand-in).
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
import importlib.metadata
import importlib.util
# module: (distribution, pinned version or None). A module present at another version than the pin is missing:
# the image's transformers (5.17) is older than the one TRL 1.16 and the trainer were measured with.
need = {"transformers": ("transformers", "5.23.0"), "peft": ("peft", "0.21.2"), "trl": ("trl", "1.16.0"),
        "datasets": ("datasets", "5.2.0"), "dill": ("dill", None), "multiprocess": ("multiprocess", None),
        "jsonschema": ("jsonschema", None), "referencing": ("referencing", None),
        "jsonschema_specifications": ("jsonschema-specifications", None), "rpds": ("rpds-py", None),
        "re2": ("google-re2", None), "tokenizers": ("tokenizers", None), "safetensors": ("safetensors", None),
        "jinja2": ("jinja2", None)}
out = []
for module, (dist, pin) in need.items():
    try:
        ok = importlib.util.find_spec(module) is not None and (pin is None or importlib.metadata.version(dist) == pin)
    except importlib.metadata.PackageNotFoundError:
        ok = False
    if not ok:
        out.append(f"{dist}=={pin}" if pin else dist)
print(" ".join(out))
PY
)
if [ -n "$missing" ]; then
  if [ -z "$WHEELS" ]; then
    echo "gpu_check: missing $missing; there is no network: pass --wheels DIR with their wheels" >&2
    exit 2
  fi
  echo "installing from $WHEELS: $missing" >&2
  # torch is never touched: a wheel that would replace it fails here instead of downloading another.
  # shellcheck disable=SC2086 (one word per requirement)
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
