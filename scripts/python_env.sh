# Sourced by scripts/build: sets PAGEDATTN_PYTHON to a Python that has what
# the Python package's build and tests need (nanobind, scikit-build-core,
# NumPy, ml_dtypes, pytest; python/requirements.txt), installing them from
# the package registry into .venv/ when missing. PAGEDATTN_PYTHON set by the
# caller (scripts/gpu: the GPU machine's Python, which has them) is kept.
if [ -z "${PAGEDATTN_PYTHON:-}" ]; then
  venv=.venv
  if [ ! -x "$venv/bin/python" ]; then
    echo "pagedattn: creating $venv for the Python package"
    python3 -m venv "$venv"
  fi
  stamp="$venv/.requirements"
  if ! cmp -s python/requirements.txt "$stamp"; then
    echo "pagedattn: installing python/requirements.txt into $venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check -r python/requirements.txt
    cp python/requirements.txt "$stamp"
  fi
  PAGEDATTN_PYTHON=$PWD/$venv/bin/python
fi
export PAGEDATTN_PYTHON
