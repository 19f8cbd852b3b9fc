# Sourced by scripts/build and scripts/sanitize: sets `launcher` and
# `cuda_launcher` to the CMake arguments that put ccache in front of the C++
# and CUDA compilers, when it is installed
# (scripts/deps installs it; a build without it works the same, only colder).
# The cache is ccache's own (~/.cache/ccache unless CCACHE_DIR says
# otherwise): it outlives the clone, so CI in a fresh clone reuses it.
# CCACHE_BASEDIR and CCACHE_NOHASHDIR keep the clone's path out of the hashes
# (absolute -I paths, and the working directory that -g1 records), so a clone
# elsewhere still hits. CCACHE_DISABLE=1 compiles everything afresh.
launcher=()
cuda_launcher=()
if command -v ccache >/dev/null; then
  export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$PWD}
  export CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  cuda_launcher=(-DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
