#!/usr/bin/env bash
# Downloads into ./.whl (git-ignored) the wheels the orchestrator and the engine server need on a GPU
# machine with no package index. That machine (the H200 image: Python 3.12) already has torch, triton,
# numpy, scipy, psutil, httpx, rich, typer (with click and annotated-doc), pyyaml, matplotlib (with
# python-dateutil), prometheus-client and filelock; what pyproject.toml needs beyond those, with each
# wheel's own Requires-Dist followed:
#   pydantic -> pydantic-core, annotated-types, typing-inspection (typing-extensions: torch has it)
#   fastapi -> starlette (anyio: httpx has it), annotated-doc (typer has it); uvicorn -> h11 (httpx has it)
#   sqlite-utils -> sqlite-fts4, click-default-group, tabulate, pluggy (click, python-dateutil, pip: there)
#   ruamel.yaml (0.19: no compiled part)
# The packages the vLLM 0.34.0 payload also carries (../shared/vllm-h200/build_payload.sh: pydantic,
# pydantic-core, annotated-types, typing-inspection, fastapi, starlette, uvicorn) are pinned to the
# payload's versions, so the two folders can never disagree. On the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/orchestrator-site .whl/*.whl
#   export PYTHONPATH=$PWD:/tmp/site:/tmp/orchestrator-site   # the repository, vLLM's payload, then these
# (benchmarks/vllm_h200/run.sh does both). Without the vLLM payload: PYTHONPATH=$PWD:/tmp/orchestrator-site.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED_WITH_VLLM="pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
fastapi==0.136.3 starlette==1.10.0 uvicorn==0.55.0"
OWN="sqlite-utils==4.2.1 sqlite-fts4==1.0.3 click-default-group==1.2.4 tabulate==0.10.0 pluggy==1.6.0
ruamel.yaml==0.19.1"
rm -rf .whl && mkdir -p .whl
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl $SHARED_WITH_VLLM $OWN
ls -la .whl && du -sh .whl
