# Sourced by the bin/ scripts: make sure the project's virtual environment exists and is up to date.
# Idempotent and quick when nothing changed: the install runs again only when pyproject.toml does.
# Usage: ensure_venv [extra]   (extra: "" for the runtime, "dev" for the test tools)
set -euo pipefail
ROLLART_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ROLLART_VENV="${ROLLART_VENV:-$ROLLART_ROOT/.venv}"
ROLLART_PY="$ROLLART_VENV/bin/python"

ensure_venv() {
    local extra="${1:-}"
    local hash want stamp
    hash="$(sha256sum <"$ROLLART_ROOT/pyproject.toml" | cut -c1-16)"
    want="$hash-${extra:-base}"
    stamp="$ROLLART_VENV/.rollart-installed"
    # A dev install covers the runtime too.
    if [[ -f "$stamp" ]] && grep -qx -e "$want" -e "$hash-dev" "$stamp"; then
        return 0
    fi
    mkdir -p "$ROLLART_ROOT/.cache"
    # Nodes of one topology may start together: one installs, the others wait for it.
    exec 9>"$ROLLART_ROOT/.cache/setup.lock"
    flock 9
    if [[ -f "$stamp" ]] && grep -qx -e "$want" -e "$hash-dev" "$stamp"; then
        exec 9>&-
        return 0
    fi
    local python="${PYTHON:-python3}"
    if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
        echo "rollart needs Python >= 3.11; '$python' is $("$python" --version 2>&1)" >&2
        exit 2
    fi
    if [[ ! -x "$ROLLART_PY" ]]; then
        echo "[setup] creating $ROLLART_VENV" >&2
        "$python" -m venv "$ROLLART_VENV"
    fi
    echo "[setup] installing rollart${extra:+[$extra]} into $ROLLART_VENV (first run only)" >&2
    "$ROLLART_PY" -m pip install -qq --disable-pip-version-check -e "$ROLLART_ROOT${extra:+[$extra]}" >&2
    ensure_bwrap
    echo "$want" >"$stamp"
    exec 9>&-
}

# Worker sandboxes use bubblewrap where it is installed (rollart/workers/sandbox.py); best effort, as
# root with apt-get only, and never a failed set-up: without it they use unshare, or run unsandboxed.
ensure_bwrap() {
    command -v bwrap >/dev/null && return 0
    if [[ $EUID -eq 0 ]] && command -v apt-get >/dev/null && {
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap ||
            { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap; }
    } >/dev/null 2>&1; then
        echo "[setup] installed bubblewrap for the worker sandboxes" >&2
    else
        echo "[setup] bubblewrap not installed (needs root and apt-get): worker sandboxes use unshare, or none" >&2
    fi
}
