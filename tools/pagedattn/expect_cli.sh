#!/bin/sh
# CLI behaviour test (CTest): runs a command and checks its exit code and
# message. Usage: expect_cli.sh <exit code> <text> <command> [args...]
# Exit code 0: stdout must contain <text>. Any other: stderr must be exactly
# one line, `error (<kind>): ...`, containing <text> (the CLI's promise: one
# line and a documented code, never a crash).
set -u
want=$1
text=$2
shift 2
command="$*"
out=$(mktemp)
err=$(mktemp)
trap 'rm -f "$out" "$err"' EXIT
"$@" >"$out" 2>"$err"
got=$?
fail() {
  echo "FAIL: $*"
  echo "--- command: $command"
  echo "--- stdout (last lines):"; tail -n 5 "$out"
  echo "--- stderr:"; cat "$err"
  exit 1
}
[ "$got" -eq "$want" ] || fail "exit code $got, expected $want"
if [ "$want" -eq 0 ]; then
  grep -qF -- "$text" "$out" || fail "stdout lacks '$text'"
else
  [ "$(wc -l <"$err")" -eq 1 ] || fail "stderr is not exactly one line"
  grep -q '^error (' "$err" || fail "stderr does not start with 'error ('"
  grep -qF -- "$text" "$err" || fail "stderr lacks '$text'"
fi
echo "ok: exit $got"
