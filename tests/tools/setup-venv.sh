#!/bin/sh
# Creates (or brings up to date) the Python environment of the integration tests' tools
# (the openai client, helm, kubernetes-validate): a venv at $1 with tests/tools/
# requirements.txt installed. Used by .ci/run and, when the venv is missing or stale, by
# the tests themselves (`test_venv` in tests/main.rs).
set -eu
venv=$1
here=$(cd "$(dirname "$0")" && pwd)
stamp="$venv/.requirements"
if [ -x "$venv/bin/python" ] && cmp -s "$here/requirements.txt" "$stamp"; then
  exit 0
fi
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check -r "$here/requirements.txt"
cp "$here/requirements.txt" "$stamp"
