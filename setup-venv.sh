# Sourced by setup.sh and setup-vllm.sh (which set ME to their name first): the venv checks both make.
# A venv is kept only when it works: its python runs, is 3.11 or newer (kvbridge's floor) and has pip (a venv whose
# creation was interrupted has none). Otherwise it is made again, and only if it is a venv (it holds pyvenv.cfg).
venv_problem() {  # prints why the venv $1 cannot be used; nothing when it can
    local py="$1/bin/python" version
    [ -x "$py" ] || { echo "$py is missing"; return; }
    version=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null) || { echo "$py does not run"; return; }
    "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "its Python is $version, kvbridge needs 3.11 or newer"; return; }
    "$py" -c 'import pip' 2>/dev/null || echo "it has no pip (its creation was interrupted?)"
}
make_venv() {  # $1: the venv folder, $2: why it cannot be used (venv_problem's line; empty: it can)
    local problem=$2
    [ -n "$problem" ] || return 0
    if [ -e "$1" ] && [ -n "$(ls -A "$1")" ]; then
        if [ ! -f "$1/pyvenv.cfg" ]; then
            echo "$ME: $1 is no venv (no pyvenv.cfg) and not usable as one ($problem); move it away" >&2
            exit 1
        fi
        echo "$ME: $1 is unusable ($problem): making it again" >&2
    fi
    if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
        echo "$ME: PYTHON=$PYTHON is not Python 3.11 or newer (or does not run): set PYTHON to one" >&2
        exit 1
    fi
    rm -rf "$1"
    "$PYTHON" -m venv "$1"
}
