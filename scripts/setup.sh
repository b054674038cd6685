#!/usr/bin/env bash
# Installs everything the project needs into one virtualenv per machine (torch is large: it is
# installed once, then reused by every clone). Re-running is cheap: pip only checks what's there.
# Prints the venv's path on the last line of stdout.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${GRPO_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/grpo-operator/venv}
python=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
  mkdir -p "$(dirname "$venv")"
  "$python" -m venv "$venv"
  "$venv/bin/pip" install -q --upgrade pip >&2
fi
# Dependencies install the first time and are only checked afterwards; the project itself is
# re-installed editable each time, so the venv follows this clone.
# (pip's build warnings go to a log, shown only when the install fails)
log="$(dirname "$venv")/setup.log"
if ! "$venv/bin/pip" install -q -e "$repo[dev]" >"$log" 2>&1; then
  cat "$log" >&2
  exit 1
fi
echo "$venv"
