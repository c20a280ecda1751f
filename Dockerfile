# vLLM with Hybrid HiSparse: the upstream OpenAI-compatible server image with its
# vllm package replaced by this distribution's CUDA wheel.
#
# Build with `make image` (it builds dist/<wheel> first). The defaults below must
# equal upstream.toml's pin and `make wheel FLAVOUR=cuda`'s output; a test holds
# them to that. BASE_DIGEST pins the base image by digest (`make image
# BASE_DIGEST=sha256:...`; docs/deploy.md says how to look it up): empty, the tag is
# used as it resolves at build time.
ARG VLLM_VERSION=0.29.0
ARG BASE_DIGEST=
FROM vllm/vllm-openai:v${VLLM_VERSION}${BASE_DIGEST:+@${BASE_DIGEST}}

ARG VLLM_VERSION
ARG DISTRIBUTION_VERSION=0.29.0+hisparse.1
ARG HISPARSE_WHEEL=vllm-0.29.0+hisparse.1-cp38-abi3-manylinux_2_32_x86_64.whl
LABEL org.opencontainers.image.title="vllm-hisparse" \
      org.opencontainers.image.description="vLLM ${VLLM_VERSION} with Hybrid HiSparse: sparse-MLA KV cache residency for DSA models" \
      org.opencontainers.image.version="${DISTRIBUTION_VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="docker.io/vllm/vllm-openai:v${VLLM_VERSION}" \
      org.opencontainers.image.documentation="/opt/vllm-hisparse/README.md"

COPY dist/${HISPARSE_WHEEL} /tmp/

# Same requirements as the upstream vllm it replaces, so no dependency changes:
# swap the package, then prove the overlay imports.
RUN python3 -m pip install --no-cache-dir --no-deps --force-reinstall "/tmp/${HISPARSE_WHEEL}" \
    && rm "/tmp/${HISPARSE_WHEEL}" \
    && python3 -c "import vllm.config.hisparse, vllm; print(vllm.__version__)"

# For operators, under /opt/vllm-hisparse: the P/D proxy (scripts/pd_proxy.py) and the
# GPU check (scripts/gpu_check.py, which builds csrc/ and runs tests/kernels), with the
# license and notice.
COPY LICENSE NOTICE README.md setup.py upstream.toml /opt/vllm-hisparse/
COPY scripts/ /opt/vllm-hisparse/scripts/
COPY csrc/ /opt/vllm-hisparse/csrc/
COPY vllm/ /opt/vllm-hisparse/vllm/
COPY tests/support/ /opt/vllm-hisparse/tests/support/
COPY tests/kernels/ /opt/vllm-hisparse/tests/kernels/

ENTRYPOINT ["vllm", "serve"]
