# Sourced by the Python suites' run.sh (tests/parity, tests/vllm):
#   cached_venv LABEL REQUIREMENTS CACHE
# sets VENV to a virtual environment with REQUIREMENTS (every package pinned) installed, under
# CACHE: one per hash of REQUIREMENTS and the Python version ($PYTHON, default python3), built on
# first use and reused after; older ones in CACHE are removed. LABEL prefixes its messages.
cached_venv() {
  local label="$1" requirements="$2" cache="$3" python="${PYTHON:-python3}" key old start
  key="$( { cat "${requirements}"; "${python}" -c 'import sys; print(sys.version)'; } |
          sha256sum | cut -c1-16)"
  VENV="${cache}/venv-${key}"
  if [ ! -f "${VENV}/.complete" ]; then
    echo "${label}: building the virtual environment ${VENV} (first run for these pins)" >&2
    mkdir -p "${cache}"
    for old in "${cache}"/venv-*; do
      [ -e "${old}" ] && [ "${old}" != "${VENV}" ] && rm -rf "${old}"
    done
    rm -rf "${VENV}"
    start=${SECONDS}
    "${python}" -m venv "${VENV}"
    "${VENV}/bin/pip" install --no-input --disable-pip-version-check --quiet -r "${requirements}"
    touch "${VENV}/.complete"
    echo "${label}: virtual environment ready in $((SECONDS - start)) s" >&2
  fi
}
