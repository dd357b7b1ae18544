#!/usr/bin/env bash
# Downloads, into ./.whl (ignored by git), the wheels the orchestrator and the engine server need on a
# GPU machine that has no package index but has torch, triton, numpy, scipy, httpx, aiohttp, rich, typer
# (with click and annotated-doc), psutil, matplotlib (with python-dateutil), prometheus-client and pyyaml
# (the H200 image, Python 3.12). Each wheel's own Requires-Dist is covered:
#   pydantic -> pydantic-core, annotated-types, typing-inspection (typing-extensions: torch has it)
#   fastapi -> starlette (anyio: httpx has it), annotated-doc (typer has it); uvicorn -> h11 (httpx has it)
#   sqlite-utils -> sqlite-fts4, click-default-group, tabulate, pluggy (click, python-dateutil, pip: there)
#   ruamel.yaml 0.19, merge3 (no compiled part, no requirement)
#   py-spy (a static binary: `run.sh profile` samples vLLM's engine core with it)
# Versions match the ones the vLLM 0.34.0 payload carries (../shared/vllm-h200/build_payload.sh) where
# it carries the package, so installing these into the payload's folder replaces nothing with another
# version and one PYTHONPATH serves both:
#   python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude 2>/dev/null || true
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_34_x86_64"
WHEELS="pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
fastapi==0.136.3 starlette==1.10.0 uvicorn==0.55.0 opentelemetry-api==1.45.2
sqlite-utils==4.2.1 sqlite-fts4==1.0.3 click-default-group==1.2.4 tabulate==0.10.0 pluggy==1.6.0
ruamel.yaml==0.19.1 filelock==3.20.0 merge3==1.0.0
py-spy==0.4.3"
rm -rf .whl && mkdir -p .whl
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  $PLATFORMS -d .whl $WHEELS
ls -la .whl && du -sh .whl
