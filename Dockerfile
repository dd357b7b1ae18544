# The orchestrator on an official vLLM image: at start it stages the shipped optimizations on the
# image's vLLM, judging each on a live `vllm serve` of the candidate (greedy outputs against the
# baseline's, then the seed's workload in steady state) against the kept configuration's server, which
# sleeps meanwhile where the image's vLLM has sleep mode, after an A/A calibration of the baseline; it
# keeps what measures faster by an interval clear of the bar, and serves the kept configuration
# (docker/entrypoint.sh writes that policy on the first start).
ARG BASE_IMAGE=vllm/vllm-openai:v0.10.2
FROM ${BASE_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

ENV ORCHESTRATOR_HOME=/opt/orchestrator \
    ORCHESTRATOR_STATE=/var/lib/orchestrator \
    VLLM_USE_V1=0 \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /opt/orchestrator
COPY pyproject.toml README.md ./
COPY orchestrator/ orchestrator/
COPY kernels/ kernels/
COPY engine/ engine/
COPY optimizations/ optimizations/
COPY docker/ docker/

# The image's torch, triton and vllm satisfy the project's requirements and are left as they are;
# the kernel shims the plugins deploy into vllm import the project from this environment.
RUN python3 -m pip install --no-cache-dir . \
    && python3 -c "import orchestrator.cli, kernels" \
    && install -m 0755 docker/entrypoint.sh /usr/local/bin/orchestrator-entrypoint

VOLUME ["/var/lib/orchestrator"]
EXPOSE 8000
ENTRYPOINT ["/usr/local/bin/orchestrator-entrypoint"]
