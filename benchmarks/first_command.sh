#!/usr/bin/env bash
# The README's first command, timed on this machine: cold (an empty cache, so the default model's GGUF
# is converted first), then twice cached (the second start must find every program the first
# compiled). Run from the repo root with the project installed in .venv.
set -euo pipefail
cache=$(mktemp -d)
trap 'rm -rf "$cache"' EXIT
for run in cold cached "cached again"; do
  TIMEFORMAT="$run: %R s"
  time JAXRUNNER_CACHE=$cache .venv/bin/jaxrunner generate "The capital of France is" >/dev/null 2>&1
done
