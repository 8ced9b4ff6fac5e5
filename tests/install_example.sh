#!/usr/bin/env bash
# Installs refit into a temporary prefix, builds examples/ as a standalone CMake project
# against it (find_package(refit) -> refit::refit), and runs a deployment from the installed
# files: refit-coordinator serve + two example trainer processes, two publications each.
# Usage: install_example.sh <refit build dir> <refit source dir> <work dir>
set -euo pipefail
build=$1 src=$2 work=$3
rm -rf "$work"
mkdir -p "$work"
cd "$work"
fail() { echo "install_example: $*" >&2; for f in *.log *.err *.out; do [ -f "$f" ] && { echo "--- $f"; cat "$f"; } >&2; done; exit 1; }

cmake --install "$build" --prefix "$work/prefix" > install.log 2>&1 || fail "cmake --install failed"
for f in include/refit/host.hpp include/refit/result.hpp lib/librefit.so \
         lib/cmake/refit/refitConfig.cmake lib/cmake/refit/refitConfigVersion.cmake \
         lib/cmake/refit/refitTargets.cmake bin/refit-coordinator bin/refit-runtime; do
  [ -e "prefix/$f" ] || fail "the package lacks $f"
done

cmake -S "$src/examples" -B example -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_PREFIX_PATH="$work/prefix" > configure.log 2>&1 || fail "configuring examples/ failed"
cmake --build example > build.log 2>&1 || fail "building examples/ failed"
trainer=example/refit-example-trainer
[ -x "$trainer" ] || fail "no example trainer was built"

export REFIT_TOKEN="install-test-secret-$$-$RANDOM$RANDOM"
sed '/^# Multi-process deployment/,$d' "$src/configs/tiny-synthetic.yaml" > recipe.yaml
cat >> recipe.yaml <<EOF
serve: {host: 127.0.0.1, port: 0, token_env: REFIT_TOKEN, world_size: 2}
EOF
prefix/bin/refit-coordinator serve -c recipe.yaml > serve.out 2> serve.err &
coordinator=$!
trap 'kill -KILL $coordinator 2>/dev/null || true' EXIT
for _ in $(seq 600); do grep -q "serving" serve.out 2>/dev/null && break; sleep 0.1; done
port=$(sed -n 's/.*127\.0\.0\.1:\([0-9]*\).*/\1/p' serve.out)
[ -n "$port" ] || fail "refit-coordinator serve did not start"
runtime=$(ps -o pid= --ppid "$coordinator" | tr -d ' ')

timeout 120 "$trainer" --config recipe.yaml --rank 0 --port "$port" --iterations 2 > t0.out 2> t0.err &
t0=$!
timeout 120 "$trainer" --config recipe.yaml --rank 1 --port "$port" --iterations 2 > t1.out 2> t1.err &
t1=$!
wait $t0 || fail "trainer rank 0 failed"
wait $t1 || fail "trainer rank 1 failed"
for out in t0.out t1.out; do
  grep -q "version 2 committed" "$out" || fail "$out has no committed version 2"
done
[ "$(grep -o 'pub-[0-9a-f]*' t0.out)" = "$(grep -o 'pub-[0-9a-f]*' t1.out)" ] \
  || fail "the ranks report different publications"

kill -TERM $coordinator
wait $coordinator || fail "refit-coordinator serve exited with $?"
trap - EXIT
for pid in $runtime; do
  if kill -0 "$pid" 2>/dev/null && ! grep -q '^State:.*Z' "/proc/$pid/status" 2>/dev/null; then
    fail "refit-runtime $pid outlived its coordinator"
  fi
done
cat t0.out t1.out
rm -rf "$work"
echo "install_example: ok"
